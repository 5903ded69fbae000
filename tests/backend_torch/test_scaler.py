"""The GradScaler subclass follows the core's reference loss-scale algorithm exactly."""

import copy
import math
import random
import warnings

import pytest

import ampbridge
import ampbridge._testing
from ampbridge import LossScaleConfig, LossScaleError, LossScaleState

torch = ampbridge._testing.require("torch")
import ampbridge.torch as abt  # noqa: E402

INF, NAN = float("inf"), float("nan")

CONFIGS = {
    "torch-default": LossScaleConfig(mode="dynamic", growth_interval=7),
    "hysteresis-2": LossScaleConfig(mode="dynamic", growth_interval=5, hysteresis=2),
    "hysteresis-3-consecutive": LossScaleConfig(mode="dynamic", growth_interval=4, hysteresis=3,
                                                consecutive_hysteresis=True),
    "min-max": LossScaleConfig(mode="dynamic", initial_scale=64.0, growth_interval=3, min_scale=2.0,
                               max_scale=1024.0),
    "growth-3-backoff-0.25": LossScaleConfig(mode="dynamic", growth_factor=3.0, backoff_factor=0.25,
                                             growth_interval=4, min_scale=1e-3),
    "factors-1.1-0.9": LossScaleConfig(mode="dynamic", growth_factor=1.1, backoff_factor=0.9, growth_interval=2),
    "growth-1": LossScaleConfig(mode="dynamic", growth_factor=1.0, growth_interval=2),
    "no-skip": LossScaleConfig(mode="dynamic", growth_interval=3, skip_nonfinite=False),
    "warn-at-min": LossScaleConfig(mode="dynamic", initial_scale=8.0, growth_interval=50, min_scale=1.0,
                                   on_min_scale="warn"),
    "static": LossScaleConfig(mode="static", initial_scale=1024.0),
    "none": LossScaleConfig(mode="none"),
    "none-no-skip": LossScaleConfig(mode="none", skip_nonfinite=False),
    # DeepSpeed >= 0.17.1's growth timing (window + 1 before the first growth and after each overflow)
    "first-growth-later": LossScaleConfig(mode="dynamic", growth_interval=4, first_growth_interval=5, hysteresis=2),
    "first-growth-sooner": LossScaleConfig(mode="dynamic", growth_interval=6, first_growth_interval=2),
    # optax's apply_if_finite(inner, N)
    "max-skips-2": LossScaleConfig(mode="dynamic", growth_interval=3, max_consecutive_skips=2),
    "max-skips-0-static": LossScaleConfig(mode="static", initial_scale=8.0, max_consecutive_skips=0),
}


def read(scaler):
    """All five fields in one device read (the reference's order)."""
    if not scaler._enabled:
        return scaler.loss_scale_state()
    v = torch.stack([scaler._scale.double(), scaler._growth_tracker.double(), scaler._hysteresis_left.double(),
                     scaler._skipped.double(), scaler._streak.double()]).tolist()
    return LossScaleState(v[0], int(v[1]), int(v[2]), scaler._steps, int(v[3]), int(v[4]))


def drive(scaler, opt, param, found_infs, *, native=None, native_opt=None):
    """Feed synthetic gradients; yield the state after each step."""
    scaler.scale(torch.ones(()))
    if native is not None:
        native.scale(torch.ones(()))
    for i, bad in enumerate(found_infs):
        value = (NAN if i % 2 else INF) if bad else 1.0
        param.grad = torch.full_like(param, 1.0)
        param.grad[i % param.numel()] = value
        if native is not None:  # before ours unscales it in place
            native_opt.param_groups[0]["params"][0].grad = param.grad.clone()
        scaler.step(opt)
        scaler.update()
        if native is not None:
            native.step(native_opt)
            native.update()
        yield read(scaler)


