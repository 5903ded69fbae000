"""Run every benchmark (benchmarks/bench_*.py), each in its own process, and write docs/benchmarks.md.

Each script times ampbridge against the native equivalent in the same process (interleaved,
medians) and prints its own table; this runner prints them as they come and collects them, with
the machine, the versions and the date, into docs/benchmarks.md.

Usage: python benchmarks/run.py [NAME ...] [--no-write]   (NAME: torch, keras, jax, plan, scale, ...)
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
OUT = HERE.parent / "docs" / "benchmarks.md"
BENCH_SECTION = "## bench_"  # a script's own section; any other section is hand-written and kept
GPU_NOTE = ("GPU: `python benchmarks/gpu.py` (under 8 minutes on one GPU) checks every torch Plan row's CUDA claim against the dispatcher, parity with native AMP (torch, Keras, JAX), the float16/bfloat16 speedup over float32 and peak memory, and writes docs/gpu.md. No GPU has been lent to this project yet, so there is no GPU table: everything below ran on the CPU; CI runs `gpu.py --dry-run` (tests/backend_torch/test_gpu_script.py) so the script cannot rot.")
PACKAGES = ("ampbridge", "torch", "tensorflow-cpu", "keras", "jax", "jaxlib", "flax", "optax", "jmp", "numpy")


def machine() -> list[str]:
    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = []
    for name in PACKAGES:
        try:
            versions.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return [
        f"- date: {datetime.datetime.now().isoformat(timespec='minutes')}",
        f"- machine: {platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} cores, "
        f"load average {load:.1f} at the start (a shared VM: timings swing about 15% run to run)",
        f"- python {platform.python_version()}; " + ", ".join(versions),
    ]


def _merged(new: list[str]) -> tuple[str | None, list[str]]:
    """The existing page's header and sections, ``new`` replacing theirs: a partial run keeps the
    page's machine lines (they describe the other sections) and gives its own sections theirs."""
    stamp = " ".join(line.removeprefix("- ") for line in machine()[:2])
    new = [section.rstrip("\n") + f"\n\n(this section: {stamp})\n" for section in new]
    header, old = _page()
    by_name = {s.split("\n", 1)[0]: s for s in old if s.startswith(BENCH_SECTION)}
    for section in new:
        by_name[section.split("\n", 1)[0]] = section
    return (header if old else None), [by_name[k] for k in sorted(by_name)]


def _page() -> tuple[str, list[str]]:
    """The existing page's header and its sections, each starting with its ``## `` line."""
    text = OUT.read_text() if OUT.exists() else ""
    header, *old = text.split("\n## ")
    return header.rstrip("\n") + "\n\n", ["## " + s.rstrip("\n") + "\n" for s in old]


def _hand_written() -> list[str]:
    """The page's sections no script writes (the CI and test-suite times): every run keeps them."""
    return [s for s in _page()[1] if not s.startswith(BENCH_SECTION)]


def main(argv: list[str]) -> int:
    write = "--no-write" not in argv
    wanted = {a for a in argv if not a.startswith("--")}
    sections, status = [], 0
    for script in sorted(HERE.glob("bench_*.py")):
        name = script.stem[len("bench_"):]
        if wanted and name not in wanted:
            continue
        print(f"== {script.name}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        took = time.perf_counter() - t0
        print(proc.stdout, end="", flush=True)
        if proc.returncode:
            status = 1
            print(proc.stderr[-2000:], file=sys.stderr)
        doc = (script.read_text().split('"""')[1].strip().splitlines() or [""])[0]
        sections.append(f"## {script.name}\n\n{doc}\n\n```\n{proc.stdout.rstrip()}\n```\n\n"
                        f"(`python benchmarks/{script.name}`, {took:.0f} s{', FAILED' if proc.returncode else ''})\n")
    if write and sections:
        OUT.parent.mkdir(exist_ok=True)
        header = None
        if wanted:  # a partial run replaces its own sections and keeps the others
            header, sections = _merged(sections)
        if header is None:
            header = ("# Benchmarks\n\nWritten by `make bench` (`python benchmarks/run.py`). Every speed is a ratio "
                      "against the native equivalent measured in the same process; every timed row gives its median, "
                      "interquartile range (IQR) and number of rounds.\n\n" + GPU_NOTE + "\n\n"
                      + "\n".join(machine()) + "\n\n")
        OUT.write_text(header + "\n".join(_hand_written() + sections))
        print(f"written to {OUT}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
