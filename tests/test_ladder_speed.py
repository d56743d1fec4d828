"""python -m benchmarks.ladder_speed: its rows measured end to end on the CPU (two jobs side by side, through
the trainer), a job's failure kept in its row, and the rule and the study slice's cost from measured rows."""
import math
from types import SimpleNamespace

import pandas as pd
import pytest

from benchmarks.ladder_speed import COLUMNS, chosen, main, report, slice_minutes


def rows_of(table: str) -> list[list[str]]:
    return [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines()[2:]]


def test_two_jobs_side_by_side_make_one_row_and_its_csv_gives_the_same_table(corpus, tmp_path, isolated_cache):
    """--smoke at depth 2, eager, two jobs at once: one row whose aggregate tokens/s is the sum of the jobs'
    (their mean times two), each job's rate inside the printed range; the rows written with --csv and read
    back with --from print the same tables."""
    csv, out = tmp_path / "rows.csv", tmp_path / "table.md"
    args = ["--smoke", "--depths", "2", "--modes", "eager", "--jobs", "2", "data=text", f"data.path={corpus}"]
    rows = main([*args, "--csv", str(csv), "--out", str(out)])
    assert list(rows.columns) == COLUMNS and len(rows) == 1
    row = rows.iloc[0]
    assert (row["status"], row["depth"], row["jobs"], row["mode"], row["width"]) == ("ok", 2, 2, "eager", 32)
    assert row["aggregate_tokens_per_s"] == pytest.approx(2 * row["tokens_per_s"])
    assert 0 < row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
    assert row["ms_per_step"] == pytest.approx(2 * 32 * 1e3 / row["tokens_per_s"], rel=0.2)  # a mean of ratios
    again = main(["--from", str(csv), "--out", str(tmp_path / "again.md")])
    assert (tmp_path / "again.md").read_text() == out.read_text() and len(again) == 1


def test_a_failed_job_marks_its_row_with_the_error(corpus, tmp_path, isolated_cache):
    """A setting the run refuses ends the job at once; the other job of the row stops too, and the row says
    why in one line."""
    rows = main(["--smoke", "--depths", "2", "--modes", "eager", "--jobs", "2", "data=text", f"data.path={corpus}",
                 "model.head_dim=7"])
    assert rows["status"].tolist() == ["failed: error: model width 32 is not a multiple of model.head_dim=7"]


def measured(depth, mode, jobs, tokens_per_s, batch=16, status="ok", method="trainer"):
    return {"depth": depth, "width": 64 * depth, "params_active_non_embedding": 6e6 * depth, "flops_per_token": 4e7,
            "mode": mode, "jobs": jobs, "batch_size": batch, "seq_len": 2048, "tokens_per_s": tokens_per_s,
            "tokens_per_s_min": tokens_per_s, "tokens_per_s_max": tokens_per_s,
            "aggregate_tokens_per_s": jobs * tokens_per_s, "ms_per_step": 1.0, "peak_gib": 5.0, "status": status,
            "method": method, "device": "NVIDIA H200", "commit": "abc1234", "date": "2026-12-05", "command": "-"}


def test_the_rule_takes_the_fastest_completed_setting_and_breaks_ties_towards_fewer_tokens_and_jobs():
    """Per depth: the highest aggregate tokens/s among completed rows; within --tie of it the fewest tokens a
    step, then the fewest jobs, then the mode first in MODES; a failed row (out of memory) never; with the
    study's micro-batch given, only its rows."""
    rows = pd.DataFrame([
        measured(4, "compiled", 1, 100.0), measured(4, "graphs", 1, 150.0),
        measured(4, "compiled", 7, 40.0), measured(4, "graphs", 7, 40.5),        # 280 and 283.5: a tie at 2%
        measured(4, "graphs", 8, 50.0, status="failed: out of memory"),          # 400, but it did not run
        measured(4, "graphs", 4, 70.0, batch=32),                                # 280 at twice the tokens a step
        measured(5, "eager", 1, 90.0),
    ], columns=COLUMNS)
    picks = chosen(rows, tie=0.02)
    assert picks[["depth", "mode", "jobs", "batch_size"]].values.tolist() == [[4, "compiled", 7, 16], [5, "eager", 1, 16]]
    strict = chosen(rows, tie=0.0)
    assert strict[["mode", "jobs"]].values.tolist()[0] == ["graphs", 7]
    assert chosen(rows, tie=0.02, batch_size=32)[["depth", "jobs"]].values.tolist() == [[4, 4]]
    assert chosen(rows[rows["status"] != "ok"], tie=0.02).empty


def test_the_slice_is_priced_in_waves_of_the_jobs_at_a_time_and_set_beside_the_plain_setting():
    """GPU-minutes: ceil(runs / jobs) waves of tokens_per_param x N tokens at a job's tokens/s; the report sets
    each depth's choice beside its compiled one-job row of the same method, and says where that is missing."""
    packed = pd.Series(measured(4, "compiled", 7, 40.0))
    assert slice_minutes(packed, runs=21, tokens_per_param=5) == pytest.approx(3 * 5 * 24e6 / 40.0 / 60)
    assert slice_minutes(packed, runs=22, tokens_per_param=5) == pytest.approx(4 * 5 * 24e6 / 40.0 / 60)
    rows = pd.DataFrame([measured(4, "compiled", 1, 100.0, method="bare"), measured(4, "compiled", 1, 120.0),
                         measured(4, "compiled", 7, 40.0), measured(5, "graphs", 2, 60.0)], columns=COLUMNS)
    args = SimpleNamespace(runs=21, tokens_per_param=5.0, tie=0.02, batch_size=None, seq_len=None)
    text = report(rows, args)
    picks = rows_of(text.split("Chosen per depth")[1].split("\n\n", 1)[1])
    before, after = 21 * 5 * 24e6 / 120.0 / 60, 3 * 5 * 24e6 / 40.0 / 60   # the trainer's own one-job row
    assert picks[0][:3] == ["4", "compiled", "7"] and picks[0][6:9] == [f"{after:.1f}", f"{before:.1f}",
                                                                        f"{before / after:.2f}x"], text
    assert picks[1][:3] == ["5", "graphs", "2"] and picks[1][7:] == ["not measured", "-"], text
    mfu = rows_of(text.split("\n\n")[1])[2][8]
    assert mfu == f"{280.0 * 4e7 / 989e12:.1%}" and not math.isnan(float(mfu.rstrip("%")))
