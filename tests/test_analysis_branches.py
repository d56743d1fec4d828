"""analysis/branches.py on run directories written by hand in the run-directory contract: two seeds of a
trunk with branches at 50 and 100 steps (branch points 40 and 80) and of the separate runs of the same
budgets. The tables must find each branch's trunk and its loss at the same step, pair each branch with the
separate run of its seed, and count each shared prefix once."""
import json
from pathlib import Path

import numpy as np
import pytest
from scipy import stats

from analysis.branches import branch_table, compute_saved, mark_shared, vs_separate, write_report
from analysis.collect import collect
from analysis.trunks import is_branch, is_trunk, scaling_points

N, PER_STEP, FPT = 1000, 10, 6000.0  # parameters, tokens per step, FLOPs per token


def trunk_loss(step: int) -> float:
    return 4.0 - 0.01 * step


def write_run(folder: Path, name: str, steps: int, loss: float, seed: int, **fields) -> None:
    """A completed run: summary.json, and metrics.jsonl with a validation point every 10 steps."""
    run = folder / name
    run.mkdir(parents=True)
    shared = fields.get("branch_step", 0)
    summary = {"status": "completed", "run_name": name, "seed": seed, "model": "ladder", "data": "sotu",
               "params_active_non_embedding": N, "length_from": "max_steps", "max_steps": steps, "steps": steps,
               "tokens": steps * PER_STEP, "flops": steps * PER_STEP * FPT, "steps_trained": steps - shared,
               "flops_trained": (steps - shared) * PER_STEP * FPT, "loss_val_final": loss, **fields}
    (run / "summary.json").write_text(json.dumps(summary))
    rows = [{"step": s, "tokens": s * PER_STEP, "flops": s * PER_STEP * FPT,
             "loss/val": trunk_loss(s) if s <= shared or "branches" in fields else loss + 0.001 * (steps - s)}
            for s in range(0, steps + 1, 10)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def sweep(tmp_path) -> Path:
    """Seeds 0 and 1: a trunk of 100 steps, its branches of 50 and 100 steps, the separate runs of both."""
    for seed in (0, 1):
        t = f"seed={seed}"
        write_run(tmp_path / "wsd", t, 100, trunk_loss(100), seed, branches=[50, 100], branch_steps=[40, 80])
        for steps, start in ((50, 40), (100, 80)):
            write_run(tmp_path / "wsd", f"{t},branch={steps}", steps, trunk_loss(steps) - 0.1 - 0.01 * seed, seed,
                      trunk=t, branch_step=start)
            write_run(tmp_path / "cosine", f"{t},steps={steps}", steps, trunk_loss(steps) - 0.08 + 0.02 * seed, seed)
    return tmp_path


def test_every_branch_finds_its_trunk_and_the_trunks_loss_at_the_same_step(sweep):
    col = collect([sweep / "wsd", sweep / "cosine"])
    assert is_trunk(col.runs).sum() == 2 and is_branch(col.runs).sum() == 4
    table = branch_table(col.runs, col.curves)
    assert len(table) == 4
    for _, r in table.iterrows():
        assert r["trunk"] == f"wsd/seed={r['seed']}"
        assert r["trunk_loss"] == pytest.approx(trunk_loss(r["steps"]))
        assert r["loss_minus_trunk"] == pytest.approx(-0.1 - 0.01 * r["seed"])
    points = scaling_points(col.runs)
    assert not is_trunk(points).any() and len(points) == 8
    assert set(points.loc[is_branch(points), "trunk_id"]) == {"wsd/seed=0", "wsd/seed=1"}
    assert points.loc[~is_branch(points), "trunk_id"].isna().all()


def test_each_branch_is_paired_with_the_separate_run_of_its_seed(sweep):
    pairs, summary = vs_separate(collect([sweep / "wsd", sweep / "cosine"]).runs)
    assert len(pairs) == 4 and set(pairs["run_separate"].str.split("/").str[0]) == {"cosine"}
    for _, r in pairs.iterrows():
        assert r["difference"] == pytest.approx(-0.02 - 0.03 * r["seed"])  # (-0.1 - 0.01 s) - (-0.08 + 0.02 s)
    d = np.array([-0.02, -0.05])
    half = stats.t.ppf(0.975, 1) * d.std(ddof=1) / np.sqrt(2)
    for _, r in summary.iterrows():
        assert r["n"] == 2 and r["difference"] == pytest.approx(d.mean())
        assert (r["ci_lo"], r["ci_hi"]) == pytest.approx((d.mean() - half, d.mean() + half))
        assert r["sd_separate"] == pytest.approx(np.std([-0.08, -0.06], ddof=1))


def test_the_shared_prefix_is_counted_once(sweep):
    runs = collect([sweep / "wsd", sweep / "cosine"]).runs
    saved = compute_saved(runs)
    per_trunk = saved[saved["trunk"] != "all"]
    assert list(per_trunk["steps_trained"]) == [100 + 10 + 20] * 2  # the trunk, then each branch's own steps
    assert list(per_trunk["steps_separate"]) == [50 + 100] * 2
    total = saved[saved["trunk"] == "all"].iloc[0]
    assert total["flops_trained"] == 260 * PER_STEP * FPT and total["saved"] == pytest.approx(1 - 130 / 150)


def test_a_branchs_rows_up_to_its_branch_point_are_marked_shared(sweep):
    col = collect([sweep / "wsd"])
    curves = mark_shared(col.curves, col.runs)
    branch = curves[curves["run_id"] == "seed=0,branch=50"]
    assert list(branch.loc[branch["shared_prefix"], "step"]) == [0, 10, 20, 30, 40]
    assert not curves.loc[curves["run_id"] == "seed=0", "shared_prefix"].any()


def test_the_report_names_every_table(sweep, tmp_path):
    path = write_report([str(sweep / "wsd"), str(sweep / "cosine")], tmp_path / "report")
    text = path.read_text()
    assert "4 of 4 branches end below their trunk's validation loss" in text
    assert "against the separate run of the same budget" in text and "counted once" in text
    assert (tmp_path / "report" / "families.png").exists()
