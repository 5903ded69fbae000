"""Test support: import an optional dependency, or skip, or (when required) fail.

``AMPBRIDGE_REQUIRE`` lists what must be importable (comma separated, or ``all``); ``make test``
and CI set it to ``all`` so a missing framework fails the run instead of skipping silently.

Example:
    >>> require("json").__name__
    'json'
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def required(name: str) -> bool:
    wanted = {w.strip() for w in os.environ.get("AMPBRIDGE_REQUIRE", "").split(",") if w.strip()}
    return "all" in wanted or name in wanted or name.split(".")[0] in wanted


def require(name: str, reason: str = "") -> ModuleType:
    """Import ``name``; when it is missing, skip the test, or fail it when it is required."""
    import pytest

    try:
        return importlib.import_module(name)
    except ImportError as e:
        message = f"{name} is not installed{': ' + reason if reason else ''} ({e})"
        if required(name):
            pytest.fail(f"{message}, and AMPBRIDGE_REQUIRE asks for it", pytrace=False)
        pytest.skip(message)
        raise  # unreachable: skip raises
