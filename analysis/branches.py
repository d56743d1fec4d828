"""Cooldown branches of WSD trunks, read from run directories (docs/schedules.md, docs/run_directory.md).

Which runs are trunks and branches is analysis.trunks' (the run-directory contract). A branch's
metrics.jsonl begins with the trunk's rows up to its branch point, copied (every row with step <=
branch_step is the trunk's: mark_shared), and `steps_trained` / `flops_trained` count only what the branch
trained itself. As (N, D) points of the scaling fits, branches go through analysis.report (analysis.trunks
drops the trunks and keeps each family together).

    branch_table    one row per branch: its trunk, N, tokens, final loss and the trunk's loss at the same step
    vs_separate     each branch against the separate runs of the same model, tokens and seed (cosine runs)
    compute_saved   per trunk and in all: the steps and FLOPs trained (each shared prefix once) against the
                    same points trained as separate runs

    python -m analysis.branches runs/cpu_wsd_ladder runs/cpu_cosine_ladder --out docs/reports/wsd_ladder
"""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import numpy as np
import pandas as pd
from scipy import stats

from analysis import plots
from analysis.collect import DEFAULT_N, N_DEFINITIONS, collect
from analysis.tables import markdown_table
from analysis.trunks import is_branch, is_trunk, trunk_ids

N_COL = N_DEFINITIONS[DEFAULT_N]
# what makes a separate run the same point as a branch: the model and data, the tokens trained, the seed
SAME_POINT = ("model", "data", N_COL, "tokens", "seed")


