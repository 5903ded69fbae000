"""Layer patterns: globs on ``.``-joined paths, ``re:`` regexes, ``kind:`` and ``type:``.

Every framework's layer path is normalised to names joined with ``.`` (torch
``encoder.layers.0.norm``, Keras ``encoder/norm`` -> ``encoder.norm``, Flax
``encoder/layers_0/norm`` -> ``encoder.layers_0.norm``), so one rule set serves all of them.

=================  ==========================================================
pattern            matches
=================  ==========================================================
``lm_head``        the path exactly
``encoder.*.norm`` glob: ``*`` / ``?`` within one segment, ``**`` any segments
``re:.*head$``     Python regex, full match on the path
``kind:norm``      a portable layer kind (see :data:`KINDS`)
``type:LayerNorm`` the layer's class name, exactly
=================  ==========================================================

Patterns are compiled once (cached by text), so matching a large model is a loop of
precompiled checks, not of regex compilations.

Example:
    >>> compile_pattern("encoder.**.norm").matches("encoder.layers.0.norm")
    True
    >>> compile_pattern("kind:norm").matches("x", kind="norm")
    True
"""

from __future__ import annotations

import difflib
import functools
import re
from dataclasses import dataclass

__all__ = ["KINDS", "Pattern", "compile_pattern", "join_path", "did_you_mean"]

#: The portable layer kinds; each backend maps its framework's classes onto them.
KINDS: tuple[str, ...] = (
    "norm",
    "embedding",
    "softmax",
    "linear",
    "conv",
    "attention",
    "recurrent",
)


def did_you_mean(word: str, choices: "list[str] | tuple[str, ...]") -> str | None:
    """A ``did you mean 'x'?`` hint for a misspelt word, or None when nothing is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"did you mean {close[0]!r}?" if close else None


def join_path(*names: str) -> str:
    """Join framework layer names into an ampbridge path (``/`` and ``.`` both separate).

    Example:
        >>> join_path("encoder/layers_0", "norm")
        'encoder.layers_0.norm'
    """
    text = ".".join(map(str, names))
    if "/" not in text and ".." not in text and not text.startswith(".") and not text.endswith("."):
        return text  # already normalised (the common case, on every module of a large model)
    parts: list[str] = []
    for name in names:
        parts.extend(p for p in str(name).replace("/", ".").split(".") if p)
    return ".".join(parts)


@dataclass(frozen=True)
class Pattern:
    """A compiled layer pattern. ``matches(path, kind=, class_name=)`` tests one layer.

    ``target`` says what it looks at: ``"kind"``/``"type"`` compare ``value``; a ``"path"``
    pattern is ``value`` exactly (``regex`` None) or ``regex`` in full. ``prefix`` is the
    literal first path segment every match must start with, when there is one (an index key).
    """

    text: str
    target: str  # "path" | "kind" | "type"
    value: str | None = None
    regex: "re.Pattern[str] | None" = None
    prefix: str | None = None

    def matches(self, path: str, kind: str | None = None, class_name: str | None = None) -> bool:
        if self.target == "kind":
            return kind == self.value
        if self.target == "type":
            return class_name == self.value
        if self.regex is None:
            return path == self.value
        return self.regex.fullmatch(path) is not None


def _glob_to_regex(glob: str) -> str:
    segments: list[str] = []
    for seg in glob.split("."):
        if not (seg == "**" and segments and segments[-1] == "**"):  # "**.**" is "**"
            segments.append(seg)
    if segments == ["**"]:
        return ".*"
    out: list[str] = []
    for i, seg in enumerate(segments):
        if seg == "**":
            # a leading ** eats the dot after it, any later one the dot before it
            out.append(r"(?:[^.]+\.)*" if i == 0 else r"(?:\.[^.]+)*")
            continue
        if "**" in seg:
            raise ValueError(f"'**' must be a whole path segment (as in 'a.**.b'), not part of {seg!r}")
        if not seg:
            raise ValueError("empty path segment (two dots in a row, or a leading/trailing dot)")
        body = "".join("[^.]*" if ch == "*" else "[^.]" if ch == "?" else re.escape(ch) for ch in seg)
        needs_dot = i > 0 and not (i == 1 and segments[0] == "**")
        out.append((r"\." if needs_dot else "") + body)
    return "".join(out)


@functools.lru_cache(maxsize=4096)
def compile_pattern(text: str) -> Pattern:
    """Compile a layer pattern, raising ``ValueError`` (with what is accepted) when it is bad."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("a pattern must be a non-empty string")
    if text.startswith("re:"):
        try:
            regex = re.compile(text[3:])
        except re.error as e:
            raise ValueError(f"not a valid regular expression: {e}") from None
        return Pattern(text, "path", regex=regex)
    if text.startswith("kind:"):
        kind = text[5:]
        if kind not in KINDS:
            hint = did_you_mean(kind, KINDS)
            raise ValueError(
                f"unknown layer kind {kind!r}" + (f"; {hint}" if hint else "")
                + f"; accepted kinds: {', '.join(KINDS)}"
            )
        return Pattern(text, "kind", value=kind)
    if text.startswith("type:"):
        name = text[5:]
        if not name:
            raise ValueError("'type:' needs a class name, as in 'type:LayerNorm'")
        return Pattern(text, "type", value=name)
    first = text.split(".")[0]
    if ":" in first:
        prefix = text.split(":", 1)[0]
        hint = did_you_mean(prefix, ("re", "kind", "type"))
        raise ValueError(
            f"unknown pattern prefix {prefix + ':'!r}" + (f"; {hint}" if hint else "")
            + "; accepted: a path glob, 're:REGEX', 'kind:KIND' or 'type:ClassName'"
        )
    if not any(ch in text for ch in "*?"):
        if not all(text.split(".")):
            raise ValueError("empty path segment (two dots in a row, or a leading/trailing dot)")
        return Pattern(text, "path", value=text, prefix=first)
    literal_first = not any(ch in first for ch in "*?")
    return Pattern(text, "path", regex=re.compile(_glob_to_regex(text)), prefix=first if literal_first else None)
