"""What the CLI's commands and the demo share: the usage and input errors, reading an input file,
the shipped examples, ``show``'s notes.

Example:
    >>> (EXAMPLES / "amp.toml").exists()
    True
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from typing import Any

from ..core.fields import LOSS_SCALE_FIELDS, TOP_FIELDS
from ..core.policy import Policy
from ..errors import AmpBridgeError

#: the example policies shipped inside the package (``ampbridge validate`` runs on them installed)
EXAMPLES = Path(__file__).parent.parent / "examples"


class UsageError(Exception):
    """Bad usage: exit status 2."""


class InputError(AmpBridgeError):
    """A bad or unreadable input file (or a user's model callable that fails): exit status 1."""


def read_text(path: str | os.PathLike[str], what: str) -> str:
    """An input file's text, or an :class:`InputError` naming it (missing, a directory, unreadable, not UTF-8)."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise InputError(f"{what} {str(path)!r}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{what} {str(path)!r}: a directory, not a file") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {str(path)!r}: not UTF-8 text (byte {e.start}); is it a binary file?") from None
    except OSError as e:
        raise InputError(f"{what} {str(path)!r}: cannot read it: {e.strerror or e}") from None


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


def import_attribute(spec: str, flag: str, example: str) -> Any:
    """``module:name`` given to ``flag``: the attribute, imported with the working directory first on
    the path; bad usage and a failing user module are each one line."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"{flag} takes module:callable (as in {example}), got {spec!r}")
    sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name.split(".")[0] and e.name != module_name:
            raise InputError(f"{flag} {spec}: importing {module_name!r} failed: {one_line(e)}") from None
        raise UsageError(f"{flag}: cannot import {module_name!r}: {e}") from None
    except Exception as e:  # the user's module failed while importing: its error, in one line
        raise InputError(f"{flag} {spec}: importing {module_name!r} failed: {one_line(e)}") from None
    finally:
        sys.path.pop(0)
    if not hasattr(module, attr):
        raise UsageError(f"{flag}: {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def load_model(spec: str) -> tuple[Any, tuple[Any, ...]]:
    """``--model module:callable``: the model the callable returns, and any example inputs after it."""
    factory = import_attribute(spec, "--model", "mypkg.models:build")
    try:
        made = factory() if callable(factory) else factory
    except Exception as e:  # the user's callable raised: say so, with its own one-line summary
        raise InputError(f"--model {spec}: the callable raised {one_line(e)}") from None
    if isinstance(made, tuple) and made:  # (model, *example_inputs), as Flax needs inputs
        return made[0], tuple(made[1:])
    return made, ()


def one_line(e: BaseException) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__
