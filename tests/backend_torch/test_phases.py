"""Precision schedules: phases switch autocast dtype, pins and storage live, optimizer state kept."""

import copy
import logging

import pytest

import ampbridge
import ampbridge._testing

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402

F = torch.nn.functional

# float32 while fragile -> float16 mixed -> float16 with the norms (and embedding) pinned
SCHEDULE = """
compute_dtype = "float16"
keep_float32 = ["kind:norm", "kind:embedding"]
[loss_scale]
initial_scale = 1048576.0
growth_interval = 3

[[phase]]
until_step = 4
compute_dtype = "float32"

[[phase]]
until_step = 8
keep_float32 = []
"""


def loss_of(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def test_three_phases_every_step_computes_as_policy_at_that_step(tiny, helpers, probe):
    policy = ampbridge.loads(SCHEDULE)
    fresh = copy.deepcopy(tiny)
    amp = abt.apply(tiny, policy)
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-2)
    params = [id(p) for p in tiny.parameters()]
    phases, modes = [], []
    for step, (tokens, y) in enumerate(helpers.batches(12, seed=6)):
        want = abt.plan(fresh, policy.at(step=step))  # the plan of the phase in force, planned on its own
        assert [r.key() for r in amp.plan.rows] == [r.key() for r in want.rows], step
        with probe.Probe(tiny) as seen:
            loss = loss_of(tiny(tokens), y)
        assert probe.check_plan(want, seen, model=tiny) >= 9
        phases.append(amp.phase)
        modes.append(amp.scaler.config.mode)
        amp.step(loss, opt)
        opt.zero_grad()
    assert phases == [0] * 4 + [1] * 4 + [None] * 4  # None: past the last (closed) phase: the top level
    assert modes == ["none"] * 4 + ["dynamic"] * 8
    assert [id(p) for p in tiny.parameters()] == params  # the same Parameter objects throughout
    applied = 12 - amp.scaler.loss_scale_state().skipped
    assert all(int(s["step"]) == applied for s in opt.state.values())  # Adam's moments were never reset


def test_the_schedule_is_bit_identical_to_switching_by_hand(tiny, helpers):
    ours, native = tiny, copy.deepcopy(tiny)
    amp = abt.apply(ours, ampbridge.loads(SCHEDULE))
    opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_n = torch.optim.AdamW(native.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)  # created when fp16 starts
    for step, (tokens, y) in enumerate(helpers.batches(14, seed=7)):
        la = loss_of(ours(tokens), y)
        amp.step(la, opt_a)
        opt_a.zero_grad()
        if step < 4:  # float32: no autocast, and nothing overflows
            ln = loss_of(native(tokens), y)
            ln.backward()
            opt_n.step()
        else:
            ln = loss_of(helpers.native_forward(native, tokens, torch.float16, pinned=step >= 8), y)
            scaler.scale(ln).backward()
            scaler.step(opt_n)
            scaler.update()
        opt_n.zero_grad()
        assert torch.equal(la, ln), step
    for k, v in ours.state_dict().items():
        assert torch.equal(v, native.state_dict()[k]), k
    state = amp.scaler.loss_scale_state()
    assert (state.scale, state.good_steps) == (scaler.get_scale(), scaler._get_growth_tracker())
    assert state.steps == 14  # counted across phases


def test_storage_changes_keep_parameters_and_moments(helpers):
    policy = ampbridge.loads("""
        compute_dtype = "bfloat16"
        param_dtype = "bfloat16"
        [[phase]]
        until_epoch = 1
        param_dtype = "float32"
    """)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    amp = abt.apply(model, policy)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    for _ in range(3):
        amp.step((model(x).float() - y).square().mean(), opt)
        opt.zero_grad()
    weight = model[0].weight
    moment = opt.state[weight]["exp_avg"].clone()
    amp.set_epoch(1)
    assert model[0].weight is weight and weight.dtype == torch.bfloat16 and model[1].weight.dtype == torch.bfloat16
    assert opt.state[weight]["exp_avg"].dtype == torch.bfloat16  # torch's Adam needs moments in the param's dtype
    assert torch.equal(opt.state[weight]["exp_avg"], moment.to(torch.bfloat16))
    assert amp.plan["0"].param_dtype == "bfloat16"
    for _ in range(2):
        assert amp.step((model(x).float() - y).square().mean(), opt)
        opt.zero_grad()
    assert int(opt.state[weight]["step"]) == 5


