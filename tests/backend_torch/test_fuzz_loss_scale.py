"""Differential fuzzer: ``ampbridge.torch.apply`` + ``amp.step`` against the hand-written
``torch.amp.GradScaler`` loop, bit for bit.

A "model" is a list of parameters of random leaf shapes (scalars, size 1, size 0, larger), order and
dtypes (float32, bfloat16 by a ``param_dtype`` override, the native side stores them so by hand);
each step's loss is ``sum(p * g)``, so the gradients are exactly ``g`` times the scale, and a
non-finite entry of ``g`` (inf, -inf, NaN, or a finite value that overflows once scaled) lands in the
chosen leaf. Loss-scale settings are those GradScaler can express (initial scale, growth and backoff
factors, interval). Compared after every step: the skip decision, the scale and its growth
counter, every parameter and every optimizer state tensor, for SGD, Adam and AdamW in their
foreach, for-loop and fused (CPU) implementations, with and without gradient accumulation.

float16 parameters are left out: torch's GradScaler refuses float16 gradients, so there is no
native loop to compare with (ampbridge allows them when the policy stores parameters in float16).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from ampbridge._testing import fuzz_settings, require

torch = require("torch")
hypothesis = require("hypothesis")

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402

import ampbridge.torch as at  # noqa: E402
from ampbridge import LossScaleConfig, Policy, Rule  # noqa: E402

SHAPES = [(), (1,), (0,), (3,), (2, 2), (2, 1, 3)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
BAD = [math.inf, -math.inf, math.nan, 3.0e38]  # the last: finite, inf once multiplied by a scale >= 2
OPTIMIZERS = {
    "sgd": lambda ps, impl: torch.optim.SGD(ps, lr=0.25, momentum=0.5, weight_decay=0.125, **impl),
    "adam": lambda ps, impl: torch.optim.Adam(ps, lr=0.125, **impl),
    "adamw": lambda ps, impl: torch.optim.AdamW(ps, lr=0.125, weight_decay=0.25, **impl),
}
IMPLEMENTATIONS = {"foreach": {"foreach": True}, "forloop": {"foreach": False}, "fused": {"fused": True}}


class Leaf(nn.Module):
    def __init__(self, value: torch.Tensor):
        super().__init__()
        self.w = nn.Parameter(value)


class Leaves(nn.Module):
    """The parameters of a gradient "model", one child per leaf (``l0``, ``l1``, ...), in order."""

    def __init__(self, values: list[torch.Tensor]):
        super().__init__()
        for i, value in enumerate(values):
            self.add_module(f"l{i}", Leaf(value))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


# --- strategies ----------------------------------------------------------------------------------

leaves_st = st.lists(st.tuples(st.sampled_from(SHAPES), st.sampled_from(sorted(DTYPES))), min_size=1, max_size=5)


@st.composite
def bad_steps(draw, leaves, micro=1, max_steps=8):
    """Per step and micro-batch: None (finite) or (leaf, flat position, value)."""
    sized = [i for i, (shape, _) in enumerate(leaves) if math.prod(shape)]
    spot = st.none()
    if sized:
        spot = st.one_of(st.none(), st.tuples(st.sampled_from(sized), st.integers(0, 5), st.sampled_from(BAD)))
    return draw(st.lists(st.lists(spot, min_size=micro, max_size=micro), min_size=1, max_size=max_steps))


def scale_settings():
    """Loss-scale settings torch's GradScaler can express (growth_factor > 1 > backoff_factor > 0)."""
    return st.builds(
        dict,
        initial_scale=st.one_of(st.sampled_from([1.0, 2.0, 2.0**16, 2.0**24, 2.0**126]),
                                st.floats(1.0, 2.0**30, width=32)),
        growth_factor=st.one_of(st.just(2.0), st.floats(1.0, 16.0, exclude_min=True, width=32)),
        # >= 2**-8: within a case the scale stays a normal float32 whose reciprocal is finite (below
        # 2**-128, 1/scale is inf and GradScaler's unscale turns finite gradients into inf/NaN that it
        # then applies, natively too: found by this fuzzer with backoff 2**-149, reported, not a setting here)
        backoff_factor=st.one_of(st.just(0.5), st.floats(2.0**-8, 1.0, exclude_max=True, width=32)),
        growth_interval=st.integers(1, 4))


