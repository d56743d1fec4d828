"""Numbers and tables as text: one rule of significant digits per column, and DataFrames as GitHub Markdown
through pandas (DataFrame.to_markdown, which uses tabulate).

The rule of a column of numbers (column_format), chosen once from all its values:
    integers       every value of an integer type, or a whole number below 1e5: written as integers (n, dof,
                   a token count);
    fixed point    magnitudes within a factor of 100 of each other and inside [1e-3, 1e5): the same number
                   of decimals in every row, `digits` significant digits for the largest (a column of means
                   reads 3.509, 3.540, 3.589, never 3.54 beside 3.555);
    significant    otherwise (a column of different quantities, or of p-values over several decades): each
                   value with `digits` significant digits, trailing zeros kept, in scientific notation below
                   1e-3 and from 1e5 (fmt): 1.398, 21.68, 8.812e+05.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import numpy as np
import pandas as pd


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))


def fmt(v, digits: int = 4) -> str:
    """One number with `digits` significant digits, trailing zeros kept (3.540); scientific notation below
    1e-3 and from 1e5; integers as they are; NaN as ''. Anything else as str()."""
    if isinstance(v, (float, np.floating)):
        if np.isnan(v):
            return ""
        if not np.isfinite(v):
            return str(float(v))
        if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
            return f"{v:.{digits - 1}e}"
        return f"{v:#.{digits}g}".rstrip(".")
    return str(v)


def column_format(values: Iterable, digits: int = 4) -> Callable[[object], str]:
    """The formatter of a column (module docstring): a function that writes each of its values by the rule
    chosen from all of them. Non-numbers are written by str(), NaN as ''."""
    values = [v for v in values if _is_number(v) and np.isfinite(float(v))]
    nums = np.array([float(v) for v in values], float)
    integral = all(isinstance(v, (int, np.integer)) for v in values) or (
        np.all(nums == np.round(nums)) and np.all(np.abs(nums) < 1e5))
    if nums.size and integral:
        return lambda v: (str(int(round(float(v)))) if _is_number(v) and np.isfinite(float(v))
                          else fmt(v, digits))
    mags = np.abs(nums[nums != 0])
    if mags.size and mags.max() < 1e5 and mags.min() >= 1e-3 and mags.max() < 100 * mags.min():
        decimals = max(0, digits - 1 - math.floor(math.log10(mags.max())))
        return lambda v: f"{float(v):.{decimals}f}" if _is_number(v) and np.isfinite(float(v)) else fmt(v, digits)
    return lambda v: fmt(float(v), digits) if _is_number(v) else fmt(v, digits)


def interval_texts(values, lows, highs, digits: int = 4) -> list[str]:
    """'3.509 [3.504, 3.513]' per row, every number of the column written by one rule (column_format of the
    values and bounds together); the value alone where a bound is NaN, '' where the value is."""
    values, lows, highs = (np.asarray(x, float) for x in (values, lows, highs))
    f = column_format(np.concatenate([values, lows, highs]), digits)
    return ["" if not np.isfinite(v) else f(v) + (f" [{f(lo)}, {f(hi)}]" if np.isfinite(lo) and np.isfinite(hi) else "")
            for v, lo, hi in zip(values, lows, highs)]


def format_columns(df: pd.DataFrame, digits: int = 4) -> pd.DataFrame:
    """Every cell as text, each column by its own rule (column_format)."""
    rules = {c: column_format(df[c], digits) for c in df.columns}
    return pd.DataFrame({c: [rules[c](v) for v in df[c]] for c in df.columns}, index=df.index)


def markdown_table(df: pd.DataFrame, digits: int = 4) -> str:
    """DataFrame -> GitHub Markdown table (DataFrame.to_markdown): every cell written by its column's rule
    (format_columns), a "|" inside a cell escaped, the text then taken as it is (no number parsing, no index
    column)."""
    cells = format_columns(df, digits).map(lambda s: s.replace("|", "\\|"))
    return cells.to_markdown(index=False, tablefmt="github", disable_numparse=True)


def ratio_text(v, lo=np.nan, hi=np.nan) -> str:
    """'1.023', or '1.023 [0.981, 1.052]' with a range; '' for NaN."""
    if not np.isfinite(v):
        return ""
    return f"{v:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if np.isfinite(lo) and np.isfinite(hi) else "")
