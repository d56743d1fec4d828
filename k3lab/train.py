"""One training run: composed config -> data, model, Lightning trainer -> the run directory.

`run.py` (Hydra) calls `train(cfg)`. Everything a run needs to be analysed or resumed lands in its
run directory (docs/run_directory.md).
"""
from __future__ import annotations

import logging
import re
import resource
import statistics
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from k3lab.config import (BalanceConfig, DataConfig, DecayConfig, GLUConfig, KernelsConfig, MixerConfig,
                          ModelConfig, MoEConfig, OptimConfig, ResidualConfig)
from k3lab.data import K3DataModule
from k3lab.flops import flops_per_token
from k3lab.lit import K3LitModule
from k3lab.model.attnres import plot_diagnostics
from k3lab.model.k3 import K3Model
from k3lab.progress import progress_callback, print_run_header
from k3lab.rundir import AtomicCheckpointIO, JsonlLogger, Summary, environment, read_metrics

SWITCHES = ("decay", "glu", "balance", "optim", "residual", "moe", "mixer")
MODEL_GROUPS = {"decay": DecayConfig, "glu": GLUConfig, "moe": MoEConfig, "balance": BalanceConfig,
                "residual": ResidualConfig, "mixer": MixerConfig}


def typed(schema, node) -> object:
    """OmegaConf node -> dataclass instance; an unknown key or a wrong type raises, naming the key."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), node))


def model_config(cfg: DictConfig, vocab_size: int) -> ModelConfig:
    groups = {name: typed(schema, cfg[name]) for name, schema in MODEL_GROUPS.items()}
    model = OmegaConf.merge(OmegaConf.structured(ModelConfig), cfg.model)
    mc: ModelConfig = OmegaConf.to_object(model)
    for name, value in groups.items():
        setattr(mc, name, value)
    mc.kernels = typed(KernelsConfig, cfg.kernels)
    mc.vocab_size = vocab_size
    return mc.validate()


def default_run_name(overrides: list[str]) -> str:
    """'decay=softplus seed=1' -> 'decay=softplus,seed=1'; no overrides -> 'k3'."""
    skip = ("resume=", "out_dir=", "group=", "run_name=", "overwrite=", "trainer=", "logger=", "hydra")
    kept = sorted(o for o in overrides if not o.startswith(skip))
    return re.sub(r"[^A-Za-z0-9=,._+-]", "_", ",".join(kept)) or "k3"


def find_resume_dir(cfg: DictConfig) -> Path:
    if cfg.resume == "last":
        candidates = sorted(Path(cfg.out_dir).glob("**/checkpoints/last.ckpt"), key=lambda p: p.stat().st_mtime)
        if not candidates:
            raise FileNotFoundError(f"resume=last: no checkpoints/last.ckpt under {Path(cfg.out_dir).resolve()}")
        return candidates[-1].parent.parent
    run_dir = Path(cfg.resume)
    if not (run_dir / "checkpoints" / "last.ckpt").exists():
        raise FileNotFoundError(f"resume={cfg.resume}: no checkpoint at {run_dir / 'checkpoints' / 'last.ckpt'}")
    return run_dir


def prepare_run_dir(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, Path, Path | None]:
    """Returns (config to use, run directory, checkpoint to resume from or None)."""
    if cfg.resume:
        run_dir = find_resume_dir(cfg)
        saved = OmegaConf.load(run_dir / "config.yaml")
        return saved, run_dir, run_dir / "checkpoints" / "last.ckpt"
    run_dir = Path(str(cfg.out_dir)) / str(cfg.group) / str(cfg.run_name or default_run_name(overrides))
    if rank_zero_only.rank != 0:  # a DDP worker that Lightning started from this script: rank 0 owns the directory
        return OmegaConf.merge(cfg, {"run_name": run_dir.name}), run_dir, None
    if (run_dir / "summary.json").exists() and not cfg.overwrite:
        raise FileExistsError(f"run directory {run_dir} exists; pass resume={run_dir} to continue it, "
                              f"overwrite=true to start it again, or run_name=<new name>")
    if cfg.overwrite and run_dir.exists():
        for name in ("metrics.jsonl", "metrics.csv", "summary.json", "checkpoints/last.ckpt"):
            (run_dir / name).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = OmegaConf.merge(cfg, {"run_name": run_dir.name})
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    OmegaConf.save(OmegaConf.create(list(overrides)), run_dir / "overrides.yaml")
    return cfg, run_dir, None


@rank_zero_only
def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """On resume, drop lines logged after the checkpoint, so the resumed run continues one curve."""
    import json

    rows = [r for r in read_metrics(run_dir) if r["step"] <= last_step]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def deterministic_mode(tc: DictConfig) -> bool | str:
    """Lightning's ``deterministic`` from trainer.deterministic: null means on for the CPU and off on
    GPUs; true, false and "warn" are passed through. Lightning then calls
    torch.use_deterministic_algorithms and sets CUBLAS_WORKSPACE_CONFIG."""
    mode = tc.get("deterministic")
    if mode is None:
        return tc.accelerator == "cpu"
    if mode not in (True, False, "warn"):
        raise ValueError(f"trainer.deterministic={mode!r} is not an option; valid options: null, true, false, warn")
    return mode


def build_trainer(cfg: DictConfig, run_dir: Path, loggers: list, n_val_batches: int,
                  callbacks: Sequence[Callback] = ()) -> L.Trainer:
    tc = cfg.trainer
    ckpt = ModelCheckpoint(dirpath=run_dir / "checkpoints", save_last=True, save_top_k=0,
                           every_n_train_steps=cfg.train.ckpt_every, save_on_train_epoch_end=False)
    return L.Trainer(
        accelerator=tc.accelerator, devices=tc.devices, strategy=tc.strategy, num_nodes=tc.num_nodes,
        precision=tc.precision, max_steps=cfg.train.max_steps, max_epochs=-1,
        val_check_interval=cfg.train.val_every, check_val_every_n_epoch=None,
        limit_val_batches=cfg.train.val_batches or n_val_batches, num_sanity_val_steps=0,
        overfit_batches=cfg.train.overfit_batches, logger=loggers, log_every_n_steps=cfg.train.log_every,
        callbacks=[ckpt, progress_callback(cfg.train.max_steps), *callbacks], plugins=[AtomicCheckpointIO()],
        enable_progress_bar=sys.stdout.isatty(), enable_model_summary=False, default_root_dir=run_dir,
        deterministic=deterministic_mode(tc),
    )


def quiet_lightning() -> None:
    """Keep the log readable: no Lightning tips or device banners (the run header says it all)."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=".*treespec.*")
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")


