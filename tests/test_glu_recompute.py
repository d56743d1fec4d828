"""kernels.recompute_glu: every dense GLU FFN keeps only W1 x and W2 x for the backward and rebuilds the
elementwise product (W3's input) there.

The same numbers with and without it (bitwise, eager), what the autograd graph keeps (distinct storages
seen by saved_tensors_hooks, eager and compiled), one graph under torch.compile, and the flag reaching every
GLU the config builds while it is off by default.
"""
import pytest
import torch
import torch._dynamo
from hydra import compose, initialize_config_dir
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import k3lab.model.ffn as ffn_module
from k3lab.config import GLUConfig, KernelsConfig, MixerConfig, ModelConfig, MoEConfig, run_config
from k3lab.model.ffn import GLU
from k3lab.model.k3 import K3Model
from k3lab.model.moe import MoE
from test_registry import ROOT

VOCAB = 97
D, HIDDEN, B, T = 64, 96, 2, 24
GLUS = ["situ", "swiglu"]


def glu(name: str, recompute_glu: bool, dtype=torch.float32) -> GLU:
    torch.manual_seed(0)
    return GLU(D, HIDDEN, GLUConfig(name=name), recompute_glu=recompute_glu).to(dtype)


def inputs(dtype=torch.float32) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()


def kept_storages(module: torch.nn.Module, fn) -> tuple[object, dict[int, int]]:
    """fn()'s result and the storages (data_ptr -> bytes) the autograd graph keeps while it runs,
    module's parameters left out (each saved tensor stays alive, so no pointer is reused meanwhile)."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    kept = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            kept[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept


def output_and_grads(module: torch.nn.Module, x: torch.Tensor, fn=None) -> list[torch.Tensor]:
    module.zero_grad(set_to_none=True)
    x.grad = None
    y = (module if fn is None else fn)(x)
    y.square().mean().backward()
    return [y.detach(), x.grad] + [p.grad for p in module.parameters()]


class MatmulCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.bmm, torch.ops.aten.addmm)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", GLUS)
def test_glu_gives_bitwise_the_same_output_and_gradients(name):
    """fp32 on the CPU: the output, the input's gradient and W1, W2, W3's gradients are bitwise the same."""
    plain = output_and_grads(glu(name, False), inputs())
    rec = output_and_grads(glu(name, True), inputs())
    assert len(plain) == len(rec) == 5
    for a, b in zip(plain, rec):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", GLUS)
def test_backward_reruns_the_elementwise_part_and_no_matmul(name, monkeypatch):
    """With the flag glu_combine runs once in the forward and once more in the backward; the backward runs
    as many matmuls as without it (W3's is not rerun: the checkpoint's rerun stops at W3's input)."""
    calls = []
    real = ffn_module.glu_combine
    monkeypatch.setattr(ffn_module, "glu_combine", lambda *a: calls.append(1) or real(*a))
    counts = {}
    for on in (False, True):
        m, x = glu(name, on), inputs()
        calls.clear()
        y = m(x)
        forward_calls = len(calls)
        mm = MatmulCount()
        with mm:
            y.square().mean().backward()
        counts[on] = (forward_calls, len(calls), mm.n)
    assert counts[False] == (1, 1, 6)  # backward: W1, W2, W3 each a weight and an input gradient
    assert counts[True] == (1, 2, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", GLUS)
def test_eager_keeps_only_the_input_and_both_projections(name, dtype):
    """Eager, one forward: with the flag the graph keeps exactly x, W1 x and W2 x (no parameter counted), so
    the product, W3's input ([B*T, hidden] in the activation dtype), is not among them; without it the product
    is kept, with the elementwise intermediates eager autograd saves per op."""
    kept, product = {}, {}
    for on in (False, True):
        m, x = glu(name, on, dtype), inputs(dtype)
        seen = {}
        m.w1.register_forward_hook(lambda mod, args, out: seen.__setitem__("gate", out))
        m.w2.register_forward_hook(lambda mod, args, out: seen.__setitem__("up", out))
        m.w3.register_forward_pre_hook(lambda mod, args: seen.__setitem__("product", args[0]))
        _, kept[on] = kept_storages(m, lambda: m(x))
        ptr = {k: v.untyped_storage().data_ptr() for k, v in seen.items()}
        product[on] = ptr["product"]
        if on:
            assert set(kept[on]) == {x.untyped_storage().data_ptr(), ptr["gate"], ptr["up"]}
    size = B * T * HIDDEN * dtype.itemsize
    assert sum(kept[True].values()) == B * T * D * dtype.itemsize + 2 * size
    assert kept[False][product[False]] == size
    assert sum(kept[False].values()) >= sum(kept[True].values()) + size


@pytest.mark.parametrize("backend", ["aot_eager", "aot_eager_decomp_partition"])
@pytest.mark.parametrize("name", GLUS)
def test_compiled_keeps_one_tensor_less_and_matches_eager(name, backend):
    """torch.compile(fullgraph=True) on the CPU: one graph, eager's output and gradients (fp32 tolerance), and
    what the compiled forward keeps for its backward: with the flag x, W1 x and W2 x; under Inductor's
    decompositions and partitioner (aot_eager_decomp_partition) without the flag exactly one [B*T, hidden]
    tensor more (the product), under aot_eager at least that."""
    kept = {}
    for on in (False, True):
        torch._dynamo.reset()
        m, x = glu(name, on), inputs()
        eager = output_and_grads(m, x)
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(m, backend=counter, fullgraph=True)
        for a, b in zip(output_and_grads(m, x, compiled), eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        y, kept[on] = kept_storages(m, lambda: compiled(x))
        y.sum().backward()
        assert counter.frame_count == 1
    size = B * T * HIDDEN * 4
    assert sum(kept[True].values()) == B * T * D * 4 + 2 * size
    if backend == "aot_eager_decomp_partition":
        assert sum(kept[False].values()) - sum(kept[True].values()) == size
    else:
        assert sum(kept[False].values()) - sum(kept[True].values()) >= size


def tiny(recompute_glu: bool, name: str = "situ", moe: str = "dense", n_layers: int = 2, **overrides) -> ModelConfig:
    return ModelConfig(n_layers=n_layers, d_model=64, head_dim=32, vocab_size=VOCAB, glu=GLUConfig(name=name),
                       moe=MoEConfig(name=moe), kernels=KernelsConfig(recompute_glu=recompute_glu), **overrides)


def model_step(model: K3Model, fn=None) -> list[torch.Tensor]:
    """The summed loss of model(tokens, targets) and every parameter gradient after its backward."""
    gen = torch.Generator().manual_seed(2)
    tokens, targets = torch.randint(0, VOCAB, (B, T), generator=gen), torch.randint(0, VOCAB, (B, T), generator=gen)
    model.zero_grad(set_to_none=True)
    out = (model if fn is None else fn)(tokens, targets)
    out.mean.backward()
    return [out.sum.detach()] + [p.grad for p in model.parameters()]


@pytest.mark.parametrize("moe", ["dense", "latent_norm"])
@pytest.mark.parametrize("name", GLUS)
def test_model_gives_bitwise_the_same_loss_and_gradients(name, moe):
    """A 2-layer K3Model (hybrid KDA/MLA on the torch path; moe=dense, or latent_norm whose first layer is a
    dense GLU and whose MoE has a shared expert): same init, the loss and every gradient bitwise equal."""
    results = []
    for on in (False, True):
        torch.manual_seed(0)
        model = K3Model(tiny(on, name, moe))
        assert [m.recompute_glu for m in model.modules() if isinstance(m, GLU)] == [on] * 2
        results.append(model_step(model))
    assert all(g is not None for g in results[0])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_compiled_model_is_one_graph_and_keeps_one_product_less_per_layer():
    """All-MLA moe=dense model under torch.compile(fullgraph=True): one frame with aot_eager, eager's loss and
    gradients; under Inductor's decompositions and partitioner the flag keeps exactly n_layers [B*T, hidden]
    fp32 tensors less for the backward."""
    cfg = dict(mixer=MixerConfig(name="mla"))
    torch.manual_seed(0)
    model = K3Model(tiny(True, **cfg))
    eager = model_step(model)
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = model_step(model, torch.compile(model, backend=counter, fullgraph=True))
    assert counter.frame_count == 1
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)

    kept = {}
    for on in (False, True):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = K3Model(tiny(on, **cfg))
        fn = torch.compile(model, backend="aot_eager_decomp_partition", fullgraph=True)
        model_step(model, fn)
        gen = torch.Generator().manual_seed(2)
        tokens, targets = torch.randint(0, VOCAB, (B, T), generator=gen), torch.randint(0, VOCAB, (B, T), generator=gen)
        out, kept[on] = kept_storages(model, lambda: fn(tokens, targets))
        out.mean.backward()
    hidden = model.cfg.ffn_hidden
    assert sum(kept[False].values()) - sum(kept[True].values()) == model.cfg.n_layers * B * T * hidden * 4


def test_off_by_default_and_builds_the_same_modules():
    """kernels.recompute_glu is false in KernelsConfig and conf/config.yaml; with it on the model has the same
    parameter names, shapes and initial values (the flag owns no tensor)."""
    assert KernelsConfig().recompute_glu is False
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config")
    assert cfg.kernels.recompute_glu is False
    assert run_config(cfg).model_config(VOCAB).kernels.recompute_glu is False
    states = []
    for on in (False, True):
        torch.manual_seed(0)
        model = K3Model(tiny(on, moe="latent_norm"))
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])


@pytest.mark.parametrize("moe", ["dense", "dense_matched", "latent_norm"])
def test_flag_reaches_every_dense_glu_from_the_config(moe):
    """Every GLU the model builds gets the flag: the dense FFNs (moe=dense, dense_matched, the first_dense
    layers) and the MoE's shared experts; the routed experts are not GLU modules (kernels.checkpoint_experts)."""
    for on in (False, True):
        model = K3Model(tiny(on, moe=moe, n_layers=3))
        glus = [m for m in model.modules() if isinstance(m, GLU)]
        shared = [m.shared for m in model.modules() if isinstance(m, MoE)]
        assert len(glus) == 3 and all(g.recompute_glu is on for g in glus)
        assert len(shared) == (2 if moe == "latent_norm" else 0) and all(s in glus for s in shared)
