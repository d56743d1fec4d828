"""`python -m k3lab.evaluate PATH ... --tasks ...`: downstream evals of run checkpoints through lm-eval.

    python -m k3lab.evaluate runs/default/k3 --tasks sotu_cloze,sotu_complete --include docs/examples/evals
    python -m k3lab.evaluate runs/decay --tasks hellaswag,lambada_openai --limit 500    # every completed run below

Each PATH is a run directory or a folder searched for them; every completed run with a checkpoint is
evaluated, and a task whose result it already holds for the same checkpoint, task configuration and
settings is skipped (--force evaluates again). The results go into the run directory, one file per task,
`evals/<task>.json` (`write_result`), which `python -m analysis.collect` reads as the columns
`eval/<task>/<measure>`: the run directory stays the whole contract between a run and its analysis.

`K3LM` is the lm-eval `LM` of a k3lab checkpoint (k3lab.generate.load_run). Every text it is asked about
starts a document: it follows one end-of-document token, as each document does in training. A context keeps
its last `max_length` tokens (default: the run's data.seq_len, the length it trained at; NoPE lets it read
longer). `loglikelihood` scores continuations in batches from one forward each (`K3Model.forward` with
`logits_at`, so only the scored positions reach the LM head), `loglikelihood_rolling` scores a whole text
in lm-eval's disjoint windows, and `generate_until` decodes through the layers' inference form
(k3lab.generate.generate). lm-eval is an extra: pip install -e ".[eval]".
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from k3lab.config import require_package
from k3lab.errors import UserError, prog_error
from k3lab.fileio import atomic_write_text
from k3lab.generate import CHECKPOINT, LoadedRun, generate, load_run
from k3lab.rundir import git_revision, read_summary

PROG = "python -m k3lab.evaluate"
EVALS = "evals"  # the folder of a run directory that holds one <task>.json per task


def lm_class():
    """The lm-eval `LM` subclass for k3lab checkpoints, defined once lm-eval is importable."""
    from lm_eval.api.model import LM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    class K3LM(LM):
        """lm-eval's model interface over a loaded run (see the module docstring for its conventions)."""

        def __init__(self, run: LoadedRun, batch_size: int = 16, max_length: int | None = None, seed: int = 0):
            super().__init__()
            if run.tokenizer is None:
                raise UserError(f"{run.run_dir} trained on data={run.cfg.data.name}, which has no text tokenizer")
            self.run, self.model, self.tok = run, run.model, run.tokenizer
            self.batch_size = batch_size
            self.max_length = max_length or int(run.cfg.data.seq_len)
            self._device = run.model.embed.weight.device
            self.generator = torch.Generator(self._device).manual_seed(seed)

        # -- token-level scoring ---------------------------------------------------------------
        @torch.no_grad()
        def score(self, pairs: Sequence[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
            """(context ids, continuation ids) -> (sum of log p(continuation | context), whether greedy decoding
            yields the continuation): batches of sequences of similar length, each the last max_length + 1
            tokens of context + continuation, padded on the right (causal: padding changes nothing before it)."""
            order = sorted(range(len(pairs)), key=lambda i: -(len(pairs[i][0]) + len(pairs[i][1])))
            out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                seqs = [(pairs[i][0] + pairs[i][1])[-(self.max_length + 1):] for i in batch]
                n_scored = [min(len(pairs[i][1]), len(s) - 1) for i, s in zip(batch, seqs)]
                width = max(len(s) - 1 for s in seqs)
                x = torch.full((len(batch), width), self.tok.eod_id, dtype=torch.long)
                scored = torch.zeros(len(batch), width, dtype=torch.bool)
                targets = []
                for row, (s, n) in enumerate(zip(seqs, n_scored)):
                    x[row, :len(s) - 1] = torch.tensor(s[:-1])
                    scored[row, len(s) - 1 - n:len(s) - 1] = True
                    targets += s[len(s) - n:]
                logp = torch.log_softmax(self.model(x.to(self.device), logits_at=scored.to(self.device)).double(), -1)
                target = torch.tensor(targets, device=logp.device)
                picked = logp.gather(1, target[:, None])[:, 0]
                greedy = logp.argmax(1) == target
                at = 0
                for i, n in zip(batch, n_scored):
                    out[i] = (float(picked[at:at + n].sum()), bool(greedy[at:at + n].all()))
                    at += n
            return out

        def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            """The ids of a (context, continuation) pair, the end-of-document id first: the pair is encoded whole
            and split after the context's ids (a merge across the boundary stays in the continuation), with the
            context's trailing spaces moved to the continuation, as lm-eval's Hugging Face model does."""
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, ctx = self.tok.encode(context + continuation), self.tok.encode(context)
            return [self.tok.eod_id, *ctx], whole[len(ctx):]

        # -- the LM interface --------------------------------------------------------------------
        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            return self.score([self.encode_pair(*r.args) for r in requests])

        def loglikelihood_rolling(self, requests) -> list[float]:
            totals = []
            for r in requests:
                windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                    self.tok.encode(r.args[0]), prefix_token=self.tok.eod_id, max_seq_len=self.max_length,
                    context_len=1)]
                totals.append(sum(logp for logp, _ in self.score(windows)))
            return totals

        def generate_until(self, requests) -> list[str]:
            texts = []
            for r in requests:
                context, kwargs = r.args
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                sample = kwargs.get("do_sample", False) and kwargs.get("temperature", 1.0) > 0
                prompt = [self.tok.eod_id, *self.tok.encode(context)][-self.max_length:]
                ids = generate(self.model, prompt, int(kwargs.get("max_gen_toks", 256)),
                               temperature=float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                               top_k=int(kwargs.get("top_k", 0) or 0), generator=self.generator, end_id=self.tok.eod_id,
                               stop=lambda ids: any(u in self.tok.decode(ids) for u in until))
                text = self.tok.decode(ids)
                for u in until:
                    text = text.split(u)[0]
                texts.append(text)
            return texts

    return K3LM


