"""Numerics diagnostics: per-layer statistics, overflow attribution, the monitor's log, the report."""

from __future__ import annotations

import functools
import re

import pytest

from ampbridge._testing import require

jax = require("jax")
nn = require("flax.linen")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ampbridge.jax as abj  # noqa: E402
from ampbridge.backends.jax.stats import layer_statistics as _layer_statistics  # noqa: E402
from ampbridge import LossScaleConfig, Policy, Rule  # noqa: E402
from ampbridge.diagnostics.runlog import STAT_KEYS, layer_stats, read_log  # noqa: E402


@jax.custom_vjp
def amplify(x):
    return x


def _amplify_bwd(_, ct):  # the planted backward-only overflow: 1e30 * cotangent, back in its dtype
    return ((ct.astype(jnp.float32) * jnp.float32(1e30)).astype(ct.dtype),)


amplify.defvjp(lambda x: (x, None), _amplify_bwd)


class Amplify(nn.Module):
    """An identity whose gradient overflows (a layer without parameters)."""

    @nn.compact
    def __call__(self, x):
        return amplify(x)


class Net(nn.Module):
    """first -> block (mid, gate) -> big -> head; ``plant="backward"`` puts Amplify after gate."""

    plant: str = ""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, name="first")(x))
        x = Block(self.plant, name="block")(x)
        x = nn.Dense(8, name="big")(x)
        return nn.Dense(2, name="head")(nn.LayerNorm(name="norm")(x))


class Block(nn.Module):
    plant: str = ""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="mid")(x)
        if self.plant == "backward":
            x = Amplify(name="amp")(x)
        return x * jax.nn.sigmoid(nn.Dense(8, name="gate")(x))


def policy_with(scale: float = 2.0 ** 10, pins: tuple[str, ...] = ("kind:norm",), **kw) -> Policy:
    return Policy(compute_dtype="float16", keep_float32=pins,
                  loss_scale=LossScaleConfig(mode="dynamic", initial_scale=scale, growth_interval=1000, **kw))


@functools.lru_cache(maxsize=None)
def compiled(plant: str, policy: Policy, attribution: bool | str):
    """The applied model, its optimizer and a jitted train step returning the numerics (shared
    by the tests that only differ in their data, so each compiles once)."""
    amp = abj.apply(Net(plant), policy)
    tx = abj.optimizer(optax.adam(1e-2), policy)

    def loss_fn(p, x, y):
        return jnp.mean((amp.apply({"params": p}, x) - y) ** 2)

    @functools.partial(jax.jit, static_argnames=("every",))
    def step(params, opt_state, x, y, every=1):
        loss, grads, stats = abj.numerics(amp, loss_fn, opt_state, every=every,
                                          attribution=attribution)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads, stats

    return amp, tx, jax.jit(amp.init), step, loss_fn


def setup(plant: str = "", policy: Policy | None = None, *, big: float = 1.0, attribution: bool | str = True):
    """The applied model, its state, the jitted train step, a batch and the loss function."""
    amp, tx, init, step, loss_fn = compiled(plant, policy or policy_with(), attribution)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)
    params = init(jax.random.key(0), x)["params"]
    params = {**params, "big": {**params["big"], "kernel": params["big"]["kernel"] * big}}
    return amp, params, tx.init(params), step, x, y, loss_fn


def reference_stats(grads, stats):
    """``layer_stats`` (numpy) of the fetched gradients each layer owns."""
    out = {}
    for path, compute in zip(stats.layers, stats.compute_dtypes):
        node = grads
        for key in path.split(".") if path else ():
            node = node[key]
        g = np.concatenate([np.asarray(v, np.float64).ravel() for v in jax.tree_util.tree_leaves(node)])
        out[path] = layer_stats(g, float(stats.loss_scale), compute)
    return out


def assert_stats_equal(got, want):
    assert set(got) == set(want)
    for path in want:
        for key in STAT_KEYS:
            g, w = got[path][key], want[path][key]
            if key in ("grad_max_abs", "grad_rms"):
                assert (np.isnan(g) and np.isnan(w)) or g == pytest.approx(w, rel=1e-6, abs=0), (path, key, g, w)
            else:
                assert g == w, (path, key, g, w)  # fractions: exactly


