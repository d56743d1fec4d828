"""Why does Quantile Balancing's MaxVio lag? Split the next step's imbalance into its causes.

    OMP_NUM_THREADS=1 python -m benchmarks.qb_lag --out qb_lag.jsonl train.max_steps=150 group=qb_lag

Trains like ``run.py`` (same overrides) with a probe that, after every optimizer step and the bias
update it triggers, re-routes the step's own batch, per MoE layer. With S the router scores of the
step's forward, b the bias it routed with, b1 the K3 update of b on S (arXiv:2607.24653 eqs. 13-14) and
b* the fixed point of that update on S (iterated 50 times):

    actual        MaxVio(S, b)             what the step routed with (the logged moe/maxvio)
    own_update    MaxVio(S, b1)            one K3 update, in sample (its cutoffs moved with the bias)
    own_fixed     MaxVio(S, b*)            the best any bias does on this batch
    drift_both    MaxVio(S', b*)           the same batch after the optimizer step
    drift_router  MaxVio(s(x W'), b*)      the router's new weights on the old inputs x
    drift_input   MaxVio(s(x' W), b*)      the old weights on the new inputs x' (the residual stream moved)
    next_fixed    MaxVio(S_next, b*)       the next step's batch with this step's b*

(MaxVio = max_j load_j / mean load - 1, arXiv:2408.15664; means over the MoE layers). Means over four
step ranges are printed at the end; with ``--out PATH`` one JSON row per step also goes to PATH.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import Callback

from benchmarks.table import markdown
from k3lab.model.moe import MoE
from k3lab.model.router import QuantileBalance, expert_load, max_violation, route
from k3lab.train import train

ROOT = Path(__file__).resolve().parents[1]

KEYS = ["actual", "own_update", "own_fixed", "drift_both", "drift_router", "drift_input", "next_fixed"]


def maxvio(scores: torch.Tensor, bias: torch.Tensor, k: int) -> float:
    return max_violation(expert_load(route(scores, bias, k).idx, scores.shape[1]))


def fixed_point(scores: torch.Tensor, bias: torch.Tensor, k: int, iters: int = 50) -> torch.Tensor:
    """The K3 update iterated on one batch's scores (QuantileBalance with `iters`), from `bias`."""
    qb = QuantileBalance(scores.shape[1], k, iters=iters)
    qb.observe(route(scores, bias, k), bias)
    return qb.update(bias)


class QBLagProbe(Callback):
    """Records, per MoE router, the inputs, scores, bias and weights of its last forward (hooks), and
    after each training step computes the quantities of the module docstring."""

    def __init__(self, out: Path | None = None):
        self.out, self.rows, self.last, self.prev_fixed = out, [], {}, {}

    def on_fit_start(self, trainer, pl_module):
        self.layers = [m for m in pl_module.model.modules() if isinstance(m, MoE)]
        for m in self.layers:
            m.router.register_forward_hook(self._hook)

    def _hook(self, router, inputs, routing):
        self.last[router] = (inputs[0].detach().float(), routing.scores.detach(), router.bias.clone(),
                             router.weight.detach().float().clone())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        before = dict(self.last)                      # the step's own forward
        pl_module.eval()
        with torch.no_grad():
            pl_module.model(batch[0])                 # the same batch, after the optimizer step
        pl_module.train()
        row = {"step": trainer.global_step, "lr": trainer.optimizers[0].param_groups[0]["lr"]}
        values = {key: [] for key in KEYS}
        for m in self.layers:
            k, router = m.top_k, m.router
            x, S, b, W = before[router]
            x2, S2, _, W2 = self.last[router]
            b1 = router.bias.float()
            b_star = fixed_point(S, b1, k)
            values["actual"].append(maxvio(S, b, k))
            values["own_update"].append(maxvio(S, b1, k))
            values["own_fixed"].append(maxvio(S, b_star, k))
            values["drift_both"].append(maxvio(S2, b_star, k))
            values["drift_router"].append(maxvio(torch.sigmoid(x @ W2.T), b_star, k))
            values["drift_input"].append(maxvio(torch.sigmoid(x2 @ W.T), b_star, k))
            if router in self.prev_fixed:
                values["next_fixed"].append(maxvio(S, self.prev_fixed[router], k))
            self.prev_fixed[router] = b_star
        row.update({key: statistics.mean(v) for key, v in values.items() if v})
        self.rows.append(row)
        if self.out is not None:
            with open(self.out, "a") as f:
                f.write(json.dumps(row) + "\n")

    def summary(self) -> str:
        """Means over four equal step ranges, as a markdown table."""
        n = len(self.rows)
        cuts = [round(i * n / 4) for i in range(5)]
        rows = []
        for lo, hi in zip(cuts, cuts[1:]):
            part = self.rows[lo:hi]
            if not part:
                continue
            means = {key: f"{statistics.mean(r[key] for r in part if key in r):.3f}" if any(key in r for r in part)
                     else "nan" for key in KEYS}
            rows.append({"steps": f"{part[0]['step']}-{part[-1]['step']}", **means})
        return markdown(rows, ["steps", *KEYS])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.qb_lag", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, metavar="PATH", help="also write one JSON row per step to PATH")
    p.add_argument("overrides", nargs="*", help="run.py overrides (default model, balance=qb)")
    args = p.parse_args(argv)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.unlink(missing_ok=True)
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=args.overrides)
    probe = QBLagProbe(args.out)
    train(cfg, overrides=args.overrides, callbacks=[probe])
    print(probe.summary())


if __name__ == "__main__":
    main()
