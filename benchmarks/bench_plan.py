"""Plan building at scale: 10,000 layers against 50 rules (core only, no framework).

Prints the median of several rounds; the target is well under a second.
"""

from __future__ import annotations

import statistics
import time
import warnings

import ampbridge
from ampbridge import Layer, Policy, Rule


def main() -> None:
    rules = tuple(Rule(f"block{i}.**.proj", compute_dtype="float32") for i in range(45))
    policy = Policy(compute_dtype="float16", keep_float32=("kind:norm", "re:.*\\.ln_[0-9]+$", "type:RMSNorm",
                                                            "lm_head", "embed"), overrides=rules)
    kinds = ("linear", "norm", "attention", None)
    layers = [Layer(f"block{i % 100}.sub{i}.{'proj' if i % 3 else 'ln_1'}", kinds[i % 4], "Linear", 10)
              for i in range(10_000)]
    times = []
    for _ in range(7):
        ampbridge.compile_pattern.cache_clear()
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ampbridge.build_plan(layers, policy)
        times.append(time.perf_counter() - t0)
    times.sort()
    print(f"build_plan: 10,000 layers x 50 rules: median {statistics.median(times) * 1000:.1f} ms "
          f"(IQR {times[len(times) // 4] * 1000:.1f}-{times[(3 * len(times)) // 4] * 1000:.1f}, "
          f"min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}) over {len(times)} rounds")


if __name__ == "__main__":
    main()
