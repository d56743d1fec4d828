"""GLU(recompute_glu=True): the GLU keeps only W1 x and W2 x for the backward and rebuilds the elementwise
product (W3's input) there.

The same numbers with and without it (bitwise, eager), what the autograd graph keeps (distinct storages
seen by saved_tensors_hooks, eager and compiled) and one graph under torch.compile.
"""
import pytest
import torch
import torch._dynamo
from torch._dynamo.testing import CompileCounterWithBackend
from torch.utils._python_dispatch import TorchDispatchMode

import k3lab.model.ffn as ffn_module
from k3lab.config import GLUConfig
from k3lab.model.ffn import GLU

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
