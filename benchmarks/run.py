"""Run every benchmark (benchmarks/bench_*.py), each in its own process, and print their tables.

Usage: python benchmarks/run.py [NAME ...]   (NAME: torch, keras, jax, plan, ...; default: all)
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main(argv: list[str]) -> int:
    wanted = set(argv)
    status = 0
    for script in sorted(HERE.glob("bench_*.py")):
        name = script.stem[len("bench_"):]
        if wanted and name not in wanted:
            continue
        print(f"== {script.name}", flush=True)
        status |= subprocess.call([sys.executable, str(script)])
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
