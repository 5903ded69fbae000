"""The monitor between samples (issue 24): ``Monitor.wrap`` runs the step without a monitor on
unsampled steps (the same compiled program, no device read) and replays a skipped unsampled step
with the statistics program, so every non-finite step still gets per-layer statistics (issue 23)."""

from __future__ import annotations

import functools
import json
import re

import pytest

from ampbridge._testing import jax_device_reads as device_reads, require

jax = require("jax")
nn = require("flax.linen")
optax = require("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ampbridge.jax as abj  # noqa: E402
from ampbridge import LossScaleConfig, Policy  # noqa: E402
from ampbridge.diagnostics.runlog import read_log  # noqa: E402


@jax.custom_vjp
def amplify(x):
    return x


amplify.defvjp(lambda x: (x, None), lambda _, ct: ((ct.astype(jnp.float32) * jnp.float32(1e30)).astype(ct.dtype),))


class Net(nn.Module):
    """first -> mid -> (amp: a backward-only overflow when planted) -> big -> norm -> head."""

    plant: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(8, name="first")(x))
        x = nn.Dense(8, name="mid")(x)
        if self.plant:
            x = Amp(name="amp")(x)
        x = nn.Dense(8, name="big")(x)
        return nn.Dense(2, name="head")(nn.LayerNorm(name="norm")(x))


class Amp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return amplify(x)


POLICY = Policy(compute_dtype="float16", keep_float32=("kind:norm",),
                loss_scale=LossScaleConfig(mode="dynamic", initial_scale=2.0 ** 10, growth_interval=1000))


@functools.lru_cache(maxsize=None)
def compiled(plant: bool = False, attribution: str = "outputs"):
    amp = abj.apply(Net(plant), POLICY)
    tx = abj.optimizer(optax.adam(1e-2), POLICY)

    def loss_fn(p, x, y):
        return jnp.mean((amp.apply({"params": p}, x) - y) ** 2)

    @functools.partial(jax.jit, static_argnames="sample")
    def step(params, opt_state, x, y, sample=False):
        loss, grads, stats = abj.numerics(amp, loss_fn, opt_state, attribution=attribution, sample=sample)(
            params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, stats

    @jax.jit
    def no_monitor(params, opt_state, x, y):  # the step as written without ampbridge's monitor
        loss, grads = abj.value_and_grad(loss_fn, opt_state)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, None

    return amp, tx, step, no_monitor


def start(plant: bool = False, big: float = 1.0, attribution: str = "outputs"):
    amp, tx, step, no_monitor = compiled(plant, attribution)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)
    params = jax.jit(amp.init)(jax.random.key(0), x)["params"]
    params = {**params, "big": {**params["big"], "kernel": params["big"]["kernel"] * big}}
    return amp, params, tx.init(params), step, no_monitor, x, y


def lowered_ops(text: str) -> int:  # as benchmarks/bench_monitor_jax.py counts them
    ops = re.findall(r"\b((?:stablehlo|chlo|mhlo|func|sdy)\.\w+)", text)
    return sum(1 for op in ops if op not in ("func.func", "func.return"))


def compiled_instructions(text: str) -> int:
    return sum(1 for line in text.splitlines() if re.match(r"\s*(?:ROOT\s+)?%[\w.\-]+ = ", line))


