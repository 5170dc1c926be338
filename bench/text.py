"""Numbers and markdown tables as the report writes them (shared by report.py and the section
modules that render their own part)."""
from __future__ import annotations

import math


def fmt(x, nd=2) -> str:
    """A number with nd decimals, "n/a" for NaN / missing."""
    if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)):
        return f"{x:.{nd}f}"
    return "n/a"


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: header, separator, one line per row."""
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def yes(ok, no: str = "NO") -> str:
    """"yes" for a true check, ``no`` otherwise; "-" where it does not apply (None)."""
    return "-" if ok is None else ("yes" if ok else no)
