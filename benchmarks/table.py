"""The benchmarks' Markdown tables, through pandas (`DataFrame.to_markdown`, which uses tabulate).

Cells are formatted by the caller, as text, and printed as given: tabulate's number parsing is off, so
"1,234", "0.150" and "12.5%" keep their digits.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd


def markdown(rows: pd.DataFrame | Sequence[Mapping[str, object]], columns: Sequence[str] | None = None) -> str:
    """A Markdown (pipe) table of `rows`: a DataFrame, or one mapping per row from column name to cell, in
    the first row's order (`columns`: the table's columns when there are no rows)."""
    if not isinstance(rows, pd.DataFrame):
        rows = pd.DataFrame(list(rows)) if rows else pd.DataFrame(columns=columns)
    return rows.astype(str).to_markdown(index=False, disable_numparse=True)