# --- statistics ---------------------------------------------------------------------------

def test_statistics_equal_the_numpy_reference_on_the_real_gradients(demo):
    """The conformance model, float16 compute, norms pinned to float32 (another underflow limit),
    head parameters stored in bfloat16 (bfloat16 gradients), a scale small enough that some
    gradients would underflow; three real steps."""
    model, variables, batches, loss_fn = demo
    policy = Policy(compute_dtype="float16", keep_float32=("kind:norm",),
                    overrides=(Rule(("head",), param_dtype="bfloat16"),),
                    loss_scale=LossScaleConfig(mode="dynamic", initial_scale=4.0, growth_interval=1))
    amp = abj.apply(model, policy)
    params = amp.cast_params(variables, batches[0][0])["params"]
    tx = abj.optimizer(optax.sgd(0.1), policy)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads, stats = abj.numerics(amp, lambda p: loss_fn(amp.apply({"params": p}, x), y), opt_state)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads, stats

    underflows = 0
    for i, (x, y) in enumerate(batches[:3]):
        params, opt_state, grads, stats = step(params, opt_state, x, y)
        assert int(stats.step) == i and float(stats.loss_scale) == 4.0 * 2 ** i  # the scale used
        assert stats.layers == tuple(r.path for r in amp.plan(x) if r.param_count)  # forward order
        assert stats.compute_dtypes[stats.layers.index("block.norm1")] == "float32"
        assert grads["head"]["kernel"].dtype == jnp.bfloat16
        got = stats.layer_stats()
        assert_stats_equal(got, reference_stats(grads, stats))
        underflows += sum(s["underflow"] > 0 for s in got.values())
    assert underflows > 0  # the comparison covered underflowing gradients


def test_statistics_of_planted_values_match_exactly():
    """Zeros, values that underflow float16 once unscaled (and ones just above), inf and nan,
    through a parameter whose gradient is what we plant, for a few scales."""
    c = np.array([0.0, 0.0, 1e-12, 5e-8, 6e-8, 3e-8, 1e-3, -2.0, 0.6, 0.5, np.inf, np.nan], np.float32)

    class Given(nn.Module):
        @nn.compact
        def __call__(self):
            return self.param("w", nn.initializers.zeros, (c.size,))

    for scale in (2.0 ** 17, 3.0, 1e5):
        policy = Policy(compute_dtype="float16",
                        loss_scale=LossScaleConfig(mode="dynamic", initial_scale=scale))
        amp = abj.apply(Given(), policy)
        params = amp.init(jax.random.key(0))["params"]
        opt_state = abj.optimizer(optax.sgd(1.0), policy).init(params)
        run = jax.jit(lambda p, s: abj.numerics(amp, lambda p: jnp.sum(amp.apply({"params": p}) * c), s)(p))
        _, grads, stats = run(params, opt_state)
        want = reference_stats(grads, stats)
        assert_stats_equal(stats.layer_stats(), want)
        # a float16 row's gradients come through float16: beyond 65504 they are inf, not "overflow"
        beyond = np.count_nonzero(~np.isfinite(c) | (np.abs(c.astype(np.float64) * scale) > 65504))
        assert want[""]["underflow"] > 0 and want[""]["nonfinite"] == beyond / 12
        assert bool(stats.found_inf) and bool(stats.skipped)


def test_exact_underflow_limit_survives_subnormal_flushing():
    """The underflow test compares significands and exponents as integers: XLA's CPU flushes
    subnormal float32 values to zero in comparisons, so ``|g| < 2**-133 * S`` cannot be a
    float comparison for bfloat16 (or for a subnormal scale). Overflow: finite values beyond the
    compute dtype's max (here planted directly; a float16 row's own gradients arrive through
    float16, where such values are already inf)."""
    g = np.array([1e-40, 5e-41, 2e-45, 1e-39, 0.0, 3.0, 1e-30, 7e4, -1e5, 3.4e38, np.inf], np.float32)
    cases = ((1.0, "bfloat16"), (0.5, "bfloat16"), (1e-39, "float16"), (3.0, "float32"), (2.0 ** 20, "float16"))
    for scale, compute in cases:
        counts, magnitudes = jax.jit(lambda g, s, compute=compute: _layer_statistics(
            {"w": [g]}, {"w": compute}, s))(jnp.asarray(g), jnp.float32(scale))
        want = layer_stats(g, scale, compute)
        n = g.size
        assert want["overflow"] > 0 or compute == "float32"
        assert [int(v) / n for v in np.asarray(counts)[0]] == [want[k] for k in ("zero", "nonfinite", "underflow",
                                                                                 "overflow")], (scale, compute)


