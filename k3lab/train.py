"""One training run: composed config -> run directory, data, model, Lightning trainer -> results.

`run.py` (Hydra) calls `train_job(cfg)`: `train(cfg)`, then, for a WSD trunk, `train` of each of its cooldown
branches (k3lab/branches.py). `train` builds the parts in this order and records everything a run needs to
be analysed or resumed in its run directory (docs/run_directory.md):

    run directory   k3lab.rundir.prepare_run_dir   (new, restarted, or the one being resumed)
    data            k3lab.data.K3DataModule
    model           k3lab.model.K3Model            plain PyTorch, built from ModelConfig alone;
                                                   model.compile() when train.compile is on
    training logic  k3lab.lit.K3LitModule          loss, balancing, metrics, optimizer
    run length      k3lab.budget.run_length        max_steps, or tokens per parameter, or a FLOP budget;
                    k3lab.branches                 a trunk's branch points, a branch's start in its trunk
    loggers         metrics.jsonl (+ TensorBoard, wandb)
    trainer         Lightning, with the checkpoint callback, the progress display and the preemption
                    checkpoint (k3lab.preempt: on the cluster's warning signal, save, stop, requeue)

Before any of it, `check_config` types the composed config once (k3lab.config.RunConfig) and checks it,
so a bad setting fails in a second with one line and leaves nothing on disk (k3lab/errors.py); every part
below receives its typed section of that RunConfig.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import resource
import statistics
import sys
import uuid
import warnings
from collections.abc import Collection, Sequence
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch
import torch._functorch.config
from torch import nn
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from omegaconf import DictConfig

from k3lab.branches import (KeepBranchPoints, TrunkNotReady, branch_plan, branch_run, stable_phase,
                            start_from_trunk)
from k3lab.budget import run_length
from k3lab.config import RunConfig, TrainerConfig, check_config, compile_mode
from k3lab.data import K3DataModule
from k3lab.data.tokenizer import save_to_run
from k3lab.errors import ConfigError, reading_data
from k3lab.flops import flops_per_token
from k3lab.lit import K3LitModule, TrainMetrics
from k3lab.model import K3Model
from k3lab.model.residual import attnres_saturation
from k3lab.optim import decay_steps
from k3lab.parallel import JobProcesses, build_strategy, n_processes, one_job_argv
from k3lab.plots import plot_depth_diagnostics, write_run_plots
from k3lab.preempt import (Preempted, PreemptionCheckpoint, StoppedAtDeadline, check_not_past_deadline,
                           signal_number, stop_at)
from k3lab.probes import RecallProbes
from k3lab.progress import print_final, print_run_header, progress_callback
from k3lab.rundir import (AtomicCheckpointIO, JsonlLogger, Summary, UnreadableCheckpoint, checkpoint_step, cpu_load,
                          cpu_threads, device_sharing, environment, prepare_run_dir, read_metrics, truncate_metrics,
                          write_metrics_csv)
from k3lab.switches import SWITCHES


def train(cfg: DictConfig, overrides: list[str] = (), callbacks: Sequence[Callback] = ()) -> dict:
    """One run into its run directory; extra Lightning callbacks (probes) may ride along. Returns summary.json,
    whose `outcome` says how this process started the run (new, resume or restart; skip when it found the
    run completed and did nothing: see prepare_run_dir). A bad setting raises ConfigError before anything
    is written (check_config); any failure after the directory exists is recorded there as `failed`."""
    quiet_lightning()
    run = check_config(cfg, overrides)
    if run.train.preempt_signal:
        signal_number(run.train.preempt_signal)
    check_not_past_deadline()  # K3LAB_STOP_AT: a run that would begin after it does not (k3lab.preempt)
    trunk_dir = Path(run.out_dir) / run.group / str(run.train.trunk)
    if run.train.trunk and not run.resume and not trunk_dir.is_dir():
        raise TrunkNotReady(f"train.trunk={run.train.trunk}: no run directory {trunk_dir}: a cooldown branch "
                            "starts from its trunk, in the same out_dir and group; train the trunk first")
    plan = prepare_run_dir(cfg, list(overrides))
    if plan.action == "skip":
        rank_zero_only(print)(f"{plan.run_dir}: {plan.reason}")
        return {**plan.previous, "outcome": "skip"}
    run_dir, ckpt_path = plan.run_dir, plan.ckpt_path
    if plan.reason:
        rank_zero_only(print)(f"{run_dir}: {plan.reason}")
    if plan.action == "resume":
        run = check_config(plan.cfg)  # the run's own config.yaml: its data may have moved since
    fields = {"run_name": run_dir.name, "group": run.group, "seed": run.seed,
              "switches": {s: getattr(run, s).name for s in SWITCHES}, "model": run.model.name,
              "data": run.data.name, "kernels": run.kernels.backend, "outcome": plan.action,
              "config_fingerprint": plan.fingerprint}
    try:
        start_step = checkpoint_step(ckpt_path) if ckpt_path else 0
    except UnreadableCheckpoint as err:
        Summary(run_dir, fields).finish("failed", error=f"{type(err).__name__}: {err}")
        raise
    elapsed = truncate_metrics(run_dir, start_step) if ckpt_path else 0.0
    # from here on, any failure is recorded in summary.json
    summary = Summary(run_dir, fields, elapsed_s=elapsed)
    known: dict = {}  # what final_fields needs, filled in as the parts are built
    loggers: list = []
    job = JobProcesses()  # the worker processes and process group of this run end with it
    preemption = PreemptionCheckpoint(run_dir / "checkpoints" / "last.ckpt", run.train.preempt_signal,
                                      run.train.log_every, stop_at())
    preemption.install()
    try:
        if ckpt_path:
            rank_zero_only(print)(f"resuming {run_dir} from step {start_step}"
                                  + (f" (it had {plan.previous['status']})" if plan.previous.get("status") else ""))
        load_start = cpu_load()
        torch.set_num_threads(cpu_threads(run.trainer.threads, n_processes(run.trainer)))
        L.seed_everything(run.seed, workers=True, verbose=False)
        with reading_data():
            datamodule = K3DataModule(run.data, seed=run.seed)
            datamodule.prepare_data()
            datamodule.setup("fit")

        model = K3Model(run.model_config(datamodule.vocab_size))
        compile_model(model, run)
        tokens_per_step = run.data.batch_size * run.data.seq_len * n_processes(run.trainer) * run.trainer.num_nodes
        fpt = flops_per_token(model, run.data.seq_len)
        counts = model.param_counts()
        length = run_length(run.train, counts["params_active_non_embedding"], fpt, tokens_per_step)
        optim_cfg = run.optim
        branches, shared = [], {}  # a WSD trunk's branches (k3lab/branches.py); a branch's shared prefix
        if run.train.branches:
            branches = branch_plan(run.train, optim_cfg, length.max_steps, counts["params_active_non_embedding"],
                                   fpt, tokens_per_step)
            optim_cfg = stable_phase(optim_cfg)
            shared = {"branches": [b.budget for b in branches], "branch_steps": [b.start for b in branches]}
        if run.train.trunk:
            start = length.max_steps - decay_steps(optim_cfg, length.max_steps)
            if ckpt_path is None:  # new or restarted: from the trunk's checkpoint at the branch point
                ckpt_path, elapsed = start_from_trunk(run_dir, run.train.trunk, start)
                start_step = start
                summary.add_elapsed(elapsed)
            shared = {"trunk": run.train.trunk, "branch_step": start, "shared_prefix_tokens": start * tokens_per_step,
                      "shared_prefix_flops": start * tokens_per_step * fpt}
        module = K3LitModule(model, optim_cfg, length.max_steps, run.train.log_every,
                             tokens_per_step, fpt, ckpt_every=run.train.ckpt_every)
        module.elapsed_offset = elapsed
        known.update(counts=counts, tokens_per_step=tokens_per_step, fpt=fpt, train_tokens=datamodule.train_tokens,
                     shared_steps=shared.get("branch_step", 0))
        summary.update(n_layers=model.cfg.n_layers, d_model=model.cfg.width, seq_len=run.data.seq_len,
                       tokens_per_step=tokens_per_step, max_steps=length.max_steps, length_from=length.set_by,
                       tokens_per_param=run.train.tokens_per_param, flop_budget=run.train.flop_budget,
                       **shared, **counts, flops_per_token=fpt, unigram_entropy=datamodule.unigram_entropy(),
                       **environment(), **device_sharing(load_start, torch.get_num_threads()))
        if datamodule.lm is not None and rank_zero_only.rank == 0:  # text data: sampling and evals read it there
            summary.update(tokenizer=save_to_run(datamodule.lm.tokenizer, run_dir))
        print_run_header(run, run_dir, counts, fpt, datamodule.unigram_entropy(), tokens_per_step, length)

        if run.logger.wandb is not None:
            summary.update(wandb_id=summary.data.get("wandb_id") or uuid.uuid4().hex[:12])  # one wandb run per directory
        loggers = build_loggers(run, run_dir, tokens_per_step, fpt, start_step, summary.data.get("wandb_id"))
        # a trunk validates at its branch points and its budgets' ends, and keeps its state at each branch point
        validate_at = {step for b in branches for step in (b.start, b.steps) if step <= length.max_steps}
        keep = [KeepBranchPoints(run_dir, [b.start for b in branches])] if branches else []
        trainer = job.trainer = build_trainer(run, run_dir, loggers, datamodule.n_val_batches, length.max_steps,
                                              [preemption, *keep, *probe_callbacks(run, datamodule), *callbacks],
                                              validate_at)
        datamodule.set_start_step(start_step)
        if ckpt_path is None:
            trainer.validate(module, datamodule=datamodule, verbose=False)  # the step-0 point of every curve
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        if trainer.global_step % run.train.val_every and trainer.global_step not in validate_at:
            trainer.validate(module, datamodule=datamodule, verbose=False)
        trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    except BaseException as err:  # noqa: BLE001 - record any failure, including Ctrl-C, then re-raise
        record_failure(summary, err, final_fields(run_dir, **known))
        close_loggers(loggers, failed=True)
        job.end()
        if isinstance(err, Preempted):
            rank_zero_only(print)(f"{run_dir}: {err}")
            preemption.restore()
            if not isinstance(err, StoppedAtDeadline):
                preemption.hand_over()  # under submitit: requeue the job and exit
        raise
    finally:
        preemption.restore()
    close_loggers(loggers, failed=False)
    job.end()
    summary.finish("completed", **final_fields(run_dir, **known),
                   attnres_saturation=attnres_saturation(module.last_depth) if module.last_depth else None,
                   **device_sharing(load_start, torch.get_num_threads()))
    write_metrics_csv(run_dir)
    write_run_plots(run_dir)
    if module.last_depth:
        rank_zero_only(plot_depth_diagnostics)(module.last_depth, run_dir / "plots")
    print_final(summary.data)
    return summary.data


def probe_callbacks(run: RunConfig, datamodule: K3DataModule) -> list[Callback]:
    """The recall probes of probes=recall (k3lab.probes), on the model's vocabulary without its end-of-document
    token; none under probes=none."""
    probes = run.probes
    if probes.name == "none":
        return []
    eod = (datamodule.lm.tokenizer.eod_id,) if datamodule.lm is not None else ()
    return [RecallProbes(probes, probes.resolved_lengths(run.trainer.accelerator), datamodule.vocab_size, eod)]


# "1" in the environment of the processes a run's trainer starts (the other ranks of a DDP or FSDP run on one
# node, which Lightning starts by running the script again with the run's own command): they train that run
ONE_RUN_ENV = "K3LAB_ONE_RUN"


def train_job(cfg: DictConfig, overrides: list[str] = ()) -> dict:
    """What run.py trains for one job: the run and, when it is a WSD trunk (train.branches), then each of its
    cooldown branches in turn, shortest first, each into its own run directory beside the trunk's
    (k3lab/branches.py) and each decided like any run (a completed one skipped, a killed one resumed, a new
    one started from the trunk's branch point). Returns the trunk's summary with `branches`: the
    (run name, outcome, final validation loss) of each branch.

    Each branch trains with its own command in sys.argv, so that the ranks its trainer starts train that
    branch; the ranks the trunk's trainer started train the trunk alone (ONE_RUN_ENV). Processes started from
    outside (torchrun, SLURM) all run this loop, in step. A job started with `resume=<dir>` continues that
    one run."""
    started_by_a_run = os.environ.get(ONE_RUN_ENV) == "1"
    with environ(ONE_RUN_ENV, "1"):
        summary = train(cfg, overrides)
    if started_by_a_run or cfg.resume or not cfg.train.get("branches"):
        return summary
    run_dir = Path(str(cfg.out_dir)) / str(cfg.group) / summary["run_name"]
    done = []
    for budget in sorted(cfg.train.branches):
        branch_cfg, command = branch_run(run_dir, summary, budget, list(overrides), bool(cfg.overwrite))
        with one_job_argv(command, multirun=True), environ(ONE_RUN_ENV, "1"):
            branch = train(branch_cfg, overrides)
        done.append((branch["run_name"], branch["outcome"], branch.get("loss_val_final")))
    return {**summary, "branches": done}


@contextmanager
def environ(key: str, value: str):
    """os.environ[key] = value while the block runs, then as it was."""
    before = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def record_failure(summary: Summary, err: BaseException, fields: dict) -> None:
    """summary.json says `failed` with the error, and metrics.csv mirrors what was logged; when the disk is
    full even that may fail, which is said on stderr while the original error goes on up."""
    try:
        summary.finish("failed", error=f"{type(err).__name__}: {err}", **fields)
        write_metrics_csv(summary.path.parent)
    except OSError as write_err:
        rank_zero_only(print)(f"warning: could not record the failure in {summary.path}: {write_err}", file=sys.stderr)


def quiet_lightning() -> None:
    """Keep the log readable: no Lightning tips or device banners (the run header says it all)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*treespec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    # a cooldown branch starts from its trunk's checkpoint, whose ModelCheckpoint state names the trunk's folder
    warnings.filterwarnings("ignore", message=".*The dirpath has changed from.*")
    # FSDP2 warns that a sublayer returns a view (e.g. MoE's reshape), whose pre-backward hook an in-place op
    # would drop; the residual stream only ever adds sublayer outputs out of place (tests/test_fsdp.py
    # checks every gradient against one process)
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*")


def deterministic_mode(tc: TrainerConfig) -> bool | str:
    """Lightning's ``deterministic`` from trainer.deterministic: null means on for the CPU and off on
    GPUs; true, false and "warn" are passed through (TrainerConfig.check rejects anything else). Lightning
    then calls torch.use_deterministic_algorithms and sets CUBLAS_WORKSPACE_CONFIG."""
    return tc.accelerator == "cpu" if tc.deterministic is None else tc.deterministic


def compile_model(model: nn.Module, run: RunConfig) -> None:
    """model.compile() when compile_mode(cfg) says so, in torch.compile's mode train.compile_mode, with
    train.activation_memory_budget handed to the partitioner that splits each compiled graph into forward and
    backward (torch._functorch.config, a process-wide setting read when a graph is first compiled): at 1 the
    backward keeps what the min-cut partitioner would; below 1 it recomputes the ops cheapest by FLOPs until
    the saved activations fit that share. Under reduce-overhead the forward and backward graphs are recorded
    as CUDA graphs (torch's CUDA graph trees) and replayed, one launch each: the batches have one shape, and
    the step reads nothing back to the host (k3lab.lit), which a recorded graph could not hold."""
    if not compile_mode(run):
        return
    torch._functorch.config.activation_memory_budget = run.train.activation_memory_budget
    model.compile(backend=run.train.compile_backend, mode=run.train.compile_mode)


def build_loggers(run: RunConfig, run_dir: Path, tokens_per_step: int, fpt: float, start_step: int = 0,
                  wandb_id: str | None = None) -> list:
    """metrics.jsonl always (the source); TensorBoard and wandb as mirrors when the logger group names them.

    A resumed run continues its mirrors: TensorBoard drops the events a killed process logged after the
    checkpoint (purge_step), as metrics.jsonl does; wandb continues the run `wandb_id` (summary.json keeps it).
    wandb leaves stdout alone (console="off") and prints only where its files are (quiet), so the log
    stays plain text when it is a file."""
    lc = run.logger
    loggers = [JsonlLogger(run_dir, tokens_per_step, fpt)]
    if lc.tensorboard is not None:
        from lightning.pytorch.loggers import TensorBoardLogger

        loggers.append(TensorBoardLogger(save_dir=str(run_dir), name=lc.tensorboard.dir, version="",
                                         default_hp_metric=False, purge_step=start_step + 1 if start_step else None))
    if lc.wandb is not None:
        import wandb
        from lightning.pytorch.loggers import WandbLogger

        mirror = WandbLogger(project=lc.wandb.project, name=run_dir.name, save_dir=str(run_dir), id=wandb_id,
                             mode=lc.wandb.mode, settings=wandb.Settings(console="off", quiet=True),
                             config=dataclasses.asdict(run))
        mirror._wandb_init.pop("anonymous", None)  # Lightning always passes anonymous=None, which wandb warns about
        loggers.append(mirror)
    return loggers


def close_loggers(loggers: list, failed: bool) -> None:
    """End the wandb run of this run directory (a multirun starts the next one in the same process)."""
    from lightning.pytorch.loggers import WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger) and logger._experiment is not None:
            logger.experiment.finish(exit_code=1 if failed else 0)


