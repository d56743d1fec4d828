"""tune.py, the learning rate tuned at every size: stage 1 runs the grid per configuration and size, a choice
at the edge of its grid is widened one step beyond until it is inside (or the rounds run out), stage 2 runs
the reported seeds at each choice, the report reads the same directories; run again, it issues the same
commands and chooses the same. The training is replaced by run directories written from a known loss surface
(the command's config composed as run.py composes it, its final loss a function of depth and rate), so what is
tested is the driver's reading and deciding; the training it launches is run.py's (tests/test_train.py)."""
import itertools
import json
import math
from pathlib import Path

import pytest
import yaml
from hydra.core.override_parser.overrides_parser import OverridesParser

import tune
from analysis.rates import choices, grid_edges, rate_table
from analysis.collect import collect

ROOT = Path(__file__).resolve().parents[1]
BEST = {2: 2.0, 3: 1.0}  # depth -> the rate of lowest loss: beyond the grid [0.5, 1, 2] at depth 2, inside at 3


def loss(depth: int, lr_scale: float, seed: int) -> float:
    """A parabola in log2(rate) around BEST[depth], plus a small seed term."""
    return 3.0 - 0.1 * depth + 0.05 * (math.log2(lr_scale) - math.log2(BEST[depth])) ** 2 + 1e-4 * (seed % 7)


def fake_run_all(out: Path, issued: list):
    """A stand-in for tune.run_all: each run of each multirun becomes a completed run directory whose config.yaml
    holds the keys the plan varies (depth, rate, seed) beside the shared model keys."""
    def run_all(commands, parallel):
        for args in commands:
            issued.append(args)
            parsed = OverridesParser.create().parse_overrides([a for a in args if a != "-m"])
            values = {o.key_or_group: list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
                      for o in parsed}
            for depth, rate, seed in itertools.product(values["model.n_layers"], values["optim.lr_scale"],
                                                       values["seed"]):
                run_dir = out / values["group"][0] / f"model.n_layers={depth},optim.lr_scale={rate:g},seed={seed}"
                run_dir.mkdir(parents=True, exist_ok=True)
                config = {"seed": seed, "group": values["group"][0],
                          "model": {"name": "ladder", "n_layers": depth, "aspect": 16, "head_dim": 16},
                          "optim": {"name": "muon_per_head", "lr_scale": float(rate)}}
                (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
                summary = {"status": "completed", "seed": seed, "run_name": run_dir.name, "n_layers": depth,
                           "d_model": 16 * depth, "params_active_non_embedding": 1000 * depth, "tokens": 500 * depth,
                           "loss_val_final": loss(depth, float(rate), seed)}
                (run_dir / "summary.json").write_text(json.dumps(summary))
    return run_all


@pytest.fixture
def plan(tmp_path) -> Path:
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({
        "group": "ladder", "command": ["model=ladder", "model.aspect=16", "model.head_dim=16"],
        "sizes": {"d2": ["model.n_layers=2"], "d3": ["model.n_layers=3"]},
        "grid": {"optim.lr_scale": [0.5, 1, 2]}, "tune_seeds": [1000], "seeds": [0, 1], "max_widen": 2}))
    return path


def test_one_command_tunes_every_size_widens_an_edge_and_trains_the_seeds_at_the_choice(plan, tmp_path, monkeypatch):
    issued = []
    monkeypatch.setattr(tune, "run_all", fake_run_all(tmp_path / "runs", issued))
    report = tune.tune(tune.load_plan(plan), [f"out_dir={tmp_path / 'runs'}"], parallel=1)

    def rates(args):
        return next(a.split("=", 1)[1] for a in args if a.startswith("optim.lr_scale="))

    def seeds(args):
        return next(a.split("=", 1)[1] for a in args if a.startswith("seed="))

    # stage 1 (both sizes), one widening at depth 2 (2 is the highest of the grid: 4 next), then stage 2
    assert [(rates(a), seeds(a)) for a in issued] == [("0.5,1,2", "1000"), ("0.5,1,2", "1000"), ("4", "1000"),
                                                      ("2", "0,1"), ("1", "0,1")]
    assert "model.n_layers=2" in issued[2]
    best = choices(rate_table(collect([tmp_path / "runs"]).runs, tune_seeds=[1000]))
    assert dict(zip(best["n_layers"], best["optim.lr_scale"])) == {2: 2.0, 3: 1.0}
    assert (best["edge"] == "").all()  # 4 was worse than 2: the choice is inside its widened grid
    assert report.name == "report.md" and (report.parent / "transfer.png").exists()
    assert "optim.lr_scale=2" in report.read_text()

    again = []
    monkeypatch.setattr(tune, "run_all", fake_run_all(tmp_path / "runs", again))
    tune.tune(tune.load_plan(plan), [f"out_dir={tmp_path / 'runs'}"], parallel=1)
    assert [(rates(a), seeds(a)) for a in again] == [("0.5,1,2", "1000"), ("0.5,1,2", "1000"), ("2", "0,1"),
                                                     ("1", "0,1")]  # nothing left to widen; run.py skips the rest


