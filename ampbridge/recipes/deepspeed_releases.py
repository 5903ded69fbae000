"""What DeepSpeed does, by release: the loss scaler's growth test and which steps it skips.

Every rule here was read in DeepSpeed's own sources of the releases named (``CHECKED``); a release
between two checked ones whose rules differ is read by the later one and reported as a loss.

- Growth test of ``DynamicLossScaler`` (ZeRO 1-3, ``deepspeed/runtime/fp16/loss_scaler.py``):
  ``(cur_iter - last_overflow_iter) % window == 0`` up to 0.17.0 (ampbridge's reference, exact);
  from 0.17.1 (PR 6976, commit e440506) ``stable_interval = cur_iter - last_overflow_iter - 1 > 0
  and stable_interval % window == 0``: the first growth after an overflow (and at the start) waits
  one finite step more.
- Without ZeRO, fp16 runs ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``, whose ``_update_scale``
  has no hysteresis, uses the stable_interval test and clamps at ``min_loss_scale`` in every
  checked release.
- Skipping a step with non-finite gradients (``skip_nonfinite``), see :func:`skips`.
"""

from __future__ import annotations

import re

#: the release ampbridge reads for when none is given (the newest whose sources were checked)
CURRENT = "0.19.8"
#: the releases whose sources these rules were read from
CHECKED = ("0.17.0", "0.19.2", "0.19.3", "0.19.8")
#: first release with the stable_interval growth test in DynamicLossScaler (PR 6976, e440506)
STABLE_INTERVAL = (0, 17, 1)
#: first release with bf16.check_grad_overflow defaulting to true (commit f0253c8)
CHECK_DEFAULT_TRUE = (0, 19, 3)
#: the old ``release=`` names, as the release each stands for
RELEASE_NAMES = {"modulo": "0.17.0", "stable_interval": CURRENT}
#: the release whose NaN-step table was measured on real engines (tests/backend_torch/test_recipes_real_tools.py,
#: test_nan_step_table_from_real_engines_agrees_with_the_reading); the other CHECKED rows are read from source
MEASURED = "0.19.8"