def test_an_unsampled_step_is_the_step_without_a_monitor(tmp_path):
    """Exact: the same lowered program (text, StableHLO ops, converts) and the same optimised HLO
    as the step written with ``abj.value_and_grad``; per unsampled step one dispatch and no read,
    copy or wait, as without a monitor; and the parameters bit-identical after 120 steps."""
    amp, params, opt_state, step, no_monitor, x, y = start()
    plain = no_monitor.lower(params, opt_state, x, y)
    unsampled = step.lower(params, opt_state, x, y, sample=False)
    sampled = step.lower(params, opt_state, x, y, sample=True)
    def body(t):
        return t.split("\n", 1)[1]  # the module's name differs
    assert body(unsampled.as_text()) == body(plain.as_text())
    assert lowered_ops(unsampled.as_text()) == lowered_ops(plain.as_text()) < lowered_ops(sampled.as_text())
    assert unsampled.as_text().count("stablehlo.convert") == plain.as_text().count("stablehlo.convert")
    assert compiled_instructions(unsampled.compile().as_text()) == compiled_instructions(plain.compile().as_text())

    calls = []

    def counted_step(*args, sample):
        calls.append(sample)
        return step(*args, sample=sample)

    p0, s0 = params, opt_state
    for _ in range(2):  # warm: both programs compiled, the log header written
        p0, s0, _ = no_monitor(p0, s0, x, y)
    with abj.Monitor(tmp_path / "run.jsonl", amp, x, every=100) as monitor:
        train = monitor.wrap(counted_step)
        p1, s1, _ = train(params, opt_state, x, y)  # step 0: sampled
        monitor.flush()
        jax.block_until_ready((p0, p1))
        with device_reads() as without:
            for _ in range(98):
                p0, s0, _ = no_monitor(p0, s0, x, y)
        with device_reads() as with_monitor:
            for _ in range(98):
                p1, s1, _ = train(p1, s1, x, y)
        assert with_monitor == without == {"read": 0, "copy_to_host_async": 0, "block_until_ready": 0}
        assert calls == [True] + [False] * 98
        for _ in range(21):  # 100 is sampled again, then on
            p1, s1, _ = train(p1, s1, x, y)
    steps = read_log(tmp_path / "run.jsonl").steps
    assert [s["step"] for s in steps] == [0, 100] and calls[99:] == [False, True] + [False] * 19
    want = run_plain(params, opt_state, no_monitor, [(x, y)] * 120)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves((p1, s1)), jax.tree_util.tree_leaves(want)))


def run_plain(params, opt_state, no_monitor, batches):
    for x, y in batches:
        params, opt_state, _ = no_monitor(params, opt_state, x, y)
    return params, opt_state


@pytest.mark.parametrize("flush_at", [None, 120], ids=["no-flush", "flush-mid-window"])
def test_a_skipped_unsampled_step_is_replayed_with_its_statistics(tmp_path, flush_at):
    """Forward overflows in ``big`` at steps 50 and 151 (not sampled at every=100): both are logged
    at their own step with the statistics and attribution the statistics program gives on that
    step (equal to a run sampling every step, exactly), between the sampled steps 0, 100, 200;
    the trained parameters stay bit-identical to the run without a monitor."""
    amp, params, opt_state, step, no_monitor, x, y = start(big=2000.0)
    loud = {50, 151}
    batches = [(x * (300.0 if i in loud else 1.0), y) for i in range(201)]
    log = tmp_path / "run.jsonl"
    with abj.Monitor(log, amp, x, every=100) as monitor:
        train = monitor.wrap(step)
        p, s = params, opt_state
        for i, (xb, yb) in enumerate(batches):
            p, s, _ = train(p, s, xb, yb)
            if i == flush_at:
                monitor.flush()
    got = read_log(log)
    assert [r["step"] for r in got.steps] == [0, 50, 100, 151, 200]
    assert [r["skipped"] for r in got.steps] == [False, True, False, True, False]
    assert [r["first_nonfinite"] for r in got.steps if r["found_inf"]] == [{"path": "big", "where": "output"}] * 2
    assert got.end == {"kind": "end", "steps": 201, "skipped": 2, "first_step": 0, "last_step": 200}
    want_p, want_s = run_plain(params, opt_state, no_monitor, batches)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves((p, s)),
                                                    jax.tree_util.tree_leaves((want_p, want_s))))

    # the same run sampling every step: the replayed records are what that run logged at 50 and 151
    every = tmp_path / "every.jsonl"
    with abj.Monitor(every, amp, x, every=1) as monitor:
        train = monitor.wrap(step)
        p, s = params, opt_state
        for xb, yb in batches:
            p, s, _ = train(p, s, xb, yb)
    reference = {r["step"]: r for r in read_log(every).steps}
    for record in got.steps:
        assert json.dumps(record, sort_keys=True) == json.dumps(reference[record["step"]], sort_keys=True)  # nan too
        assert set(record["layers"]) == {"first", "mid", "big", "norm", "head"}


