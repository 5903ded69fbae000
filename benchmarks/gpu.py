"""The GPU check: what CUDA really runs under ampbridge, against native AMP, in one script (< 8 min on one GPU).

Records, on the first CUDA device:
(a) every torch Plan row's claimed CUDA compute dtype (``ampbridge.torch.plan(model, policy,
    device_type="cuda")``, read from torch's op lists, nothing run) against what CUDA autocast ran
    (the dispatcher: ``amp.trace``, a ``TorchDispatchMode`` recording each module's op dtypes),
    for a model holding every module class the Plan knows, under float16 and bfloat16;
(b) parity of ampbridge with native AMP on CUDA, same weights and batches, float16 + dynamic loss
    scaling: torch (``torch.autocast`` + ``GradScaler``), Keras (its ``mixed_float16`` policy +
    ``LossScaleOptimizer``, per Keras backend, each in its own process) and JAX (``jmp`` + optax):
    the largest loss difference over the steps and whether the parameters end bit-identical;
(c) the speedup of float16 and bfloat16 over float32, ampbridge and native AMP, median step time
    over interleaved rounds: torch on matmul-bound transformer blocks, JAX (against jmp) on a
    matmul-bound MLP;
(d) peak device memory of each (c) variant (``torch.cuda.max_memory_allocated``; JAX: the
    compiled step's memory analysis);
(e) FP8 on torch, where the GPU has float8 tensor cores (compute capability >= 8.9): ampbridge's
    ``[fp8] scaling = "current"`` against native torchao (``convert_to_float8_training`` with
    ``Float8LinearConfig()``, emulate=False) under bfloat16 autocast, on a matmul-bound MLP: parity
    (losses and parameters over the steps) and the median step time of each, with the plain
    bfloat16 step as the baseline. Elsewhere (the CPU, an older GPU, no torchao) the section is one
    line saying why it was skipped: emulated float8 timings say nothing about a GPU.
It writes a markdown table (``--out``, default docs/gpu.md).

``--dry-run`` runs the same code paths on the CPU with tiny sizes in well under a minute (CI runs
it: tests/backend_torch/test_gpu_script.py), writing to stdout unless ``--out`` is given; its
numbers say nothing about a GPU.

Usage: python benchmarks/gpu.py [--dry-run] [--out PATH] [--keras-backends jax,torch,tensorflow]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "docs" / "gpu.md"


# --- (a) the Plan's CUDA claims against the dispatcher --------------------------------------------

def _zoo(torch, d: int):
    """A model holding every module class the torch Plan has a CUDA claim for."""
    nn = torch.nn

    class Zoo(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, d)
            self.linear = nn.Linear(d, d)
            self.bilinear = nn.Bilinear(d, d, d)
            self.prelu = nn.PReLU()
            self.conv1d = nn.Conv1d(d, d, 3, padding=1)
            self.conv2d = nn.Conv2d(4, 4, 3, padding=1)
            self.batchnorm = nn.BatchNorm1d(d)
            self.layernorm = nn.LayerNorm(d)
            self.groupnorm = nn.GroupNorm(4, d)
            self.rmsnorm = nn.RMSNorm(d)
            self.attn = nn.MultiheadAttention(d, 4, batch_first=True)
            self.lstm = nn.LSTM(d, d, batch_first=True)
            self.gru = nn.GRU(d, d, batch_first=True)
            self.softmax = nn.Softmax(-1)
            self.log_softmax = nn.LogSoftmax(-1)
            self.encoder = nn.TransformerEncoderLayer(d, 4, 2 * d, dropout=0.0, batch_first=True)

        def forward(self, tokens):
            h = self.embed(tokens)  # (batch, seq, d)
            h = self.linear(h)
            h = h + self.bilinear(h, h)
            h = self.prelu(h)
            h = self.conv1d(h.transpose(1, 2)).transpose(1, 2)
            img = self.conv2d(h.reshape(h.shape[0], 4, h.shape[1], -1))
            h = h + img.reshape(h.shape)
            h = self.batchnorm(h.transpose(1, 2)).transpose(1, 2)
            h = self.layernorm(h)
            h = self.groupnorm(h.transpose(1, 2)).transpose(1, 2)
            h = self.rmsnorm(h)
            h = h + self.attn(h, h, h, need_weights=False)[0]
            h = self.lstm(h)[0]
            h = self.gru(h)[0]
            h = self.encoder(h)
            return self.log_softmax(h) + self.softmax(h)

    return Zoo()


def plan_vs_dispatcher(torch, abt, ampbridge, device: str, d: int) -> list[dict]:
    rows = []
    for compute in ("float16", "bfloat16"):
        policy = ampbridge.Policy(compute_dtype=compute)  # no rules: every row is autocast's own doing
        torch.manual_seed(0)
        model = _zoo(torch, d)
        claimed = {r.path: r for r in abt.plan(model, policy, device_type=device).rows}
        amp = abt.apply(model.to(device), policy)
        tokens = torch.randint(0, 64, (2, 16), device=device)
        traced = {r.path: r for r in amp.trace(tokens).rows}
        for path, row in claimed.items():
            seen = traced.get(path)
            ran = seen is not None and "did not run" not in (seen.note or "")
            observed = seen.compute_dtype if ran else "-"
            if ran and "traced: ran in " in (seen.note or ""):
                observed = seen.note.split("traced: ran in ")[1].split(";")[0].strip()
            rows.append({"policy": compute, "path": path or "(root)", "class": row.class_name,
                         "claimed": row.compute_dtype, "observed": observed,
                         "match": (observed == row.compute_dtype) if ran else None})
    return rows


# --- (b) parity and (c)/(d) speed and memory: torch ---------------------------------------------

def _block(torch, d: int, layers: int):
    nn = torch.nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, max(1, d // 64), batch_first=True)
            self.ln2, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, h):
            x = self.ln1(h)
            h = h + self.attn(x, x, x, need_weights=False)[0]
            return h + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(h))))

    return nn.Sequential(*[Block() for _ in range(layers)])


def _torch_runner(torch, abt, ampbridge, device: str, d: int, layers: int, batch: int, seq: int,
                  how: str, compute: str):
    """(step function, model, optimizer): ``how`` is ampbridge / native / float32."""
    torch.manual_seed(0)
    model = _block(torch, d, layers).to(device)
    dtype = getattr(torch, compute)
    f16 = compute == "float16"
    if how == "ampbridge":
        policy = ampbridge.Policy(compute_dtype=compute, loss_scale=ampbridge.LossScaleConfig(
            mode="dynamic" if f16 else "none", initial_scale=2.0 ** 15, growth_interval=2000))
        amp = abt.apply(model, policy)
        opt = torch.optim.SGD(amp.model.parameters(), lr=1e-3)

        def step(x):
            loss = amp.model(x).float().square().mean()
            amp.step(loss, opt)
            opt.zero_grad(set_to_none=True)
            return loss

        return step, amp.model, opt
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 15, growth_interval=2000) if (
        how == "native" and f16) else None

    def step(x):
        if how == "native":
            with torch.autocast(device, dtype=dtype):
                out = model(x)
        else:
            out = model(x)
        loss = out.float().square().mean()
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, model, opt


def torch_parity(torch, abt, ampbridge, device: str, d: int, steps: int) -> dict:
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 16, d, generator=g).to(device) for _ in range(steps)]
    out = {}
    for how in ("ampbridge", "native"):
        step, model, _ = _torch_runner(torch, abt, ampbridge, device, d, 2, 2, 16, how, "float16")
        losses = [float(step(x)) for x in batches]
        out[how] = (losses, [p.detach().cpu() for p in model.parameters()])
    diff = max(abs(a - b) for a, b in zip(out["ampbridge"][0], out["native"][0]))
    same = all(torch.equal(a, b) for a, b in zip(out["ampbridge"][1], out["native"][1]))
    return {"framework": "torch", "device": device, "steps": steps, "max_loss_diff": diff,
            "identical_params": same, "last_loss": out["native"][0][-1]}


def _time(fn, sync, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t0) / steps


def torch_speed(torch, abt, ampbridge, device: str, d: int, layers: int, batch: int, seq: int,
                rounds: int, steps: int) -> list[dict]:
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.randn(batch, seq, d, device=device)
    variants = [("float32", "float32", "float32")] + [
        (how, compute, compute) for compute in ("float16", "bfloat16") for how in ("ampbridge", "native")]
    runners, memory = {}, {}
    for how, compute, _ in variants:
        step, model, opt = _torch_runner(torch, abt, ampbridge, device, d, layers, batch, seq, how, compute)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        for _ in range(3):  # warm up (and build optimizer state, autotune)
            step(x)
        sync()
        memory[(how, compute)] = torch.cuda.max_memory_allocated() / 2 ** 20 if cuda else None
        runners[(how, compute)] = step
    times = {k: [] for k in runners}
    keys = list(runners)
    for r in range(rounds):  # interleaved, order rotating, so drifting load hits every variant
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(_time(lambda k=k: runners[k](x), sync, steps))
    base = statistics.median(times[("float32", "float32")])
    return [{"framework": "torch", "how": how, "compute": compute, "ms": statistics.median(times[(how, compute)]) * 1e3,
             "speedup": base / statistics.median(times[(how, compute)]), "peak_mib": memory[(how, compute)],
             "rounds": rounds} for how, compute, _ in variants]


# --- (e) FP8: ampbridge's [fp8] against native torchao -------------------------------------------

def fp8_skip_reason(torch, device: str) -> str | None:
    """Why the FP8 rows cannot measure a GPU here, or None when they can."""
    if device != "cuda":
        return "skipped: no CUDA device (float8 matmuls need compute capability 8.9+; the CPU only emulates them)"
    cap = tuple(torch.cuda.get_device_capability())
    if cap < (8, 9):
        return (f"skipped: compute capability {cap[0]}.{cap[1]} has no float8 tensor cores (8.9+ does); torchao "
                "would emulate")
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "skipped: torchao is not installed (pip install 'ampbridge[torch-fp8]')"
    return None


def _fp8_runner(torch, abt, ampbridge, device: str, d: int, layers: int, how: str, emulate: bool):
    """(step, model): ``how`` is ampbridge ([fp8] current scaling), native (torchao) or bfloat16 (no FP8)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    nn = torch.nn
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(d, 4 * d), nn.GELU(),
                                                                 nn.Linear(4 * d, d))]).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if how == "ampbridge":
        amp = abt.apply(model, ampbridge.Policy(
            compute_dtype="bfloat16", loss_scale=ampbridge.LossScaleConfig(mode="none", skip_nonfinite=False),
            fp8=ampbridge.Fp8Config(("kind:linear",), scaling="current")))

        def step(x):
            with amp.autocast():
                loss = model(x).float().square().mean()
            amp.step(loss, opt)
            opt.zero_grad(set_to_none=True)
            return loss
        return step, model
    if how == "native":
        convert_to_float8_training(model, config=Float8LinearConfig(emulate=emulate))

    def step(x):
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss
    return step, model