# --- attribution ----------------------------------------------------------------------------

def test_a_forward_overflow_names_the_layer_whose_output_overflowed(tmp_path):
    """``big``'s float16 output exceeds 65504 on the steps fed large inputs; every later layer is
    non-finite too, but the first in forward order is named, through real training steps."""
    amp, params, opt_state, step, x, y, _ = setup(big=2000.0)
    log = tmp_path / "run.jsonl"
    loud = {3, 7}
    with abj.Monitor(log, amp, x, every=1) as monitor:
        for i in range(10):
            before = params
            params, opt_state, grads, stats = step(params, opt_state, x * (300.0 if i in loud else 1.0), y)
            monitor.record(i, stats)
            assert bool(stats.found_inf) == (i in loud), i
            if i in loud:
                out = dict(zip(stats.leaves, np.asarray(stats.output_nonfinite)))
                assert not out["block.gate"] and out["big"] and out["head"]
                assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                                jax.tree_util.tree_leaves(params)))
    steps = read_log(log).steps
    assert [s["step"] for s in steps] == list(range(10))
    assert [s["first_nonfinite"] for s in steps if s["found_inf"]] == [{"path": "big", "where": "output"}] * 2
    assert [s["step"] for s in steps if s["skipped"]] == sorted(loud)
    assert steps[4]["loss_scale"] == steps[3]["loss_scale"] / 2 and all(s["first_nonfinite"] is None
                                                                        for s in steps if not s["found_inf"])


@pytest.mark.parametrize("watch", ["inputs", "outputs", False])
def test_a_backward_overflow_names_the_layer_whose_gradient_overflowed(tmp_path, watch):
    """Amplify's backward multiplies the cotangent by 1e30 (float16: inf); its forward, and every
    forward output, stays finite. The gradient then poisons every earlier layer; the first in
    backward order is named. Through real steps, skipped each time. Without watching gradients
    (attribution=False) the parameter gradients alone name the nearest layer with parameters."""
    amp, params, opt_state, step, x, y, _ = setup("backward", attribution=watch)
    log = tmp_path / "run.jsonl"
    with abj.Monitor(log, amp, x, every=1) as monitor:
        for i in range(3):
            params, opt_state, grads, stats = step(params, opt_state, x, y)
            monitor.record(i, stats)
            assert not np.asarray(stats.output_nonfinite).any() and stats.watched == (watch or "none")
            flagged = [p for p, f in zip(stats.leaves, np.asarray(stats.gradient_nonfinite)) if f]
            # input gradients: amp's and everything before it; output gradients: before amp only
            assert flagged == ["first", "block.mid", "block.amp"][:{"inputs": 3, "outputs": 2, False: 0}[watch]]
    steps = read_log(log).steps
    named = "block.amp" if watch else "block.mid"
    assert [s["first_nonfinite"] for s in steps] == [{"path": named, "where": "gradient"}] * 3
    assert [s["skipped"] for s in steps] == [True] * 3 and abj.loss_scale(opt_state).skipped == 3


def test_a_non_finite_loss_with_finite_layers_is_the_loss():
    amp, params, opt_state, step, x, y, _ = setup()
    *_, stats = step(params, opt_state, x, y * jnp.inf)
    assert bool(stats.found_inf) and stats.first_nonfinite() == {"path": "", "where": "loss"}
    assert not np.asarray(stats.output_nonfinite).any()


