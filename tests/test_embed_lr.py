"""optim.embed_lr_scale: the input embedding's AdamW rate as a multiple of the AdamW rate (a tuned AdamW's
"embedding rate"). It reaches the embedding table and nothing else; at 1 the groups are those of every run
before it (their checkpoints keep their layout); a rate that is not positive is refused with one line."""
import pytest
import torch
from hydra import compose, initialize_config_dir

from k3lab.config import OptimConfig, check_config
from k3lab.errors import ConfigError
from k3lab.optim import Muon, param_groups

from test_optim import ToyLM, seeded_toy
from test_train import ROOT


def settings(groups: list[dict]) -> dict[int, dict]:
    """Each parameter's optimizer settings (everything of its group but the parameter lists and the name)."""
    return {id(p): {k: v for k, v in g.items() if k not in ("params", "name", "head_blocks")}
            for g in groups for p in g["params"]}


@pytest.mark.parametrize("name", ["muon_per_head", "muon", "adamw"])
@pytest.mark.parametrize("tie", [False, True])
def test_the_embedding_rate_reaches_the_embedding_alone(name, tie):
    model = ToyLM(tie=tie)
    base = settings(param_groups(model, OptimConfig(name=name, lr_scale=0.5)))
    groups = param_groups(model, OptimConfig(name=name, lr_scale=0.5, embed_lr_scale=3.0))
    [embed] = [g for g in groups if g["name"] == "embed"]
    assert [id(p) for p in embed["params"]] == [id(model.embed.weight)]  # tied: the one table, listed once
    assert embed["lr"] == pytest.approx(3.0 * 0.5 * OptimConfig.adam_lr, rel=1e-15)
    scaled = settings(groups)
    assert scaled.keys() == base.keys()  # every parameter once
    for pid, before in base.items():
        factor = 3.0 if pid == id(model.embed.weight) else 1.0
        assert scaled[pid]["lr"] == pytest.approx(before["lr"] * factor, rel=1e-15), pid
        assert {k: v for k, v in scaled[pid].items() if k != "lr"} == {k: v for k, v in before.items() if k != "lr"}


def test_at_one_the_groups_are_unchanged():
    names = [g["name"] for g in param_groups(ToyLM(), OptimConfig())]
    assert names == ["muon", "adamw", "adamw_no_decay"]


def test_the_embedding_steps_at_its_own_rate():
    """One AdamW step from zero moments moves each entry of a parameter with a gradient by about its rate
    (Adam's first step is lr * g / (|g| + eps)); the embedding's rows that were read move 3x as far as at 1."""
    moved = {}
    for scale in (1.0, 3.0):
        model = seeded_toy()
        opt = Muon(param_groups(model, OptimConfig(name="adamw", embed_lr_scale=scale, weight_decay=0.0)))
        before = model.embed.weight.detach().clone()
        model(torch.tensor([[1, 2, 3]])).sum().backward()
        opt.step()
        moved[scale] = (model.embed.weight.detach() - before)[1:4].abs().max().item()
    # |step| = lr * |g| / (|g| + eps), g of order 1 and eps 1e-8: equal to lr to about 1e-7 relative
    assert moved[1.0] == pytest.approx(OptimConfig.adam_lr, rel=1e-5)
    assert moved[3.0] == pytest.approx(3 * OptimConfig.adam_lr, rel=1e-5)


def test_a_rate_that_is_not_positive_is_one_line():
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["optim.embed_lr_scale=0"])
    with pytest.raises(ConfigError, match=r"optim.embed_lr_scale=0.0 must be > 0") as err:
        check_config(cfg)
    assert "\n" not in str(err.value)
