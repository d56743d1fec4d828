"""Tables write each column of numbers by one rule of digits (analysis.tables)."""
import numpy as np
import pandas as pd

from analysis.tables import column_format, interval_texts, markdown_table


def test_a_column_of_numbers_is_written_by_one_rule():
    """Means to the same decimals (4 significant digits of the largest), values over decades (p-values, fitted
    parameters) each to 4 significant digits, counts as integers, and an interval's bounds by its value's rule."""
    means = [3.5, 3.5554, 3.4]
    assert [column_format(means)(v) for v in means] == ["3.500", "3.555", "3.400"]
    ps = [0.2, 3e-5, 0.04]
    assert [column_format(ps)(v) for v in ps] == ["0.2000", "3.000e-05", "0.04000"]
    params = [1.398, 21.68, 8.812e5, 0.1382]
    assert [column_format(params)(v) for v in params] == ["1.398", "21.68", "8.812e+05", "0.1382"]
    assert [column_format([3, 12, 400])(v) for v in (3, 12, 400)] == ["3", "12", "400"]
    assert interval_texts([3.5, np.nan, 3.6], [3.45, np.nan, 3.55], [3.56, np.nan, np.nan]) == \
        ["3.500 [3.450, 3.560]", "", "3.600"]
    text = markdown_table(pd.DataFrame({"mean": means, "n": [3, 12, 400]}))
    assert "| 3.500  | 3   |" in text