class StepCheckpoint(ModelCheckpoint):
    """checkpoints/last.ckpt every `every_n_train_steps` optimizer steps, as ModelCheckpoint, except that at a
    step that also validates (every `val_every`, and the steps of `validate_at`) it is written after the
    validation, through Lightning's own deferral to on_validation_end. Written before it, a run killed during
    that validation would resume after the step and never log the step's validation point."""

    def __init__(self, val_every: int, validate_at: Collection[int] = (), **kwargs):
        super().__init__(**kwargs)
        self.val_every = val_every
        self.validate_at = frozenset(validate_at)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        validates = step % self.val_every == 0 or step in self.validate_at
        if (self._every_n_train_steps > 0 and step % self._every_n_train_steps == 0 and validates
                and trainer.enable_validation and not self._should_skip_saving_checkpoint(trainer)):
            self._defer_save_until_validation = True
            return
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


def build_trainer(run: RunConfig, run_dir: Path, loggers: list, n_val_batches: int, max_steps: int,
                  callbacks: Sequence[Callback] = (), validate_at: Collection[int] = ()) -> L.Trainer:
    """The Lightning trainer of a run of `max_steps` optimizer steps (k3lab.budget.run_length), validating
    every train.val_every steps and after each step of `validate_at` (a WSD trunk's branch points and
    budgets' ends: validate_also_at)."""
    tc, tr = run.trainer, run.train
    ckpt = StepCheckpoint(tr.val_every, validate_at, dirpath=run_dir / "checkpoints", save_last=True,
                          save_top_k=0, every_n_train_steps=tr.ckpt_every, save_on_train_epoch_end=False)
    try:
        trainer = L.Trainer(
            accelerator=tc.accelerator, devices=tc.devices, strategy=build_strategy(tc), num_nodes=tc.num_nodes,
            precision=tc.precision, max_steps=max_steps, max_epochs=-1,
            val_check_interval=tr.val_every, check_val_every_n_epoch=None,
            limit_val_batches=tr.val_batches or n_val_batches, num_sanity_val_steps=0,
            overfit_batches=tr.overfit_batches, logger=loggers, log_every_n_steps=tr.log_every,
            callbacks=[TrainMetrics(), ckpt, progress_callback(max_steps), *callbacks], plugins=[AtomicCheckpointIO()],
            enable_progress_bar=False, enable_model_summary=False, default_root_dir=run_dir,
            deterministic=deterministic_mode(tc),
            # FSDP2's all-gathered parameters cannot be inference tensors (on CUDA its unshard reads their
            # version counter), so sharded runs validate under no_grad instead of inference_mode
            inference_mode=tc.strategy != "fsdp",
        )
    except MisconfigurationException as err:  # Lightning's own check of the trainer settings
        raise ConfigError(f"trainer: {err}") from err
    if validate_at:
        validate_also_at(trainer, validate_at)
    return trainer


