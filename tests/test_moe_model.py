"""The moe and balance switches inside the K3 stack: each changes only the FFN sublayers it names, and
moe=dense_matched matches latent_norm's active parameters."""
import pytest
import torch

from k3lab.config import BalanceConfig, GLUConfig, MixerConfig, ModelConfig, MoEConfig
from k3lab.flops import flops_per_token
from k3lab.model.k3 import K3Model
from k3lab.model.moe import MoE, latent_norm_active_params, matched_dense_hidden


def tiny(moe="dense", balance="qb", seed=0, **moe_kw) -> K3Model:
    torch.manual_seed(seed)
    # all-MLA mixers keep the test fast; the FFN sublayers (what these switches own) are the same
    cfg = ModelConfig(vocab_size=97, n_layers=4, d_model=64, head_dim=32, mixer=MixerConfig(name="mla"),
                      moe=MoEConfig(name=moe, **moe_kw), balance=BalanceConfig(name=balance))
    return K3Model(cfg)


def shapes(model: torch.nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("balance", ["sign", "aux", "none"])
def test_balance_is_refused_under_dense(balance):
    """A dense FFN has no router to balance, so a balance option other than the default would do nothing."""
    from k3lab.errors import ConfigError

    with pytest.raises(ConfigError, match=f"balance={balance} balances a router, and moe=dense has none"):
        tiny("dense", balance)


@pytest.mark.parametrize("moe", ["latent_norm", "latent", "standard"])
def test_moe_replaces_only_the_ffn_of_layers_after_first_dense(moe):
    dense, sparse = shapes(tiny("dense")), shapes(tiny(moe, first_dense=1))
    ffn = tuple(f"sublayers.{2 * layer + 1}.fn." for layer in range(1, 4))   # FFN sublayers of layers 1..3
    assert {k: v for k, v in dense.items() if not k.startswith(ffn)} == \
        {k: v for k, v in sparse.items() if not k.startswith(ffn)}
    model = tiny(moe, first_dense=1)
    assert [type(model.sublayers[2 * layer + 1].fn) is MoE for layer in range(4)] == [False, True, True, True]


def test_training_step_updates_router_bias_and_counts():
    model = tiny("latent_norm", "qb", first_dense=1)
    moes = model.moe_layers()
    tokens = torch.randint(0, 97, (4, 32))
    loss = model(tokens).logsumexp(-1).mean() + model.aux_loss()
    loss.backward()
    model.update_router_biases()
    for m in moes:
        assert m.router.bias.abs().sum() > 0 and abs(float(m.router.bias.mean())) < 1e-6
        assert 0 <= m.stats()["maxvio"] < m.n_experts
    counts = model.param_counts()
    inactive = sum(m.n_params_total() - m.n_params_active() for m in moes)
    assert inactive > 0 and counts["params_active"] == counts["params_total"] - inactive


def test_init_router_std_and_scaled_expert_output():
    """The model's initialiser honours moe.router_init_std and scales the expert output stack w3 and
    W_up by 1/sqrt(2 n_layers) like every projection into the residual stream."""
    model = tiny("latent_norm", first_dense=1, router_init_std=0.1, expert_hidden=64)
    moe = model.moe_layers()[0]
    std, out = model.cfg.init_std, model.cfg.init_std / (2 * model.cfg.n_layers) ** 0.5
    assert abs(float(moe.router.weight.std()) - 0.1) < 0.01
    assert abs(float(moe.experts.w1.std()) - std) < 0.1 * std
    assert abs(float(moe.experts.w3.std()) - out) < 0.1 * out
    assert abs(float(moe.up.weight.std()) - out) < 0.15 * out


@pytest.mark.parametrize("kw", [{}, {"scale_with_latent": False}, {"n_shared": 0}, {"n_shared": 2, "expert_hidden": 40},
                                {"n_experts": 16, "top_k": 4, "latent_ratio": 2}])
def test_latent_norm_active_params_counts_what_the_moe_layer_holds(kw):
    """The closed form that dense_matched is sized by equals MoE.n_params_active of the layer it describes."""
    cfg = MoEConfig(name="latent_norm", **kw)
    assert latent_norm_active_params(64, cfg, 176) == MoE(64, cfg, GLUConfig(), BalanceConfig(),
                                                          ffn_hidden=176).n_params_active()


def test_dense_matched_is_a_dense_ffn_with_latent_norms_active_parameters():
    """moe=dense_matched: a GLU in the FFN sublayers after first_dense, as wide as gives the active parameters of
    latent_norm's MoE layer (to within the rounding of the width to 8: 12 d per layer), so the two models have
    the same active parameters and FLOPs per token; every other tensor is the plain dense model's."""
    matched, latent, dense = tiny("dense_matched", first_dense=1), tiny("latent_norm", first_dense=1), tiny("dense")
    assert not matched.moe_layers()
    d, n_ffn = matched.cfg.width, matched.cfg.n_layers - 1
    hidden = matched_dense_hidden(d, matched.cfg.moe, matched.cfg.ffn_hidden)
    assert hidden % 8 == 0 and hidden > matched.cfg.ffn_hidden
    assert [matched.sublayers[2 * layer + 1].fn.w1.out_features for layer in range(4)] == \
        [matched.cfg.ffn_hidden] + [hidden] * n_ffn
    a, b = matched.param_counts()["params_active"], latent.param_counts()["params_active"]
    assert abs(a - b) <= 12 * d * n_ffn and a != dense.param_counts()["params_active"]
    assert flops_per_token(matched, 32) == pytest.approx(flops_per_token(latent, 32), rel=5e-3)
    ffn = tuple(f"sublayers.{2 * layer + 1}.fn." for layer in range(1, 4))
    assert {k: v for k, v in shapes(matched).items() if not k.startswith(ffn)} == \
        {k: v for k, v in shapes(dense).items() if not k.startswith(ffn)}
    with pytest.raises(ValueError, match="dense_matched"):
        MoE(64, MoEConfig(name="dense_matched"), GLUConfig(), BalanceConfig())
