"""Plain-text tables: fixed-width columns, no dependency."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Render rows under a header with columns padded to their widest cell.

    Example:
        >>> print(render_table(("a", "bb"), [("1", "2")]))
        a  bb
        -  --
        1  2
    """
    widths = [len(h) for h in header]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    return "\n".join(lines)
