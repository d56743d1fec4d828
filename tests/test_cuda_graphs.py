"""train.compile_mode=reduce-overhead (CUDA graphs of the compiled forward and backward) on a GPU: the graphed
steps follow the compiled and the eager curves. Where it cannot run (the CPU) it is refused, and its
plumbing is tested on the CPU (tests/test_train.py, tests/test_messages.py)."""
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from k3lab.rundir import read_metrics
from k3lab.train import train

ROOT = Path(__file__).resolve().parents[1]
# bf16 keeps 8 significant bits: one rounding of a value moves it by at most 2^-8 of itself
BF16_ULP = 2.0**-8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_steps_follow_the_compiled_and_the_eager_curve(tmp_path, monkeypatch):
    """The study's ladder model at depth 4 (Triton KDA, gated MLA, latent MoE with Quantile Balancing, Full
    AttnRes) on MQAR, 20 deterministic bf16-mixed steps three times: eager, compiled, and compiled with CUDA
    graphs. The graphed run records its graphs without a skip (a graph inductor declines to record raises,
    with its reason) and replays the compiled run's kernels, so its loss stays within one bf16 rounding of the compiled
    run's at every step. Against eager (other kernels, other roundings) the first step's loss, same weights
    and batch, agrees within two bf16 roundings, and the curve within four on average over the steps."""
    import torch._inductor.config
    from torch._dynamo.utils import counters

    monkeypatch.setattr(torch._inductor.config.triton, "cudagraph_or_error", True)  # a skip raises, saying why

    common = ["trainer=gpu", "trainer.deterministic=true", "model=ladder", "model.n_layers=4", "residual.n_blocks=8",
              "data=mqar", "data.batch_size=16", "train.max_steps=20", "train.log_every=1", "train.val_every=20",
              "train.val_batches=1", "train.ckpt_every=0", f"out_dir={tmp_path}", "group=graphs"]
    variants = {"eager": ["train.compile=false"], "compiled": ["train.compile=true"],
                "graphed": ["train.compile=true", "train.compile_mode=reduce-overhead"]}
    losses = {}
    for name, extra in variants.items():
        args = [*common, *extra, f"run_name={name}"]
        torch._dynamo.reset()
        counters.clear()
        with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=args)
        summary = train(cfg, overrides=args)
        assert summary["status"] == "completed", summary
        if name == "graphed":
            assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
        losses[name] = torch.tensor([r["loss/train"] for r in read_metrics(tmp_path / "graphs" / name)
                                     if "loss/train" in r], dtype=torch.float64)
    graphed, compiled, eager = losses["graphed"], losses["compiled"], losses["eager"]
    assert len(graphed) == len(compiled) == len(eager) == 20
    assert ((graphed - compiled).abs() <= BF16_ULP * compiled.abs()).all(), (graphed, compiled)
    assert abs(graphed[0] - eager[0]) <= 2 * BF16_ULP * eager[0], (graphed[0], eager[0])
    assert (graphed - eager).abs().mean() <= 4 * BF16_ULP * eager.mean(), (graphed, eager)