def test_attribution_inside_nn_scan():
    """The probes are gradients, so they cross lifted transforms (nn.scan) like any gradient."""

    class Layer(nn.Module):
        plant: bool

        @nn.compact
        def __call__(self, x, _):
            x = nn.Dense(4, name="dense")(x)
            return (Amplify(name="amp")(x) if self.plant else x), None

    class Scanned(nn.Module):
        plant: bool = False

        @nn.compact
        def __call__(self, x):
            x = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)(
                self.plant, name="layers")(nn.Dense(4, name="first")(x), None)[0]
            return nn.Dense(1, name="head")(x)

    for plant, want in ((True, {"path": "layers.amp", "where": "gradient"}), (False, None)):
        policy = policy_with(scale=8.0, pins=())
        amp = abj.apply(Scanned(plant), policy)
        x = jnp.ones((2, 3))
        params = amp.init(jax.random.key(0), x)["params"]
        opt_state = abj.optimizer(optax.sgd(0.1), policy).init(params)
        _, grads, stats = jax.jit(lambda p, s: abj.numerics(
            amp, lambda p: jnp.mean(amp.apply({"params": p}, x) ** 2), s)(p))(params, opt_state)
        assert stats.first_nonfinite() == want
        assert "layers.dense" in stats.layers and grads["layers"]["dense"]["kernel"].shape == (3, 4, 4)
        assert_stats_equal(stats.layer_stats(), reference_stats(grads, stats))


# --- what numerics costs: nothing on the host, nothing in the gradients ---------------------

def test_the_step_with_numerics_has_no_host_callback(inspect):
    amp, params, opt_state, step, x, y, loss_fn = setup()
    for every in (1, 100, None):
        assert inspect.callbacks(functools.partial(step, every=every), params, opt_state, x, y) == []


def test_gradients_with_numerics(demo, bits_equal):
    """Statistics and output watching leave the gradients bit-identical to the hand-written
    step; watching input gradients (one sum per module input) may move float16 sums' last bits."""
    model, variables, batches, loss_fn = demo
    policy = Policy(compute_dtype="float16", loss_scale=LossScaleConfig(mode="dynamic", initial_scale=2.0 ** 8))
    amp = abj.apply(model, policy)
    x, y = batches[0]
    params = amp.cast_params(variables, x)["params"]
    opt_state = abj.optimizer(optax.sgd(0.1), policy).init(params)
    plain = jax.jit(jax.grad(lambda p: abj.scale_loss(loss_fn(amp.apply({"params": p}, x), y), opt_state)))(params)

    def grads(attribution):
        return jax.jit(lambda p: abj.numerics(amp, lambda p: loss_fn(amp.apply({"params": p}, x), y), opt_state,
                                              attribution=attribution)(p)[1])(params)

    assert bits_equal(grads("outputs"), plain)  # statistics included (every=1)
    watched = grads(True)
    assert not bits_equal(watched, plain)  # the documented difference: float16 sums associate otherwise
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(watched)[0], jax.tree_util.tree_leaves(plain)):
        if "key" in jax.tree_util.keystr(path) and "bias" in jax.tree_util.keystr(path):
            continue  # softmax ignores a key bias: its true gradient is 0, what is here is rounding
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        assert np.linalg.norm(a - b) <= 5e-3 * np.linalg.norm(b), path  # float16 rounding, not more


# --- the monitor: sampling, the report ------------------------------------------------------

