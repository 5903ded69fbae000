"""The closing table of issue 37: per framework, each model of the native-pins tests (norms,
embeddings and head pinned, trained beside the native hand-pinned model with an overflowing batch),
its pins, Plan rows, and mismatches against native (losses, parameters, scales, every module's
output dtype; target 0); and the widest Plan line of ``ampbridge demo``'s output file, if given.

Run from the repository root (it imports the tests' helpers):
``python benchmarks/native_pins_table.py torch``, ``KERAS_BACKEND=jax python benchmarks/native_pins_table.py
keras``, ``python benchmarks/native_pins_table.py jax``; ``--demo FILE`` measures a saved demo output.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings

sys.path.insert(0, os.getcwd())


def _pins(plan) -> int:
    return sum(1 for r in plan.rows if r.rule.startswith("keep_float32") and r.inherited_from is None)


def torch_rows() -> list[tuple]:
    t = importlib.import_module("tests.backend_torch.test_native_pins")
    cases = [("residual", c, t._residual, t._policy(c, "head")) for c in ("float16", "bfloat16")]
    cases += [(n, "float16", t._transformer(n), t._policy("float16", t.HEADS[n])) for n in ("bert", "gpt2", "llama")]
    out = []
    for name, compute, build, policy in cases:
        native, ours, amp = t._compare(build, policy)
        out.append(("torch", name, compute, _pins(amp.plan), len(amp.plan), len(t.mismatches(native, ours))))
    return out


def keras_rows() -> list[tuple]:
    import keras
    import numpy as np

    t = importlib.import_module("tests.backend_keras.test_native_pins")
    kx = importlib.import_module("tests.backend_keras.conftest")._helpers()
    out = []
    for name in ("residual", "bert", "llama"):
        native = t._native(kx, name)
        seen_n = kx.probe(native)
        try:
            losses_n = t._fit(kx, native, keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.01), initial_scale=1024.0, dynamic_growth_steps=2), name)
        except Exception as e:  # noqa: BLE001 - native Keras's own failure: no comparison
            out.append(("keras/" + keras.backend.backend(), name, "float16", "-", "-",
                        f"native fails ({type(e).__name__})"))
            continue
        kx.seed(0)
        ours = t.ak.apply(t._residual(native=False) if name == "residual" else t._hub(name), t.POLICY)
        seen_a = kx.probe(ours)
        losses_a = t._fit(kx, ours, t.ak.optimizer(keras.optimizers.SGD(0.01), t.POLICY), name)
        bad = sum(a != b for a, b in zip(losses_a, losses_n)) + abs(len(losses_a) - len(losses_n))
        bad += sum(not np.array_equal(kx.numpy(a), kx.numpy(b)) for a, b in zip(native.weights, ours.weights))
        bad += ours.optimizer.state.scale != float(kx.numpy(native.optimizer.dynamic_scale))
        bad += sum(seen_a.get(p, {}).get("outputs") != seen_n.get(p, {}).get("outputs") for p in seen_a.keys() | seen_n.keys())
        plan = t.ak.plan(ours, t.POLICY)
        out.append(("keras/" + keras.backend.backend(), name, "float16", _pins(plan), len(plan), bad))
    return out


def jax_rows() -> list[tuple]:
    t = importlib.import_module("tests.backend_jax.test_native_pins")
    c = importlib.import_module("tests.backend_jax.conftest")
    import jax

    ids = t._batches()[0][0]
    plan = t.abj.plan(t.Decoder(), t.POLICY, ids)
    try:  # its assertions: losses, parameters, scales, every module's output dtype equal to jmp's
        t.test_residual_decoder_trains_bit_identical_to_jmp_hand_pinning(c.tree_bits_equal, c.output_dtypes)
        bad = 0
    except AssertionError as e:
        bad = f"fails: {str(e).splitlines()[0][:60]}"
    del jax
    return [("jax (flax linen)", "residual decoder", "float16", _pins(plan), len(plan), bad)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("framework", choices=["torch", "keras", "jax"], nargs="?")
    parser.add_argument("--demo", help="a saved `ampbridge demo` output: its widest Plan line")
    args = parser.parse_args()
    if args.framework:
        warnings.simplefilter("ignore")
        rows = {"torch": torch_rows, "keras": keras_rows, "jax": jax_rows}[args.framework]()
        print("| framework | model | compute | pins | rows | mismatches vs native |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print("| " + " | ".join(str(x) for x in r) + " |")
    if args.demo:
        with open(args.demo, encoding="utf-8") as f:
            lines = f.read().splitlines()
        widest = max(lines, key=len) if lines else ""
        print(f"demo: {len(lines)} lines, widest {len(widest)} characters: {widest[:80]!r}...")


if __name__ == "__main__":
    main()
