"""The whole model under torch.compile on the CPU (dynamo; the "eager" and "aot_eager" backends, no Inductor).

Traced whole, the sublayer loop of K3Model.forward unrolls into one graph, the AttnRes bookkeeping with it.
A graph break inside a sublayer (here: the torch KDA path's data-dependent decay-path choice and the MoE's
CPU loop over experts, whose split sizes are data) makes dynamo skip K3Model.forward and compile each call it makes as a frame of
its own; the residual's read/write/end then run eagerly: compiled as frames, they would be recompiled at every
sublayer for its op index and number of depth sources, up to dynamo's recompile limit of 8.
"""
import pytest
import torch
import torch._dynamo
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch._dynamo.testing import CompileCounterWithBackend

from k3lab.config import KernelsConfig, MixerConfig, ModelConfig, MoEConfig, ResidualConfig
from k3lab.model.attnres import AttnResidual
from k3lab.model.k3 import K3Model, PreNorm
from test_moe import grouped_mm_on_cpu

VOCAB = 97


def build(residual: str, **overrides) -> K3Model:
    """6 layers = 12 sublayers and 13 AttnRes ops (more than dynamo's recompile limit of 8)."""
    torch.manual_seed(0)
    cfg = ModelConfig(n_layers=6, d_model=64, head_dim=32, vocab_size=VOCAB, residual=ResidualConfig(name=residual),
                      **overrides)
    return K3Model(cfg)


def step(model, fn) -> list[torch.Tensor]:
    """Logits and every parameter gradient of one forward+backward of fn (the model or its compiled form)."""
    model.zero_grad(set_to_none=True)
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = fn(tokens)
    logits.square().mean().backward()
    return [logits.detach()] + [p.grad for p in model.parameters() if p.grad is not None]


def entries(fn) -> int:
    """Compiled frames dynamo holds for fn's code."""
    return len(_debug_get_cache_entry_list(fn.__code__))


@pytest.mark.parametrize("residual", ["block_attnres", "full_attnres"])
def test_graph_breaks_in_sublayers_do_not_recompile_the_residual(residual):
    """With sublayers that graph-break (torch KDA path, MoE), torch.compile(backend="eager") gives eager's
    logits and gradients, never compiles AttnResidual.read/write/end as frames of their own (`read` would
    otherwise be compiled once per sublayer, up to the recompile limit) and compiles each sublayer wrapper
    once per sublayer kind (KDA, MLA, GLU, MoE: at most 4 entries)."""
    torch._dynamo.reset()
    model = build(residual)
    eager = step(model, model)
    compiled = step(model, torch.compile(model, backend="eager"))
    assert len(compiled) == len(eager)
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert entries(K3Model.forward) == 0  # skipped: the graph breaks sit inside its loop
    assert [entries(f) for f in (AttnResidual.read, AttnResidual.write, AttnResidual.end)] == [0, 0, 0]
    assert 1 <= entries(PreNorm.forward) <= 4


@pytest.mark.parametrize("residual,two_phase", [("block_attnres", False), ("block_attnres", True),
                                                ("full_attnres", False), ("standard", False)])