def test_a_backward_overflow_between_samples_names_its_layer(tmp_path):
    """``amp`` multiplies its cotangent by 1e30 on every step: steps 0-4 skip while the scale
    backs off (never finite: 2**10 / 2**5 still overflows float16); every=3 samples 0 and 3 and
    replays 1, 2, 4, each named ``amp`` by its input gradient."""
    amp, params, opt_state, step, _, x, y = start(plant=True, attribution="inputs")
    log = tmp_path / "run.jsonl"
    with abj.Monitor(log, amp, x, every=3) as monitor:
        train = monitor.wrap(step)
        for _ in range(5):
            params, opt_state, _ = train(params, opt_state, x, y)
    steps = read_log(log).steps
    assert [r["step"] for r in steps] == [0, 1, 2, 3, 4] and all(r["skipped"] for r in steps)
    assert [r["first_nonfinite"] for r in steps] == [{"path": "amp", "where": "gradient"}] * 5
    assert [r["loss_scale"] for r in steps] == [2.0 ** (10 - k) for k in range(5)]
    assert all(r["layers"]["mid"]["nonfinite"] == 1.0 for r in steps)


def test_nnx_between_samples(tmp_path):
    """NNX: the model and optimizer change in place; the replay runs on copies of their state
    after the last sampled step, and the live model ends as the run without a monitor leaves it."""
    nnx = require("flax.nnx")

    class NnxNet(nnx.Module):
        def __init__(self, rngs):
            self.first = nnx.Linear(4, 8, rngs=rngs)
            self.big = nnx.Linear(8, 8, rngs=rngs)
            self.head = nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x):
            return self.head(self.big(jax.nn.relu(self.first(x))))

    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 2)), jnp.float32)
    policy = Policy(compute_dtype="float16", loss_scale=LossScaleConfig(mode="dynamic", initial_scale=4.0))

    def fresh():
        model = abj.apply(NnxNet(nnx.Rngs(0)), policy)
        model.big.kernel.set_value(model.big.kernel.get_value() * 100.0)
        return model, nnx.Optimizer(model, abj.optimizer(optax.adam(1e-2), policy), wrt=nnx.Param)

    @functools.partial(nnx.jit, static_argnames="sample")
    def step(model, opt, x, y, sample=False):
        loss, grads, stats = abj.numerics(model, lambda m: jnp.mean((m(x) - y) ** 2), opt, sample=sample,
                                          attribution="outputs")(model)
        opt.update(model, grads)
        return stats

    loud = {3, 7}
    batches = [(x * (300.0 if i in loud else 1.0), y) for i in range(9)]
    model, opt = fresh()
    log = tmp_path / "nnx.jsonl"
    with abj.Monitor(log, model, every=5) as monitor:
        train = monitor.wrap(step)
        for xb, yb in batches:
            train(model, opt, xb, yb)
    steps = read_log(log).steps
    assert [r["step"] for r in steps] == [0, 3, 5, 7]
    assert [r["first_nonfinite"] for r in steps] == [None, {"path": "big", "where": "output"}, None,
                                                     {"path": "big", "where": "output"}]
    assert all(set(r["layers"]) == {"first", "big", "head"} for r in steps)
    plain_model, plain_opt = fresh()
    for xb, yb in batches:
        step(plain_model, plain_opt, xb, yb)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(nnx.state((model, opt))),
                                                    jax.tree_util.tree_leaves(nnx.state((plain_model, plain_opt)))))


