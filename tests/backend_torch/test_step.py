"""``amp.step(loss, opt, clip_grad_norm=..., accumulate=...)`` equals the torch.amp loop written by
hand (``scaler.unscale_`` + ``clip_grad_norm_``; ``loss / N`` over N micro-batches, step on the
last), bit for bit, over steps that include an overflow (skipped: parameters, optimizer state
unchanged, scale halved)."""

import copy

import pytest

import ampbridge
import ampbridge._testing

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402

nn = torch.nn
GROWTH_INTERVAL = 3
POLICY = ampbridge.Policy(compute_dtype="float16",
                          loss_scale=ampbridge.LossScaleConfig(mode="dynamic", initial_scale=2.0**12,
                                                               growth_interval=GROWTH_INTERVAL))
STEPS = 7
POISONED_STEP = 3  # its last micro-batch's loss is multiplied by inf


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))


def batches(step, accumulate):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)) for _ in range(accumulate)]


def loss_of(model, x, y, poisoned):
    loss = nn.functional.mse_loss(model(x).float(), y)
    return loss * float("inf") if poisoned else loss


def make_opt(model, kind):
    if kind == "sgd-momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **{kind: True})


def opt_state(opt):
    return [{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()} for s in opt.state.values()]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def native_run(kind, clip, accumulate):
    """The hand-written torch.amp loop (torch's docs' clipping and accumulation recipes)."""
    model = build()
    opt = make_opt(model, kind)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=GROWTH_INTERVAL)
    trace = []
    for step in range(STEPS):
        for i, (x, y) in enumerate(batches(step, accumulate)):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = loss_of(model, x, y, step == POISONED_STEP and i == accumulate - 1)
                loss = loss / accumulate if accumulate > 1 else loss
            scaler.scale(loss).backward()
        norm = None
        if clip is not None:
            scaler.unscale_(opt)
            norm = nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        trace.append(([p.detach().clone() for p in model.parameters()], opt_state(opt), scaler.get_scale(), norm))
    return trace


def ampbridge_run(kind, clip, accumulate):
    model = build()
    amp = abt.apply(model, POLICY)
    opt = make_opt(model, kind)
    trace, results = [], []
    for step in range(STEPS):
        for i, (x, y) in enumerate(batches(step, accumulate)):
            with amp.autocast():
                loss = loss_of(model, x, y, step == POISONED_STEP and i == accumulate - 1)
            result = amp.step(loss, opt, clip_grad_norm=clip, accumulate=accumulate)
            assert result.accumulating == (i < accumulate - 1)
            if not result.accumulating:
                opt.zero_grad()
        results.append(bool(result))
        trace.append(([p.detach().clone() for p in model.parameters()], opt_state(opt), amp.scaler.get_scale(),
                      result.grad_norm))
    return trace, results, amp


@pytest.mark.parametrize("kind, clip, accumulate", [
    ("foreach", 0.05, 1), ("fused", 0.05, 1), ("sgd-momentum", 0.05, 1),
    ("foreach", None, 3), ("foreach", 0.05, 3), ("fused", 0.05, 2)])
def test_step_equals_the_hand_written_loop(kind, clip, accumulate):
    native = native_run(kind, clip, accumulate)
    ours, applied, amp = ampbridge_run(kind, clip, accumulate)
    assert applied == [step != POISONED_STEP for step in range(STEPS)]
    for step, ((p_n, s_n, scale_n, norm_n), (p_a, s_a, scale_a, norm_a)) in enumerate(zip(native, ours)):
        assert same(p_n, p_a), f"parameters differ after step {step}"
        assert len(s_n) == len(s_a) and all(
            same([v for v in a.values() if isinstance(v, torch.Tensor)],
                 [v for v in b.values() if isinstance(v, torch.Tensor)]) for a, b in zip(s_n, s_a)), step
        assert scale_n == scale_a, (step, scale_n, scale_a)
        if clip is None:
            assert norm_a is None
        else:
            assert torch.equal(norm_n, norm_a) or (step == POISONED_STEP and not torch.isfinite(norm_a))
    # the poisoned step was skipped: nothing moved, the scale halved
    assert same(ours[POISONED_STEP][0], ours[POISONED_STEP - 1][0])
    tensors = [[v for v in state.values() if isinstance(v, torch.Tensor)] for state in ours[POISONED_STEP][1]]
    before = [[v for v in state.values() if isinstance(v, torch.Tensor)] for state in ours[POISONED_STEP - 1][1]]
    assert all(same(a, b) for a, b in zip(tensors, before)) and len(tensors) == len(before) > 0
    assert ours[POISONED_STEP][2] == ours[POISONED_STEP - 1][2] / 2
    assert any(ours[s][2] > ours[s - 1][2] for s in range(POISONED_STEP + 1, STEPS))  # and grew again
    state = amp.scaler.loss_scale_state()
    assert (state.steps, state.skipped) == (STEPS, 1)  # one scaler step per optimizer step
    if clip is not None:  # the clip really bit: some unclipped norm was above the threshold
        assert any(float(t[3]) > clip for t in ours if torch.isfinite(t[3]))


def test_accumulation_window_and_bad_arguments():
    model = build()
    amp = abt.apply(model, POLICY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    (x, y), = batches(0, 1)
    for _ in range(2):
        with amp.autocast():
            loss = loss_of(model, x, y, False)
        assert amp.step(loss, opt, accumulate=3).accumulating
    assert same(before, [p.detach() for p in model.parameters()])  # only gradients accumulated
    assert amp.scaler.loss_scale_state().steps == 0
    with amp.autocast():
        loss = loss_of(model, x, y, False)
    result = amp.step(loss, opt, accumulate=3)
    assert bool(result) and not result.accumulating and amp.scaler.loss_scale_state().steps == 1
    assert repr(abt.StepResult(False, accumulating=True)) == "StepResult(accumulating)"
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="accumulate must be an integer >= 1"):
            amp.step(loss, opt, accumulate=bad)
    for bad in (0.0, -1, "1"):
        with pytest.raises(ValueError, match="clip_grad_norm must be a number > 0"):
            amp.step(loss, opt, clip_grad_norm=bad)


def test_pickle_and_deepcopy_keep_the_scale():
    import pickle

    model = build()
    amp = abt.apply(model, POLICY.replace(loss_scale=POLICY.loss_scale.replace(hysteresis=2)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = batches(0, 1)
    for poisoned in (True, True, True, False):  # scale 2^12 -> 2^11 (hysteresis 2) -> 2^10, good steps 1
        with amp.autocast():
            loss = loss_of(model, x, y, poisoned)
        amp.step(loss, opt)
        opt.zero_grad()
    expected = amp.scaler.state_dict()
    assert expected["scale"] == 2.0**10 and expected["_growth_tracker"] == 1
    for twin in (pickle.loads(pickle.dumps(amp.scaler)), copy.deepcopy(amp.scaler)):
        assert twin.get_scale() == 2.0**10 and twin.state_dict() == expected
        assert twin._get_growth_tracker() == 1  # torch's own reader, before the tensors exist again
        twin.scale(torch.ones(()))  # lazily recreated on the device: the same state
        assert twin.state_dict() == expected
