"""Which runs are WSD trunks and cooldown branches, and which scaling points share a trunk.

The contract (docs/run_directory.md). A trunk's summary.json lists its branch points (`branch_steps`); it
ends at the peak rate, so it is no (N, D) point. A branch's summary.json names its trunk (`trunk`: a run
name, the directory beside its own) and its branch point (`branch_step`); up to that step its curve is
the trunk's. Branches of one trunk are (N, D) points of one size that share their prefix, so their
seed noise is correlated: they are never seeds of one point, and a resampling draws a trunk's family
together (analysis.approach1, analysis.approach3, analysis.multipliers).

    is_trunk, is_branch   masks over a runs table (analysis.collect)
    trunk_ids             each branch's trunk (its run_id, or the trunk's path where the trunk was not read)
    scaling_points        the runs that are (N, D) points, with `trunk` naming a branch's trunk
    families              the points of a scaling table that share a trunk, one row per trunk
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd


def is_trunk(runs: pd.DataFrame) -> pd.Series:
    """Runs whose summary.json lists branch points: WSD trunks."""
    if "branch_steps" not in runs:
        return pd.Series(False, index=runs.index)
    return runs["branch_steps"].map(lambda v: isinstance(v, (list, tuple)) and len(v) > 0)


def is_branch(runs: pd.DataFrame) -> pd.Series:
    """Runs whose summary.json names a trunk: cooldown branches."""
    if "trunk" not in runs:
        return pd.Series(False, index=runs.index)
    return runs["trunk"].map(lambda v: isinstance(v, str) and v != "")


def trunk_ids(runs: pd.DataFrame) -> pd.Series:
    """For each branch, its trunk: the run_id of the run in the directory beside it named `trunk` where that
    run is among `runs`, else the trunk directory's path (branches of one unread trunk still share it);
    NaN for every other run."""
    out = pd.Series(np.nan, index=runs.index, dtype=object)
    if "path" not in runs:  # a table without run directories: the trunk's name is all there is
        branch = is_branch(runs)
        out[branch] = runs.loc[branch, "trunk"]
        return out
    by_path = {Path(p).resolve(): rid for p, rid in zip(runs["path"], runs["run_id"])}
    for i in runs.index[is_branch(runs)]:
        trunk = (Path(runs.at[i, "path"]).parent / runs.at[i, "trunk"]).resolve()
        out[i] = by_path.get(trunk, str(trunk))
    return out


def scaling_points(runs: pd.DataFrame) -> pd.DataFrame:
    """The runs that are (N, D) points for the scaling fits: every run but the trunks, with `trunk_id`
    (a branch's trunk, NaN for a run trained alone)."""
    trunk = is_trunk(runs)
    return runs[~trunk].assign(trunk_id=trunk_ids(runs)[~trunk])


def families(df: pd.DataFrame) -> pd.DataFrame:
    """The points of a scaling table (N, D, loss, trunk_id; analysis.collect.runs_to_scaling) that share a
    trunk: one row per trunk with its variant, seed, N and the D of each of its branch points, sorted."""
    if "trunk_id" not in df or df["trunk_id"].isna().all():
        return pd.DataFrame(columns=["trunk", "variant", "seed", "N", "points", "D"])
    rows = []
    for trunk, g in df[df["trunk_id"].notna()].groupby("trunk_id", sort=False):
        rows.append({"trunk": trunk, "variant": g["variant"].iloc[0] if "variant" in g else "baseline",
                     "seed": g["seed"].iloc[0] if "seed" in g else np.nan, "N": float(g["N"].iloc[0]),
                     "points": len(g), "D": ", ".join(f"{d:,.0f}" for d in sorted(g["D"]))})
    return pd.DataFrame(rows).sort_values(["variant", "N", "seed"]).reset_index(drop=True)


def resampling_units(df: pd.DataFrame) -> np.ndarray:
    """One label per row of a scaling table: the unit a bootstrap draws whole. A branch's unit is its trunk
    (the family shares its prefix); every other row is a unit of its own."""
    own = np.array([f"row {i}" for i in range(len(df))], dtype=object)
    if "trunk_id" not in df:
        return own
    trunk = df["trunk_id"].to_numpy(object)
    return np.where(pd.notna(trunk), trunk, own)
