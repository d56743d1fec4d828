"""Each switch changes what it names and nothing else.

For a switch option against the K3 default at the same seed: the parameter names, shapes and initial
values are identical except for the tensors the option owns, and the computation differs only in the
part the option names (checked by capturing the inputs of the sequence-mixing kernel, or by comparing
with the formula).
"""
import pytest
import torch
import torch.nn.functional as F

import k3lab.model.kda as kda_module
from k3lab.config import DecayConfig, GLUConfig, ModelConfig, OptimConfig
from k3lab.model.ffn import situ, softcap
from k3lab.model.k3 import K3Model
from k3lab.model.tags import named_tags
from k3lab.optim import build_optimizer

VOCAB = 97


def tiny(**overrides) -> ModelConfig:
    cfg = ModelConfig(n_layers=4, d_model=64, head_dim=32, vocab_size=VOCAB, kernels=ModelConfig().kernels)
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


def build(seed: int = 0, **overrides) -> K3Model:
    torch.manual_seed(seed)
    return K3Model(tiny(**overrides))


def state(model: K3Model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def batch(seed: int = 1, B: int = 2, T: int = 40) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def loss_of(model: K3Model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def differing(a: dict, b: dict) -> set[str]:
    return {k for k in a.keys() & b.keys() if a[k].shape != b[k].shape or not torch.equal(a[k], b[k])}


def test_same_seed_same_init_and_seed_changes_it():
    assert not differing(state(build(0)), state(build(0)))
    random_init = {n for n, p in build(0).named_parameters() if p.ndim >= 2 or n.endswith("dt_bias")}
    assert differing(state(build(0)), state(build(1))) == random_init


def test_decay_softplus_owns_only_the_decay_scale():
    base, soft = state(build()), state(build(decay=DecayConfig(name="softplus")))
    assert set(base) == set(soft)
    # same parameters; only A_h starts elsewhere (0 vs log U(1, 16)); dt_bias starts equal in both maps
    assert differing(base, soft) == {k for k in soft if k.endswith("A_log")} != set()


def test_decay_changes_only_the_gate_fed_to_the_kernel(monkeypatch):
    captured = {}
    real = kda_module.kda

    def spy(q, k, v, g, beta, **kw):
        captured.setdefault(spy.tag, []).append((q, k, v, g, beta))
        return real(q, k, v, g, beta, **kw)

    monkeypatch.setattr(kda_module, "kda", spy)
    tokens = batch()
    for tag, decay in (("sigmoid", DecayConfig()), ("softplus", DecayConfig(name="softplus"))):
        spy.tag = tag
        with torch.no_grad():
            build(decay=decay)(tokens)
    # the first KDA layer sees the same input under both maps: q, k, v, beta equal, g differs
    (q0, k0, v0, g0, b0), (q1, k1, v1, g1, b1) = captured["sigmoid"][0], captured["softplus"][0]
    for x, y in ((q0, q1), (k0, k1), (v0, v1), (b0, b1)):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    assert not torch.allclose(g0, g1)
    assert (g0 >= -5.0).all() and (g0 <= 0).all()  # sigmoid map is bounded by g_min
    assert (g1 <= 0).all()


def test_decay_maps_follow_their_formulas():
    torch.manual_seed(0)
    model = build(decay=DecayConfig(name="softplus"))
    layer = model.sublayers[0].fn
    z = torch.randn(2, 3, layer.n_heads, layer.head_dim) * 5
    A = layer.A_log.exp()[:, None]
    expected = -A * F.softplus(z + layer.dt_bias.view(layer.n_heads, layer.head_dim))
    torch.testing.assert_close(layer.log_decay(z), expected)
    assert ((A >= 1) & (A <= 16)).all()
    dt = F.softplus(layer.dt_bias)
    assert ((dt >= 1e-3 - 1e-9) & (dt <= 1e-1 + 1e-9)).all()
    sig = build().sublayers[0].fn
    shifted = z + sig.dt_bias.view(layer.n_heads, layer.head_dim)
    torch.testing.assert_close(sig.log_decay(z), -5.0 * torch.sigmoid(shifted))  # A_h = 0 at init
    slow = sig.log_decay(torch.zeros_like(z))  # z = 0: the decay starts slow, as under softplus
    assert (slow > -0.5).all() and (slow < -0.004).all()


def test_glu_swiglu_same_parameters_and_formula():
    base, swi = build(), build(glu=GLUConfig(name="swiglu"))
    assert not differing(state(base), state(swi)) and set(state(base)) == set(state(swi))
    x = torch.randn(3, 64) * 4
    ffn_s, ffn_w = base.sublayers[1].fn, swi.sublayers[1].fn
    a, b = ffn_s.w1(x), ffn_s.w2(x)
    torch.testing.assert_close(ffn_s(x), ffn_s.w3(4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25)))
    torch.testing.assert_close(ffn_w(x), ffn_w.w3(F.silu(a) * b))
    tokens = batch()
    assert loss_of(base, tokens).item() != loss_of(swi, tokens).item()  # close at init (small activations), not equal


def test_situ_is_bounded_and_near_silu_for_small_inputs():
    x = torch.linspace(-50, 50, 1001)
    assert situ(x, 4.0).abs().max() <= 4.0
    small = torch.linspace(-0.1, 0.1, 11)
    torch.testing.assert_close(situ(small, 4.0), F.silu(small), atol=1e-4, rtol=0)
    assert softcap(x, 25.0).abs().max() <= 25.0


def one_step(name: str) -> dict[str, torch.Tensor]:
    model = build()
    opt, _ = build_optimizer(model, OptimConfig(name=name, warmup_steps=1), total_steps=10)
    loss_of(model, batch()).backward()
    opt.step()
    return state(model)


@pytest.mark.parametrize("variant", ["muon", "adamw"])
def test_optim_changes_only_the_update_of_its_tensors(variant):
    model = build()
    before = state(model)
    loss0 = loss_of(model, batch()).item()
    base, other = one_step("muon_per_head"), one_step(variant)
    assert loss_of(model, batch()).item() == loss0 and not differing(before, state(model))
    changed = differing(base, other)
    per_head = {n for n, tags in named_tags(model).items() if "head_blocks" in tags}
    if variant == "muon":
        # whole-matrix vs per-head Newton-Schulz: exactly the Q/K/V projections differ
        assert changed == per_head
    else:
        # AdamW everywhere: exactly the Muon tensors (hidden matrices) differ
        muon_names = {n for n, p in model.named_parameters()
                      if p.ndim >= 2 and not n.startswith(("embed", "lm_head")) and ".conv." not in n}
        assert changed == muon_names


def test_per_head_rule_marks_exactly_qkv_projections():
    model = build()
    marked = {n: tags["head_blocks"] for n, tags in named_tags(model).items() if "head_blocks" in tags}
    expected = set()
    for i, kind in enumerate(model.cfg.layer_kinds()):
        names = ("q_proj", "k_proj", "v_proj") if kind == "kda" else ("q_proj", "k_up", "v_up")
        expected |= {f"sublayers.{2 * i}.fn.{n}.weight" for n in names}
    assert set(marked) == expected
    for n, p in model.named_parameters():
        if n in marked:
            assert p.shape[0] == marked[n] * model.cfg.head_dim


def test_hybrid_layout_is_three_kda_to_one_mla():
    assert tiny(n_layers=8).layer_kinds() == ["kda", "kda", "kda", "mla"] * 2


def test_invalid_option_names_the_valid_ones():
    with pytest.raises(ValueError, match="sigmoid, softplus"):
        K3Model(tiny(decay=DecayConfig(name="softplos")))
