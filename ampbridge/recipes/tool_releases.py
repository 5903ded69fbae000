"""What Accelerate and Lightning do, by release, where their precision behaviour changed.

Lightning (``--lightning-version``, default :data:`LIGHTNING_CURRENT`): the rules were read in the
2.6.6 sources and dated by the CHANGELOG.md that 2.6.6 ships (``lightning/pytorch/CHANGELOG.md``
and ``lightning/fabric/CHANGELOG.md``), which lists every release back to 0.x:

- 1.5.0: bfloat16 support (PR 9049); ``precision=16`` on CPU runs as bf16 (PR 10033). Before,
  ``precision=16`` on CPU raised ("You have asked for native AMP on CPU, but AMP is only available
  on GPU") and there was no ``"bf16"``.
- 2.0.0: precision names ``"16-mixed"``, ``"bf16-mixed"``, ``"32-true"``, ``"64-true"`` (PR 16783,
  Fabric PR 16767); before, ``16``, ``"bf16"``, ``32``, ``64``.
- 2.1.0: ``"16-true"`` / ``"bf16-true"`` (Trainer PR 18193, Fabric PR 17287).

Releases from 1.5.0 to 2.6.6 are read by these rules; outside that span the reading is 2.6.6's (or
1.5.0's) and a loss says so.

Accelerate (``--accelerate-version``, default :data:`ACCELERATE_CURRENT`): the rules were read
in the 1.16.0 sources only (``accelerator.py``: fp16 mixed precision only when
``device.type != "cpu"``; ``utils/dataclasses.py``: ``DeepSpeedPlugin.set_mixed_precision`` and
FSDP's ``MixedPrecision(param_dtype=d, reduce_dtype=d)``). One change is dated: bf16 on CPU went
through the GPU's bf16 check (``is_bf16_available``) until PR 906 (merged 2022-12-07). Any other
release is read by 1.16.0's rules and a loss names the rules the reading relied on.
"""

from __future__ import annotations

import re

#: the Lightning release read when none is given (the installed one, whose sources were read)
LIGHTNING_CURRENT = "2.6.6"
#: the Accelerate release read when none is given (the installed one, whose sources were read)
ACCELERATE_CURRENT = "1.16.0"
#: the oldest Lightning release the 2.6.6 CHANGELOG rules cover (bfloat16 and CPU AMP arrive here)
LIGHTNING_OLDEST = "1.5.0"


def parse(version: str, tool: str, current: str) -> tuple[int, int, int]:
    """``"2.6.6"`` -> (2, 6, 6); ``"2.1"`` -> (2, 1, 0). ValueError naming the tool on anything else.

    Example:
        >>> parse("2.1", "Lightning", LIGHTNING_CURRENT)
        (2, 1, 0)
    """
    m = re.fullmatch(r"v?(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-].*)?", str(version).strip())
    if not m:
        raise ValueError(f"{tool} version {version!r}: expected a release number such as {current}")
    return int(m[1]), int(m[2]), int(m[3] or 0)


def lightning(version: str | None) -> tuple[tuple[int, int, int], str | None]:
    """(the release as a tuple, a loss reason when it lies outside 1.5.0-2.6.6, else None).

    Example:
        >>> lightning(None)
        ((2, 6, 6), None)
        >>> lightning("3.0")[1].split(":")[0]
        'Lightning 3.0 is newer than 2.6.6, the newest release whose sources were read'
    """
    text = LIGHTNING_CURRENT if version is None else str(version).strip().lstrip("v")
    v = parse(text, "Lightning", LIGHTNING_CURRENT)
    if v > parse(LIGHTNING_CURRENT, "Lightning", LIGHTNING_CURRENT):
        return v, (f"Lightning {text} is newer than {LIGHTNING_CURRENT}, the newest release whose sources were "
                   f"read: its precision rules are not known; read by {LIGHTNING_CURRENT}'s")
    if v < parse(LIGHTNING_OLDEST, "Lightning", LIGHTNING_CURRENT):
        return v, (f"Lightning {text} is older than {LIGHTNING_OLDEST}, the oldest release the 2.6.6 CHANGELOG "
                   f"rules cover (bfloat16 and CPU AMP arrived there): read by {LIGHTNING_OLDEST}'s rules")
    return v, None


def lightning_name_problem(name: str, given: object, v: tuple[int, int, int]) -> str | None:
    """Why Lightning release ``v`` does not accept the precision ``given`` (read as ``name``), or None.

    Example:
        >>> lightning_name_problem("16-mixed", "16-mixed", (1, 9, 5)).split(";")[0]
        "Lightning 1.9.5 spells precision 16, 32, 64 or 'bf16'"
    """
    shown = ".".join(map(str, v))
    if v < (2, 0, 0) and isinstance(given, str) and given.endswith(("-mixed", "-true")):
        return (f"Lightning {shown} spells precision 16, 32, 64 or 'bf16'; the '-mixed'/'-true' names came in "
                "2.0.0 (PR 16783)")
    if v < (2, 1, 0) and name in ("16-true", "bf16-true"):
        return f"{name!r} (true half precision) came in Lightning 2.1.0 (Trainer PR 18193, Fabric PR 17287)"
    if v < (1, 5, 0) and name.startswith("bf16"):
        return f"Lightning {shown} has no bfloat16 precision: it came in 1.5.0 (PR 9049)"
    return None


def lightning_cpu_16_problem(v: tuple[int, int, int]) -> str | None:
    """Why Lightning ``v`` refuses 16-bit mixed precision on CPU (before 1.5.0), or None."""
    if v < (1, 5, 0):
        return (f"Lightning {'.'.join(map(str, v))} raises for precision=16 on CPU (\"AMP is only available on "
                "GPU\"); from 1.5.0 (PR 10033) it runs bf16 instead")
    return None


def accelerate(version: str | None) -> tuple[str, str | None]:
    """(the release, a loss reason when it is not 1.16.0, the only release whose sources were read).

    Example:
        >>> accelerate(None)
        ('1.16.0', None)
        >>> accelerate("1.2.0")[1].split(":")[0]
        'Accelerate 1.2.0 was not read (only 1.16.0 was)'
    """
    text = ACCELERATE_CURRENT if version is None else str(version).strip().lstrip("v")
    v = parse(text, "Accelerate", ACCELERATE_CURRENT)
    current = parse(ACCELERATE_CURRENT, "Accelerate", ACCELERATE_CURRENT)
    if v == current:
        return text, None
    side = "is newer than" if v > current else "was not read (only"
    tail = "" if v > current else " was)"
    reason = (f"Accelerate {text} {side} {ACCELERATE_CURRENT}{tail}: read by {ACCELERATE_CURRENT}'s rules "
              "(fp16 autocast and GradScaler only off the CPU, bf16 autocast on CPU too, convert_outputs_to_fp32, "
              "FSDP reducing in the mixed dtype, DeepSpeedPlugin.set_mixed_precision filling a missing section)")
    if v < (0, 16, 0):
        reason += ("; releases before 0.16.0 may predate PR 906 (merged 2022-12-07), before which bf16 on CPU "
                   "also asked the GPU's bfloat16 support (is_bf16_available)")
    return text, reason