def train(cfg: DictConfig, overrides: list[str] = (), callbacks: Sequence[Callback] = ()) -> dict:
    """One run into its run directory (docs/run_directory.md); extra Lightning callbacks (probes) may ride along."""
    quiet_lightning()
    deterministic_mode(cfg.trainer)  # a bad value fails here, before any run directory exists
    cfg, run_dir, ckpt_path = prepare_run_dir(cfg, list(overrides))
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data_cfg: DataConfig = typed(DataConfig, cfg.data)
    datamodule = K3DataModule(data_cfg, seed=cfg.seed)
    datamodule.prepare_data()
    datamodule.setup("fit")
    mc = model_config(cfg, datamodule.vocab_size)
    optim_cfg: OptimConfig = typed(OptimConfig, cfg.optim)

    world = (cfg.trainer.devices if cfg.trainer.devices != -1 else max(torch.cuda.device_count(), 1))
    tokens_per_step = data_cfg.batch_size * data_cfg.seq_len * world * cfg.trainer.num_nodes
    model = K3Model(mc)
    fpt = flops_per_token(model, data_cfg.seq_len)
    counts = model.param_counts()
    module = K3LitModule(model, optim_cfg, cfg.train.max_steps, cfg.train.log_every, tokens_per_step, fpt)

    summary = Summary(run_dir, {
        "run_name": run_dir.name, "group": cfg.group, "seed": cfg.seed,
        "switches": {s: cfg[s].name for s in SWITCHES}, "model": cfg.model.name, "data": cfg.data.name,
        "kernels": cfg.kernels.backend, "n_layers": mc.n_layers, "d_model": mc.width,
        "seq_len": data_cfg.seq_len, "tokens_per_step": tokens_per_step, "max_steps": cfg.train.max_steps,
        **counts, "flops_per_token": fpt, "unigram_entropy": datamodule.unigram_entropy(),
        **environment(),
    })
    print_run_header(cfg, run_dir, counts, fpt, datamodule.unigram_entropy(), tokens_per_step)

    loggers = [JsonlLogger(run_dir, tokens_per_step, fpt)]
    if cfg.logger.wandb:
        from lightning.pytorch.loggers import WandbLogger

        loggers.append(WandbLogger(project=cfg.logger.project, name=run_dir.name, save_dir=str(run_dir),
                                   offline=cfg.logger.mode == "offline",
                                   config=OmegaConf.to_container(cfg, resolve=True)))
    trainer = build_trainer(cfg, run_dir, loggers, datamodule.n_val_batches, callbacks)
    start_step = 0
    if ckpt_path is not None:
        start_step = torch.load(ckpt_path, map_location="cpu", weights_only=False)["global_step"]
        truncate_metrics(run_dir, start_step)
        module.elapsed_offset = summary.data.get("wall_time_s", 0.0)
        rank_zero_only(print)(f"resuming {run_dir} from step {start_step}")
    datamodule.set_start_step(start_step)
    try:
        if ckpt_path is None:
            trainer.validate(module, datamodule=datamodule, verbose=False)  # the step-0 point of every curve
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
        if trainer.global_step % cfg.train.val_every:
            trainer.validate(module, datamodule=datamodule, verbose=False)
        trainer.save_checkpoint(run_dir / "checkpoints" / "last.ckpt")
    except BaseException as err:  # noqa: BLE001 - record any failure, including Ctrl-C, then re-raise
        summary.finish("failed", error=f"{type(err).__name__}: {err}",
                       **final_fields(run_dir, module, tokens_per_step, fpt, datamodule.train_tokens))
        write_metrics_csv(run_dir)
        if not isinstance(err, KeyboardInterrupt):
            traceback.print_exc()
        raise
    summary.finish("completed", **final_fields(run_dir, module, tokens_per_step, fpt, datamodule.train_tokens))
    write_metrics_csv(run_dir)
    write_run_plots(run_dir)
    if module.last_depth:
        rank_zero_only(plot_diagnostics)(module.last_depth, run_dir / "plots")
    print_final(summary.data)
    return summary.data