@pytest.mark.parametrize("two_programs", [False, True], ids=["cond", "two-programs"])
def test_sampling_every_100_logs_statistics_on_0_100_200_and_every_skip(tmp_path, two_programs):
    """``every=100`` on the device (a lax.cond on the step counter) or as two compiled steps
    chosen on the host; either way steps 0, 100, 200 carry statistics, and the non-finite steps
    are logged whenever they happen, with every layer's statistics too (issue 23: a lax.cond on
    the step being non-finite, which a finite unsampled step pays only as its predicate)."""
    amp, params, opt_state, step, x, y, _ = setup()
    log = tmp_path / "run.jsonl"
    poisoned = {50, 151}
    with abj.Monitor(log, amp, x, every=100, max_lag=0 if two_programs else 8) as monitor:
        for i in range(201):
            every = (1 if monitor.due(i) else None) if two_programs else 100
            params, opt_state, _, stats = step(params, opt_state, x, y * (jnp.nan if i in poisoned else 1.0),
                                               every=every)
            monitor.record(i, stats)
    steps = read_log(log).steps
    assert [s["step"] for s in steps] == [0, 50, 100, 151, 200]
    assert [bool(s["layers"]) for s in steps] == [True] * 5
    assert all(stats["nonfinite"] == 1.0 for stats in steps[3]["layers"].values())  # a nan loss: every gradient
    assert [s["skipped"] for s in steps] == [False, True, False, True, False]
    assert set(steps[2]["layers"]) == {"first", "block.mid", "block.gate", "big", "norm", "head"}
    # the closing record: every step recorded, logged or not (issue 23)
    assert read_log(log).end == {"kind": "end", "steps": 201, "skipped": 2, "first_step": 0, "last_step": 200}


def test_report_names_the_planted_layer_counts_skips_and_plots(tmp_path, capsys):
    from ampbridge.cli import commands as _cli

    amp, params, opt_state, step, x, y, _ = setup(big=2000.0, policy=policy_with(scale=2.0 ** 12, min_scale=1.0))
    log = tmp_path / "run.jsonl"
    with abj.Monitor(log, amp, x, every=2) as monitor:
        for i in range(24):
            params, opt_state, _, stats = step(params, opt_state, x * (300.0 if i % 4 == 1 else 1.0), y,
                                               every=2)
            monitor.record(i, stats)
    header = read_log(log).header
    assert header["framework"] == "jax" and header["compute_dtype"] == "float16" and header["min_scale"] == 1.0
    assert header["layers"] == ["first", "block", "block.mid", "block.gate", "big", "norm", "head"]
    assert header["policy"]["keep_float32"] == ["kind:norm"]
    assert _cli.main(["report", str(log), "--plot", str(tmp_path / "run.png")]) == 0
    text = capsys.readouterr().out
    assert "run: jax, compute float16, 24 step(s) (steps 0-23), 18 in the log" in text  # not 22 (issue 23)
    assert "skipped steps: 6 (1, 5, 9, 13, 17, 21)" in text
    # steps non-finite: none of the 6 was sampled, yet each has per-layer statistics (issue 23)
    assert re.search(r"^big +[0-9.]+% +6$", text, re.MULTILINE), text
    assert all(s["layers"] for s in read_log(log).steps) and "have no per-layer statistics" not in text
    assert "first layer to go non-finite, by steps: big (6)" in text and 'keep_float32 = ["big"]' in text
    png = (tmp_path / "run.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_clear_errors(tmp_path):
    amp, params, opt_state, *_ = setup()
    with pytest.raises(ValueError, match="every=0; accepted: a positive int"):
        abj.numerics(amp, lambda p: 0.0, opt_state, every=0)
    with pytest.raises(TypeError, match="needs the model ampbridge.jax.apply returned"):
        abj.numerics(nn.Dense(2), lambda p: 0.0, opt_state)
    with pytest.raises(ValueError, match="every=-1"):
        abj.Monitor(tmp_path / "a.jsonl", amp, jnp.ones((1, 4)), every=-1)
    with pytest.raises(ValueError, match="max_lag=-1; accepted: an int >= 0"):
        abj.Monitor(tmp_path / "a.jsonl", amp, jnp.ones((1, 4)), max_lag=-1)
    with abj.Monitor(tmp_path / "b.jsonl", amp, jnp.ones((1, 4))) as monitor:
        with pytest.raises(TypeError, match="needs the Numerics"):
            monitor.record(0, {"loss": 1.0})


# --- flax.nnx -------------------------------------------------------------------------------

def test_nnx_statistics_attribution_and_log(tmp_path):
    """The same for an NNX model trained with nnx.Optimizer under nnx.jit: a forward overflow
    in ``big`` (on the step fed large inputs) and a backward-only one in ``amp``."""
    nnx = require("flax.nnx")

    class Amp(nnx.Module):
        def __call__(self, x):
            return amplify(x)

    class NnxNet(nnx.Module):
        def __init__(self, rngs, plant: bool):
            self.first = nnx.Linear(4, 8, rngs=rngs)
            self.amp = Amp() if plant else None
            self.big = nnx.Linear(8, 8, rngs=rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            x = jax.nn.relu(self.first(x))
            if self.amp is not None:
                x = self.amp(x)
            return self.head(self.big(x))

    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)
    policy = policy_with(scale=4.0, pins=())
    for plant in (False, True):
        model = abj.apply(NnxNet(nnx.Rngs(0), plant), policy)
        if not plant:
            model.big.kernel.set_value(model.big.kernel.get_value() * 100.0)
        opt = nnx.Optimizer(model, abj.optimizer(optax.adam(1e-2), policy), wrt=nnx.Param)

        @nnx.jit
        def step(model, opt, x, y):
            loss, grads, stats = abj.numerics(model, lambda m: jnp.mean((m(x) - y) ** 2), opt)(model)
            opt.update(model, grads)
            return grads, stats

        log = tmp_path / f"nnx-{plant}.jsonl"
        with abj.Monitor(log, model) as monitor:
            for i in range(3):
                before = jax.tree_util.tree_map(lambda v: v.get_value(), nnx.state(model, nnx.Param),
                                                is_leaf=lambda v: isinstance(v, nnx.Variable))
                grads, stats = step(model, opt, x * (300.0 if i == 1 and not plant else 1.0), y)
                monitor.record(i, stats)
                assert stats.layers == ("first", "big", "head") and stats.leaves[:1] == ("first",)
                want = {}
                for path in stats.layers:
                    g = np.concatenate([np.asarray(v.get_value(), np.float64).ravel()
                                        for _, v in nnx.to_flat_state(grads[path])])
                    want[path] = layer_stats(g, float(stats.loss_scale), "float16")
                assert_stats_equal(stats.layer_stats(), want)
                if bool(stats.skipped):
                    after = jax.tree_util.tree_map(lambda v: v.get_value(), nnx.state(model, nnx.Param),
                                                   is_leaf=lambda v: isinstance(v, nnx.Variable))
                    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(before),
                                                                    jax.tree_util.tree_leaves(after)))
        steps = read_log(log).steps
        if plant:
            assert [s["first_nonfinite"] for s in steps] == [{"path": "amp", "where": "gradient"}] * 3
        else:
            assert [s["first_nonfinite"] for s in steps] == [None, {"path": "big", "where": "output"}, None]
        assert read_log(log).header["layers"] == ["first"] + (["amp"] if plant else []) + ["big", "head"]


