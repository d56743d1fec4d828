"""benchmarks.timing, the benchmarks' one timer, and benchmarks.table, their Markdown tables through pandas."""
import pytest
import torch

from benchmarks.table import markdown
from benchmarks.timing import Timing, time_ms


def test_timing_is_the_median_with_its_quartiles():
    """numpy's linear quartiles of the per-call times: 1..5 ms give 2, 3, 4; the IQR as text; other units."""
    t = Timing.of([5.0, 1.0, 4.0, 2.0, 3.0])
    assert (t.median, t.q1, t.q3, t.n, t.seconds) == (3.0, 2.0, 4.0, 5, 0.003)
    assert t.iqr() == "2.000-4.000" and t.iqr(1) == "2.0-4.0"
    assert t.scaled(1e3) == Timing(3000.0, 2000.0, 4000.0, 5)
    with pytest.raises(ValueError, match="no timed calls"):
        Timing.of([])


def test_cpu_timer_makes_exactly_the_calls_asked_for_and_resets_gradients_before_each():
    """Off CUDA: `warmup` calls, then exactly `calls` timed ones, one time each; a tensor of grad_to_none has
    no gradient when a timed call starts (the reset runs outside the timed span)."""
    w = torch.ones(3, requires_grad=True)
    seen = []

    def step():
        seen.append(w.grad is None)
        (w * 2).sum().backward()

    t = time_ms(step, "cpu", calls=7, warmup=2, grad_to_none=[w])
    assert t.n == 7 and len(seen) == 9 and all(seen[2:])
    assert 0 <= t.q1 <= t.median <= t.q3
    with pytest.raises(ValueError, match="calls=0 must be >= 1"):
        time_ms(step, "cpu", calls=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_timer_runs_do_bench_on_a_budget_of_about_the_calls_asked_for():
    """On CUDA, do_bench's per-call times: a matmul of constant cost gets about the 50 calls asked for (its
    budget is 50 times one call's time, which do_bench's own estimate can put a few calls either way)."""
    a = torch.randn(2048, 2048, device="cuda")
    t = time_ms(lambda: a @ a, "cuda", calls=50, warmup=3)
    assert 25 <= t.n <= 100 and 0 < t.q1 <= t.median <= t.q3


def test_markdown_tables_keep_the_cells_as_formatted():
    """One row per mapping, columns in order; cells printed as given (no number parsing: '0.150' keeps its
    zero, '1,234' its comma); a table without rows still has its header."""
    text = markdown([{"variant": "a", "ms": "0.150", "tokens/s": "1,234"}, {"variant": "b", "ms": "12.5", "tokens/s": "7"}])
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()]
    assert rows[0] == ["variant", "ms", "tokens/s"] and set(rows[1][0]) <= {"-", ":"}
    assert rows[2:] == [["a", "0.150", "1,234"], ["b", "12.5", "7"]]
    empty = markdown([], columns=["kernel", "ms"])
    assert [c.strip() for c in empty.splitlines()[0].split("|")[1:-1]] == ["kernel", "ms"] and len(empty.splitlines()) == 2
