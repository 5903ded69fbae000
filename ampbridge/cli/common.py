"""What the CLI's commands and the demo share: the usage error, the shipped examples, ``show``'s notes.

Example:
    >>> (EXAMPLES / "amp.toml").exists()
    True
"""

from __future__ import annotations

import os
from pathlib import Path

from ..core.fields import LOSS_SCALE_FIELDS, TOP_FIELDS
from ..core.policy import Policy

#: the example policies shipped inside the package (``ampbridge validate`` runs on them installed)
EXAMPLES = Path(__file__).parent.parent / "examples"


class UsageError(Exception):
    """Bad usage: exit status 2."""


def defaults_notes(policy: Policy, origins: dict[str, str], main_source: str) -> dict[str, str]:
    """End-of-line comments for ``show``: which keys were defaulted, which came from a base."""
    notes: dict[str, str] = {}
    for spec in TOP_FIELDS:
        if spec.name == "version":
            continue
        src = origins.get(spec.name)
        if src is None:
            notes[spec.name] = "default" if spec.name != "reduce_dtype" else "default: param_dtype"
        elif src != main_source:
            notes[spec.name] = f"from {_short(src)}"
    for spec in LOSS_SCALE_FIELDS:
        key = f"loss_scale.{spec.name}"
        src = origins.get(key)
        if src is None:
            notes[key] = "default"
        elif src != main_source:
            notes[key] = f"from {_short(src)}"
    return notes


def _short(source: str) -> str:
    try:
        return os.path.relpath(source)
    except ValueError:
        return source
