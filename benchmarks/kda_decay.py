"""How far the KDA decay falls inside the kernels' 16-token sub-blocks while a model trains.

    python -m benchmarks.kda_decay trainer=gpu model=small decay=softplus --steps 30 --every 10

The Triton kernels (``kernels/kda/triton_fwd.py``) run a 16-token sub-block's diagonal block inside
one tensor-core product split at its middle row only for a gate bounded below (the sigmoid map,
g >= -5: a sub-block decays by at most 75 nats, every factor within e^+-40); an unbounded gate
(softplus) takes two masked products per diagonal block instead, with a per-token clamp. This trains
the bare loop of ``benchmarks.step`` (same model, optimizer, data and precision, eager) and, every
--every steps, runs one forward of that step's batch with a hook on each KDA layer's gate. For the
decay D of a sub-block and channel, D = -(g_1 + ... + g_15) over its rows, it prints the share of
chunks with some D > 75 (where the sigmoid's single split would not hold), the share of sub-blocks and
of (sub-block, channel) pairs with D > 75, the share of sub-blocks with some D > 160 (nor a split at the
sub-block's mid value, exp(+-80) in fp32) and D's quantiles over sub-blocks (their largest channel).
"""
from __future__ import annotations

import argparse
import shlex

import torch

from benchmarks.step import compose_config, device_of, precision_of, training_batches, training_step
from benchmarks.table import markdown
from k3lab.config import OptimConfig, run_config
from k3lab.model import K3Model
from k3lab.model.kda import KDA
from k3lab.optim import build_optimizer

SUB_BLOCK, CHUNK = 16, 64
BOUNDS = (75.0, 160.0)


def sub_block_decay(g: torch.Tensor) -> torch.Tensor:
    """g [B, T, H, K] log-decay (T a multiple of 64) -> D [B, H, T // 16, K]: -(sum of g over rows 1..15)
    of each 16-token sub-block, per channel."""
    B, T, H, K = g.shape
    blocks = g.float().view(B, T // SUB_BLOCK, SUB_BLOCK, H, K)[:, :, 1:].sum(2)   # [B, NS, H, K]
    return -blocks.permute(0, 2, 1, 3)


def decay_stats(decays: list[torch.Tensor]) -> dict[str, float]:
    """The shares and quantiles this module prints, over the layers' D tensors ([B, H, NS, K] each)."""
    d = torch.cat([x.flatten(0, 1) for x in decays])                    # [rows, NS, K]
    worst = d.amax(-1)                                                   # [rows, NS] largest channel
    per_chunk = worst.view(worst.shape[0], -1, CHUNK // SUB_BLOCK).amax(-1)
    q = torch.quantile(worst.flatten()[: 2**24], torch.tensor([0.5, 0.9, 0.99], device=worst.device))
    lo, hi = BOUNDS
    return {"chunks > 75": (per_chunk > lo).float().mean().item(),
            "sub-blocks > 75": (worst > lo).float().mean().item(),
            "pairs > 75": (d > lo).float().mean().item(),
            "sub-blocks > 160": (worst > hi).float().mean().item(),
            "D p50": q[0].item(), "D p90": q[1].item(), "D p99": q[2].item()}


def main(argv=None) -> str:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kda_decay", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30, help="training steps")
    p.add_argument("--every", type=int, default=10, help="measure at step 0 and every this many steps")
    p.add_argument("overrides", nargs="*", help="run.py overrides (the shape and the switches)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.every < 1:
        p.error("--steps and --every must be >= 1")
    cfg = compose_config([*args.overrides, "train.compile=false"])
    if cfg.data.seq_len % CHUNK:
        p.error(f"data.seq_len={cfg.data.seq_len}: this diagnostic needs a multiple of {CHUNK}")
    device = device_of(cfg)
    torch.manual_seed(cfg.seed)
    dm, batches = training_batches(cfg, args.steps + 1, device)
    dtype, autocast = precision_of(cfg, device)
    model = K3Model(run_config(cfg).model_config(dm.vocab_size)).to(device=device, dtype=dtype)
    layers = [m for m in model.modules() if isinstance(m, KDA)]
    if not layers:
        p.error("the model has no KDA layer (mixer=mla?)")
    optim_cfg: OptimConfig = run_config(cfg).optim
    opt, sched = build_optimizer(model, optim_cfg, total_steps=args.steps)
    clip = optim_cfg.grad_clip if optim_cfg.grad_clip > 0 else float("inf")
    decays: list[torch.Tensor] = []

    def gate_hook(layer: KDA, inputs, _output):
        z = layer.f_up(layer.f_down(inputs[0]))
        B, T, _ = z.shape
        decays.append(sub_block_decay(layer.log_decay(z.view(B, T, layer.n_heads, layer.head_dim))))

    rows = []
    for step, (x, y) in enumerate(batches):
        if step % args.every == 0 or step == args.steps:
            handles = [m.register_forward_hook(gate_hook) for m in layers]
            with torch.no_grad(), autocast:
                model(x, y)
            for h in handles:
                h.remove()
            s = decay_stats(decays)
            decays.clear()
            rows.append({"step": step, **{k: f"{v:.1%}" if "D " not in k else f"{v:.1f}" for k, v in s.items()}})
            print(f"  step {step}: " + ", ".join(f"{k} {v}" for k, v in rows[-1].items() if k != "step"), flush=True)
        if step == args.steps:
            break
        training_step(model, opt, sched, clip, autocast, x, y)
    text = f"KDA sub-block decay, {shlex.join(args.overrides)}\n\n{markdown(rows)}\n"
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