def sequence(n, p_inf, seed, cfg=None):
    """Random overflows; with ``cfg``, steered so the scale stays a normal float32 (2^-60..2^60)."""
    rng = random.Random(seed)
    out, state = [], ampbridge.initial_state(cfg) if cfg else None
    for _ in range(n):
        found = rng.random() < p_inf
        if state is not None:
            found = (found or state.scale > 2.0**60) and state.scale >= 2.0**-60
            state = ampbridge.next_state(cfg, state, found, warned=[True])
        out.append(found)
    return out


SHORT = ("growth-1", "no-skip", "warn-at-min", "none-no-skip", "first-growth-sooner", "max-skips-2",
         "max-skips-0-static")  # 2,000 steps: cheaper variations


@pytest.mark.parametrize("name", list(CONFIGS))
def test_10000_random_steps_follow_the_reference(name):
    cfg = CONFIGS[name].resolve("float16")
    found = sequence(2_000 if name in SHORT else 10_000, 0.15 if name != "warn-at-min" else 0.6, seed=sum(map(ord, name)), cfg=cfg)
    want = ampbridge.trajectory(cfg, found)
    param = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = abt.GradScaler(cfg, "cpu")
    native = native_opt = None
    if name == "torch-default":  # also torch's own GradScaler, step for step
        native = torch.amp.GradScaler("cpu", growth_interval=cfg.growth_interval)
        native_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(8))], lr=0.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i, got in enumerate(drive(scaler, opt, param, found, native=native, native_opt=native_opt)):
            assert got == want[i], f"step {i}: {got} != {want[i]}"
            if native is not None:
                assert native.get_scale() == got.scale and native._get_growth_tracker() == got.good_steps
    assert scaler.loss_scale_state() == want[-1]
    assert len({s.scale for s in want}) > (1 if cfg.mode == "dynamic" else 0) or cfg.growth_factor == 1.0
    if cfg.min_scale is not None and name in ("min-max", "warn-at-min"):
        assert min(s.scale for s in want) == cfg.min_scale
    if cfg.max_scale is not None:
        assert max(s.scale for s in want) == cfg.max_scale
    warned = [w for w in caught if issubclass(w.category, ampbridge.AmpBridgeWarning)]
    assert len(warned) == (1 if name == "warn-at-min" else 0)


@pytest.mark.parametrize("name", ["hysteresis-2", "min-max", "no-skip", "none"])
def test_the_fused_path_follows_the_reference_too(name):
    cfg = CONFIGS[name]
    found = sequence(1500, 0.2, seed=7, cfg=cfg.resolve("float16"))
    param = torch.nn.Parameter(torch.zeros(8))
    opt = torch.optim.Adam([param], lr=1e-3, fused=True)
    scaler = abt.GradScaler(cfg, "cpu")
    want = ampbridge.trajectory(cfg.resolve("float16"), found)
    for i, got in enumerate(drive(scaler, opt, param, found)):
        assert got == want[i], f"step {i}"
    if not cfg.skip_nonfinite:
        assert torch.isnan(param).any()  # the non-finite updates were applied, as asked