def test_model_without_graph_breaks_compiles_to_one_graph(residual, two_phase):
    """All-MLA layers with dense FFNs have no graph break: torch.compile(fullgraph=True, aot_eager) traces the
    whole model, AttnRes stack included (one-phase or two-phase), as one frame, once, and matches eager forward
    and backward."""
    torch._dynamo.reset()
    model = build(residual, mixer=MixerConfig(name="mla"), moe=MoEConfig(name="dense"),
                  kernels=KernelsConfig(attnres_two_phase=two_phase))
    eager = step(model, model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled_model = torch.compile(model, backend=counter, fullgraph=True)
    compiled = step(model, compiled_model)
    step(model, compiled_model)  # a second call reuses the graph
    assert counter.frame_count == 1
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.skipif(not grouped_mm_on_cpu(), reason="torch._grouped_mm has no CPU path in this torch")
@pytest.mark.parametrize("balance", ["qb", "sign"])
def test_moe_with_grouped_dispatch_compiles_to_one_graph(balance):
    """The MoE's GPU path (grouped matmuls, counts from the sorted expert ids, load statistics by
    scatter-add) has no data-dependent shapes: an all-MLA MoE model under bf16 autocast traces with
    fullgraph=True as one frame, training-mode balancing statistics included, and the step's bias update
    leaves nothing that makes the next step recompile."""
    from k3lab.config import BalanceConfig
    from k3lab.model.moe import MoE

    torch._dynamo.reset()
    model = build("standard", mixer=MixerConfig(name="mla"), balance=BalanceConfig(name=balance))
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    assert moes
    for m in moes:
        m.dispatch = "grouped"
    counter = CompileCounterWithBackend("aot_eager")
    compiled_model = torch.compile(model, backend=counter, fullgraph=True)
    loads, frames = [], []
    for _ in range(2):  # two training steps, each ending with the router-bias update as training does
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step(model, compiled_model)
        loads.append([int(m._load.sum()) for m in moes])
        frames.append(counter.frame_count)
        model.update_router_biases()
    # one graph holds every operation (dynamo also records one frame that has none); none is recompiled
    assert [len(g.graph.nodes) > 0 for g in counter.graphs].count(True) == 1
    assert frames[1] == frames[0]
    assert loads == [[2 * 24 * m.top_k for m in moes]] * 2  # 48 tokens per step, top_k experts each


def test_loss_path_compiles_to_one_graph_with_the_chunked_cross_entropy():
    """model.compile() (what train.compile does) on an all-MLA dense model: model(tokens, targets), the chunked
    linear cross-entropy's autograd.Function included, traces under aot_eager with fullgraph=True as one frame
    and gives eager's loss and every gradient; the parameter names are unchanged."""
    torch._dynamo.reset()
    model = build("block_attnres", mixer=MixerConfig(name="mla"), moe=MoEConfig(name="dense"))
    model.cfg.kernels.ce_chunk = 11  # 48 tokens: 5 chunks, the last one short
    names = [n for n, _ in model.named_parameters()]
    gen = torch.Generator().manual_seed(2)
    tokens, targets = torch.randint(0, VOCAB, (2, 24), generator=gen), torch.randint(0, VOCAB, (2, 24), generator=gen)
    targets[0, :5] = -100

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        out = model(tokens, targets)
        out.mean.backward()
        return [out.sum.detach(), out.correct, out.count] + [p.grad for p in model.parameters()]

    eager = loss_and_grads()
    counter = CompileCounterWithBackend("aot_eager")
    model.compile(backend=counter, fullgraph=True)
    compiled = loss_and_grads()
    loss_and_grads()
    assert counter.frame_count == 1
    assert [n for n, _ in model.named_parameters()] == names
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("residual", ["block_attnres", "standard"])
def test_k3_default_on_cuda_compiles_to_one_graph(residual):
    """The K3 default's GPU path (Triton KDA, short-conv and AttnRes custom ops, grouped MoE dispatch,
    QB statistics) under bf16 autocast: fullgraph=True traces the whole model as one graph, and two
    training steps with their bias updates compile it once (benchmarks.kda_train_check compares the
    compiled curve with eager's)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = K3Model(ModelConfig(n_layers=4, d_model=256, head_dim=64, vocab_size=VOCAB,
                                residual=ResidualConfig(name=residual))).cuda()
    tokens = torch.randint(0, VOCAB, (2, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    counter = CompileCounterWithBackend("aot_eager")
    compiled_model = torch.compile(model, backend=counter, fullgraph=True)
    for _ in range(2):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = compiled_model(tokens)
        logits.float().square().mean().backward()
        model.update_router_biases()
        assert torch.isfinite(logits).all()
    assert [len(g.graph.nodes) > 0 for g in counter.graphs].count(True) == 1


def test_backend_choice_traces_without_a_graph_break():
    """kernels.backend=auto asks on every CUDA forward whether Triton is available (KDA, short conv): that
    answer must trace, or torch.compile breaks the graph at every KDA layer (an import per call does)."""
    from kernels import kda, short_conv

    torch._dynamo.reset()
    fn = torch.compile(lambda x: x + kda.triton_available() + short_conv.triton_available(), backend="eager",
                       fullgraph=True)
    assert fn(torch.zeros(2)).tolist() == [2.0, 2.0]