def fp8_checks(torch, abt, ampbridge, device: str, d: int, layers: int, batch: int, rounds: int, steps: int,
               parity_steps: int, emulate: bool = False) -> tuple[dict, list[dict]]:
    """(parity row, speed rows) of ampbridge's [fp8] against native torchao; ``emulate`` only for the CPU test."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(batch, d, generator=g).to(device) for _ in range(parity_steps)]
    runs = {}
    for how in ("ampbridge", "native"):
        step, model = _fp8_runner(torch, abt, ampbridge, device, d, layers, how, emulate)
        runs[how] = ([float(step(x).detach()) for x in batches], [p.detach().cpu() for p in model.parameters()])
    parity = {"framework": "torch fp8", "device": device, "steps": parity_steps,
              "max_loss_diff": max(abs(a - b) for a, b in zip(runs["ampbridge"][0], runs["native"][0])),
              "identical_params": all(torch.equal(a, b) for a, b in zip(runs["ampbridge"][1], runs["native"][1]))}
    runners = {how: _fp8_runner(torch, abt, ampbridge, device, d, layers, how, emulate)[0]
               for how in ("bfloat16", "native", "ampbridge")}
    x = batches[0]
    for step in runners.values():
        for _ in range(3):  # warm up (torchao's casts, cuBLAS autotuning)
            step(x)
    sync()
    times = {k: [] for k in runners}
    keys = list(runners)
    for r in range(rounds):  # interleaved, order rotating
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[k].append(_time(lambda k=k: runners[k](x), sync, steps))
    base = statistics.median(times["bfloat16"])
    speed = [{"framework": "torch fp8", "how": how, "compute": "float8" if how != "bfloat16" else "bfloat16",
              "ms": statistics.median(times[how]) * 1e3, "speedup": base / statistics.median(times[how]),
              "peak_mib": None, "rounds": rounds} for how in keys]
    return parity, speed


# --- JAX: parity with jmp, speed and memory -----------------------------------------------------

def jax_checks(d: int, layers: int, batch: int, seq: int, rounds: int, steps: int, parity_steps: int) -> tuple:
    import jax
    import jax.numpy as jnp
    import jmp
    import numpy as np
    import optax

    import ampbridge
    sys.path.insert(0, str(HERE))
    from bench_jax import MLP, make_steps

    from ampbridge.cli.demo.flax_model import loss_fn

    device = jax.devices()[0].platform
    # a matmul-bound MLP (4 hidden layers of 4*d): its compile stays short, so the dry run does too
    model = MLP(widths=(4 * d,) * layers, classes=10)
    key = jax.random.key(0)
    data = [(jax.random.normal(jax.random.fold_in(key, i), (batch * seq // 4, d)),
             jax.random.randint(jax.random.fold_in(key, 100 + i), (batch * seq // 4,), 0, 10))
            for i in range(max(parity_steps, 2))]
    params = model.init(key, data[0][0])["params"]
    results, speed = {}, []
    for compute, jmp_name in (("float16", "p=f32,c=f16,o=f32"), ("bfloat16", "p=f32,c=bf16,o=f32")):
        ls = ampbridge.LossScaleConfig(mode="dynamic", initial_scale=2.0 ** 15, growth_interval=2000, min_scale=1.0)
        policy = ampbridge.Policy(compute_dtype=compute, loss_scale=ls)
        tx, amp_step, ref_step, scale_j = make_steps(model, policy, jmp.get_policy(jmp_name), optax.sgd(1e-3),
                                                     2.0 ** 15, 2000, loss_fn)
        ca = jax.jit(amp_step).lower(params, tx.init(params), *data[0]).compile()
        cj = jax.jit(ref_step).lower(params, optax.sgd(1e-3).init(params), *scale_j, *data[0]).compile()
        pa, sa = params, tx.init(params)
        pj, sj, lj = params, optax.sgd(1e-3).init(params), scale_j
        if compute == "float16":
            for x, y in data[:parity_steps]:
                pa, sa = ca(pa, sa, x, y)
                pj, sj, *lj = cj(pj, sj, *lj, x, y)
            same = all(np.array_equal(np.asarray(a), np.asarray(b))
                       for a, b in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pj)))
            diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in
                       zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pj)))
            results = {"framework": "jax", "device": device, "steps": parity_steps, "max_param_diff": diff,
                       "identical_params": same}
        state = {"a": (pa, sa), "j": (pj, sj, lj)}

        def run_a(n=steps):
            p, s = state["a"]
            for i in range(n):
                p, s = ca(p, s, *data[i % len(data)])
            jax.block_until_ready(p)
            state["a"] = (p, s)

        def run_j(n=steps):
            p, s, l = state["j"]
            for i in range(n):
                p, s, *l = cj(p, s, *l, *data[i % len(data)])
            jax.block_until_ready(p)
            state["j"] = (p, s, l)

        run_a(2), run_j(2)
        ta, tj = [], []
        for r in range(rounds):
            for name, fn in ((("a", run_a), ("j", run_j)) if r % 2 == 0 else (("j", run_j), ("a", run_a))):
                t0 = time.perf_counter()
                fn()
                (ta if name == "a" else tj).append((time.perf_counter() - t0) / steps)
        for how, times, compiled in (("ampbridge", ta, ca), ("native (jmp)", tj, cj)):
            mem = compiled.memory_analysis()
            peak = None if mem is None else (mem.temp_size_in_bytes + mem.argument_size_in_bytes
                                             + mem.output_size_in_bytes) / 2 ** 20
            speed.append({"framework": "jax", "how": how, "compute": compute, "ms": statistics.median(times) * 1e3,
                          "peak_mib": peak, "rounds": rounds})
    # float32 baseline: the same step with a float32 policy (no scaling)
    policy32 = ampbridge.Policy(compute_dtype="float32")
    tx, amp_step, _, _ = make_steps(model, policy32, jmp.get_policy("p=f32,c=f32,o=f32"), optax.sgd(1e-3), 1.0, 2000,
                                 loss_fn)
    c32 = jax.jit(amp_step).lower(params, tx.init(params), *data[0]).compile()
    p, s = c32(params, tx.init(params), *data[0])  # warm up
    t32 = []
    for _ in range(max(3, rounds // 2)):
        t0 = time.perf_counter()
        for i in range(steps):
            p, s = c32(p, s, *data[i % len(data)])
        jax.block_until_ready(p)
        t32.append((time.perf_counter() - t0) / steps)
    base = statistics.median(t32)
    for row in speed:
        row["speedup"] = base / (row["ms"] / 1e3)
    speed.insert(0, {"framework": "jax", "how": "float32", "compute": "float32", "ms": base * 1e3, "speedup": 1.0,
                     "peak_mib": None, "rounds": max(3, rounds // 2)})
    return results, speed


# --- Keras: parity, one backend per process -------------------------------------------------------

def keras_parity_one(backend: str, steps: int, dim: int) -> dict:
    os.environ["KERAS_BACKEND"] = backend
    import numpy as np

    if backend == "tensorflow":
        try:
            import torch  # noqa: F401  (before tensorflow, as the tests do)
        except ImportError:
            pass
    import keras

    import ampbridge
    import ampbridge.keras as ak

    L = keras.layers

    def build(native: bool):
        inputs = keras.Input((16, dim))
        x = L.Dense(4 * dim, activation="relu", name="fc1")(inputs)
        x = L.Dense(dim, name="fc2")(x)
        x = L.LayerNormalization(name="norm", **({"dtype": "float32"} if native else {}))(x)
        x = L.Dense(8, name="head")(L.GlobalAveragePooling1D(name="pool")(x))
        if native:
            x = L.Activation("linear", dtype="float32", name="out")(x)
        return keras.Model(inputs, x)

    rng = np.random.RandomState(0)
    xs = rng.randn(steps, 4, 16, dim).astype("float32")
    ys = rng.randint(0, 8, (steps, 4)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    native = build(True)
    keras.config.set_dtype_policy(previous)
    native.compile(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-2), initial_scale=2.0 ** 15,
                                                       dynamic_growth_steps=2000), loss)
    amp = build(False)
    amp.set_weights(native.get_weights())
    policy = ampbridge.Policy(compute_dtype="float16", keep_float32=("kind:norm",), loss_scale=ampbridge.LossScaleConfig(
        mode="dynamic", initial_scale=2.0 ** 15, growth_interval=2000))
    ak.apply(amp, policy)
    amp.compile(ak.optimizer(keras.optimizers.SGD(1e-2), policy), loss)
    la = [float(amp.train_on_batch(x, y)) for x, y in zip(xs, ys)]
    ln = [float(native.train_on_batch(x, y)) for x, y in zip(xs, ys)]
    same = all(np.array_equal(a, b) for a, b in zip(amp.get_weights(), native.get_weights()))
    device = "?"
    if backend == "jax":
        import jax
        device = jax.devices()[0].platform
    elif backend == "torch":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif backend == "tensorflow":
        import tensorflow as tf
        device = "gpu" if tf.config.list_logical_devices("GPU") else "cpu"
    return {"framework": f"keras ({backend})", "device": device, "steps": steps,
            "max_loss_diff": max(abs(a - b) for a, b in zip(la, ln)), "identical_params": same}


def keras_parity(backends: list[str], steps: int, dim: int) -> list[dict]:
    rows = []
    for backend in backends:
        proc = subprocess.run([sys.executable, __file__, "--keras-one", backend, "--steps", str(steps),
                               "--dim", str(dim)], capture_output=True, text=True,
                              env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
        if proc.returncode:
            tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
            rows.append({"framework": f"keras ({backend})", "device": "-", "error": tail[:160]})
        else:
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return rows


# --- the table --------------------------------------------------------------------------------

def _table(header: list[str], rows: list[list]) -> list[str]:
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return lines


def report(info: list[str], plan_rows, parity, speed, fp8=None) -> str:
    out = ["# GPU check (`python benchmarks/gpu.py`)", "", *info, "",
           "## (a) torch Plan: claimed CUDA compute dtype against the dispatcher", ""]
    bad = [r for r in plan_rows if r["match"] is False]
    out += _table(["policy", "row", "class", "claimed", "observed", "match"],
                  [[r["policy"], r["path"], r["class"], r["claimed"], r["observed"],
                    {True: "yes", False: "**NO**", None: "did not run"}[r["match"]]] for r in plan_rows])
    out += ["", f"{len(plan_rows) - len(bad)} of {len(plan_rows)} rows as claimed"
            + (f"; wrong: {', '.join(r['policy'] + ' ' + r['path'] for r in bad)}" if bad else ""), "",
            "## (b) parity with native AMP (float16, dynamic loss scaling, same weights and batches)", ""]
    out += _table(["framework", "device", "steps", "max loss difference", "max parameter difference",
                   "parameters bit-identical", "error"],
                  [[p["framework"], p.get("device"), p.get("steps"), p.get("max_loss_diff"), p.get("max_param_diff"),
                    p.get("identical_params"), p.get("error")] for p in parity])
    out += ["", "## (c) speedup over float32 and (d) peak memory (train step: torch transformer blocks, JAX MLP)", ""]
    out += _table(["framework", "variant", "compute", "ms/step (median)", "speedup vs float32", "peak MiB", "rounds"],
                  [[s["framework"], s["how"], s["compute"], s["ms"], s["speedup"], s["peak_mib"], s["rounds"]]
                   for s in speed])
    out += ["", "## (e) FP8: ampbridge [fp8] (current scaling) against native torchao, bfloat16 autocast", ""]
    if isinstance(fp8, str) or fp8 is None:
        out.append(fp8 or "not run")
    else:
        fp8_parity, fp8_speed = fp8
        out += _table(["variant", "steps", "max loss difference", "parameters bit-identical"],
                      [["ampbridge vs native torchao", fp8_parity["steps"], fp8_parity["max_loss_diff"],
                        fp8_parity["identical_params"]]])
        out += [""] + _table(["variant", "compute", "ms/step (median)", "speedup vs bfloat16", "rounds"],
                             [[s["how"], s["compute"], s["ms"], s["speedup"], s["rounds"]] for s in fp8_speed])
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes: checks the script runs")
    parser.add_argument("--out", help="markdown file to write (default docs/gpu.md; stdout on --dry-run)")
    parser.add_argument("--keras-backends", default=None, help="comma-separated (default jax,torch,tensorflow; "
                                                                "--dry-run: jax)")
    parser.add_argument("--keras-one", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dim", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.keras_one:
        print(json.dumps(keras_parity_one(args.keras_one, args.steps, args.dim)))
        return 0
    started = time.perf_counter()
    import torch

    import ampbridge
    import ampbridge.torch as abt

    if args.dry_run:
        device, sizes = "cpu", dict(d=32, layers=1, batch=2, seq=16, rounds=3, steps=2)
        parity_steps, kbackends = 3, ["jax"]  # the quickest Keras backend to import
    else:
        if not torch.cuda.is_available():
            print("gpu.py: no CUDA device visible to torch; use --dry-run to check the script on the CPU",
                  file=sys.stderr)
            return 1
        device, sizes = "cuda", dict(d=1024, layers=4, batch=16, seq=512, rounds=15, steps=10)
        parity_steps, kbackends = 50, ["jax", "torch", "tensorflow"]
    if args.keras_backends:
        kbackends = args.keras_backends.split(",")
    marks = [("start", time.perf_counter())]
    plan_rows = plan_vs_dispatcher(torch, abt, ampbridge, device, 32)
    marks.append(("plan", time.perf_counter()))
    parity = [torch_parity(torch, abt, ampbridge, device, 64 if args.dry_run else 256, parity_steps)]
    speed = torch_speed(torch, abt, ampbridge, device, **sizes)
    marks.append(("torch", time.perf_counter()))
    jax_parity, jax_speed = jax_checks(sizes["d"], sizes["layers"], sizes["batch"], sizes["seq"],
                                       sizes["rounds"], sizes["steps"], parity_steps)
    marks.append(("jax", time.perf_counter()))
    parity.append(jax_parity)
    speed += jax_speed
    parity += keras_parity(kbackends, parity_steps, 16 if args.dry_run else 256)
    marks.append(("keras", time.perf_counter()))
    fp8 = fp8_skip_reason(torch, device)
    print(f"(e) FP8: {fp8 or 'measuring'}", file=sys.stderr)
    if fp8 is None:
        fp8 = fp8_checks(torch, abt, ampbridge, device, d=4096, layers=2, batch=4096, rounds=sizes["rounds"],
                         steps=sizes["steps"], parity_steps=parity_steps)
        marks.append(("fp8", time.perf_counter()))
    took = ", ".join(f"{b[0]} {b[1] - a[1]:.0f} s" for a, b in zip(marks, marks[1:]))
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "none (dry run on the CPU: no GPU numbers)"
    info = [f"- date: {time.strftime('%Y-%m-%d %H:%M')}; device: {gpu}; {platform.platform()}",
            f"- torch {torch.__version__}; sizes {sizes}; parity over {parity_steps} steps; "
            f"took {time.perf_counter() - started:.0f} s ({took})"]
    text = report(info, plan_rows, parity, speed, fp8)
    if args.out or not args.dry_run:
        Path(args.out or DEFAULT_OUT).write_text(text)
        print(f"written to {args.out or DEFAULT_OUT}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
