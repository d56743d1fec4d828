"""What the command line says: one line per user error (and nothing written), the same within a
multirun that goes on, --help built from the registry, the token cache's progress lines, and tables
without colour codes when stdout is a file. The CLI cases fail their checks before torch is imported,
so each costs a fraction of a second."""
import errno
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from benchmarks.step import compose_config

from k3lab.config import check_config
from k3lab.errors import ConfigError
from k3lab.switches import GROUPS, SWITCHES, conf_defaults

ROOT = Path(__file__).resolve().parents[1]


def cli(*args: str, env: dict | None = None, prelude: str = "") -> subprocess.CompletedProcess:
    """python run.py ARGS; `prelude` runs first in the same interpreter (to hide a package)."""
    code = f"{prelude}\nimport runpy, sys\nsys.argv = ['run.py', *sys.argv[1:]]\nrunpy.run_path('run.py', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def composed(*overrides: str):
    return compose_config(list(overrides))


@pytest.mark.parametrize("args, line", [
    (["train.max_steps=abc"], "train.max_steps='abc' is not an integer or null"),
    (["train.max_stepz=3"], "train.max_stepz is not a key; did you mean train.max_steps?"),
    (["trian.max_steps=3"], "trian.max_steps is not a key; did you mean train.max_steps?"),
    (["+max_steps=100"], "max_steps is not a key; did you mean train.max_steps?"),
    (["decay=sigmod"], "decay=sigmod is not an option; did you mean decay=sigmoid? valid options: sigmoid, softplus"),
    (["decay.name=sigmod"], "decay.name='sigmod' is not an option; did you mean 'sigmoid'? valid options: sigmoid, softplus"),
    (["data=text", "data.path=/nonexistent"], "data.path '/nonexistent' does not exist"),
    (["data=text"], "data=text needs data.path=<file or folder>"),
    (["resume={tmp}/nope"], "resume={tmp}/nope: no checkpoint at {tmp}/nope/checkpoints/last.ckpt"),
    (["resume=last"], "resume=last: no unfinished run (a checkpoint, and not completed) under {tmp}/runs"),
    (["train.log_every=0"], "train.log_every=0 must be >= 1"),
    (["optim.ns_method=polar"], "optim.ns_method='polar' is not an option; valid options: standard, gram"),
    (["kernels.keep_intra=true"], "kernels.keep_intra=true acts with kernels.recompute_chunks=true only (without it "
                                  "the forward keeps At and P anyway): set both, or neither"),
    (["train.val_every=abc"], "train.val_every='abc' is not an integer"),
    (["+train.foo=1"], "train.foo is not a key; the keys of train: activation_memory_budget, branches, ckpt_every, compile, "
                       "compile_backend, compile_mode, default_steps, flop_budget, log_every, max_steps, overfit_batches, "
                       "preempt_signal, tokens_per_param, trunk, val_batches, val_every"),
    # a value out of its range (k3lab.config.setting)
    (["seed=-1"], "seed=-1 must be >= 0"),
    (["decay.g_min=1"], "decay.g_min=1.0 must be < 0"),
    (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9,1.5] must be < 1"),
    (["data.val_fraction=1.5"], "data.val_fraction=1.5 must be < 1"),
    (["moe.top_k=9"], "moe.top_k=9 must be <= moe.n_experts=8"),
    # a setting that the options it is combined with do not read
    (["optim=adamw", "optim.lr=0.01"], "optim.lr=0.01 acts with optim=muon_per_head/muon only: optim=adamw does not "
                                      "read it; drop it"),
    (["residual=standard", "residual.n_blocks=8"], "residual.n_blocks=8 acts with residual=block_attnres only: "
                                                   "residual=standard does not read it; drop it"),
    (["glu=swiglu", "glu.b1=3"], "glu.b1=3.0 acts with glu=situ only: glu=swiglu does not read it; drop it"),
    (["data=mqar", "data.vocab_size=512"], "data.vocab_size=512 acts with data=sotu/text/hf only: data=mqar does "
                                           "not read it; drop it"),
    (["balance=aux", "moe=dense"], "balance=aux balances a router, and moe=dense has none: drop balance= (or choose "
                                   "a routed moe: latent_norm, latent, standard)"),
    (["moe=dense", "kernels.checkpoint_experts=true"], "kernels.checkpoint_experts=true acts on routed experts only: "
                                                       "moe=dense has none; set it false"),
    (["kernels.recompute_states=true"], "kernels.recompute_states=true acts on the Triton KDA kernels only "
                                        "(kernels.backend=auto runs torch on trainer.accelerator=cpu): set "
                                        "kernels.backend=triton, or drop it"),
    (["kernels.backend=torch", "kernels.recompute_chunks=true"], "kernels.recompute_chunks=true acts on the Triton "
                                                                 "KDA kernels only (kernels.backend=torch ignores "
                                                                 "it): set kernels.backend=triton, or drop it"),
    (["train.compile_mode=reduce-overhead"], "train.compile_mode=reduce-overhead records CUDA graphs, and "
                                             "trainer.accelerator=cpu runs none: drop it (or train on a GPU, trainer=gpu)"),
    (["mixer=mla", "kernels.checkpoint_kda=true"], "the kernels.*kda / recompute settings act on KDA layers, and "
                                                   "mixer=mla with 4 layers has none: set them false"),
    # paths that cannot be used
    (["out_dir=/proc/k3lab"], "out_dir=/proc/k3lab cannot be made: No such file or directory in /proc"),
])
def test_a_user_error_is_one_line_exit_2_and_writes_nothing(tmp_path, args, line):
    out = tmp_path / "runs"
    proc = cli(f"out_dir={out}", *[a.format(tmp=tmp_path) for a in args])
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {line.format(tmp=tmp_path)}\n")
    assert not out.exists()


