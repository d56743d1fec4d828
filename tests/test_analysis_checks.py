"""The analysis commands check every option against what the runs hold and never succeed at nothing: a
misspelt option, a folder without runs, runs that allow no table, an output that cannot be written each stop
the command with a non-zero exit and one line (the option, the value, what is valid, closest first) before
anything is written."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.cells import DEFAULT_BASELINE
from analysis.synthetic import write_ablation_sweep, write_run, write_scaling_ladder

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    root = tmp_path_factory.mktemp("checks") / "sweep"
    write_ablation_sweep(root, broken=False)
    return root


def stops(main, argv) -> str:
    """The line a command stops with: SystemExit with a message exits with status 1 and prints it to stderr."""
    with pytest.raises(SystemExit) as stop:
        main(argv)
    line = stop.value.code
    assert isinstance(line, str) and "\n" not in line, line
    return line


def report(argv):
    from analysis.report import main

    return main(argv)


def ablate(argv):
    from analysis.ablate import main

    return main(argv)


def plan(argv):
    from analysis.plan import main

    return main(argv)


def scaling(argv):
    from analysis.scaling import main

    return main(argv)


def test_a_misspelt_metric_stops_every_command_naming_the_valid_metrics_closest_first(sweep, tmp_path):
    out = tmp_path / "rep"
    for tool, cmd, argv in (("report", report, [str(sweep), "--metric", "loss_vall", "--out", str(out)]),
                            ("ablate", ablate, [str(sweep), "--metric", "loss_vall"]),
                            ("plan", plan, [str(sweep), "--mde", "0.03", "--metric", "loss_vall"])):
        line = stops(cmd, argv)
        assert line.startswith(f"analysis.{tool}: --metric 'loss_vall' is not a metric"), line
        assert "did you mean loss_val_final? valid, closest first: loss_val_final, loss_val_best" in line, line
    line = stops(scaling, [str(sweep), "--loss-col", "loss_val_fianl"])
    assert line.startswith("analysis.scaling: --loss-col 'loss_val_fianl'") and "did you mean loss_val_final?" in line
    assert not out.exists()


def test_a_misspelt_baseline_switch_or_option_names_the_valid_ones(sweep, tmp_path):
    line = stops(report, [str(sweep), "--baseline", "gluu=swiglu", "--out", str(tmp_path / "rep")])
    assert "--baseline 'gluu' is not a switch" in line and "did you mean glu?" in line
    line = stops(ablate, [str(sweep), "--baseline", "glu=swigl"])
    assert "--baseline 'glu=swigl' is not an option these runs have; did you mean glu=swiglu?" in line
    assert "valid, closest first: glu=swiglu, glu=situ" in line
    assert stops(ablate, [str(sweep), "--baseline", "glu"]).endswith("--baseline expects SWITCH=OPTION, got 'glu'")


def test_tuning_options_without_tune_and_a_where_that_keeps_nothing_stop(sweep, tmp_path):
    line = stops(ablate, [str(sweep), "--tune-seeds", "1000"])
    assert line == "analysis.ablate: --tune-seeds sets how --tune chooses each option's rate: add --tune, or leave it out"
    line = stops(report, [str(sweep), "--where", "D > 1e12", "--out", str(tmp_path / "rep")])
    assert line == "analysis.report: --where 'D > 1e12' keeps none of the 18 rows"
    line = stops(report, [str(sweep), "--formats", "png,jpgg", "--out", str(tmp_path / "rep")])
    assert "--formats 'jpgg' is not a figure format; did you mean jpg?" in line


def test_a_folder_without_runs_says_so_and_exits_non_zero(tmp_path):
    (tmp_path / "empty").mkdir()
    for tool, cmd, argv in (("report", report, ["--out", str(tmp_path / "rep")]), ("ablate", ablate, []),
                            ("plan", plan, ["--mde", "0.03"])):
        line = stops(cmd, [str(tmp_path / "empty"), *argv])
        assert line == f"analysis.{tool}: no run directory in {tmp_path / 'empty'} (a run directory holds " \
                       "summary.json, config.yaml or metrics.jsonl)"
    write_ablation_sweep(tmp_path / "broken", seeds=(0,), broken=True)
    for run in (tmp_path / "broken").iterdir():
        if run.name not in ("failed-s0", "running-s0"):
            for f in run.iterdir():
                f.unlink()
            run.rmdir()
    line = stops(ablate, [str(tmp_path / "broken")])
    assert "no usable run in" in line and "2 run directories, all skipped (failed: 1, still running: 1)" in line


def test_a_folder_with_one_run_shows_its_runs_table_and_why_there_is_no_report(tmp_path):
    """The command itself: exit status 1, the runs table on stdout, one line on stderr, no folder written."""
    write_run(tmp_path / "one" / "run-s0", dict(DEFAULT_BASELINE), 0, 1e6, 2e7, 0.0, np.random.default_rng(0))
    out = tmp_path / "rep"
    res = subprocess.run([sys.executable, "-m", "analysis.report", str(tmp_path / "one"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 1 and not out.exists()
    assert "## Runs" in res.stdout and "| tiny    | baseline  |" in res.stdout
    line = res.stderr.strip().splitlines()[-1]
    assert line.startswith(f"analysis.report: nothing to report, so nothing written to {out}: 1 run (1 seed, 1 size")
    assert "every run has the same option of every switch (" in line and ">= 2 seeds" in line
    assert "no scaling fit: the baseline has 1 size here" in line
    line = stops(ablate, [str(tmp_path / "one")])
    assert line.startswith("analysis.ablate: no ablation table: 1 run (1 seed, 1 size")


def test_too_few_sizes_for_a_fit_stop_the_scaling_command(tmp_path):
    write_scaling_ladder(tmp_path / "ladder", sizes=np.geomspace(1e5, 1e6, 2))
    line = stops(scaling, [str(tmp_path / "ladder")])
    assert line == "analysis.scaling: no approach-3 fit: 4 points over 2 sizes (approach 3 needs >= 6 points over " \
                   ">= 3 sizes)"


def test_an_output_that_cannot_be_written_stops_before_anything_is_read(sweep, tmp_path):
    (tmp_path / "afile").write_text("")
    line = stops(report, [str(sweep), "--out", str(tmp_path / "afile")])
    assert line == f"analysis.report: --out {tmp_path / 'afile'}: a file of that name is there; give a folder"
    line = stops(report, [str(tmp_path / "nowhere"), "--out", str(tmp_path / "afile" / "rep")])
    assert "is a file, so no folder can be made below it" in line  # --out is checked before the sources
    (tmp_path / "folder").mkdir()
    line = stops(ablate, [str(sweep), "--md", str(tmp_path / "folder")])
    assert line == f"analysis.ablate: --md {tmp_path / 'folder'}: a folder of that name is there; give a file"
    line = stops(plan, ["--sd-diff", "0.03", "--mde", "0.03", "--md", str(tmp_path / "afile" / "plan.md")])
    assert line.startswith("analysis.plan: --md ") and "is a file" in line