# --- the two loops -----------------------------------------------------------------------------------

def _values(leaves, rng):
    """Initial parameters: small dyadic numbers, exact in every dtype."""
    return [torch.tensor(rng.randint(-8, 9, size=shape) / 8.0, dtype=torch.float32) for shape, _ in leaves]


def _grads(leaves, spots, rng):
    """One micro-batch's g per leaf (float32), with the chosen entry made non-finite."""
    out = [torch.tensor(rng.randint(-16, 17, size=shape) / 16.0, dtype=torch.float32) for shape, _ in leaves]
    if spots is not None:
        leaf, pos, value = spots
        flat = out[leaf].view(-1)
        flat[pos % flat.numel()] = value
    return out


def _loss(params, grads):
    return sum((p.float() * g).sum() for p, g in zip(params, grads))


def _policy(leaves, settings):
    pins = tuple(Rule((f"l{i}",), param_dtype=dtype) for i, (_, dtype) in enumerate(leaves) if dtype != "float32")
    return Policy(compute_dtype="float16", param_dtype="float32", overrides=pins,
                  loss_scale=LossScaleConfig(mode="dynamic", **settings))


def _state(opt):
    return [t for p in opt.param_groups[0]["params"] for t in opt.state.get(p, {}).values()
            if isinstance(t, torch.Tensor)]


def _bits(t):
    t = t.detach().contiguous()
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()]).tolist() \
        if t.is_floating_point() else t.tolist()


def _run_pair(leaves, steps, settings, opt_name, impl, seed, accumulate=1):
    """Run ampbridge and the native loop side by side; assert they agree after every step."""
    rng = np.random.RandomState(seed)
    values = _values(leaves, rng)
    ours_model = Leaves([v.clone() for v in values])
    amp = at.apply(ours_model, _policy(leaves, settings), device_type="cpu")
    native_model = Leaves([v.clone().to(DTYPES[d]) for v, (_, d) in zip(values, leaves)])
    ours_params, native_params = list(ours_model.parameters()), list(native_model.parameters())
    assert [p.dtype for p in ours_params] == [p.dtype for p in native_params]  # the pins did what we asked
    make = OPTIMIZERS[opt_name]
    ours_opt, native_opt = make(ours_params, IMPLEMENTATIONS[impl]), make(native_params, IMPLEMENTATIONS[impl])
    native = torch.amp.GradScaler("cpu", init_scale=settings["initial_scale"],
                                  growth_factor=settings["growth_factor"], backoff_factor=settings["backoff_factor"],
                                  growth_interval=settings["growth_interval"])
    stepped, large = [], False
    native_opt.register_step_post_hook(lambda *_: stepped.append(True))
    for n, micro_spots in enumerate(steps):
        stepped.clear()
        for spots in micro_spots:
            grads = _grads(leaves, spots, rng)
            result = amp.step(_loss(ours_params, grads), ours_opt, accumulate=accumulate)
            loss = _loss(native_params, grads)
            native.scale(loss / accumulate if accumulate > 1 else loss).backward()
        assert not result.accumulating
        unbuffered = not _state(native_opt)
        native.step(native_opt)
        # the native skip decision: GradScaler's found_inf (a fused optimizer steps and skips inside its kernel)
        native_skipped = sum(f.item() for f in native._found_inf_per_device(native_opt).values()) > 0
        if native_skipped and unbuffered and opt_name == "sgd" and impl == "fused":
            # torch's fused SGD made its momentum buffers (empty_like) and skipped: uninitialised memory
            # the next step would read (see test_fused_sgd_overflow_on_the_first_step); drop them, as a
            # loop that does not call step on an overflow never makes them
            native_opt.state.clear()
        native.update()
        where = f"step {n} ({opt_name}, {impl})"
        if impl != "fused":
            assert bool(stepped) != native_skipped, where
        assert bool(result) != native_skipped, f"{where}: applied {bool(result)}, native skipped {native_skipped}"
        if any(s is not None and not math.isfinite(s[2]) for s in micro_spots):
            assert native_skipped, f"{where}: a non-finite gradient was applied natively (the case is not what it says)"
        large |= any(s is not None and math.isfinite(s[2]) for s in micro_spots)
        assert _bits(amp.scaler._scale) == _bits(native._scale), f"{where}: scale"
        assert _bits(amp.scaler._growth_tracker) == _bits(native._growth_tracker), f"{where}: growth tracker"
        for i, (a, b) in enumerate(zip(ours_params, native_params)):
            assert _bits(a) == _bits(b), f"{where}: parameter l{i} {a} != {b}"
            # a finite 3e38 gradient may legitimately overflow an update (natively too)
            assert large or bool(torch.isfinite(a).all()), f"{where}: parameter l{i} went non-finite: {a}"
        for i, (a, b) in enumerate(zip(_state(ours_opt), _state(native_opt))):
            assert _bits(a) == _bits(b), f"{where}: optimizer state {i}"
        ours_opt.zero_grad()
        native_opt.zero_grad()
    state = amp.scaler.loss_scale_state()
    assert state.steps == len(steps)