def test_hydra_full_error_shows_the_traceback():
    proc = cli("train.max_steps=abc", env={"HYDRA_FULL_ERROR": "1"})
    assert proc.returncode == 2
    assert "Traceback" in proc.stderr and "ValidationError" in proc.stderr


def test_a_missing_logger_package_names_the_extra(tmp_path):
    proc = cli("logger=wandb", f"out_dir={tmp_path}", prelude="import sys; sys.modules['wandb'] = None")
    assert (proc.returncode, proc.stderr) == (2, 'error: logger=wandb needs the wandb package: pip install -e ".[wandb]" '
                                                 "(or pip install wandb)\n")
    hide = "import sys; sys.modules['tensorboard'] = sys.modules['tensorboardX'] = None"
    proc = cli("logger=tensorboard", f"out_dir={tmp_path}", prelude=hide)
    assert proc.returncode == 2 and 'pip install -e ".[tensorboard]"' in proc.stderr


def test_a_full_disk_is_one_line_that_says_what_to_do():
    from k3lab.errors import user_message

    err = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "runs/default/k3/checkpoints/.last.ckpt.tmp12")
    assert user_message(err) == ("No space left on device writing runs/default/k3/checkpoints/.last.ckpt.tmp12: "
                                 "free some space, then run the same command again (the run resumes from its last "
                                 "checkpoint)")
    assert user_message(OSError(errno.EACCES, "Permission denied")) is None  # anything else keeps its traceback


def test_missing_packages_are_checked_in_process_too(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r'needs the wandb package: pip install -e "\.\[wandb\]"'):
        check_config(composed("logger=[wandb,tensorboard]"))


def test_a_multirun_reports_each_failed_run_and_goes_on(tmp_path):
    out = tmp_path / "runs"
    proc = cli("-m", "train.max_steps=0,-3", "decay.name=sigmod,softplus", f"out_dir={out}", "group=g")
    assert proc.returncode == 2, proc
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: train.max_steps=0 must be a positive integer"] * 2 + [
        "error: train.max_steps=-3 must be a positive integer"] * 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "0 completed, 0 skipped, 4 failed" in proc.stdout
    assert sorted(p.name for p in (out / "g").iterdir()) == [".sweep", "multirun.yaml"]  # the sweep's records, no run



# -- --help ------------------------------------------------------------------------------------------

def test_help_lists_the_commands_every_group_its_options_and_default():
    proc = cli("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    text = proc.stdout
    for command in ("python run.py ", "python run.py -m sweep=ablate_decay", "python run.py resume=last"):
        assert f"\n  {command}" in text
    entries = dict(re.findall(r"^  (\w+) +(\S.*)$", text, re.M))
    for switch, spec in SWITCHES.items():
        assert entries[switch].split() == [f"*{spec.options[0]}", *spec.options[1:]], switch
        assert " ".join(spec.what.split()[:4]) in text
    for group, default in conf_defaults().items():
        if group in SWITCHES:
            continue
        options = {f.stem for f in (ROOT / "conf" / group).glob("*.yaml")}
        listed = set(re.findall(r"\*?(\w+)", entries[group].split("(none")[0]))
        assert listed <= options and (default is None or f"*{default}" in entries[group]), group
        assert " ".join(GROUPS[group].split()[:3]) in text
    assert text == subprocess.run([sys.executable, "-m", "k3lab.help"], cwd=ROOT, capture_output=True,
                                  text=True).stdout


def test_every_config_group_is_a_switch_or_described():
    folders = {p.name for p in (ROOT / "conf").iterdir() if p.is_dir() and p.name != "hydra"}  # Hydra's own groups
    assert folders == set(SWITCHES) | set(GROUPS)
    assert set(conf_defaults()) == folders


# -- what a run prints -------------------------------------------------------------------------------

def test_building_the_token_cache_says_so_with_its_time(tmp_path, capsys):
    from k3lab.config import DataConfig
    from k3lab.data.datamodule import prepare_lm

    (tmp_path / "c").mkdir()
    for name in ("a", "b", "c"):
        (tmp_path / "c" / f"{name}.txt").write_text(f"some words of {name} to learn merges from, " * 200)
    cfg = DataConfig(name="text", path=str(tmp_path / "c"), vocab_size=300, cache_dir=str(tmp_path / "cache"))
    prepare_lm(cfg)
    before, after = capsys.readouterr().out.splitlines()
    assert before.startswith("tokenizer: training a byte-level BPE of 300 tokens on 2 training documents of text")
    assert re.fullmatch(r"tokenizer: trained in \d+\.\d s, [\d,]+ tokens encoded in \d+\.\d s", after)
    prepare_lm(cfg)
    assert capsys.readouterr().out == ""  # a warm cache is silent


def test_tables_have_no_colour_codes_when_stdout_is_a_file(tmp_path, monkeypatch, capsys):
    from k3lab.budget import RunLength
    from k3lab.progress import print_run_header

    monkeypatch.setenv("FORCE_COLOR", "1")
    print_run_header(composed(), tmp_path, {"params_total": 10}, 1.0, 2.0, 3, RunLength(200, "default_steps"))
    out = capsys.readouterr().out
    assert "decay" in out and "\x1b" not in out