def test_an_optimum_past_every_widening_stays_flagged(plan, tmp_path, monkeypatch):
    """max_widen rounds at most: the choice is then reported at its edge, not trained further out."""
    monkeypatch.setitem(BEST, 2, 64.0)
    issued = []
    monkeypatch.setattr(tune, "run_all", fake_run_all(tmp_path / "runs", issued))
    tune.tune(tune.load_plan(plan), [f"out_dir={tmp_path / 'runs'}"], parallel=1)
    widened = [a for a in issued[2:] if "seed=1000" in a]
    assert len(widened) == 2  # 4, then 8: two rounds
    best = choices(rate_table(collect([tmp_path / "runs"]).runs, tune_seeds=[1000]))
    row = best[best["n_layers"] == 2].iloc[0]
    assert row["optim.lr_scale"] == 8.0 and row["edge"] == "optim.lr_scale at the highest of 5"


def test_grid_edges_follow_the_line_through_the_choice():
    """Two keys: an edge of one key is judged among the settings that share the other key's chosen value."""
    import pandas as pd

    grid = pd.DataFrame([{"a": a, "b": b} for a, b in itertools.product([0.5, 1, 2], [1, 3])] + [{"a": 4, "b": 1}])
    best = int(grid.index[(grid["a"] == 2) & (grid["b"] == 3)][0])  # a=4 was tried only at b=1
    words, beyond = grid_edges(grid, best, ["a", "b"])
    assert words == "a at the highest of 3; b at the highest of 2"
    assert beyond == [{"a": 4.0, "b": 3}, {"a": 2, "b": 9.0}]


@pytest.mark.parametrize("plan_text, message", [
    ({"group": "g", "sizes": {"d": []}, "grid": {"optim.lr_scale": [1]}, "seeds": [0]}, "`tune_seeds` is missing"),
    ({"group": "g", "sizes": {"d": []}, "grid": {"x": [1]}, "tune_seeds": [1], "seeds": [0], "speed": 1},
     "unknown key(s) ['speed']"),
])
def test_a_bad_plan_is_one_line(tmp_path, plan_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(plan_text))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        tune.load_plan(path)


def test_a_slice_keeps_the_named_sizes_and_configurations(plan):
    whole = tune.load_plan(plan)
    assert [(c.variant, c.size) for c in tune.cells(tune.select(whole, "d3"))] == [("default", "d3")]
    assert tune.cells(tune.select(whole)) == tune.cells(whole)
    with pytest.raises(ValueError, match=r"--sizes=d4: d4 not in the plan; it has d2, d3"):
        tune.select(whole, "d4")
    with pytest.raises(ValueError, match=r"--variants=k3: k3 not in the plan; it has default"):
        tune.select(whole, variants="k3")


def test_past_its_deadline_it_stops_before_choosing_and_the_same_command_goes_on(plan, tmp_path, monkeypatch):
    """K3LAB_STOP_AT passed during stage 1: tune stops before any choice (none from unfinished runs), writes
    no report; the same command without the deadline issues stage 1 again (run.py skips what completed) and
    goes on to the end."""
    issued = []
    monkeypatch.setattr(tune, "run_all", fake_run_all(tmp_path / "runs", issued))
    monkeypatch.setenv("K3LAB_STOP_AT", "1")  # long past
    assert tune.tune(tune.load_plan(plan), [f"out_dir={tmp_path / 'runs'}"], parallel=1) is None
    assert len(issued) == 2 and all("seed=1000" in a for a in issued)  # stage 1 only
    assert not (tmp_path / "runs" / "ladder" / "rates").exists()
    monkeypatch.delenv("K3LAB_STOP_AT")
    report = tune.tune(tune.load_plan(plan), [f"out_dir={tmp_path / 'runs'}"], parallel=1)
    assert report is not None and report.exists() and len(issued) == 2 + 2 + 1 + 2
