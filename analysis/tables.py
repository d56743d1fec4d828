"""Numbers and tables as text: compact number formatting, and DataFrames as GitHub Markdown through pandas
(DataFrame.to_markdown, which uses tabulate)."""
from __future__ import annotations

import numpy as np
import pandas as pd


def fmt(v, digits: int = 4) -> str:
    """Compact number formatting for tables."""
    if isinstance(v, (float, np.floating)):
        if np.isnan(v):
            return ""
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.{digits - 1}e}"
        return f"{v:.{digits}g}" if abs(v) >= 1 else f"{v:.{digits}f}"
    return str(v)


def markdown_table(df: pd.DataFrame, digits: int = 4) -> str:
    """DataFrame -> GitHub Markdown table (DataFrame.to_markdown): every cell formatted by `fmt` first, a "|"
    inside a cell escaped, the text then taken as it is (no number parsing, no index column)."""
    cells = df.map(lambda v: fmt(v, digits).replace("|", "\\|"))
    return cells.to_markdown(index=False, tablefmt="github", disable_numparse=True)


def ratio_text(v) -> str:
    return "" if not np.isfinite(v) else f"{v:.3f}"