# --- regressions the fuzzer found -------------------------------------------------------------------

def test_fused_sgd_overflow_on_the_first_step():
    """Shrunk from the fuzzer: fused SGD with momentum whose first step overflows. torch's kernel makes
    the momentum buffers with ``empty_like`` and skips, leaving them uninitialised; the next step reads
    them. ampbridge skips that step before the kernel: the next finite step equals fused SGD's first."""
    def run(steps, make_amp):
        p = nn.Parameter(torch.tensor(0.5))
        model = Leaves([])
        model.register_parameter("p", p)
        opt = torch.optim.SGD([p], lr=0.25, momentum=0.5, fused=True)
        amp = at.apply(model, _policy([], dict(initial_scale=4.0, growth_factor=2.0, backoff_factor=0.5,
                                               growth_interval=100)), device_type="cpu") if make_amp else None
        native = torch.amp.GradScaler("cpu", init_scale=4.0 if make_amp else 2.0, growth_interval=100)
        results = []
        for g in steps:
            loss = p * g
            if amp is not None:
                results.append(bool(amp.step(loss, opt)))
            else:
                native.scale(loss).backward()
                native.step(opt)
                native.update()
            opt.zero_grad()
        return p.detach().clone(), opt, results

    p_ours, opt_ours, results = run([math.inf, 0.75], make_amp=True)
    assert results == [False, True]
    p_native, opt_native, _ = run([0.75], make_amp=False)  # fused SGD's first step, at the scale after the backoff
    assert _bits(p_ours) == _bits(p_native)
    assert _bits(_state(opt_ours)[0]) == _bits(_state(opt_native)[0])
    # the upstream defect this guards against: the buffer torch's fused SGD leaves after a skipped first step
    q = nn.Parameter(torch.tensor(0.5))
    opt = torch.optim.SGD([q], lr=0.25, momentum=0.5, fused=True)
    q.grad = torch.tensor(math.inf)
    opt.found_inf = torch.ones(())
    opt.step()
    assert "momentum_buffer" in opt.state[q] and _bits(q) == _bits(torch.tensor(0.5))  # made, never written


# --- the properties -------------------------------------------------------------------------------

@fuzz_settings(40, 2000)
@given(data=st.data(), leaves=leaves_st, settings=scale_settings(), opt_name=st.sampled_from(sorted(OPTIMIZERS)),
       impl=st.sampled_from(sorted(IMPLEMENTATIONS)), seed=st.integers(0, 2**16))
def test_step_equals_native_gradscaler(data, leaves, settings, opt_name, impl, seed):
    """Skips, scale trajectory, parameters and optimizer state equal torch's GradScaler loop."""
    steps = data.draw(bad_steps(leaves), label="steps")
    _run_pair(leaves, steps, settings, opt_name, impl, seed)