def final_fields(run_dir: Path, module: K3LitModule, tokens_per_step: int, fpt: float, train_tokens: int) -> dict:
    rows = read_metrics(run_dir)
    val = [r["loss/val"] for r in rows if r.get("loss/val") is not None]
    train_loss = [r["loss/train"] for r in rows if r.get("loss/train") is not None]
    acc = [r["acc/val"] for r in rows if r.get("acc/val") is not None]
    steps = max((r["step"] for r in rows), default=0)
    tokens = steps * tokens_per_step
    non_emb = module.model.param_counts()["params_active_non_embedding"]
    speeds = [r["speed/tokens_per_s"] for r in rows if r.get("speed/tokens_per_s")]
    return {
        "steps": steps, "tokens": tokens, "flops": tokens * fpt, "flops_6nd": 6.0 * non_emb * tokens,
        "epochs": tokens / train_tokens,  # passes over the training split (DESIGN: at most about 4)
        "tokens_per_s_median": statistics.median(speeds) if speeds else None,
        "peak_memory_mb": peak_memory_mb(),
        "loss_val_final": val[-1] if val else None, "loss_val_best": min(val) if val else None,
        "loss_train_final": train_loss[-1] if train_loss else None, "acc_val_final": acc[-1] if acc else None,
    }


def peak_memory_mb() -> float:
    """Peak GPU memory allocated by torch on this rank, or the process's peak resident memory on CPU."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


@rank_zero_only
def write_metrics_csv(run_dir: Path) -> None:
    """metrics.csv, a mirror of metrics.jsonl for spreadsheet users (one column per key)."""
    import pandas as pd

    rows = read_metrics(run_dir)
    if rows:
        pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)


@rank_zero_only
def write_run_plots(run_dir: Path) -> None:
    """Per-run figures in <run_dir>/plots: the loss curves, and MoE MaxVio when the model routes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir)
    (run_dir / "plots").mkdir(exist_ok=True)
    panels = [("loss", ["loss/train", "loss/val"]), ("maxvio", ["moe/maxvio"])]
    for name, keys in panels:
        series = {k: [(r["step"], r[k]) for r in rows if r.get(k) is not None] for k in keys}
        if not any(series.values()):
            continue
        fig, ax = plt.subplots(figsize=(5, 3.2))
        for k, pts in series.items():
            if pts:
                ax.plot(*zip(*pts), label=k, marker="." if k == "loss/val" else None)
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        if name == "maxvio":
            ax.set_yscale("log")
        ax.set_title(run_dir.name, fontsize=8)
        ax.legend()
        fig.tight_layout()
        fig.savefig(run_dir / "plots" / f"{name}.png", dpi=110)
        plt.close(fig)


@rank_zero_only
def print_final(s: dict) -> None:
    if s.get("loss_val_final") is None:
        print(f"done: no validation loss, {s['steps']} steps, {s['wall_time_s']:.0f} s")
        return
    gap = s["unigram_entropy"] - s["loss_val_final"]
    where = f"{gap:.3f} nats below" if gap >= 0 else f"{-gap:.3f} nats above"
    print(f"done: val loss {s['loss_val_final']:.4f} ({where} the unigram entropy {s['unigram_entropy']:.4f}), "
          f"{s['steps']} steps, {s['tokens']:,} tokens, {s['wall_time_s']:.0f} s")
