"""Loading a policy is linear in its size: `ampbridge validate` of JSON and TOML policies with 1k to 1M `keep_float32` entries.

Each size is a fresh process (no pattern cache carried over), timed end to end by the CLI
(`ampbridge validate FILE`) and, inside it, by ``ampbridge.load``. Seconds per entry are counted
above the load of a one-entry policy (the fixed cost: first-call set-up). The target: seconds per
entry flat within 2x from 1k to 1M entries (a quadratic loader's grow 1000x over that range).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = tuple(int(a) for a in sys.argv[1:]) or (1_000, 10_000, 100_000, 1_000_000)
ROUNDS = 3  # per size and format (the 1M case takes about a minute each)
TIMED = "import time, sys, ampbridge; t = time.perf_counter(); ampbridge.load(sys.argv[1]); print(time.perf_counter() - t)"


def write(directory: Path, n: int, fmt: str) -> Path:
    patterns = [f"layers.{i}.norm" for i in range(n)]
    path = directory / f"policy_{n}.{fmt}"
    if fmt == "json":
        path.write_text(json.dumps({"version": 1, "compute_dtype": "bfloat16", "keep_float32": patterns}, indent=1))
    else:
        body = ",\n".join(f'  "{p}"' for p in patterns)
        path.write_text(f'version = 1\ncompute_dtype = "bfloat16"\nkeep_float32 = [\n{body},\n]\n')
    return path


def main() -> int:
    rows, per_entry = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("json", "toml"):
            fixed = 0.0
            for n in (1,) + SIZES:
                path = write(Path(tmp), n, fmt)
                loads, clis = [], []
                for _ in range(ROUNDS if n < 1_000_000 else 1):
                    loads.append(float(subprocess.run([sys.executable, "-c", TIMED, str(path)], check=True,
                                                      capture_output=True, text=True).stdout))
                    t0 = time.perf_counter()
                    done = subprocess.run([sys.executable, "-m", "ampbridge", "validate", str(path)],
                                          capture_output=True, text=True)
                    clis.append(time.perf_counter() - t0)
                    assert done.returncode == 0, done.stderr
                load = statistics.median(loads)
                if n == 1:
                    fixed = load
                per_entry[(fmt, n)] = max(load - fixed, 1e-9) / n
                loads.sort()
                iqr = f"{loads[len(loads) // 4]:.3f}-{loads[(3 * len(loads)) // 4]:.3f}"
                rows.append((fmt, f"{n:,}", f"{path.stat().st_size / 1e6:.1f}", f"{load:.3f}", iqr, str(len(loads)),
                             f"{statistics.median(clis):.3f}", "-" if n == 1 else f"{1e6 * per_entry[(fmt, n)]:.1f}"))
    head = ("format", "entries", "MB", "load s", "load IQR s", "rounds", "validate s (CLI)", "us per entry (above 1 entry)")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    status = 0
    for fmt in ("json", "toml"):
        values = [per_entry[(fmt, n)] for n in SIZES]
        spread = max(values) / min(values)
        met = spread <= 2.0
        status |= not met
        print(f"{fmt}: seconds per entry from {SIZES[0]:,} to {SIZES[-1]:,} entries vary {spread:.2f}x "
              f"(target <= 2x: {'met' if met else 'MISSED'})")
    return status


if __name__ == "__main__":
    sys.exit(main())
