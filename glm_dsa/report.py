"""Plain-text tables for the command-line reports (ledger, prefill, golden).

A table is a title line, a header, a rule and one line per row; the first column is
left-aligned, the others right-aligned. Numbers are rendered exactly: integers with thousands
separators, floats with 10 significant digits (no exponent), so a reader can match every cell against the
JSON the same command prints with ``--json``.
"""

from __future__ import annotations

from typing import Any, Sequence

__all__ = ["si", "number", "table"]

_SI = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def si(x: float, unit: str) -> str:
    """``53.65 GB``-style decimal rendering (1 GB = 1e9 B)."""
    for scale, prefix in _SI:
        if abs(x) >= scale:
            return f"{x / scale:.4g} {prefix}{unit}"
    return f"{x:.4g} {unit}"


def number(x: Any) -> str:
    """Exact integers with thousands separators; floats with 10 significant digits, without
    exponent (``549,755,813,900`` for 5.4975581389e11); None as ``-``."""
    if x is None:
        return "-"
    if isinstance(x, int):
        return f"{x:,}"
    return f"{x:,.10g}" if abs(x) < 1e10 else f"{float(f'{x:.10g}'):,.0f}"


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """``== title``, the header, a rule and the rows; non-string cells go through ``number``."""
    cells = [list(map(str, headers))] + [[v if isinstance(v, str) else number(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        # labels left-aligned, numbers right-aligned
        cols = (v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths)))
        return "  ".join(cols).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([f"== {title}", line(cells[0]), rule] + [line(r) for r in cells[1:]])