# ---------------------------------------------------------------------------------------------
# results in the run directory


def checkpoint_identity(run: LoadedRun) -> dict:
    """What a result was computed from: the checkpoint's step and the sha256 of its file."""
    h = hashlib.sha256()
    with open(run.checkpoint, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return {"step": run.step, "sha256": h.hexdigest()}


def task_sha256(config: dict) -> str:
    """A task configuration's identity (lm-eval's dumped config, functions by their qualified name)."""
    def plain(value):
        return f"{value.__module__}.{value.__qualname__}" if callable(value) else str(value)
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=plain).encode()).hexdigest()


def measures(task_results: dict) -> dict[str, float]:
    """lm-eval's `results[task]` ({"acc,none": 0.5, "acc_stderr,none": 0.1, "alias": ...}) -> {"acc": 0.5,
    "acc_stderr": 0.1}; a measure under a filter other than `none` is named `<metric>/<filter>`."""
    out = {}
    for key, value in task_results.items():
        if "," not in key or not isinstance(value, (int, float)):
            continue
        metric, filt = key.split(",", 1)
        out[metric if filt == "none" else f"{metric}/{filt}"] = float(value)
    return out


def result_path(run_dir: Path, task: str) -> Path:
    return Path(run_dir) / EVALS / f"{task}.json"


def is_current(run_dir: Path, task: str, identity: dict) -> bool:
    """Whether evals/<task>.json holds a result for `identity` (checkpoint, task configuration, settings)."""
    try:
        return json.loads(result_path(run_dir, task).read_text())["identity"] == identity
    except (OSError, ValueError, KeyError):
        return False


