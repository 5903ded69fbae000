"""The cost of ampbridge.torch's numerics monitor: a train step with no monitor, every=100, every=1.

Four copies of one transformer-ish model (embedding, pre-norm attention + MLP blocks, head; float16
compute, norms and embedding pinned, dynamic loss scaling) train on the same batches: one without a
monitor, one with ``amp.monitor(path, every=100)``, one with ``every=1``, one with ``every=100,
attribution=False``. Rounds run the four in rotating order so machine load hits all of them; the
table shows median step times, the median of per-round ratios against no monitor with its
interquartile range and round count, and exact counts per step (host syncs =
``aten._local_scalar_dense``, casts = ``aten._to_copy``, the monitor's device-to-host transfers,
aten ops) on an unsampled and on a sampled step. Two optimizers: a for-loop SGD (the scaler reads
found_inf, one sync per step as in torch: an unsampled step runs no probe, a non-finite one is
replayed) and a fused AdamW (no sync: on the CPU device found_inf already lies in host memory and
the monitor reads its four bytes, no aten op, so it too replays instead of probing; on an
accelerator the probes would stay on, which this CPU run does not measure).

Usage: python benchmarks/bench_monitor_torch.py [--rounds N] [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ampbridge
import ampbridge.torch as abt
from ampbridge.backends.torch import monitor as torch_monitor

sys.path.insert(0, str(Path(__file__).parent))
from _stats import quartiles  # noqa: E402

F = torch.nn.functional
nn = torch.nn


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2, self.fc1, self.act, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)

    def forward(self, h):
        x = self.ln1(h)
        h = h + self.attn(x, x, x, need_weights=False)[0]
        return h + self.fc2(self.act(self.fc1(self.ln2(h))))


class Model(nn.Module):
    def __init__(self, vocab=128, d=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


POLICY = ampbridge.Policy(compute_dtype="float16", keep_float32=("kind:norm", "kind:embedding"),
                          loss_scale=ampbridge.LossScaleConfig(mode="dynamic"))
VARIANTS = {  # name: monitor arguments (None: no monitor)
    "no monitor": None,
    "every=100": dict(every=100),
    "every=1": dict(every=1),
    "every=100, no attribution": dict(every=100, attribution=False),
}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step(amp, opt, tokens, y):
    loss = F.cross_entropy(amp.model(tokens).flatten(0, 1), y.flatten())
    amp.step(loss, opt)
    opt.zero_grad(set_to_none=True)


def run(optimizer, rounds, folder):
    torch.manual_seed(0)
    base = Model()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 128, (4, 16), generator=g), torch.randint(0, 128, (4, 16), generator=g))
               for _ in range(8)]
    sides = {}
    for name, kwargs in VARIANTS.items():
        model = Model()
        model.load_state_dict(base.state_dict())
        amp = abt.apply(model, POLICY)
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if optimizer == "fused AdamW"
               else torch.optim.SGD(model.parameters(), lr=1e-3))
        monitor = amp.monitor(Path(folder) / f"{optimizer}-{name}.jsonl".replace(" ", "_"), **kwargs) \
            if kwargs is not None else None
        sides[name] = (amp, opt, monitor)
    transfers = []
    real = torch_monitor._to_host
    torch_monitor._to_host = lambda t: transfers.append(1) or real(t)

    def counted(name):
        amp, opt, _ = sides[name]
        transfers.clear()
        with Count() as c:
            step(amp, opt, *batches[0])
        return c.ops["_local_scalar_dense"], c.ops["_to_copy"], len(transfers), sum(c.ops.values())

    counts = {}
    try:
        for i in range(3):  # warm-up past step 0 (sampled and probed: the monitor learns its case)
            for name, (amp, opt, _) in sides.items():
                step(amp, opt, *batches[i % len(batches)])
        for name, (_, _, monitor) in sides.items():
            counts[name] = [counted(name)]  # step 3: unsampled for every=100
            if monitor is not None:  # a sampled step runs the same code whatever N is
                every, monitor.every = monitor.every, 1
                counts[name].append(counted(name))
                monitor.every = every
            else:
                counts[name].append(counted(name))
        wall = {name: [] for name in sides}
        cpu = {name: [] for name in sides}
        for r in range(rounds):
            order = list(sides)[r % len(sides):] + list(sides)[:r % len(sides)]
            tokens, y = batches[r % len(batches)]
            for name in order:
                amp, opt, _ = sides[name]
                start, start_cpu = time.perf_counter(), time.process_time()
                step(amp, opt, tokens, y)
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
    finally:
        torch_monitor._to_host = real
        for _, _, monitor in sides.values():
            if monitor is not None:
                monitor.close()
    base, base_cpu = wall["no monitor"], statistics.median(cpu["no monitor"])
    rows = []
    for name in sides:
        q1, paired, q3 = quartiles([a / b for a, b in zip(wall[name], base)])
        rows.append((name, statistics.median(wall[name]) * 1e3, (paired, q1, q3, len(base)), statistics.median(cpu[name]) / base_cpu,
                     counts[name]))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--quick", action="store_true", help="20 rounds (a smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a busy VM)")
    args = parser.parse_args()
    rounds = 20 if args.quick else args.rounds
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {rounds} rotating rounds per variant; "
          f"float16 compute, norms+embedding pinned, dynamic loss scale, 2 blocks d=64, batch 4x16")
    header = (f"{'optimizer':12s} {'variant':27s} {'ms/step':>8s} {'paired':>7s} {'paired IQR':>11s} {'n':>4s} {'cpu':>6s} "
              f"{'unsampled: syncs/casts/transfers/ops':>37s} {'sampled: syncs/casts/transfers/ops':>35s}")
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory() as folder:
        for optimizer in ("SGD", "fused AdamW"):
            for name, ms, paired, cpu, counts in run(optimizer, rounds, folder):
                unsampled, sampled = ("/".join(map(str, c)) for c in counts)
                print(f"{optimizer:12s} {name:27s} {ms:8.2f} {paired[0]:7.3f} {f'{paired[1]:.3f}-{paired[2]:.3f}':>11s} "
                      f"{paired[3]:4d} {cpu:6.3f} {unsampled:>37s} {sampled:>35s}")
    print("paired: median of per-round wall-time ratios to no monitor (IQR: their interquartile range, n rounds); cpu: ratio of median process CPU times;\n"
          "counts are per step, exact (a transfer is one device-to-host copy of everything the step logs;\n"
          "syncs are .item()/bool() reads, casts aten._to_copy). A sampled step costs the same for every N: every=N costs about\n"
          "the unsampled step + (sampled - unsampled) / N.")


if __name__ == "__main__":
    main()