def parse(version: str) -> tuple[int, int, int]:
    """``"0.19.8"`` -> (0, 19, 8); ``"0.17"`` -> (0, 17, 0). ValueError on anything else."""
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-].*)?", str(version).strip())
    if not m:
        raise ValueError(f"DeepSpeed version {version!r}: expected a release number such as {CURRENT}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def resolve(version: str | None, release: str | None) -> str:
    """The release to read for, from ``version`` and the older ``release`` switch (either may be None)."""
    if release is not None and release not in RELEASE_NAMES:
        raise ValueError(f"release={release!r}; accepted: {', '.join(RELEASE_NAMES)} (or pass version='X.Y.Z')")
    if version is None:
        return RELEASE_NAMES[release] if release else CURRENT
    parse(version)
    if release is not None and grows_late(version) != (release == "stable_interval"):
        raise ValueError(f"release={release!r} contradicts version={version!r}: DeepSpeed {version} uses the "
                         f"{'stable_interval' if grows_late(version) else 'modulo'} growth test")
    return str(version).strip().lstrip("v")


def grows_late(version: str) -> bool:
    """True where ZeRO's DynamicLossScaler grows one step later after an overflow than ampbridge."""
    return parse(version) >= STABLE_INTERVAL


def cell_source(version: str) -> str:
    """How ampbridge knows the NaN-step cells of DeepSpeed ``version`` (said in a conversion's notes).

    Example:
        >>> cell_source("0.19.8").startswith("measured")
        True
        >>> cell_source("0.19.3").split(",")[0]
        'read from the DeepSpeed 0.19.3 sources (stage_1_and_2.py'
        >>> cell_source("0.20.0").split(":")[0]
        'not read'
    """
    v = parse(version)
    if v == parse(MEASURED):
        return (f"measured on real DeepSpeed {MEASURED} engines (one NaN step per cell, "
                "test_nan_step_table_from_real_engines_agrees_with_the_reading) and read from its sources")
    if any(v == parse(c) for c in CHECKED):
        return (f"read from the DeepSpeed {version} sources (stage_1_and_2.py, stage3.py, bf16_optimizer.py, "
                f"engine.py), not measured: the NaN-step table was measured on {MEASURED} engines")
    if parse(CHECKED[0]) < v < parse(CHECKED[-1]):
        return (f"not read: DeepSpeed {version} lies between the releases read ({', '.join(CHECKED)}); where "
                "those agree their rule is used, where they differ the cell is a loss")
    return (f"not read: DeepSpeed {version} is outside the releases read ({CHECKED[0]}-{CHECKED[-1]}); every "
            "bf16 and float32 cell is a loss")


def _between(v: tuple[int, int, int], lo: str, hi: str) -> bool:
    return parse(lo) < v < parse(hi)


def skips(version: str, mode: str, stage: int, check: bool | None, fp32_accum: bool = False
          ) -> tuple[bool, str, str | None]:
    """Does DeepSpeed ``version`` skip the optimizer step when a gradient is inf/nan?

    ``mode``: "fp16", "bf16" or "fp32"; ``check``: bf16.check_grad_overflow as the config gives
    it (None: absent); ``fp32_accum``: data_types.grad_accum_dtype is fp32. Returns (skips, the
    code path that decides, a reason to report as a loss when the release was not checked and the
    checked releases around it differ, else None).

    - fp16: always (every optimizer checks for overflow).
    - bf16 without ZeRO: 0.19.2 and later run FP16_Optimizer with bf16 (DDP_BFLOAT16), which skips
      on a non-finite gradient norm whatever check_grad_overflow says; 0.17.0 ran BF16_Optimizer,
      which did not skip.
    - bf16 under ZeRO 1-2 (stage_1_and_2.py): check_grad_overflow (absent before 0.19.2; default
      false up to 0.19.2, true from 0.19.3). ZeRO 1 with float32 gradient accumulation runs
      BF16_Optimizer instead: skips in 0.19.8 (is_invalid_grad_norm), not in 0.19.3.
    - bf16 and fp32 under ZeRO 3 (stage3.py), fp32 under ZeRO 1-2: 0.19.8 skips on a non-finite
      gradient norm; 0.19.3 and earlier checked overflow only for fp16.
    - fp32 without ZeRO: the plain torch optimizer, never.
    """
    v = parse(version)
    if mode != "fp16" and not parse(CHECKED[0]) <= v <= parse(CHECKED[-1]):
        # outside the releases read, the cell is the nearest checked release's, said as a loss
        near = CHECKED[0] if v < parse(CHECKED[0]) else CHECKED[-1]
        skip, why, _ = skips(near, mode, stage, check, fp32_accum)
        side = "older than the oldest" if near == CHECKED[0] else "newer than the newest"
        return skip, why, (f"DeepSpeed {version} is {side} release whose sources were read ({near}): whether it "
                           f"skips a non-finite {mode} step here is not known; read as {near} ({why})")
    new = v >= parse("0.19.8")
    unchecked = _between(v, "0.19.3", "0.19.8")
    between = ("DeepSpeed 0.19.4-0.19.7 not checked: read as 0.19.8 (which skips on a non-finite gradient "
               "norm), 0.19.3 did not skip here")
    if mode == "fp16":
        return True, "the fp16 optimizers' overflow check", None
    if mode == "bf16" and stage == 0:
        if v <= parse("0.17.0"):
            return False, "BF16_Optimizer (no overflow check)", None
        reason = ("DeepSpeed 0.17.1-0.19.1 not checked: read as 0.19.2 (FP16_Optimizer with bf16 skips), 0.17.0 "
                  "ran BF16_Optimizer, which did not skip") if v < parse("0.19.2") else None
        return True, "FP16_Optimizer with bf16 (no ZeRO) checks the gradient norm whatever check_grad_overflow says", \
            reason
    if mode == "bf16" and stage in (1, 2) and not (stage == 1 and fp32_accum):
        if v <= parse("0.17.0"):
            return False, f"ZeRO {stage}: no overflow check for bf16 ({version} has no check_grad_overflow)", None
        default = v >= CHECK_DEFAULT_TRUE
        on = default if check is None else bool(check)
        reason = ("DeepSpeed 0.17.1-0.19.1 not checked: read as 0.19.2 (bf16.check_grad_overflow decides); 0.17.0 "
                  "had no such key and did not skip") if v < parse("0.19.2") and on else None
        return on, (f"ZeRO {stage}: bf16.check_grad_overflow" + (f" (absent: {str(default).lower()} in "
                    f"{version})" if check is None else "")), reason
    if mode == "fp32" and stage == 0:
        return False, "the plain torch optimizer (no overflow check)", None
    where = {("bf16", 1): "ZeRO 1 with float32 gradient accumulation (BF16_Optimizer)",
             ("bf16", 3): "ZeRO 3", ("fp32", 3): "ZeRO 3"}.get((mode, stage), f"ZeRO {stage}")
    if new or unchecked:
        return True, f"{where} skips on a non-finite gradient norm (0.19.8)", between if unchecked else None
    return False, f"{where} checks overflow only in fp16 ({version})", None
