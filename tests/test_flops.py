"""The FLOP count of k3lab.flops against hand counts, and parameter counts against module sizes."""
import torch

from k3lab.config import MixerConfig, ModelConfig, MoEConfig
from k3lab.flops import flops_per_token, matmul_params_per_token, mixing_flops_per_token
from k3lab.model.k3 import K3Model


def model(**kw) -> K3Model:
    torch.manual_seed(0)
    return K3Model(ModelConfig(n_layers=4, d_model=64, head_dim=32, vocab_size=101, **kw))


def test_all_mla_model_matches_a_hand_count():
    m = model(mixer=MixerConfig(name="mla"), moe=MoEConfig(name="dense"))
    D, H, d, r, F, V, L = 64, 2, 32, 32, m.cfg.ffn_hidden, 101, 4
    attn = D * H * d + D * r + r * H * d * 2 + D * H * d + H * d * D  # q, kv_down, k_up + v_up, gate, out
    ffn = 3 * D * F
    assert matmul_params_per_token(m) == L * (attn + ffn) + D * V  # + LM head, no input embedding
    assert mixing_flops_per_token(m.cfg, seq_len=128) == L * 12 * H * d * 128
    assert flops_per_token(m, 128) == 6 * matmul_params_per_token(m) + L * 12 * H * d * 128


def test_kda_term_grows_with_kda_layers_not_with_sequence_length():
    hybrid, kda = model(), model(mixer=MixerConfig(name="kda"))
    assert mixing_flops_per_token(kda.cfg, 128) == mixing_flops_per_token(kda.cfg, 4096)  # linear in T
    assert mixing_flops_per_token(hybrid.cfg, 4096) > mixing_flops_per_token(kda.cfg, 4096)  # one MLA layer


def test_moe_active_parameters_count_top_k_of_n_experts():
    dense = model(moe=MoEConfig(name="dense"))
    moe = model(moe=MoEConfig(name="standard", n_experts=8, top_k=2, n_shared=1, scale_with_latent=False))
    counts = moe.param_counts()
    routed = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    assert routed > 0
    assert counts["params_total"] - counts["params_active"] == routed - routed * 2 // 8
    assert counts["params_non_embedding"] == counts["params_total"] - 101 * 64
    assert dense.param_counts()["params_total"] == dense.param_counts()["params_active"]
