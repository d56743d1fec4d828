"""k3lab entry point.

    python run.py                                   # K3 default, tiny model, sotu corpus, CPU
    python run.py decay=softplus glu=swiglu seed=1  # flip switches
    python run.py -m decay=sigmoid,softplus seed=0,1,2 group=decay   # a sweep (one run directory each)
    python run.py resume=last                       # continue the most recent unfinished run
    python run.py resume=runs/default/decay=softplus,seed=1   # continue that run (a path as k3lab prints it)
    python run.py -m sweep=ablate_decay             # a sweep from sweeps/; the same command again skips
                                                    # completed runs and resumes killed or failed ones
    python run.py trainer=fsdp                      # FSDP2 over every GPU of the node (trainer=ddp: DDP)
    python run.py optim.schedule=wsd train.tokens_per_param=20 'train.branches=[5,10,20]'
                                                    # a stable trunk, then a cooldown branch per budget
    python run.py --help                            # every group, its options and its default

Each run writes <out_dir>/<group>/<run_name>/ (docs/run_directory.md). A bad key, option or value
prints one line `error: ...` and exits with status 2 (k3lab/errors.py; HYDRA_FULL_ERROR=1 for the traceback).
"""
import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from k3lab.config import check_config
from k3lab.errors import run_command, task_errors
from k3lab.help import register as register_help_page


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    job = HydraConfig.get()
    with task_errors(single_run=job.mode == RunMode.RUN):
        check_config(cfg, job.overrides.task)  # before torch and Lightning are imported: fails in a second
        from k3lab.parallel import one_job_argv
        from k3lab.preempt import StoppedAtDeadline
        from k3lab.train import train_job

        with one_job_argv(list(job.overrides.task), multirun=job.mode == RunMode.MULTIRUN):  # DDP/FSDP workers
            try:
                summary = train_job(cfg, overrides=job.overrides.task)
            except StoppedAtDeadline as stop:  # K3LAB_STOP_AT: the sweep's table says so, and its next job
                if job.mode != RunMode.MULTIRUN:  # does not start either
                    raise
                return {"outcome": "stopped", "message": str(stop)}
    return {key: summary.get(key) for key in ("outcome", "status", "loss_val_final", "run_name", "branches")}


def quote_paths(argv: list[str]) -> list[str]:
    """`resume=<run dir>` with the value quoted for Hydra's override grammar: the project's own run names
    hold `=` and `,` (`runs/default/decay=softplus,seed=1`), which the grammar would read as syntax."""
    quoted = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if key == "resume" and sep and value and value[0] not in "'\"":
            value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
        quoted.append(f"{key}{sep}{value}")
    return quoted


if __name__ == "__main__":
    import faulthandler
    import sys

    faulthandler.enable()  # a process that crashes in native code (a worker rank too) leaves its Python stack
    sys.argv = [sys.argv[0], *quote_paths(sys.argv[1:])]
    register_help_page()
    run_command(main)