def write_result(run_dir: Path, task: str, results: dict, identity: dict, seconds: float) -> Path:
    """evals/<task>.json: the task's measures, whether higher is better for each, the samples scored and
    what the result was computed from (`identity`), written whole or not at all."""
    higher = results.get("higher_is_better", {}).get(task, {})
    record = {
        "task": task,
        "metrics": measures(results["results"][task]),
        "higher_is_better": {m: bool(v) for m, v in higher.items() if v is not None},
        "samples": results.get("n-samples", {}).get(task, {}).get("effective"),
        "identity": identity,
        "lm_eval": results.get("config", {}).get("lm_eval_version") or _lm_eval_version(),
        "git_rev": git_revision(),
        "seconds": round(seconds, 2),
        "created_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    path = result_path(run_dir, task)
    path.parent.mkdir(exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    return path


def _lm_eval_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("lm_eval")


# ---------------------------------------------------------------------------------------------
# the command


def find_runs(paths: Sequence[str]) -> tuple[list[Path], list[str]]:
    """(completed runs with a checkpoint under `paths`, a line for each run directory left out and why)."""
    runs, skipped = [], []
    for p in map(Path, paths):
        if not p.exists():
            raise UserError(f"{p} does not exist")
        found = [p] if (p / "config.yaml").exists() else sorted(c.parent for c in p.rglob("config.yaml"))
        if not found:
            raise UserError(f"{p} holds no run directory (no config.yaml in it or below it)")
        for run_dir in found:
            status = read_summary(run_dir).get("status")
            if status != "completed":
                skipped.append(f"{run_dir}: skipped, status {status or 'unknown'} (not completed)")
            elif not (run_dir / CHECKPOINT).is_file():
                skipped.append(f"{run_dir}: skipped, no single-file {CHECKPOINT}")
            else:
                runs.append(run_dir)
    return runs, skipped


def task_manager(names: Sequence[str], include: Sequence[str]):
    """lm-eval's TaskManager over the folders of `include` alone when they hold every task named (indexing
    lm-eval's own thousands of task files takes a minute on a small CPU), else over them and lm-eval's tasks."""
    from lm_eval.tasks import TaskManager

    if include:
        local = TaskManager(include_path=list(include), include_defaults=False)
        if set(names) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=list(include) or None)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Evaluate run checkpoints with lm-eval into <run>/evals/.")
    p.add_argument("paths", nargs="+", help="run directories, or folders searched for them")
    p.add_argument("--tasks", required=True, help="comma-separated lm-eval task names")
    p.add_argument("--include", action="append", default=[], help="a folder of task YAMLs (repeatable)")
    p.add_argument("--num-fewshot", type=int, default=None, help="examples in each prompt (default: the task's)")
    p.add_argument("--limit", type=int, default=None, help="evaluate only the first N documents of each task")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per forward when scoring (default 16)")
    p.add_argument("--max-length", type=int, default=None, help="context tokens kept (default: the run's data.seq_len)")
    p.add_argument("--seed", type=int, default=0, help="seed of lm-eval's draws and of sampled generations")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--force", action="store_true", help="evaluate again what is already evaluated")
    return p


def evaluate(args: argparse.Namespace) -> list[Path]:
    """Evaluate every run of args.paths on args.tasks; returns the result files written."""
    require_package(PROG, "lm_eval", extra="eval")
    import lm_eval

    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    runs, skipped = find_runs(args.paths)
    for line in skipped:
        print(line)
    names = [t for t in args.tasks.split(",") if t]
    manager = task_manager(names, args.include)
    unknown = [t for t in names if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"--tasks: {', '.join(unknown)} is not a task lm-eval knows"
                        + ("" if args.include else " (a folder of your own task YAMLs: --include <folder>)"))
    loaded = manager.load(names)["tasks"]
    configs = {name: task_sha256(task.dump_config()) for name, task in loaded.items()}
    settings = {"num_fewshot": args.num_fewshot, "limit": args.limit, "max_length": args.max_length, "seed": args.seed}
    written = []
    model_class = lm_class()
    for run_dir in runs:
        run = load_run(run_dir, args.device)
        base = {"checkpoint": checkpoint_identity(run), **settings}
        pending = [t for t in configs if args.force or not is_current(run_dir, t, {**base, "task_sha256": configs[t]})]
        if not pending:
            print(f"{run_dir}: evaluated already at step {run.step} on {', '.join(configs)}, skipped")
            continue
        t0 = time.perf_counter()
        lm = model_class(run, batch_size=args.batch_size, max_length=args.max_length, seed=args.seed)
        results = lm_eval.simple_evaluate(model=lm, tasks=pending, task_manager=manager, num_fewshot=args.num_fewshot,
                                          limit=args.limit, log_samples=False, random_seed=args.seed,
                                          numpy_random_seed=args.seed, torch_random_seed=args.seed,
                                          fewshot_random_seed=args.seed)
        seconds = time.perf_counter() - t0
        for task in results["results"]:
            identity = {**base, "task_sha256": configs.get(task) or task_sha256(results["configs"].get(task, {}))}
            path = write_result(run_dir, task, results, identity, seconds)
            written.append(path)
            shown = ", ".join(f"{m} {v:.4f}" for m, v in measures(results["results"][task]).items())
            print(f"{run_dir}: {task} at step {run.step}: {shown} -> {path}")
    return written


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        evaluate(args)
    except UserError as err:
        return prog_error(PROG, err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