def test_epoch_schedules_switch_on_set_epoch_only(caplog):
    policy = ampbridge.loads("""
        compute_dtype = "float16"
        [loss_scale]
        growth_interval = 2
        [[phase]]
        until_epoch = 2
        [[phase]]
        keep_float32 = ["kind:norm"]
        [phase.loss_scale]
        reset = true
        initial_scale = 1024.0
    """)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    amp = abt.apply(model, policy)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(5):  # a loss with real gradients, small enough not to overflow at 2^18 (the mean of a
        # LayerNorm's output has none: its roundoff, scaled, overflowed with one OpenMP thread, not with two)
        assert amp.step((model(torch.randn(2, 4)).float() - 1.0).square().mean() * 1e-3, opt)
    grown = amp.scaler.get_scale()
    assert grown > 65536.0 and amp.phase == 0
    amp.set_step(100)  # a schedule by epoch ignores steps
    amp.set_epoch(1)
    assert amp.phase == 0 and amp.scaler.get_scale() == grown  # same phase: nothing changes
    with caplog.at_level(logging.INFO, logger="ampbridge.torch"):
        amp.set_epoch(2)
    assert amp.phase == 1 and amp.plan["1"].compute_dtype == "float32" and "epoch 2: phase 1 in force" in caplog.text
    assert amp.scaler.loss_scale_state() == ampbridge.LossScaleState(1024.0, 0, 1, 5, 0)  # reset = true (the run counters carry)
    with pytest.raises(ValueError, match="epoch must be an integer >= 0; received -1"):
        amp.set_epoch(-1)


def test_a_checkpoint_restores_the_phase_in_force(tiny, helpers):
    policy = ampbridge.loads(SCHEDULE)
    amp = abt.apply(tiny, policy)
    opt = torch.optim.SGD(tiny.parameters(), lr=0.1)
    for tokens, y in helpers.batches(9, seed=8):
        amp.step(loss_of(tiny(tokens), y), opt)
    state = amp.state_dict()
    assert state["phase"] is None and state["step"] == 9
    other = helpers.Tiny()
    other.load_state_dict(tiny.state_dict())
    amp2 = abt.apply(other, policy)
    assert amp2.phase == 0 and amp2.plan["fc1"].compute_dtype == "float32"
    amp2.load_state_dict(state)
    assert amp2.phase is None and amp2.plan["ln1"].compute_dtype == "float32"
    assert amp2.scaler.loss_scale_state() == amp.scaler.loss_scale_state()


def test_a_phase_switch_runs_the_core_phase_policy_with_its_source(tmp_path):
    # the policy in force after a switch is the core's lookup (Policy.at / phase_policy): the file it
    # came from and its [kinds] are kept, as for the first phase
    path = tmp_path / "sched.toml"
    path.write_text('compute_dtype = "float16"\n[[phase]]\nuntil_step = 1\ncompute_dtype = "float32"\n'
                    '[[phase]]\nuntil_step = 2\ncompute_dtype = "bfloat16"\n')
    policy = ampbridge.load(path)
    model = torch.nn.Linear(4, 4)
    amp = abt.apply(model, policy)
    assert amp.active_policy == policy.at(step=0) and amp.active_policy.source == policy.source
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    amp.step(model(torch.randn(2, 4)).float().square().mean(), opt)
    assert amp.phase == 1 and amp.active_policy.compute_dtype == "bfloat16"
    assert amp.active_policy == policy.at(step=1) and amp.active_policy.source == policy.source