def test_a_resumed_run_between_samples_and_a_donated_state(tmp_path):
    """``start=95``: the first call is unsampled, so the window starts from the state passed in;
    the overflow at 97 is replayed from it. A donated carry cannot be replayed: said by name."""
    amp, params, opt_state, step, _, x, y = start(big=2000.0)
    log = tmp_path / "resumed.jsonl"
    with abj.Monitor(log, amp, x, every=100) as monitor:
        train = monitor.wrap(step, start=95)
        for i in range(95, 102):
            params, opt_state, _ = train(params, opt_state, x * (300.0 if i == 97 else 1.0), y)
    steps = read_log(log).steps
    assert [r["step"] for r in steps] == [97, 100] and steps[0]["first_nonfinite"] == {"path": "big", "where": "output"}
    assert read_log(log).end["first_step"] == 95 and read_log(log).end["steps"] == 7

    donating = jax.jit(step.__wrapped__, static_argnames="sample", donate_argnums=(0, 1))
    amp, params, opt_state, *_ = start(big=2000.0)
    monitor = abj.Monitor(tmp_path / "donated.jsonl", amp, x, every=100)
    train = monitor.wrap(donating)
    for i in range(4):
        params, opt_state, _ = train(params, opt_state, x * (300.0 if i == 2 else 1.0), y)
    with pytest.raises(ValueError, match="was donated .donate_argnums., so skipped steps can be neither found nor replayed"):
        monitor.flush()
    # past two sampled steps: the first sends the donated window's counters (skipping deleted
    # arrays), the second reads them and names the donation (not JAX's "Array has been deleted")
    amp, params, opt_state, *_ = start(big=2000.0)
    train = abj.Monitor(tmp_path / "donated-sampled.jsonl", amp, x, every=3).wrap(donating)
    with pytest.raises(ValueError, match="the state of steps 0-1 was donated .donate_argnums."):
        for i in range(7):
            params, opt_state, _ = train(params, opt_state, x, y)
    assert i == 6  # raised at the second sampled step after the window, where its counters are read


def test_wrap_errors(tmp_path):
    amp, params, opt_state, step, no_monitor, x, y = start()
    with abj.Monitor(tmp_path / "a.jsonl", amp, x, every=2) as monitor:
        with pytest.raises(ValueError, match="carry=-1; accepted: an int >= 0"):
            monitor.wrap(step, carry=-1)
        with pytest.raises(ValueError, match="a sampled step returned no Numerics"):
            monitor.wrap(lambda *a, sample: no_monitor(*a))(params, opt_state, x, y)
    with pytest.raises(ValueError, match="sample='yes'; accepted: True or False"):
        abj.numerics(amp, lambda p: 0.0, opt_state, sample="yes")


def test_a_carry_that_is_not_the_last_output_starts_a_new_window(tmp_path):
    """A run restored from an earlier state between samples (linen: the carry is not the last
    call's output): the steps before the restore are settled from their own window, the steps
    after it from the restored state, so a skip on each side is replayed and logged at its own
    step, and the parameters equal a run without a monitor that was restored the same way."""
    amp, params, opt_state, step, no_monitor, x, y = start(big=2000.0)
    batches = [(x * (300.0 if i == 6 else 1.0), y) for i in range(8)]
    log = tmp_path / "run.jsonl"
    with abj.Monitor(log, amp, x, every=100) as monitor:
        train = monitor.wrap(step)
        p, s = params, opt_state
        for k, (xb, yb) in enumerate(batches[:7]):  # steps 0-6; 6 is skipped
            p, s, _ = train(p, s, xb, yb)
            if k == 4:
                checkpoint = (p, s)
        p, s = checkpoint
        for xb, yb in batches[5:]:  # steps 7-9: batches 5-7 again from the checkpoint; 8 is skipped
            p, s, _ = train(p, s, xb, yb)
    got = read_log(log)
    assert [(r["step"], r["skipped"]) for r in got.steps] == [(0, False), (6, True), (8, True)]
    assert [r["first_nonfinite"] for r in got.steps[1:]] == [{"path": "big", "where": "output"}] * 2
    assert got.end["steps"] == 10 and got.end["skipped"] == 2
    want_p, want_s = run_plain(params, opt_state, no_monitor, batches)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves((p, s)),
                                                    jax.tree_util.tree_leaves((want_p, want_s))))