def validate_also_at(trainer: L.Trainer, steps: Collection[int]) -> None:
    """Make `trainer` validate after each of `steps` optimizer steps besides its val_check_interval.

    Lightning's Trainer takes one interval; its training loop asks `_should_check_val_fx` after every batch
    whether to validate (where total_batch_idx + 1 is the number of steps done, restored on resume), so
    this trainer's loop has that question widened to the steps given. Lightning's private name: a test
    (tests/test_branches.py) checks the validations land on the steps."""
    steps = frozenset(steps)
    loop = trainer.fit_loop.epoch_loop
    every = loop._should_check_val_fx
    loop._should_check_val_fx = lambda data_fetcher: every(data_fetcher) or loop.total_batch_idx + 1 in steps


def final_fields(run_dir: Path, counts: dict | None = None, tokens_per_step: int = 0, fpt: float = 0.0,
                 train_tokens: int = 0, shared_steps: int = 0) -> dict:
    """The summary.json fields known at the end: length, FLOPs, speed, memory, the final losses and the last
    value of every recall probe, `probe/...` (a run that failed before its model was built has only the losses
    and speed its metrics hold). `steps`, `tokens` and `flops` count from step 0; `*_trained` leave out the
    `shared_steps` a cooldown branch took from its trunk (k3lab/branches.py), so that summed over a sweep they
    count every step once."""
    rows = read_metrics(run_dir)
    val = [r["loss/val"] for r in rows if r.get("loss/val") is not None]
    train_loss = [r["loss/train"] for r in rows if r.get("loss/train") is not None]
    acc = [r["acc/val"] for r in rows if r.get("acc/val") is not None]
    steps = max((r["step"] for r in rows), default=0)
    tokens = steps * tokens_per_step
    speeds = [r["speed/tokens_per_s"] for r in rows if r.get("speed/tokens_per_s")]
    return {
        "steps": steps, "tokens": tokens, "flops": tokens * fpt,
        "steps_trained": steps - shared_steps, "tokens_trained": (steps - shared_steps) * tokens_per_step,
        "flops_trained": (steps - shared_steps) * tokens_per_step * fpt,
        "flops_6nd": 6.0 * counts["params_active_non_embedding"] * tokens if counts else None,
        "epochs": tokens / train_tokens if train_tokens else None,  # passes over the training split (at most ~4)
        "tokens_per_s_median": statistics.median(speeds) if speeds else None,
        "peak_memory_mb": peak_memory_mb(),
        "loss_val_final": val[-1] if val else None, "loss_val_best": min(val) if val else None,
        "loss_train_final": train_loss[-1] if train_loss else None, "acc_val_final": acc[-1] if acc else None,
        **{key: value for r in rows for key, value in r.items() if key.startswith("probe/")},
    }


def peak_memory_mb() -> float:
    """Peak GPU memory allocated by torch on this rank, or the process's peak resident memory on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
