"""Run length by budget (k3lab/budget.py): train.tokens_per_param and train.flop_budget give the step counts
they promise, computed here from the model's own parameter counts and FLOPs function; the LR schedule
follows the resolved length; two length settings are one clear error."""
import json
import math
import re

import lightning as L
import pytest
from hydra import compose, initialize_config_dir

from k3lab.config import run_config
from k3lab.data.tokenizer import ByteTokenizer
from k3lab.flops import flops_per_token
from k3lab.model import K3Model
from k3lab.train import train

from test_train import ROOT, byte_args, rows

TOKENS_PER_STEP = 4 * 32  # FAST: data.batch_size=4, data.seq_len=32, one CPU process


pytestmark = pytest.mark.usefixtures("isolated_cache")


def compose_run(overrides: list[str]):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def independent_model(overrides: list[str]) -> K3Model:
    """The run's model, built here from the same config (byte tokenizer: vocabulary 257)."""
    return K3Model(run_config(compose_run(overrides)).model_config(ByteTokenizer.vocab_size))


class StopAtStart(L.Callback):
    """Records the trainer's length and the LR multiplier at the given steps, then stops before the first step."""

    def __init__(self, steps: list[int]):
        self.steps = steps
        self.seen: dict = {}

    def on_train_start(self, trainer, pl_module):
        factor = trainer.lr_scheduler_configs[0].scheduler.lr_lambdas[0]
        self.seen = {"max_steps": trainer.max_steps, "lr": {s: factor(s) for s in self.steps}}
        trainer.should_stop = True


def test_tokens_per_param_20_sets_max_steps_and_the_schedule_follows(corpus, tmp_path):
    overrides = byte_args(corpus, tmp_path, "train.tokens_per_param=20", "optim.warmup_frac=0.1", "run_name=tpp")
    model = independent_model(overrides)
    n = model.param_counts()["params_active_non_embedding"]
    expected = math.ceil(20 * n / TOKENS_PER_STEP)
    assert expected == 51_319  # 20 x 328,438 / 128 = 51,318.4: rounded up
    warmup = round(0.1 * expected)
    probe = StopAtStart([warmup - 2, warmup - 1, expected - 1, expected])
    summary = train(compose_run(overrides), overrides=overrides, callbacks=[probe])

    assert summary["params_active_non_embedding"] == n
    assert (summary["max_steps"], summary["length_from"]) == (expected, "tokens_per_param")
    assert summary["tokens_per_param"] == 20
    assert summary["flop_budget"] is None
    assert json.loads((tmp_path / "default" / "tpp" / "summary.json").read_text())["max_steps"] == expected
    assert probe.seen["max_steps"] == expected
    lr = probe.seen["lr"]
    assert lr[warmup - 2] < 1.0 and lr[warmup - 1] == 1.0       # warm-up: 10% of the resolved length
    assert lr[expected - 1] > 0.1 and lr[expected] == pytest.approx(0.1)  # cosine ends at the last step


def test_flop_budget_trains_the_steps_it_promises_and_spends_the_budget(corpus, tmp_path):
    budget = 3.5e9
    overrides = byte_args(corpus, tmp_path, f"train.flop_budget={budget}", "train.val_every=6", "run_name=c")
    fpt = flops_per_token(independent_model(overrides), 32)
    expected = math.ceil(budget / (fpt * TOKENS_PER_STEP))
    assert expected == 12  # 3.5e9 / (2,461,824 FLOPs/token x 128 tokens) = 11.1 steps: rounded up
    summary = train(compose_run(overrides), overrides=overrides)

    assert summary["status"] == "completed"
    assert (summary["max_steps"], summary["steps"], summary["length_from"]) == (expected, expected, "flop_budget")
    assert summary["flop_budget"] == budget and summary["flops_per_token"] == fpt
    assert budget <= summary["flops"] < budget + fpt * TOKENS_PER_STEP  # at least the budget, under a step more
    lrs = [r["optim/lr"] for r in rows(tmp_path / "default" / "c") if "optim/lr" in r]
    assert len(lrs) == expected and lrs[-1] == pytest.approx(0.1 * 0.006)  # the cosine reached its floor


@pytest.mark.parametrize("extra", [
    ["train.max_steps=10", "train.tokens_per_param=20"],
    ["train.tokens_per_param=20", "train.flop_budget=1e12"],
    ["debug=fast_dev_run", "train.flop_budget=1e12"],
])
def test_two_length_settings_are_one_error_before_any_run_directory(corpus, tmp_path, extra):
    overrides = byte_args(corpus, tmp_path, *extra)
    with pytest.raises(ValueError, match="the run length is set by at most one of") as err:
        train(compose_run(overrides), overrides=overrides)
    assert "\n" not in str(err.value)
    assert not any(tmp_path.glob("*/*/summary.json"))


@pytest.mark.parametrize("extra, message", [
    ("train.tokens_per_param=0", "train.tokens_per_param=0.0 must be a positive number"),
    ("train.flop_budget=-1.0", "train.flop_budget=-1.0 must be a positive number"),
    ("train.max_steps=0", "train.max_steps=0 must be a positive integer"),
])
def test_bad_length_values_fail_naming_the_key(corpus, tmp_path, extra, message):
    overrides = byte_args(corpus, tmp_path, extra)
    with pytest.raises(ValueError, match=re.escape(message)):
        train(compose_run(overrides), overrides=overrides)


def test_a_length_of_the_wrong_type_fails_as_the_config_is_composed(corpus, tmp_path):
    from k3lab.errors import user_message

    with pytest.raises(Exception) as err:
        compose_run(byte_args(corpus, tmp_path, "train.max_steps=2.5"))
    assert user_message(err.value) == "train.max_steps=2.5 is not an integer or null"
