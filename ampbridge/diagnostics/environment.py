"""The bisect switch: run any applied model in float32 (or another policy) without code changes.

``AMPBRIDGE_DISABLE=1`` makes every backend's ``apply`` use the ``float32`` preset;
``AMPBRIDGE_POLICY=NAME_OR_FILE`` makes it use that preset or policy file instead of the one in
the code. Either says so once per process (an :class:`AmpBridgeWarning`), so a run can be
bisected ("is it mixed precision?") by setting one variable.

Example:
    >>> import os, ampbridge
    >>> os.environ["AMPBRIDGE_DISABLE"] = "1"
    >>> effective_policy(ampbridge.preset("mixed_float16"), "torch", warn=False).compute_dtype
    'float32'
    >>> del os.environ["AMPBRIDGE_DISABLE"]
"""

from __future__ import annotations

import os

from ..errors import PolicyError, Problem, warn_once

_FALSE = ("", "0", "false", "no", "off")


def effective_policy(policy, framework: str, *, warn: bool = True):
    """The policy a backend must apply: ``policy`` unless the environment replaces it (said once
    per process, pointing at the user's line)."""
    from ..core.io import PRESETS, as_policy, preset

    disable = os.environ.get("AMPBRIDGE_DISABLE", "").strip().lower()
    override = os.environ.get("AMPBRIDGE_POLICY", "").strip()
    if disable not in _FALSE:
        replacement, why = preset("float32"), "AMPBRIDGE_DISABLE is set: running in float32"
    elif override:
        try:
            replacement = as_policy(override)
        except PolicyError as e:  # the user set a variable: say which one
            why = "; ".join(str(p) for p in e.problems)
            raise PolicyError([Problem(f"the environment variable names no usable policy ({why})",
                                       key="AMPBRIDGE_POLICY", value=override,
                                       accepted="a preset (" + ", ".join(PRESETS) + ") or a policy file path")]) from None
        why = f"AMPBRIDGE_POLICY={override}: using that policy instead of the one given"
    else:
        return policy
    if warn:
        warn_once(f"ampbridge ({framework}): {why}", key=why)
    return replacement