@pytest.mark.parametrize("kind", ["adam", "adam-foreach", "adam-fused", "sgd-momentum"])
@pytest.mark.parametrize("bad", [INF, NAN], ids=["inf", "nan"])
def test_an_overflow_skips_the_step_leaving_params_and_optimizer_state_bit_identical(kind, bad, helpers):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    amp = abt.apply(model, ampbridge.Policy(compute_dtype="float16", keep_float32=("kind:norm",)))
    make = {"adam": lambda p: torch.optim.Adam(p, lr=1e-2), "adam-foreach": lambda p: torch.optim.Adam(p, foreach=True),
            "adam-fused": lambda p: torch.optim.Adam(p, fused=True),
            "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)}[kind]
    opt = make(model.parameters())
    x, y = torch.randn(6, 8), torch.randn(6, 4)
    for _ in range(3):
        assert amp.step((model(x) - y).square().mean(), opt)
        opt.zero_grad()
    params = {k: v.clone() for k, v in model.state_dict().items()}
    state = copy.deepcopy(opt.state_dict())
    scale = amp.scaler.get_scale()
    hook = model[2].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([3]), bad))
    result = amp.step((model(x) - y).square().mean(), opt)
    hook.remove()
    assert not result
    for k, v in model.state_dict().items():
        assert torch.equal(v, params[k]), k
    after = opt.state_dict()
    for pid, s in state["state"].items():
        for key, value in s.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
    assert amp.scaler.get_scale() == scale * 0.5
    assert amp.scaler.loss_scale_state().skipped == 1
    opt.zero_grad()
    assert amp.step((model(x) - y).square().mean(), opt)  # and training goes on


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-adam"])
def test_on_min_scale_error_raises_where_the_reference_does(fused):
    cfg = LossScaleConfig(mode="dynamic", initial_scale=4.0, min_scale=1.0, on_min_scale="error", hysteresis=2)
    found = [True, False, True, True, True, True, True]
    ref_state = ampbridge.initial_state(cfg)
    for i, f in enumerate(found):
        try:
            ref_state = ampbridge.next_state(cfg, ref_state, f)
        except LossScaleError:
            stop = i
            break
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.Adam([param], fused=True) if fused else torch.optim.SGD([param], lr=0.1)
    scaler = abt.GradScaler(cfg, "cpu")
    states = []
    with pytest.raises(LossScaleError, match="min_scale=1.0"):
        for state in drive(scaler, opt, param, found):
            states.append(state)
    assert len(states) == stop
    assert scaler.loss_scale_state() == ref_state  # raised before backing off, as the reference


@pytest.mark.parametrize("name,fused,syncs", [
    ("torch-default", False, 1), ("torch-default", True, 0), ("hysteresis-2", False, 1), ("hysteresis-2", True, 0),
    ("min-max", True, 0), ("static", True, 0), ("none", False, 1), ("none", True, 0), ("no-skip", False, 0),
    ("none-no-skip", False, 0), ("warn-at-min", False, 1), ("error-at-min", False, 1), ("error-at-min", True, 1),
])
def test_host_syncs_per_step(name, fused, syncs, counter):
    """Native GradScaler: 1 read per step (for-loop optimizer), 0 (fused). ampbridge: the same,
    except on_min_scale error/warn on the fused path (1: the host must know to raise or warn)."""
    cfg = CONFIGS.get(name) or LossScaleConfig(mode="dynamic", min_scale=1.0, on_min_scale="error")
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=0.1, fused=fused or None)
    scaler = abt.GradScaler(cfg, "cpu")
    scaler.scale(torch.ones(()))
    counts = []
    for _ in range(3):
        param.grad = torch.ones(4)
        with counter() as c:
            scaler.step(opt)
            scaler.update()
        counts.append(c.syncs)
    assert counts == [syncs] * 3
    native = torch.amp.GradScaler("cpu")
    native.scale(torch.ones(()))
    param.grad = torch.ones(4)
    with counter() as c:
        native.step(opt)
        native.update()
    assert c.syncs == (0 if fused else 1)