def test_has_aux_carries_batch_stats_through():
    """A BatchNorm model: loss_fn returns (loss, new batch_stats), as with jax.value_and_grad."""

    class BN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.BatchNorm(use_running_average=False, momentum=0.5)(nn.Dense(4)(x)))

    policy = policy_with(scale=8.0, pins=())
    amp = abj.apply(BN(), policy)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 3)), jnp.float32)
    variables = jax.jit(amp.init)(jax.random.key(0), x)
    opt_state = abj.optimizer(optax.sgd(0.1), policy).init(variables["params"])

    def loss_fn(p, stats):
        out, state = amp.apply({"params": p, "batch_stats": stats}, x, mutable=["batch_stats"])
        return jnp.mean(out ** 2), state["batch_stats"]

    (loss, new_stats), grads, stats = jax.jit(lambda p, b: abj.numerics(amp, loss_fn, opt_state, has_aux=True)(p, b))(
        variables["params"], variables["batch_stats"])
    assert float(stats.loss) == float(loss) and new_stats["BatchNorm_0"]["mean"].dtype == jnp.float32
    assert not np.array_equal(new_stats["BatchNorm_0"]["mean"], variables["batch_stats"]["BatchNorm_0"]["mean"])
    # call order, not name order: the outer nn.Dense(1) was constructed (named) first
    assert stats.leaves == ("Dense_1", "BatchNorm_0", "Dense_0") and stats.first_nonfinite() is None
    assert_stats_equal(stats.layer_stats(), reference_stats(grads, stats))
