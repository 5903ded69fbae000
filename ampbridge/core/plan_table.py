"""The Plan as text: a table per layer, its notes as numbered footnotes under it, each printed once.

Two layouts, the first that fits :data:`TABLE_WIDTH` characters wins:

- *full*: the layer's whole path, ``compute``/``param``/``output`` columns, the deciding rule with its
  pattern and the ancestor it came through (``keep_float32[0] kind:norm (via block)``);
- *tree*, for deep models (transformers' 60-character paths): each layer's name indented (one space
  a level) under the layer that holds it, the dtypes as one ``dtypes`` cell, compute/param/output in
  short names (``bf16/f32/bf16``),
  the rule by its label (``keep_float32[1]``, ``^`` where a layer follows an enclosing layer's match),
  and a legend of the rules' patterns under the table.

Either way a row's note, and a kind source too long for its column, is a footnote ``[n] text`` under
the table (the row's ``notes`` column has the numbers), long lines under the table wrap at
:data:`TABLE_WIDTH`, and ``Plan.to_json()`` keeps every note on every row.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from .table import render_table

#: the widest line a Plan prints (the table falls back to its tree layout, text under it wraps)
TABLE_WIDTH = 120
#: the widest kind cell (``norm (base class LlamaRMSNorm)``); a longer one is a footnote
KIND_WIDTH = 30
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}


def wrap(line: str) -> str:
    """A footnote or note wrapped at :data:`TABLE_WIDTH`, continuation lines indented under its text."""
    if len(line) <= TABLE_WIDTH:
        return line
    indent = " " * (line.index(" ") + 1 if line.startswith(("[", "note:", "warning:")) else 4)
    return textwrap.fill(line, TABLE_WIDTH, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False)


class _Footnotes:
    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}

    def refer(self, text: str) -> str:
        return str(self.numbers.setdefault(text, len(self.numbers) + 1))

    def lines(self) -> list[str]:
        return [f"[{n}] {text}" for text, n in self.numbers.items()]


def _row_notes(r: Any, notes: _Footnotes) -> list[str]:
    refs = [notes.refer(r.note)] if r.note else []
    if getattr(r, "fp8_forward", None):
        by = f", realised by {r.fp8_by}" if r.fp8_by else ""
        refs.append(notes.refer(f"float8 matmuls: {r.fp8_forward} forward, {r.fp8_backward} backward, "
                                f"{r.fp8_scaling} scaling{by}"))
    other = getattr(r, "other_ops", ())
    if other:
        refs.append(notes.refer(f"ops in another dtype than the row's {r.compute_dtype}: {', '.join(other)}"))
    return refs


def _full(rows: Sequence[Any]) -> tuple[list[str], list[tuple[str, ...]], _Footnotes]:
    notes = _Footnotes()
    cells = []
    for r in rows:
        kind, refs = r.kind_text, []
        if len(kind) > KIND_WIDTH:  # the kind in its column, how it was decided below
            kind = r.kind or "-"
            refs.append(notes.refer(f"kind: {r.kind_text}"))
        refs += _row_notes(r, notes)
        cells.append((r.path or "(root)", kind, r.class_name, str(r.param_count), r.compute_dtype,
                      r.param_dtype, r.output_dtype, r.decided_by, ",".join(refs)))
    return ["layer", "kind", "class", "params", "compute", "param", "output", "decided by", "notes"], cells, notes


def _tree_order(rows: Sequence[Any]) -> list[tuple[Any, int, str]]:
    """(row, depth, name) depth first, siblings in the Plan's order; a layer sits under its nearest
    listed ancestor and is named by its path relative to it (``layers.0`` under an NNX list)."""
    paths = {r.path for r in rows}
    children: dict[str | None, list[Any]] = {}
    for r in rows:
        parent, p = None, r.path
        while p:
            p = p.rsplit(".", 1)[0] if "." in p else ""
            if p in paths:
                parent = p
                break
        children.setdefault(parent if r.path else None, []).append(r)
    out: list[tuple[Any, int, str]] = []
    stack = [(r, 0, None) for r in reversed(children.get(None, []))]
    while stack:
        r, depth, parent = stack.pop()
        name = r.path[len(parent) + 1:] if parent else (r.path or "(root)")
        out.append((r, depth, name))
        stack.extend((c, depth + 1, r.path) for c in reversed(children.get(r.path, [])) if c is not r)
    return out


def _tree(rows: Sequence[Any]) -> tuple[list[str], list[tuple[str, ...]], _Footnotes]:
    notes = _Footnotes()
    cells = []
    for r, depth, name in _tree_order(rows):
        refs = []
        if r.kind_text != (r.kind or "-"):
            refs.append(notes.refer(f"kind: {r.kind_text}"))
        refs += _row_notes(r, notes)
        dtypes = "/".join(_SHORT.get(d, d) for d in (r.compute_dtype, r.param_dtype, r.output_dtype))
        rule = r.rule + (" ^" if r.inherited_from is not None and r.rule != "default" else "")
        cells.append((" " * depth + name, r.kind or "-", r.class_name, str(r.param_count), dtypes, rule,
                      ",".join(refs)))
    return ["layer", "kind", "class", "params", "dtypes", "decided by", "notes"], cells, notes


def _legend(rows: Sequence[Any], policy: Any) -> list[str]:
    shown = {r.rule for r in rows}
    rules = [f"{label} = {', '.join(rule.match)}" for label, rule in policy.rules if label in shown]
    lines = []
    if rules:
        lines.append("rules: " + "; ".join(rules) + " (^: follows an enclosing layer the rule matched)")
    used = {d for r in rows for d in (r.compute_dtype, r.param_dtype, r.output_dtype) if d in _SHORT}
    lines.append("dtypes: compute/param/output; " + ", ".join(f"{_SHORT[d]} {d}" for d in _SHORT if d in used))
    return lines


def render(rows: Sequence[Any], policy: Any, head: str, tail: Sequence[str]) -> str:
    """``head``, the rows as a table (full layout, else tree), the footnotes and ``tail``, wrapped."""
    for layout in (_full, _tree):
        header, cells, notes = layout(rows)
        if not notes.numbers:
            header, cells = header[:-1], [c[:-1] for c in cells]
        body = render_table(header, cells)
        if max(len(line) for line in body.splitlines()) <= TABLE_WIDTH:
            break
    under = notes.lines() + (_legend(rows, policy) if layout is _tree else []) + list(tail)
    return "\n".join([head, body] + [wrap(line) for line in under])
