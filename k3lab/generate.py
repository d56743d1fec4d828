"""`python -m k3lab.generate RUN_DIR --prompt ...`: sample text from a run's checkpoint.

    python -m k3lab.generate runs/default/k3 --prompt "Fellow citizens" --max-tokens 60
    python -m k3lab.generate runs/default/k3 --prompt "The economy" --prompt "Our army" --temperature 0.8 --top-k 40

The run directory is all it reads: config.yaml (the model), checkpoints/last.ckpt (the weights) and the
tokenizer the run kept (summary.json's `tokenizer`, k3lab.data.tokenizer.save_to_run). Decoding runs each
layer in its inference form (`K3Model.forward(..., cache=)`): KDA continues from its recurrent state and its
short convs' last inputs, constant memory per token; MLA attends over its cache of latents; AttnRes mixes
over depth at each position as in training; MoE routes with the router biases as trained. The prompt is
read in one call (KDA's chunkwise form), then one token per call. A prompt starts a document: its tokens
follow one end-of-document token, as every document does in training. A sequence ends at the
end-of-document token or after --max-tokens. --temperature 0 decodes greedily; --top-k keeps the k most
likely tokens before sampling; --seed fixes the draws.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from k3lab.config import run_config
from k3lab.data.tokenizer import Tokenizer, load_from_run
from k3lab.errors import UserError, prog_error
from k3lab.model import K3Model
from k3lab.rundir import read_summary

PROG = "python -m k3lab.generate"
CHECKPOINT = Path("checkpoints") / "last.ckpt"


@dataclass
class LoadedRun:
    """A run directory's model (eval mode, its checkpoint's weights) with what it was trained on."""
    run_dir: Path
    cfg: DictConfig            # the run's config.yaml
    model: K3Model
    tokenizer: Tokenizer | None  # None for data without text (mqar)
    step: int                  # the optimizer step of the checkpoint
    checkpoint: Path


def load_run(run_dir: str | Path, device: str | torch.device = "cpu") -> LoadedRun:
    """The model of `run_dir` from its config.yaml and checkpoints/last.ckpt, in eval mode on `device`. The
    kernel backend is `auto` whatever the run trained with (Triton on CUDA, PyTorch on the CPU): the same
    math, in the form the device runs. A UserError says what is missing."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").exists():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml)")
    ckpt_path = run_dir / CHECKPOINT
    if not ckpt_path.exists():
        raise UserError(f"{run_dir} has no checkpoint ({CHECKPOINT}): the run has not saved one yet")
    if ckpt_path.is_dir():
        raise UserError(f"{ckpt_path} is a sharded checkpoint (trainer=fsdp); gather it into one file first "
                        "(docs/run_directory.md, 'Sharded checkpoints')")
    cfg = OmegaConf.load(run_dir / "config.yaml")
    ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    weights = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    run = run_config(cfg)
    run.kernels.backend = "auto"
    model = K3Model(run.model_config(vocab_size=weights["embed.weight"].shape[0]))
    model.load_state_dict(weights)
    entry = read_summary(run_dir).get("tokenizer")
    tokenizer = load_from_run(run_dir, entry) if entry else None
    return LoadedRun(run_dir, cfg, model.to(device).eval(), tokenizer, int(ckpt["global_step"]), ckpt_path)


def sample_next(logits: torch.Tensor, temperature: float, top_k: int,
                generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] -> token ids [B]: the argmax at temperature 0, else a draw from softmax(logits / temperature)
    over the top_k most likely tokens (all of them when top_k is 0)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)[:, 0]


@torch.no_grad()
def generate(model: K3Model, prompt: Sequence[int], max_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
             generator: torch.Generator | None = None, end_id: int | None = None,
             stop: Callable[[list[int]], bool] | None = None) -> list[int]:
    """The ids that follow `prompt` (its ids, the end-of-document id first): at most max_tokens, ending before
    `end_id` or as soon as `stop(ids so far)` is true. The prompt goes through the model in one call, then
    every new token in a call of its own, each layer continuing from its cache."""
    device = model.embed.weight.device
    tokens = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    cache = model.empty_cache(1)
    last = torch.zeros_like(tokens, dtype=torch.bool)
    last[:, -1] = True
    logits = model(tokens, logits_at=last, cache=cache)                       # [1, V]
    out: list[int] = []
    for _ in range(max_tokens):
        token = sample_next(logits, temperature, top_k, generator)
        if token.item() == end_id:
            break
        out.append(int(token.item()))
        if stop is not None and stop(out):
            break
        logits = model(token[:, None], cache=cache)[:, -1]
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Sample text from a run's checkpoint (docs/evals.md).")
    p.add_argument("run_dir", help="a run directory with checkpoints/last.ckpt")
    p.add_argument("--prompt", action="append", required=True, help="text to continue (repeat for several)")
    p.add_argument("--max-tokens", type=int, default=100, help="tokens to generate at most (default 100)")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy (default 1)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p


def check_args(args: argparse.Namespace) -> None:
    for flag, value, low in (("--max-tokens", args.max_tokens, 1), ("--top-k", args.top_k, 0),
                             ("--temperature", args.temperature, 0)):
        if value < low:
            raise UserError(f"argument {flag}: {value!r} must be >= {low}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        run = load_run(args.run_dir, args.device)
        if run.tokenizer is None:
            raise UserError(f"{args.run_dir} trained on data={run.cfg.data.name}, which has no text tokenizer")
        generator = torch.Generator(args.device).manual_seed(args.seed)
        for prompt in args.prompt:
            ids = generate(run.model, [run.tokenizer.eod_id, *run.tokenizer.encode(prompt)], args.max_tokens,
                           temperature=args.temperature, top_k=args.top_k, generator=generator,
                           end_id=run.tokenizer.eod_id)
            print(prompt + run.tokenizer.decode(ids), flush=True)
    except UserError as err:
        return prog_error(PROG, err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
