"""Parity: ampbridge.torch trains bit-identically to the hand-written torch.amp equivalent."""

import copy

import pytest

import ampbridge
import ampbridge._testing

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402

F = torch.nn.functional
PINNED = ("kind:norm", "kind:embedding")


def fp16_policy(pins=PINNED):
    return ampbridge.Policy(compute_dtype="float16", keep_float32=pins, loss_scale=ampbridge.LossScaleConfig(
        mode="dynamic", initial_scale=2.0**20, growth_interval=3))


def loss_of(logits, y):
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def snapshot(model, opt):
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in opt.state.values()]
    return params, state


def assert_same(a, b):
    (pa, sa), (pb, sb) = a, b
    assert pa.keys() == pb.keys()
    for k in pa:
        assert pa[k].dtype == pb[k].dtype and torch.equal(pa[k], pb[k]), k
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        for k in x:
            assert torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k], k


def test_float16_dynamic_pinned_30_steps_bit_identical(tiny, helpers):
    ours, native = tiny, copy.deepcopy(tiny)
    amp = abt.apply(ours, fp16_policy())
    opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_n = torch.optim.AdamW(native.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=3)
    found = []
    for tokens, y in helpers.batches(30):
        la = loss_of(amp.model(tokens), y)
        applied = amp.step(la, opt_a)
        opt_a.zero_grad()
        ln = loss_of(helpers.native_forward(native, tokens, torch.float16), y)
        before = scaler.get_scale()
        scaler.scale(ln).backward()
        scaler.step(opt_n)
        scaler.update()
        opt_n.zero_grad()
        found.append(scaler.get_scale() < before)
        assert torch.equal(la, ln)
        assert bool(applied) == (not found[-1])
        assert amp.scaler.state_dict()["scale"] == scaler.get_scale()
        assert amp.scaler.state_dict()["_growth_tracker"] == scaler.state_dict()["_growth_tracker"]
    assert 0 < sum(found) < 30, "the run should both overflow and grow"
    assert_same(snapshot(ours, opt_a), snapshot(native, opt_n))
    # the full reference state, against the core's oracle fed with native's overflows
    cfg = amp.scaler.config
    assert amp.scaler.loss_scale_state() == ampbridge.trajectory(cfg, found)[-1]


def test_bfloat16_without_scaling_bit_identical(tiny, helpers):
    ours, native = tiny, copy.deepcopy(tiny)
    policy = ampbridge.Policy(compute_dtype="bfloat16", keep_float32=PINNED)
    amp = abt.apply(ours, policy)
    assert amp.scaler.config.mode == "none"
    opt_a = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_n = torch.optim.AdamW(native.parameters(), lr=1e-2)
    for tokens, y in helpers.batches(30, seed=2):
        la = loss_of(amp.model(tokens), y)
        assert amp.step(la, opt_a)
        opt_a.zero_grad()
        ln = loss_of(helpers.native_forward(native, tokens, torch.bfloat16), y)
        ln.backward()
        opt_n.step()
        opt_n.zero_grad()
        assert torch.equal(la, ln)
    assert_same(snapshot(ours, opt_a), snapshot(native, opt_n))
    assert amp.scaler.loss_scale_state() == ampbridge.LossScaleState(1.0, 0, 1, 30, 0)


def test_the_native_loop_on_amp_equals_amp_step(tiny, helpers):
    a, b = tiny, copy.deepcopy(tiny)
    amp_a, amp_b = abt.apply(a, fp16_policy()), abt.apply(b, fp16_policy())
    opt_a = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for tokens, y in helpers.batches(10, seed=3):
        amp_a.step(loss_of(a(tokens), y), opt_a)
        opt_a.zero_grad()
        with amp_b.autocast():
            loss = loss_of(amp_b.model(tokens), y)
        amp_b.scaler.scale(loss).backward()
        amp_b.scaler.step(opt_b)
        amp_b.scaler.update()
        opt_b.zero_grad()
    assert_same(snapshot(a, opt_a), snapshot(b, opt_b))
    assert amp_a.scaler.state_dict() == amp_b.scaler.state_dict()


def test_without_pins_it_is_plain_autocast(tiny, helpers):
    """mixed_float16 with nothing pinned: no cast of ampbridge's own, native torch.amp bit for bit."""
    ours, native = tiny, copy.deepcopy(tiny)
    amp = abt.apply(ours, "mixed_float16")
    opt_a, opt_n = torch.optim.Adam(ours.parameters()), torch.optim.Adam(native.parameters())
    scaler = torch.amp.GradScaler("cpu")
    for tokens, y in helpers.batches(5, seed=4):
        la = loss_of(amp.model(tokens), y)
        amp.step(la, opt_a)
        with torch.autocast("cpu", dtype=torch.float16):
            ln = loss_of(native(tokens).float(), y)
        scaler.scale(ln).backward()
        scaler.step(opt_n)
        scaler.update()
        assert torch.equal(la, ln)
        opt_a.zero_grad()
        opt_n.zero_grad()
    assert_same(snapshot(ours, opt_a), snapshot(native, opt_n))


@pytest.mark.parametrize("fused", [False, True], ids=["for-loop-adam", "fused-adam"])
def test_same_host_syncs_and_casts_per_step_as_native(tiny, helpers, counter, fused):
    ours, native = tiny, copy.deepcopy(tiny)
    amp = abt.apply(ours, fp16_policy())
    opt_a = torch.optim.Adam(ours.parameters(), fused=fused)
    opt_n = torch.optim.Adam(native.parameters(), fused=fused)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=3)
    counts = []
    for tokens, y in helpers.batches(4, seed=5):
        with counter() as ca:
            applied = amp.step(loss_of(amp.model(tokens), y), opt_a)
        opt_a.zero_grad()
        with counter() as cn:
            ln = loss_of(helpers.native_forward(native, tokens, torch.float16), y)
            scaler.scale(ln).backward()
            scaler.step(opt_n)
            scaler.update()
        opt_n.zero_grad()
        counts.append(((ca.syncs, ca.casts), (cn.syncs, cn.casts), bool(applied)))
    n_params = len(list(ours.parameters()))
    for ours_count, native_count, applied in counts:
        assert ours_count == native_count
        # fused: the optimizer reads found_inf on the device (torch's no-sync path is kept);
        # for-loop Adam: the scaler's one read, plus Adam's own read of each parameter's step count
        assert ours_count[0] == (0 if fused else 1 + (n_params if applied else 0))
    assert any(a for *_, a in counts) and not all(a for *_, a in counts)