def test_state_dict_round_trip_and_native_compatibility():
    cfg = CONFIGS["hysteresis-2"]
    a = abt.GradScaler(cfg, "cpu")
    param = torch.nn.Parameter(torch.zeros(4))
    opt = torch.optim.SGD([param], lr=0.1)
    *_, last = drive(a, opt, param, [False, True, False, False, True, True])
    sd = a.state_dict()
    assert sd["hysteresis_left"] == last.hysteresis_left and sd["steps"] == 6 and sd["skipped"] == 3
    b = abt.GradScaler(cfg, "cpu")
    b.load_state_dict(sd)
    assert b.loss_scale_state() == last  # before its tensors exist
    b.scale(torch.ones(()))
    assert b.loss_scale_state() == last
    # a plain torch GradScaler's checkpoint loads (missing fields start fresh) ...
    native = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=5)
    native.scale(torch.ones(()))
    c = abt.GradScaler(cfg, "cpu")
    c.load_state_dict(native.state_dict())
    assert c.loss_scale_state() == LossScaleState(512.0, 0, 2, 0, 0)
    # ... and ours loads into torch's (its five keys are there)
    native.load_state_dict({k: sd[k] for k in ("scale", "growth_factor", "backoff_factor", "growth_interval",
                                                "_growth_tracker")})
    assert native.get_scale() == last.scale
    with pytest.warns(ampbridge.AmpBridgeWarning, match="growth_interval"):
        c.load_state_dict({**sd, "growth_interval": 99})
    assert c._growth_interval == 5
    with pytest.raises(ValueError, match="needs at least 'scale'"):
        c.load_state_dict({"steps": 1})


def test_it_is_a_torch_grad_scaler_with_float32_factors():
    s = abt.GradScaler(LossScaleConfig(mode="dynamic", growth_factor=1.1, backoff_factor=0.3), "cpu")
    assert isinstance(s, torch.amp.GradScaler)
    assert s.get_growth_factor() == ampbridge.core.loss_scale.f32(1.1) != 1.1
    assert s.get_backoff_factor() == ampbridge.core.loss_scale.f32(0.3)
    import pickle

    s.scale(torch.ones(()))
    clone = pickle.loads(pickle.dumps(s))
    assert clone.loss_scale_state() == s.loss_scale_state()


def test_float16_parameters_get_float16_gradients_unscaled():
    """Native GradScaler refuses float16 gradients; the `float16` preset asks for them."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    amp = abt.apply(model, "float16")
    assert model[0].weight.dtype == torch.float16
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = model[0].weight.clone()
    assert amp.step(model(torch.randn(3, 4)).float().square().mean(), opt)
    assert model[0].weight.dtype == torch.float16 and not torch.equal(before, model[0].weight)
    assert math.isfinite(amp.scaler.get_scale())


@pytest.mark.parametrize("limit", [0, 1, 3])
def test_max_consecutive_skips_applies_the_update_where_optax_would(limit):
    """After ``limit`` skipped non-finite steps in a row the next non-finite update is applied (the
    parameter moves), until a finite step; the core's LossScaler decides the same steps."""
    cfg = LossScaleConfig(mode="dynamic", initial_scale=4.0, growth_interval=100, max_consecutive_skips=limit)
    found = [True, True, True, True, False, True, True, False, True]
    reference = ampbridge.LossScaler(cfg)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([param], lr=1.0)
    scaler = abt.GradScaler(cfg, "cpu")
    scaler.scale(torch.ones(()))
    for i, bad in enumerate(found):
        before = param.detach().clone()
        param.grad = torch.tensor([INF if bad else 1.0, 1.0])
        scaler.step(opt)
        scaler.update()
        applied = reference.update(bad)
        moved = not torch.equal(param.detach(), before)
        assert moved == applied == bool(scaler.last_step_result), f"step {i}"
        param.data.zero_()  # an applied inf update leaves inf behind: start each step from zeros
    assert scaler.loss_scale_state() == reference.state
    assert reference.state.skipped == sum(1 for i, _ in enumerate(found) if found[i]) - (
        {0: 7, 1: 4, 3: 1}[limit])


def test_max_consecutive_skips_refuses_a_fused_optimizer_by_name():
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([param], lr=1e-3, fused=True)
    scaler = abt.GradScaler(LossScaleConfig(mode="dynamic", max_consecutive_skips=2), "cpu")
    scaler.scale(torch.ones(()))
    param.grad = torch.ones(2)
    with pytest.raises(ampbridge.errors.UnsupportedOptionError, match="max_consecutive_skips=2 with a fused"):
        scaler.step(opt)