@fuzz_settings(20, 1000)
@given(data=st.data(), leaves=leaves_st, settings=scale_settings(), opt_name=st.sampled_from(sorted(OPTIMIZERS)),
       impl=st.sampled_from(sorted(IMPLEMENTATIONS)), accumulate=st.integers(2, 3), seed=st.integers(0, 2**16))
def test_accumulation_equals_native_gradscaler(data, leaves, settings, opt_name, impl, accumulate, seed):
    """``amp.step(..., accumulate=N)``: a non-finite gradient in any micro-batch skips the step, as
    the hand-written loop (``scaler.scale(loss / N).backward()`` N times, then step) does."""
    steps = data.draw(bad_steps(leaves, micro=accumulate, max_steps=5), label="steps")
    _run_pair(leaves, steps, settings, opt_name, impl, seed, accumulate=accumulate)


# --- a distributed step: two gloo ranks, a non-finite gradient on any rank ---------------------------

DDP_SHAPES = [(), (1,), (0,), (3,), (2, 2)]


@st.composite
def ddp_cases(draw):
    """One DDP case: float32 parameters, per step and rank the g of ``sum(p * g)``, with a non-finite
    entry in any rank's leaf or none (DDP averages the ranks' gradients: it reaches every rank)."""
    shapes = draw(st.lists(st.sampled_from(DDP_SHAPES), min_size=1, max_size=4))
    rng = np.random.RandomState(draw(st.integers(0, 2**16)))
    values = [(rng.randint(-8, 9, size=math.prod(s)) / 8.0).reshape(s).tolist() for s in shapes]
    steps = []
    for _ in range(draw(st.integers(1, 5))):
        grads = [[(rng.randint(-16, 17, size=math.prod(s)) / 16.0) for s in shapes] for _ in range(2)]
        bad = draw(st.one_of(st.none(), st.tuples(st.integers(0, 1), st.integers(0, len(shapes) - 1),
                                                  st.integers(0, 5), st.sampled_from(BAD[:3]))))
        if bad is not None and grads[bad[0]][bad[1]].size:
            rank, leaf, pos, value = bad
            grads[rank][leaf][pos % grads[rank][leaf].size] = value
        elif bad is not None:
            bad = None  # a size-0 leaf holds nothing
        steps.append({"grads": [[g.reshape(s).tolist() for g, s in zip(r, shapes)] for r in grads], "bad": bad})
    return {"values": values, "steps": steps, "settings": draw(scale_settings()),
            "impl": draw(st.sampled_from([{"foreach": True}, {"foreach": False}]))}


def _drawn(strategy, count):
    """``count`` examples of ``strategy``, drawn by hypothesis under fuzz_settings (the same ones every
    ``make test``): the ranks run them all in one launch, so there is no shrinking; a failure names its case."""
    cases = []

    @fuzz_settings(count, 25 * count, phases=[hypothesis.Phase.generate])
    @given(strategy)
    def collect(case):
        cases.append(case)

    collect()
    return cases


@pytest.mark.slow
def test_ddp_step_equals_native_ddp_gradscaler(tmp_path):
    """wrap_ddp + amp.step against DistributedDataParallel + torch.amp.GradScaler on 2 gloo ranks:
    the skip decision, scale, growth tracker and parameters after every step, on every rank."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys
    from pathlib import Path

    workers = Path(__file__).with_name("distributed_workers.py")
    cases = _drawn(ddp_cases(), 6)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, str(workers), "fuzz_ddp", str(tmp_path), str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"fuzz_ddp ran past 300 s: {output[-3000:]}")
    assert proc.returncode == 0, output[-4000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for n, case in enumerate(cases):
        for r in range(2):
            ours, native = ranks[r][n]["ours"], ranks[r][n]["native"]
            for k, (a, b) in enumerate(zip(ours, native)):
                where = f"case {n} rank {r} step {k}: {case['steps'][k]['bad']} {case['settings']} {case['impl']}"
                assert a == b, where
                bad = case["steps"][k]["bad"]
                if bad is not None:
                    assert not a["applied"], where
        assert ranks[0][n]["ours"] == ranks[1][n]["ours"], f"case {n}: the ranks differ"
    assert any(s["bad"] is not None for c in cases for s in c["steps"])  # the draw placed overflows
