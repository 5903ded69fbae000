"""JAX backend cost: the ampbridge train step against the hand-written jmp + optax step.

Both steps train the same Flax model with float16 compute, float32 master weights and dynamic loss
scaling, on three models so every regime is watched: ``transformer`` (the conformance model, made
wider so a step takes a few milliseconds; adam), ``mlp`` (256-512-512-512-10, batch 64, SGD: matmul
bound) and ``many-small`` (32 Dense(16) layers, 64 parameter arrays, batch 8, adam: the optimizer
and the per-leaf loss-scale work dominate).
The jmp step is what a careful JAX user writes today: ``jmp`` policy casts, ``jmp.DynamicLossScale``,
and the skip done by hand with ``jmp.select_tree(jmp.all_finite(grads), ...)``.

Reported:
- HLO ops: every ``<dialect>.<op>`` occurrence in ``jax.jit(step).lower(...).as_text()``
  (StableHLO, before XLA optimises), ``func.func``/``func.return`` excluded; and the instructions of
  the optimised module (``.compile().as_text()``, lines ``%name = type op(...)``, fusion bodies included), which is what runs.
- host callbacks in the jitted step (must be 0).
- step time: both compiled steps in one process, interleaved round by round (order alternating),
  each round ``--steps`` steps; the ratio is the median over rounds of ampbridge / jmp, with its
  interquartile range and the number of rounds.

Where the MLP's time goes (an earlier measurement reported 1.13-1.18 there): XLA's CPU profile
(``jax.profiler`` with ``create_perfetto_trace=True``, durations summed per fusion) shows the two
compiled programs run the same kernels: the same 5 YNNPACK dot fusions and 4 Eigen dots (the
``operand_precision=highest`` ampbridge's matmul_precision puts on its dots changes no kernel on
the CPU), and one elementwise update fusion per parameter on each side, within noise of each
other. The rest was per call: every leaf of the optimizer state is a buffer the jitted step takes
and returns (about 1.3 us each: a jitted ``x + 1`` over 1, 2, 6, 12 int32 scalars takes 3.7, 5.0,
9.9, 17.8 us a call; flattening the state is < 1 us, NamedTuples flatten in C++), and the
loss-scale state had 6 scalar leaves against jmp's 2, each updated by its own small fusion that
recomputed the AND of the 8 per-parameter finiteness flags. On the same MLP at widths 4 (compute
~0) that was 50 us a step against 39 us for jmp. Now: ``PackedLossScale(scale, counters: int32[5])``
(2 leaves), one finiteness flag carried through the per-parameter reductions, selects without
wrapper functions, one ``-0.0`` array per shape: MLP lowered ops 300 -> 294 (jmp 292), optimised
instructions 874 -> 678 (jmp 767), state leaves 6 -> 2 (jmp 2), and the width-4 step at jmp's
time (``tests/backend_jax/test_step_counts.py`` holds the counts).

Usage: python benchmarks/bench_jax.py [--rounds 31] [--steps 20] [--dim 64] [--models transformer,mlp,many-small]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax

import ampbridge
import ampbridge.jax as abj
from ampbridge._testing import compiled_instructions, compiled_kernels, lowered_ops
from ampbridge.cli.demo.flax_model import build, loss_fn
from ampbridge.cli.demo.model import Config, batches

sys.path.insert(0, str(Path(__file__).parent))
from _stats import spread  # noqa: E402


def host_callbacks(text: str) -> int:
    return len(re.findall(r"callback|outfeed|infeed|send\(|recv\(", text))


class MLP(nn.Module):
    """256-512-512-512-10: a step dominated by its matmuls."""

    widths: tuple[int, ...] = (512, 512, 512)
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for w in self.widths:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.classes)(x)


class ManySmall(nn.Module):
    """32 residual Dense(16) layers: 64 small parameter arrays, a step dominated by the optimizer."""

    depth: int = 32
    width: int = 16

    @nn.compact
    def __call__(self, x):
        for _ in range(self.depth):
            x = x + jnp.tanh(nn.Dense(self.width)(x))
        return x


def make_steps(model, policy, jmp_policy, inner, scale0, period, loss=loss_fn):
    amp = abj.apply(model, policy)
    tx = abj.optimizer(inner, policy)

    def ampbridge_step(params, opt_state, x, y):
        def scaled_loss(p):
            return abj.scale_loss(loss(amp.apply({"params": p}, x), y), opt_state)

        grads = jax.grad(scaled_loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    # jmp.DynamicLossScale cannot be an argument of jit(...).lower() (its tree_unflatten runs a
    # dtype check on lowering placeholders and fails), so its two arrays travel instead
    def jmp_step(params, opt_state, scale, counter, x, y):
        loss_scale = jmp.DynamicLossScale(scale, counter, period=period)

        def scaled_loss(p):
            logits = model.apply({"params": jmp_policy.cast_to_compute(p)}, jmp_policy.cast_to_compute(x))
            return loss_scale.scale(loss(jmp_policy.cast_to_output(logits), y))

        grads = loss_scale.unscale(jax.grad(scaled_loss)(params))
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = inner.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(finite, (new_params, new_opt_state), (params, opt_state))
        return params, opt_state, loss_scale.loss_scale, loss_scale.counter

    return tx, ampbridge_step, jmp_step, (jnp.float32(scale0), jnp.zeros((), jnp.int32))


def _mse(out, y):
    return jnp.mean(jnp.square(out.astype(jnp.float32) - y))


def setup(name: str, dim: int, steps: int):
    """(description, module, params, batches, loss, inner optimizer factory) of one benchmark model."""
    key = jax.random.key(0)
    if name == "transformer":
        config = Config(dim=dim, hidden=4 * dim, heads=4, seq=16, batch=16, vocab=256)
        model, variables = build(0, config)
        data = [tuple(map(jnp.asarray, b)) for b in batches(max(steps, 8), config=config)]
        text = f"conformance transformer dim={config.dim} hidden={config.hidden} seq={config.seq} batch={config.batch}"
        return text, model, variables["params"], data, loss_fn, lambda: optax.adam(1e-3)
    if name == "mlp":
        model = MLP()
        data = [(jax.random.normal(jax.random.fold_in(key, i), (64, 256)),
                 jax.random.randint(jax.random.fold_in(key, 100 + i), (64,), 0, 10)) for i in range(8)]
        params = model.init(key, data[0][0])["params"]
        return "MLP 256-512-512-512-10, batch 64", model, params, data, loss_fn, lambda: optax.sgd(1e-2)
    if name == "many-small":
        model = ManySmall()
        data = [(jax.random.normal(jax.random.fold_in(key, i), (8, 16)),
                 jax.random.normal(jax.random.fold_in(key, 100 + i), (8, 16))) for i in range(8)]
        params = model.init(key, data[0][0])["params"]
        return "32 residual Dense(16) layers, batch 8", model, params, data, _mse, lambda: optax.adam(1e-3)
    raise SystemExit(f"bench_jax.py: unknown model {name!r}; accepted: transformer, mlp, many-small")


def measure(name: str, args) -> list[str]:
    text, model, params, data, loss, inner = setup(name, args.dim, args.steps)
    scale0, period = 2.0 ** 15, 2000
    policy = ampbridge.Policy(compute_dtype="float16", loss_scale=ampbridge.LossScaleConfig(
        mode="dynamic", initial_scale=scale0, growth_interval=period, min_scale=1.0))
    jmp_policy = jmp.get_policy("p=f32,c=f16,o=f32")
    tx, amp_step, ref_step, scale_j = make_steps(model, policy, jmp_policy, inner(), scale0, period, loss)
    state_a = jax.jit(tx.init)(params)
    state_j = jax.jit(inner().init)(params)

    lowered_a = jax.jit(amp_step).lower(params, state_a, *data[0])
    lowered_j = jax.jit(ref_step).lower(params, state_j, *scale_j, *data[0])
    text_a, text_j = lowered_a.as_text(), lowered_j.as_text()
    ops_a, ops_j = lowered_ops(text_a), lowered_ops(text_j)
    compiled_a, compiled_j = lowered_a.compile(), lowered_j.compile()
    inst_a, inst_j = compiled_instructions(compiled_a.as_text()), compiled_instructions(compiled_j.as_text())
    kern_a, kern_j = compiled_kernels(compiled_a.as_text()), compiled_kernels(compiled_j.as_text())

    # same numbers first: the comparison is only fair if both steps compute the same thing
    pa, sa = params, state_a
    pj, sj, lj = params, state_j, scale_j
    for x, y in data[:5]:
        pa, sa = compiled_a(pa, sa, x, y)
        pj, sj, *lj = compiled_j(pj, sj, *lj, x, y)
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pj)))

    def run_a(n):
        nonlocal pa, sa
        for i in range(n):
            pa, sa = compiled_a(pa, sa, *data[i % len(data)])
        jax.block_until_ready(pa)

    def run_j(n):
        nonlocal pj, sj, lj
        for i in range(n):
            pj, sj, *lj = compiled_j(pj, sj, *lj, *data[i % len(data)])
        jax.block_until_ready(pj)

    run_a(args.steps), run_j(args.steps)  # warm up
    times_a, times_j, ratios = [], [], []
    for r in range(args.rounds):
        order = (("a", run_a), ("j", run_j)) if r % 2 == 0 else (("j", run_j), ("a", run_a))
        took = {}
        for key, fn in order:
            t0 = time.perf_counter()
            fn(args.steps)
            took[key] = (time.perf_counter() - t0) / args.steps
        times_a.append(took["a"])
        times_j.append(took["j"])
        ratios.append(took["a"] / took["j"])

    ratio = statistics.median(ratios)
    leaves = jax.tree_util.tree_leaves(params)
    n_params = sum(int(np.prod(p.shape)) for p in leaves)
    out = [f"### {name}: {text} ({n_params} params, {len(leaves)} arrays), float16 compute, dynamic loss scale, "
           f"{'SGD' if name == 'mlp' else 'adam'}",
           f"same parameters after 5 steps: {same}", ""]
    rows = [("", "ampbridge", "jmp (hand-written)", "ratio"),
            ("lowered StableHLO ops", str(sum(ops_a.values())), str(sum(ops_j.values())),
             f"{sum(ops_a.values()) / sum(ops_j.values()):.3f}")]
    if name == "transformer":
        # the preset's loss scale has no min_scale: its scale arithmetic takes the subnormal-safe path
        tx_p, step_p, _, _ = make_steps(model, ampbridge.preset("mixed_float16"), jmp_policy, inner(), scale0, period)
        ops_p = lowered_ops(jax.jit(step_p).lower(params, jax.jit(tx_p.init)(params), *data[0]).as_text())
        rows.append(("  (preset mixed_float16: no min_scale)", str(sum(ops_p.values())), "-", "-"))
    leaves_a = len(jax.tree_util.tree_leaves(state_a))
    leaves_j = len(jax.tree_util.tree_leaves(state_j)) + len(scale_j)
    rows += [("optimised HLO instructions", str(inst_a), str(inst_j), f"{inst_a / inst_j:.3f}"),
             ("compiled kernels (ENTRY fusions, dots, calls)", str(kern_a), str(kern_j), f"{kern_a - kern_j:+d}"),
             ("optimizer + loss-scale state leaves", str(leaves_a), str(leaves_j), "-"),
             ("host callbacks in the step", str(host_callbacks(text_a)), str(host_callbacks(text_j)), "-"),
             ("step ms, median (IQR, rounds)", spread(times_a, scale=1e3), spread(times_j, scale=1e3),
              spread(ratios))]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for k, row in enumerate(rows):
        out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    out.append(f"ratio over {args.rounds} interleaved rounds of {args.steps} steps: {spread(ratios)}; "
               f"target <= 1.03: {'met' if ratio <= 1.03 else 'MISSED'}")
    diff = (ops_a - ops_j) + (ops_j - ops_a)
    extra = ", ".join(f"{op.split('.')[-1]} {ops_a[op] - ops_j[op]:+d}" for op, _ in diff.most_common(8))
    out.append(f"lowered op difference (ampbridge - jmp): {extra or 'none'}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--models", default="transformer,mlp,many-small")
    args = parser.parse_args()
    print(f"device: {jax.devices()[0].platform} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    for name in args.models.split(","):
        print()
        print("\n".join(measure(name, args)), flush=True)


if __name__ == "__main__":
    main()
