"""Step time of ampbridge's torch ``[fp8]`` (current scaling) against native torchao (emulate=True) on CPU.

Interleaved rounds of 10 steps each; a 4-layer 256-wide MLP, batch 64, under
``torch.autocast(bfloat16)``; prints the median step times and the median of the per-round ratios
(each round times both paths back to back, so a busy machine slows both). Not a benchmarks/run.py
row (it runs ``bench_*.py`` only): both paths run the same torchao code, so the ratio is 1 up to
noise; the script is here to check that it stays so.

Usage: OMP_NUM_THREADS=1 python benchmarks/fp8_step_time.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings

import torch
from torchao.float8 import Float8LinearConfig, convert_to_float8_training

import ampbridge.torch as abt
from ampbridge import Fp8Config, Policy


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[m for _ in range(4) for m in (torch.nn.Linear(256, 256), torch.nn.ReLU())])


def main(rounds: int) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    x, y = torch.randn(64, 256), torch.randn(64, 256)
    native = mlp()
    convert_to_float8_training(native, config=Float8LinearConfig(emulate=True))
    native_opt = torch.optim.SGD(native.parameters(), lr=1e-3)
    mine = mlp()
    amp = abt.apply(mine, Policy(compute_dtype="bfloat16", fp8=Fp8Config(("kind:linear",), scaling="current")))
    mine_opt = torch.optim.SGD(mine.parameters(), lr=1e-3)

    def native_step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = native(x)
        loss = ((out.float() - y) ** 2).mean()
        native_opt.zero_grad()
        loss.backward()
        native_opt.step()

    def ampbridge_step() -> None:
        with amp.autocast():
            out = mine(x)
        loss = ((out - y) ** 2).mean()
        mine_opt.zero_grad()
        amp.step(loss, mine_opt)

    def timed(step) -> float:
        start = time.perf_counter()
        for _ in range(10):
            step()
        return (time.perf_counter() - start) / 10

    for step in (native_step, ampbridge_step):
        timed(step)  # warm-up
    pairs = [(timed(native_step), timed(ampbridge_step)) for _ in range(rounds)]
    n, m = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    ratio = statistics.median(b / a for a, b in pairs)
    print(f"native torchao {n * 1e3:.2f} ms/step, ampbridge {m * 1e3:.2f} ms/step, "
          f"ratio {ratio:.3f} (median of {rounds} rounds)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
