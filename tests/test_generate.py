"""Decoding from caches (k3lab.model K3Model.forward(..., cache=)) and `python -m k3lab.generate`: the
prompt in one call and then one token per call give the logits of the full forward on the same tokens."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from k3lab.config import DecayConfig, MixerConfig, ModelConfig, ResidualConfig
from k3lab.generate import generate, load_run, main, sample_next
from k3lab.model.k3 import K3Model
from k3lab.model.kda import KDACache
from k3lab.model.mla import MLACache

ROOT = Path(__file__).resolve().parents[1]
VOCAB, T, PROMPT = 97, 100, 70  # a prompt longer than one KDA chunk (64), then 30 steps of one token
EPS32 = torch.finfo(torch.float32).eps


def hybrid(decay: str, residual: str, mixer: str = "hybrid") -> K3Model:
    """A 4-layer model (hybrid: KDA, KDA, KDA, MLA; MoE from layer 1) with every parameter that is zero at
    initialisation made random: AttnRes pseudo-queries (a uniform mix would hide a wrong source) and router
    biases (they select the experts)."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=4, d_model=64, head_dim=32, vocab_size=VOCAB)
    cfg.decay, cfg.residual, cfg.mixer = DecayConfig(name=decay), ResidualConfig(name=residual), MixerConfig(name=mixer)
    model = K3Model(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "queries" in name:
                p.normal_(0.0, 1.0)
        for moe in model.moe_layers():
            moe.router.bias.normal_(0.0, 0.05)
    return model


def decode(model: K3Model, tokens: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits [B, T, V] from the first `prompt` tokens in one cached call, then one token per call."""
    cache = model.empty_cache(tokens.shape[0])
    parts = [model(tokens[:, :prompt], cache=cache)]
    parts += [model(tokens[:, t:t + 1], cache=cache) for t in range(prompt, tokens.shape[1])]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("residual", ["standard", "block_attnres", "full_attnres"])
@pytest.mark.parametrize("decay", ["sigmoid", "softplus"])
def test_decode_equals_forward(decay, residual):
    """fp64: the two paths are the same math, so they agree to the one fp32 rounding of the returned logits
    (at most one ulp of the largest, eps32 * max|logit|). fp32: the cached path rounds differently (KDA's
    recurrence against its chunkwise form, MLA's absorbed up-projections against attention over k and v), so
    its distance from the fp64 logits is bounded by a small multiple of the full fp32 forward's own."""
    tokens = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    model = hybrid(decay, residual)
    with torch.no_grad():
        model.double()
        full64, cached64 = model(tokens), decode(model, tokens, PROMPT)
        model.float()
        full32, cached32 = model(tokens), decode(model, tokens, PROMPT)
    scale = full64.abs().max().item()
    assert (cached64 - full64).abs().max().item() <= 2 * EPS32 * scale
    forward_error = (full32.double() - full64.double()).abs().max().item()
    assert 0 < forward_error < 1e-4 * scale
    assert (cached32.double() - full64.double()).abs().max().item() <= 4 * forward_error


@pytest.mark.parametrize("mixer", ["kda", "mla"])
def test_decode_equals_forward_single_mixer(mixer):
    tokens = torch.randint(0, VOCAB, (1, 80), generator=torch.Generator().manual_seed(2))
    model = hybrid("sigmoid", "block_attnres", mixer).double()
    with torch.no_grad():
        assert (decode(model, tokens, 1) - model(tokens)).abs().max().item() <= 2 * EPS32 * model(tokens).abs().max()


def test_cache_memory():
    """KDA's cache has the same size after any number of tokens; MLA's grows by the latent width r per token
    (not the 2 H d of keys and values)."""
    model = hybrid("sigmoid", "standard")
    cache = model.empty_cache(1)
    with torch.no_grad():
        model(torch.zeros(1, 5, dtype=torch.long), cache=cache)
        sizes = [c.state.numel() + sum(x.numel() for x in c.conv) for c in cache if isinstance(c, KDACache)]
        model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert sizes == [c.state.numel() + sum(x.numel() for x in c.conv) for c in cache if isinstance(c, KDACache)]
    (mla,) = [c for c in cache if isinstance(c, MLACache)]
    assert mla.latent.shape == (1, 6, model.cfg.kv_rank)


def test_generate_greedy_is_the_forward_argmax():
    model = hybrid("softplus", "block_attnres")
    prompt = [0, 5, 17, 3]
    out = generate(model, prompt, 12, temperature=0)
    with torch.no_grad():
        for i, token in enumerate(out):
            assert token == model(torch.tensor([prompt + out[:i]]))[0, -1].argmax().item()
    assert generate(model, prompt, 12, temperature=0, end_id=out[3]) == out[:out.index(out[3])]
    assert generate(model, prompt, 12, temperature=0, stop=lambda ids: len(ids) == 5) == out[:5]


def test_sample_next():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0]]).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, 0, 0, gen).eq(1).all()
    assert sample_next(logits, 1.0, 1, gen).eq(1).all()
    top2 = sample_next(logits, 1.0, 2, gen)
    assert set(top2.tolist()) == {1, 3}
    # p(1) = e^3 / (e^3 + e^2) = 0.731 among the top 2; 4 standard deviations of 4000 draws is 0.028
    assert abs(top2.eq(1).double().mean().item() - 0.731) < 0.028
    again = sample_next(logits, 1.0, 0, torch.Generator().manual_seed(5))
    assert again.equal(sample_next(logits, 1.0, 0, torch.Generator().manual_seed(5)))
    assert set(again.tolist()) == {0, 1, 2, 3}


def test_cli(trained_run, capsys):
    """A trained run samples through the command line: each prompt, then its greedy continuation by
    `generate` on the prompt's ids (the end-of-document id first); a bad run directory is one line."""
    prompts = ["line 3 of", "says"]
    cmd = [sys.executable, "-m", "k3lab.generate", str(trained_run), "--prompt", prompts[0], "--prompt", prompts[1],
           "--max-tokens", "8", "--temperature", "0"]
    lines = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()
    run = load_run(trained_run)
    tok = run.tokenizer
    assert lines == [p + tok.decode(generate(run.model, [tok.eod_id, *tok.encode(p)], 8, temperature=0,
                                             end_id=tok.eod_id)) for p in prompts]
    assert main([str(trained_run.parent), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no config.yaml" in err
