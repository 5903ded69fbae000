"""The ampbridge error and warning hierarchy.

Every error ampbridge raises on purpose derives from :class:`AmpBridgeError` and also from
the built-in exception a caller would naturally catch (``ValueError`` for a bad policy,
``ImportError`` for a missing framework), so ``except ValueError`` keeps working.

Example:
    >>> import ampbridge
    >>> try:
    ...     ampbridge.loads('compute_dtype = "fp8"')
    ... except ValueError as e:
    ...     print(type(e).__name__)
    PolicyError
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AmpBridgeError",
    "PolicyError",
    "Problem",
    "BackendUnavailableError",
    "UnknownBackendError",
    "UnsupportedOptionError",
    "LossScaleError",
    "AmpBridgeWarning",
    "UnmatchedRuleWarning",
]

_ABSENT: Any = object()


class AmpBridgeError(Exception):
    """Base class of every error ampbridge raises on purpose."""


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a policy: where it is, what was received, what is accepted."""

    message: str
    key: str | None = None
    file: str | None = None
    line: int | None = None
    value: Any = field(default=_ABSENT, compare=False)
    accepted: str | None = None
    hint: str | None = None

    @property
    def has_value(self) -> bool:
        return self.value is not _ABSENT

    def __str__(self) -> str:
        where = ""
        if self.file:
            where = self.file + (f":{self.line}" if self.line else "") + ": "
        elif self.line:
            where = f"line {self.line}: "
        text = where + (f"{self.key}: " if self.key else "") + self.message
        if self.has_value:
            text += f"; received {self.value!r} (of type {type(self.value).__name__})"
        if self.accepted:
            text += f"; accepted: {self.accepted}"
        if self.hint:
            text += f". {self.hint}"
        return text


class PolicyError(AmpBridgeError, ValueError):
    """A policy document or object is invalid.

    ``problems`` lists every problem found (validation does not stop at the first);
    ``file``, ``line``, ``key`` and ``value`` describe the first one.
    """

    def __init__(self, problems: list[Problem] | tuple[Problem, ...] | str):
        if isinstance(problems, str):
            problems = [Problem(problems)]
        self.problems: tuple[Problem, ...] = tuple(problems)
        first = self.problems[0] if self.problems else Problem("invalid policy")
        self.file = first.file
        self.line = first.line
        self.key = first.key
        self.value = first.value if first.has_value else None
        self.accepted = first.accepted
        super().__init__(str(self))

    def __str__(self) -> str:
        if len(self.problems) == 1:
            return str(self.problems[0])
        lines = [f"{len(self.problems)} problems in the policy:"]
        lines += [f"  - {p}" for p in self.problems]
        return "\n".join(lines)


class BackendUnavailableError(AmpBridgeError, ImportError):
    """A framework (or a library a backend needs) is not installed."""


class UnknownBackendError(AmpBridgeError, TypeError):
    """No installed backend recognises the object it was given."""


class UnsupportedOptionError(AmpBridgeError, NotImplementedError):
    """A backend cannot honour a policy setting; it refuses rather than drop it silently."""


class LossScaleError(AmpBridgeError, FloatingPointError):
    """An overflow at ``min_scale`` with ``on_min_scale = "error"``."""


class AmpBridgeWarning(UserWarning):
    """Base class of ampbridge's warnings."""


class LossyPolicyWarning(AmpBridgeWarning):
    """A policy combination that loses precision or protection (``ampbridge.core.risks``)."""


class UnmatchedRuleWarning(AmpBridgeWarning):
    """A pinning or override rule matched no layer of the model (usually a typo)."""


class IdleRuleWarning(AmpBridgeWarning):
    """A rule whose layers never ran their forward in a traced forward (the model reads their
    weights directly, as Mamba does its ``conv1d``): it changes nothing that runs."""


class BroadRuleWarning(AmpBridgeWarning):
    """A rule reaches most of a model's parameters through the containers it matches (everything a
    matched container holds follows the rule): said once per policy and model, with the share."""


#: what :func:`warn_once` has said in this process (tests clear it)
_warned: set[str] = set()


def outside_stacklevel() -> int:
    """The ``stacklevel`` that makes ``warnings.warn``, called by the caller of this function, point
    at the first frame outside ampbridge: the user's line, however deep inside ampbridge it starts."""
    import sys

    package = __file__.rsplit("/", 1)[0] + "/"
    frame, level = sys._getframe(2), 2  # level 1 is the function that calls warnings.warn
    while frame is not None and frame.f_code.co_filename.startswith(package):
        frame, level = frame.f_back, level + 1
    return level


def warn_once(message: str, category: type[Warning] = AmpBridgeWarning, *, key: str | None = None,
              stacklevel: int | None = None) -> bool:
    """Warn once per process for ``key`` (default: the message); True when it warned. The warning
    points at the user's code (the first frame outside ampbridge) unless ``stacklevel`` is given.

    Every backend says a process-wide fact (the bisect switch is on, this CPU truncates bfloat16)
    through here, so it is said once however many models are applied.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True):
        ...     warnings.simplefilter("always")
        ...     warn_once("example"), warn_once("example")
        (True, False)
    """
    key = message if key is None else key
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(message, category, stacklevel=outside_stacklevel() if stacklevel is None else stacklevel + 1)
    return True
