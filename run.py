"""k3lab entry point.

    python run.py                                   # K3 default, tiny model, sotu corpus, CPU
    python run.py decay=softplus glu=swiglu seed=1  # flip switches
    python run.py -m decay=sigmoid,softplus seed=0,1,2 group=decay   # a sweep (one run directory each)
    python run.py resume=last                       # continue the most recent killed run
    python run.py -m sweep=ablate_decay             # a sweep from sweeps/; the same command again skips
                                                    # completed runs and resumes killed or failed ones
    python run.py trainer=fsdp                      # FSDP2 over every GPU of the node (trainer=ddp: DDP)

Each run writes <out_dir>/<group>/<run_name>/ (docs/run_directory.md).
"""
import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    from k3lab.parallel import one_job_argv  # imported here so `--help` and config errors come back fast
    from k3lab.train import train

    job = HydraConfig.get()
    with one_job_argv(list(job.overrides.task), multirun=job.mode == RunMode.MULTIRUN):  # DDP/FSDP workers
        summary = train(cfg, overrides=job.overrides.task)
    return {key: summary.get(key) for key in ("outcome", "status", "loss_val_final", "run_name")}


if __name__ == "__main__":
    main()