def mark_shared(curves: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The curves with `shared_prefix`: True for a branch's rows at or before its branch point (the trunk's,
    copied), False for every row a run trained itself."""
    start = runs.set_index("run_id")["branch_step"] if "branch_step" in runs else pd.Series(dtype=float)
    step0 = curves["run_id"].map(start)
    return curves.assign(shared_prefix=(curves["step"] <= step0).fillna(False).astype(bool))


def _trunk_loss_at(curves: pd.DataFrame, trunk: str, step: int) -> float:
    at = curves[(curves["run_id"] == trunk) & (curves["metric"] == "loss/val") & (curves["step"] == step)]
    return float(at["value"].iloc[-1]) if len(at) else np.nan


def branch_table(runs: pd.DataFrame, curves: pd.DataFrame) -> pd.DataFrame:
    """One row per branch: trunk, seed, N, budget (the length rule's value), steps, branch_step, tokens, loss
    (final validation loss), trunk_loss (the trunk's validation loss at the branch's last step, which every
    trunk validates) and their difference (negative: the decay helped)."""
    b = runs[is_branch(runs)].assign(trunk_id=trunk_ids(runs))
    rows = []
    for _, r in b.iterrows():
        trunk_loss = _trunk_loss_at(curves, r["trunk_id"], int(r["steps"])) if isinstance(r["trunk_id"], str) \
            else np.nan
        rows.append({"trunk": r["trunk_id"], "run_id": r["run_id"], "seed": r.get("seed"), "N": r[N_COL],
                     "budget": _budget(r), "steps": int(r["steps"]), "branch_step": int(r["branch_step"]),
                     "tokens": r["tokens"], "loss": r["loss_val_final"], "trunk_loss": trunk_loss,
                     "loss_minus_trunk": r["loss_val_final"] - trunk_loss})
    return pd.DataFrame(rows).sort_values(["N", "budget", "seed"]).reset_index(drop=True) if rows else \
        pd.DataFrame(columns=["trunk", "run_id", "seed", "N", "budget", "steps", "branch_step", "tokens", "loss",
                              "trunk_loss", "loss_minus_trunk"])


def _budget(r: pd.Series):
    """The value of the rule that set a run's length (tokens per parameter, FLOPs), else its steps."""
    rule = r.get("length_from")
    return r[rule] if rule in ("tokens_per_param", "flop_budget") else r.get("max_steps")


def vs_separate(runs: pd.DataFrame, level: float = 0.95) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each branch against the separate runs of the same point (SAME_POINT: model, data, N, tokens, seed): the
    runs that are neither trunks nor branches (e.g. cosine runs of the same budget).

    Returns (pairs, summary). pairs: one row per (point, seed) with both losses and the difference (branch -
    separate). summary: per (N, budget), over seeds: n, the mean difference with the Student-t interval of
    the paired differences (level; none for n < 2), the spread of the differences, and the seed-to-seed
    standard deviation of the separate runs (the noise of one run)."""
    branches, separate = runs[is_branch(runs)], runs[~is_branch(runs) & ~is_trunk(runs)]
    keys = [k for k in SAME_POINT if k in runs]
    pairs = branches.merge(separate, on=keys, suffixes=("_branch", "_separate"))
    if pairs.empty:
        return pairs, pd.DataFrame()
    pairs = pd.DataFrame({
        "N": pairs[N_COL], "budget": pairs.apply(lambda r: _budget(r.rename(lambda c: c.removesuffix("_branch"))),
                                                 axis=1),
        "tokens": pairs["tokens"], "seed": pairs["seed"], "branch": pairs["loss_val_final_branch"],
        "separate": pairs["loss_val_final_separate"], "schedule_separate": pairs.get("config.optim.schedule_separate"),
        "run_branch": pairs["run_id_branch"], "run_separate": pairs["run_id_separate"]})
    pairs["difference"] = pairs["branch"] - pairs["separate"]
    rows = []
    for (n, budget), g in pairs.groupby(["N", "budget"]):
        d = g["difference"].to_numpy(float)
        k = len(d)
        half = stats.t.ppf(0.5 + level / 2, k - 1) * d.std(ddof=1) / np.sqrt(k) if k >= 2 else np.nan
        rows.append({"N": n, "budget": budget, "n": k, "branch": g["branch"].mean(), "separate": g["separate"].mean(),
                     "difference": d.mean(), "ci_lo": d.mean() - half, "ci_hi": d.mean() + half,
                     "sd_difference": d.std(ddof=1) if k >= 2 else np.nan,
                     "sd_separate": g["separate"].std(ddof=1) if k >= 2 else np.nan})
    return pairs.sort_values(["N", "budget", "seed"]).reset_index(drop=True), pd.DataFrame(rows)


def compute_saved(runs: pd.DataFrame) -> pd.DataFrame:
    """Per trunk (one row each, then `all`): the steps and FLOPs its family trained (the trunk's, plus each
    branch's own steps after its branch point: summary.json's *_trained) against the same branch points
    trained as separate runs from step 0 (each branch's `steps` and `flops`), and the share saved."""
    trunk_of = trunk_ids(runs)
    rows = []
    for _, t in runs[is_trunk(runs)].iterrows():
        fam = runs[trunk_of == t["run_id"]]
        rows.append({"trunk": t["run_id"], "N": t[N_COL], "branches": len(fam),
                     "steps_trained": t["steps_trained"] + fam["steps_trained"].sum(),
                     "steps_separate": fam["steps"].sum(),
                     "flops_trained": t["flops_trained"] + fam["flops_trained"].sum(),
                     "flops_separate": fam["flops"].sum()})
    table = pd.DataFrame(rows, columns=["trunk", "N", "branches", "steps_trained", "steps_separate",
                                        "flops_trained", "flops_separate"])
    if len(table):
        total = table[["branches", "steps_trained", "steps_separate", "flops_trained", "flops_separate"]].sum()
        table = pd.concat([table, pd.DataFrame([{"trunk": "all", "N": np.nan, **total}])], ignore_index=True)
    table["saved"] = 1 - table["flops_trained"] / table["flops_separate"]
    return table


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------

def plot_families(curves: pd.DataFrame, runs: pd.DataFrame, seed: int = 0):
    """One panel per trunk of `seed` (by N): validation loss against tokens of the trunk (grey), its branches
    (coloured, from their branch point) and the separate runs of the same N and seed (dashed, same colour as
    the branch of their length)."""
    trunks = runs[is_trunk(runs) & (runs["seed"] == seed)].sort_values(N_COL)
    if trunks.empty:
        return None
    trunk_of = trunk_ids(runs)
    separate = runs[~is_branch(runs) & ~is_trunk(runs)]
    val = curves[curves["metric"] == "loss/val"]
    fig, axes = plots.plt.subplots(1, len(trunks), figsize=(4.4 * len(trunks), 3.6), squeeze=False)
    for ax, (_, t) in zip(axes[0], trunks.iterrows()):
        fam = runs[trunk_of == t["run_id"]].sort_values("tokens")
        colors = {tok: plots.PALETTE[i % len(plots.PALETTE)] for i, tok in enumerate(fam["tokens"])}
        g = val[val["run_id"] == t["run_id"]].sort_values("tokens")
        ax.plot(g["tokens"], g["value"], color="0.55", lw=1.3, label="trunk (peak rate)")
        for _, b in fam.iterrows():
            g = val[(val["run_id"] == b["run_id"]) & (val["step"] >= b["branch_step"])].sort_values("tokens")
            ax.plot(g["tokens"], g["value"], color=colors[b["tokens"]], lw=1.6, marker="o", ms=2.5,
                    label=f"branch {_budget(b):g}")
        same = separate[(separate[N_COL] == t[N_COL]) & (separate["seed"] == seed)]
        for _, s in same.iterrows():
            g = val[val["run_id"] == s["run_id"]].sort_values("tokens")
            ax.plot(g["tokens"], g["value"], color=colors.get(s["tokens"], "k"), lw=1.0, ls="--",
                    label=f"separate {_budget(s):g}")
        tail = val[val["run_id"].isin(fam["run_id"]) | (val["run_id"] == t["run_id"])]
        low, high = tail["value"].min(), tail[tail["tokens"] >= tail["tokens"].max() / 8]["value"].max()
        ax.set_ylim(low - 0.05 * (high - low), high + 0.1 * (high - low))  # the decays, not the first steps
        ax.set_title(f"N = {t[N_COL]:,.0f}, seed {seed}", fontsize=10)
        ax.set_xlabel("training tokens")
        ax.set_ylabel("validation loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write_report(paths: list[str], out: Path, seed: int = 0) -> Path:
    """report.md (and branches.csv, separate.csv, compute.csv, families.png) for the runs under `paths`."""
    col = collect(paths, verbose=True)
    runs, curves = col.runs, col.curves
    out.mkdir(parents=True, exist_ok=True)
    lines = ["# Cooldown branches against separate runs", "",
             f"Runs: {len(runs)} ({int(is_trunk(runs).sum())} trunks, {int(is_branch(runs).sum())} branches, "
             f"{int((~is_trunk(runs) & ~is_branch(runs)).sum())} separate), from {', '.join(paths)}.", ""]
    table = branch_table(runs, curves)
    table.to_csv(out / "branches.csv", index=False)
    below = int((table["loss_minus_trunk"] < 0).sum())
    lines += ["## Each branch against its trunk at the same step", "",
              f"{below} of {len(table)} branches end below their trunk's validation loss at the same step "
              "(the trunk holds the peak rate; the branch decayed over its last steps).", "",
              markdown_table(table.drop(columns=["run_id"])), ""]
    pairs, summary = vs_separate(runs)
    if len(pairs):
        pairs.to_csv(out / "separate.csv", index=False)
        lines += ["## Each branch against the separate run of the same budget", "",
                  "Paired by seed (the same initialisation and batches): difference = branch - separate, its mean "
                  "over seeds with a 95% Student-t interval of the paired differences; `sd_separate` is the "
                  "seed-to-seed standard deviation of the separate runs, the noise of one run.", "",
                  markdown_table(summary), "", "Per seed:", "",
                  markdown_table(pairs.drop(columns=["run_branch", "run_separate"])), ""]
    saved = compute_saved(runs)
    saved.to_csv(out / "compute.csv", index=False)
    lines += ["## Compute: the shared prefixes counted once", "",
              "Per trunk: the steps and FLOPs its family trained (trunk, plus each branch after its branch point) "
              "against the same branch points trained as separate runs from step 0.", "",
              markdown_table(saved, 3), ""]
    fig = plot_families(curves, runs, seed)
    if fig is not None:
        plots.save(fig, out / "families", formats=("png",))
        lines += [f"![validation loss of each trunk, its branches and the separate runs, seed {seed}]"
                  "(families.png)", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m analysis.branches", description=__doc__.splitlines()[0])
    p.add_argument("paths", nargs="+", help="run directories or sweep folders (trunks, branches, separate runs)")
    p.add_argument("--out", required=True, help="folder for report.md, the tables and the figure")
    p.add_argument("--seed", type=int, default=0, help="the seed whose curves the figure shows")
    args = p.parse_args(argv)
    try:
        print(write_report(args.paths, Path(args.out), args.seed))
    except FileNotFoundError as e:
        raise SystemExit(f"analysis.branches: {e}") from None


if __name__ == "__main__":
    main()
