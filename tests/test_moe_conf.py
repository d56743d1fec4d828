"""The `moe` and `balance` config groups match their dataclasses, and the MoE benchmark script runs."""
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from k3lab.config import BalanceConfig, GLUConfig, MoEConfig
from k3lab.model.moe import MoE
from k3lab.switches import SWITCHES

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("group,schema,options", [("moe", MoEConfig, SWITCHES["moe"].options),
                                                  ("balance", BalanceConfig, SWITCHES["balance"].options)])
def test_config_group_files_match_the_schema(group, schema, options):
    files = sorted((ROOT / "conf" / group).glob("*.yaml"))
    assert {f.stem for f in files} == set(options)
    for f in files:
        raw = OmegaConf.load(f)
        assert raw.name == f.stem
        cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), raw))  # unknown keys raise
        assert isinstance(cfg, schema)


@pytest.mark.parametrize("option,experts,top_k,width", [("latent_norm", 32, 8, 32), ("latent", 32, 8, 32),
                                                         ("standard", 8, 2, 128)])
def test_moe_options_on_the_tiny_model(option, experts, top_k, width):
    raw = OmegaConf.load(ROOT / "conf" / "moe" / f"{option}.yaml")
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(MoEConfig), raw))
    moe = MoE(128, cfg, GLUConfig(), BalanceConfig())
    assert (moe.n_experts, moe.top_k, moe.width, moe.hidden) == (experts, top_k, width, 176)
    assert (moe.norm is not None) == (option == "latent_norm")


def table_column(text: str, i: int) -> list[str]:
    """Column i of the rows of the Markdown table in `text` (below its header and rule)."""
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [line.split("|")[1 + i].strip() for line in lines[2:]]


def test_benchmark_runs_on_cpu():
    from benchmarks import moe_bench as bench

    rows = bench.main(["--device", "cpu", "--small", "--iters", "1", "--warmup", "0"])
    assert {r["dispatch"] for r in rows} >= {"loop"}
    assert all(r["ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert any(r["experts"] >= 64 and r["top_k"] == 8 for r in rows)
    for r in rows:
        assert math.isnan(r["max_abs_diff"]) or r["max_abs_diff"] < 1e-5


def test_experts_benchmark_runs_on_cpu(capsys):
    """--experts --small on the CPU: the two torch forms, each against eager grouped (fp32: within 1e-6; the
    checkpointed form reruns the same ops), the table with the checkpointed form as the anchor."""
    from benchmarks import moe_bench as bench

    rows = bench.main(["--device", "cpu", "--small", "--experts", "--iters", "1", "--warmup", "0"])
    assert [r["form"] for r in rows] == ["grouped", "grouped, checkpointed"]
    assert all(r["ms"] > 0 and r["max_rel_error"] < 1e-6 for r in rows) and rows[1]["ratio"] == 1.0
    assert ["grouped", "grouped, checkpointed"] == table_column(capsys.readouterr().out, 0)


def test_routing_benchmark_runs_on_cpu(capsys):
    """--routing --small on the CPU: every form of QB's cutoffs and of the expert counts, each checked equal
    to its group's first form inside the benchmark (it raises otherwise), timed against it."""
    from benchmarks import moe_bench as bench

    rows = bench.main(["--device", "cpu", "--small", "--routing", "--iters", "1", "--warmup", "0"])
    assert [r["selection"] for r in rows] == ["QB cutoffs"] * 3 + ["tokens per expert"] * 5
    assert all(r["us"] > 0 for r in rows) and rows[0]["ratio"] == rows[3]["ratio"] == 1.0
    assert "topk, transposed (qb_quantile_exact)" in table_column(capsys.readouterr().out, 1)


def test_tune_kernels_refuses_a_kernel_it_does_not_have(capsys):
    """--tune-kernels with a name outside fwd, bwd stops with one line naming the valid ones (which grids run
    is tested under the interpreter, tests/test_grouped_glu.py)."""
    from benchmarks import moe_bench as bench

    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--small", "--tune", "--tune-kernels", "fwd,up"])
    assert "--tune-kernels 'fwd,up': valid kernels are fwd and bwd" in capsys.readouterr().err


def test_combine_benchmark_runs_on_cpu(capsys):
    """--combine --small on the CPU: both forms of the experts' mix back per token, the second checked against
    moe.combine inside the benchmark (it raises beyond fp32 rounding), timed against it."""
    from benchmarks import moe_bench as bench

    rows = bench.main(["--device", "cpu", "--small", "--combine", "--iters", "1", "--warmup", "0"])
    assert [r["form"] for r in rows] == ["slots added in turn (moe.combine)", "sum over slots"]
    assert rows[0]["ratio"] == 1.0 and rows[1]["max_rel_error"] < 1e-6 and all(r["us"] > 0 for r in rows)
    assert table_column(capsys.readouterr().out, 0) == ["slots added in turn (moe.combine)", "sum over slots"]
