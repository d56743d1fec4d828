"""The ladder plans (ladders/*.yaml, run by tune.py): every configuration at every size composes and types as
run.py types it, for its tuning runs and its reported ones; and the second GPU study's plan holds the design
of issue 56, its dry run pricing each job from the model's own parameter counts and the measured tokens/s of
results/pycode_study/PLAN.md, without data or training."""
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import tune
from analysis.ablate import TUNE_SEED_MIN
from k3lab.budget import run_length
from k3lab.config import run_config
from k3lab.flops import flops_per_token
from k3lab.model import K3Model

ROOT = Path(__file__).resolve().parents[1]
PLANS = sorted((ROOT / "ladders").glob("*.yaml"))
STUDY = ROOT / "ladders" / "pycode_study2.yaml"
DATA = ["++data.path=/unused"]  # the token shards are not read: nothing trains


@pytest.mark.parametrize("path", PLANS, ids=[p.stem for p in PLANS])
def test_every_cell_of_a_plan_composes_and_types(path):
    plan = tune.load_plan(path)
    cells = tune.cells(plan)
    assert cells
    for cell in cells:
        for tuning in (True, False):
            cfg = tune.compose_cell(plan, DATA, cell, tuning)
            run = run_config(cfg)  # every group typed against the schema
            run.train.check()
            run.optim.check()
            run.model_config(64)
            assert all(OmegaConf.select(cfg, key) is not None for key in cell.grid), cell
    assert set(plan["tune_seeds"]).isdisjoint(plan["seeds"]) and min(plan["tune_seeds"]) >= TUNE_SEED_MIN


def test_the_second_study_plan_holds_the_design_of_issue_56():
    plan = tune.load_plan(STUDY)
    cells = tune.cells(plan)
    variants = {name: v["overrides"] for name, v in plan["variants"].items()}
    assert variants["k3"] == [] and variants["standard"] == ["residual=standard"]
    assert variants["adamw"] == ["optim=adamw"]
    adamw = plan["variants"]["adamw"]["grid"]
    assert {"optim.lr_scale", "optim.embed_lr_scale", "optim.betas"} <= set(adamw)  # rate, embedding rate, beta2
    assert {b[1] for b in adamw["optim.betas"]} == {0.95, 0.99}
    assert len(plan["seeds"]) >= 3
    depths = {}
    for cell in cells:
        cfg = tune.compose_cell(plan, DATA, cell)
        assert cfg.optim.schedule == "wsd" and cfg.train.tokens_per_param == 20
        assert list(cfg.train.branches) == [5, 10, 20]
        assert run_config(cfg).data.val_tokens >= 1_000_000
        depths.setdefault(cell.variant, set()).add((cfg.model.n_layers, cfg.model.aspect))
    ladder = {d for d, aspect in depths["k3"] if aspect == 64}
    assert len(ladder) >= 3 and ladder <= {d for d, _ in depths["adamw"]}  # AdamW on every ladder size
    assert any(d == 12 for d, _ in depths["k3"]) and depths["k3"] == depths["standard"]  # the AttnRes point


def test_the_dry_run_prices_every_job_from_the_models_counts():
    """Each job's tokens computed here from the model's parameter count and the budget rule: a trunk of
    ceil(20 N / 32,768) steps, then each branch's last round(0.2 T_i) steps; the tuning jobs one WSD run of 5
    tokens per parameter. Minutes: tokens / the plan's tokens/s, whose measured sizes are PLAN.md's."""
    plan = tune.load_plan(STUDY)
    speed = plan["dry_run"]["tokens_per_s"]
    measured = (ROOT / "results" / "pycode_study" / "PLAN.md").read_text()
    assert f"| 4 | 256 | {speed['d4']:,} |" in measured and f"| 6 | 384 | {speed['d6']:,} |" in measured
    table = tune.dry_run(plan, DATA)
    per_step = 16 * 2048
    counts = {}  # size and model-changing overrides -> (the model, N): built here, once each
    for _, row in table.iterrows():
        [cell] = [c for c in tune.cells(plan) if (c.variant, c.size) == (row["variant"], row["size"])]
        cfg = tune.compose_cell(plan, DATA, cell, row["stage"] == "tune")
        key = tuple(o for o in cell.overrides if not o.startswith("optim"))
        if key not in counts:
            model = K3Model(run_config(cfg).model_config(8192))
            counts[key] = model, model.param_counts()["params_active_non_embedding"]
        model, n = counts[key]
        assert row["N"] == n
        if row["stage"] == "tune":
            steps = math.ceil(5 * n / per_step)
            assert row["jobs"] == math.prod(len(v) for v in cell.grid.values())
        else:
            lengths = [math.ceil(b * n / per_step) for b in (5, 10, 20)]
            steps = lengths[-1] + sum(round(0.2 * t) for t in lengths)
            assert row["jobs"] == 3
            assert row["minutes_if_separate"] == pytest.approx(3 * sum(lengths) * per_step / speed[row["size"]] / 60,
                                                               rel=1e-12)
            assert run_length(cfg.train, n, flops_per_token(model, 2048), per_step).max_steps == lengths[-1]
            assert lengths[-1] * per_step / 110.5e6 < 4.1  # the longest branch within about 4 epochs of the corpus
            fpt = flops_per_token(model, 2048)
            assert (row["C_first"], row["C_last"]) == pytest.approx((fpt * lengths[0] * per_step,
                                                                     fpt * lengths[-1] * per_step), rel=1e-12)
        assert row["steps_per_job"] == steps and row["tokens_per_job"] == steps * per_step
        assert row["minutes"] == pytest.approx(row["jobs"] * steps * per_step / speed[row["size"]] / 60, rel=1e-12)


def test_the_presets_neighbouring_sizes_train_overlapping_compute():
    """Approach 1 measures where two sizes' curves cross only where they train overlapping compute: the
    longest point of each ladder size beyond the shortest of the next (tune.compute_overlaps), for every
    configuration of the second study."""
    table = tune.dry_run(tune.load_plan(STUDY), DATA)
    overlaps = tune.compute_overlaps(table)
    assert set(overlaps["variant"]) == {"k3", "standard", "adamw"}
    for _, r in overlaps.iterrows():
        small, large = r["sizes"].split("-")
        rows = table[(table["stage"] == "seeds") & (table["variant"] == r["variant"])].set_index("size")
        assert rows.loc[small, "N"] < rows.loc[large, "N"]
        assert r["overlap"] == pytest.approx(rows.loc[small, "C_last"] / rows.loc[large, "C_first"])
        assert r["overlap"] > 1, overlaps


def test_the_dry_run_command_runs_in_a_fresh_process():
    """`python tune.py PLAN --sizes d4 ... --dry-run` as PLAN.md types a slice (options before and after the
    run.py overrides): nothing imported beforehand (the schema that conf/config.yaml composes onto is
    registered by tune.py itself), and only the slice's cells priced."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, str(ROOT / "tune.py"), str(STUDY), "--sizes", "d4", *DATA, "--dry-run"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "device minutes alone on the device" in lines[-1] and lines[-1].startswith("33 jobs"), lines[-1]
    rows = [line.split() for line in lines[1:] if line.split()[:1] in (["k3"], ["standard"], ["adamw"])]
    assert len(rows) == 6 and {r[1] for r in rows} == {"d4"}, lines
