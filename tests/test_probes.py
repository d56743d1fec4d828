"""Recall probes (k3lab/probes.py): a model that cannot recall scores chance, an ideal copier scores 1, the
sequences hold what they claim, and a run with probes=recall logs them and keeps their last values."""
import json
import math

import numpy as np
import pytest
import torch

from k3lab.config import ModelConfig
from k3lab.model.k3 import K3Model
from k3lab.probes import DIGITS, mqar_probe, passkey_probe, probe_accuracy

VOCAB, EOD = 300, 0


class SuffixCopier:
    """An ideal recaller with K3Model's call: at each asked position, all the logit on the token that followed
    the earlier position whose preceding tokens match the current ones longest (an induction head that
    looks back as far as it needs)."""

    def __call__(self, x: torch.Tensor, logits_at: torch.Tensor) -> torch.Tensor:
        out = []
        for b, t in logits_at.nonzero().tolist():
            seq = x[b].numpy()
            match = np.zeros(t, dtype=np.int64)          # match[s]: how far seq[..s] and seq[..t] agree backwards
            alive = seq[:t] == seq[t]
            for back in range(t + 1):
                match += alive
                if back == t or not alive.any():
                    break
                alive &= np.concatenate([[False] * (back + 1), seq[:t - back - 1] == seq[t - back - 1]])
            logits = torch.zeros(VOCAB)
            logits[seq[int(match.argmax()) + 1]] = 1.0
            out.append(logits)
        return torch.stack(out)


def model(blind: bool) -> K3Model:
    """A small untrained model; blind: every mixer's output projection zeroed, so each position sees itself alone."""
    torch.manual_seed(0)
    m = K3Model(ModelConfig(n_layers=4, d_model=64, head_dim=32, vocab_size=VOCAB)).eval()
    if blind:
        with torch.no_grad():
            for sub in m.sublayers[::2]:
                sub.fn.o_proj.weight.zero_()
    return m


def within_chance(correct: int, count: int, chance: float) -> bool:
    """|accuracy - chance| within 4 binomial standard deviations. A probe's guesses are not independent
    trials (MQAR's queries of one example share its values; a blind model's guesses at n keys hit like the
    fixed points of a random permutation, variance about 1 per example against the binomial n p (1 - p)),
    which 4 deviations cover."""
    return abs(correct / count - chance) <= 4 * math.sqrt(chance * (1 - chance) / count)


@pytest.mark.parametrize("blind", [False, True], ids=["untrained", "context_blind"])
def test_a_model_that_cannot_recall_scores_chance(blind):
    m = model(blind)
    for probe in (mqar_probe(64, 128, VOCAB, 8, (EOD,)), passkey_probe(64, 128, VOCAB, 5, (EOD,))):
        correct, count = probe_accuracy(m, probe, 16, torch.device("cpu"))
        assert within_chance(correct, count, probe.chance), (correct / count, probe.chance)


def test_an_ideal_recaller_scores_one():
    for probe in (mqar_probe(8, 256, VOCAB, 16, (EOD,)), passkey_probe(8, 256, VOCAB, 5, (EOD,))):
        count = int((probe.y != -100).sum())
        assert probe_accuracy(SuffixCopier(), probe, 4, torch.device("cpu")) == (count, count)


def test_mqar_layout():
    probe = mqar_probe(32, 512, VOCAB, 16, (EOD,), seed=3)
    assert probe.chance == 1 / 16
    again = mqar_probe(32, 512, VOCAB, 16, (EOD,), seed=3)
    assert all(np.array_equal(a, b) for a, b in zip((probe.x, probe.y, probe.candidates),
                                                    (again.x, again.y, again.candidates)))
    for x, y, cand in zip(probe.x, probe.y, probe.candidates):
        keys, scored = x[0:32:2], np.flatnonzero(y != -100)
        assert EOD not in x and len(set(keys)) == 16 and len(set(cand)) == 16 and not set(keys) & set(cand)
        assert sorted(x[scored]) == sorted(keys)                     # every key queried once
        assert all(y[t] == cand[list(keys).index(x[t])] for t in scored)  # the target is the key's value
        filler = np.delete(x, np.concatenate([np.arange(32), scored]))
        assert not set(filler) & (set(keys) | set(cand))
    # queries spread over the sequence (uniform gaps): the mean distance to the pairs grows with the length
    gaps = [np.flatnonzero(mqar_probe(32, n, VOCAB, 16, (EOD,)).y != -100).mean() for n in (128, 1024)]
    assert gaps[1] > 4 * gaps[0]


def test_passkey_layout():
    probe = passkey_probe(32, 300, VOCAB, 5, (EOD,), seed=3)
    assert probe.chance == 1 / DIGITS
    depths = []
    for x, y, cand in zip(probe.x, probe.y, probe.candidates):
        needle = x[-7:]                                              # marker (2) and passkey (5)
        starts = [s for s in range(len(x) - 7) if np.array_equal(x[s:s + 7], needle)]
        assert len(starts) == 1 and EOD not in x and set(needle[2:]) <= set(cand)
        depths.append(starts[0])
        assert np.array_equal(np.flatnonzero(y != -100), np.arange(len(x) - 6, len(x) - 1))
        assert np.array_equal(y[y != -100], needle[2:])
        filler = np.delete(x, np.r_[starts[0]:starts[0] + 7, len(x) - 7:len(x)])
        assert not set(filler) & (set(needle[:2]) | set(cand))
    assert min(depths) < 60 and max(depths) > 220                     # needles at every depth


def test_run_logs_probes(trained_run):
    """The run of `trained_run` has probes=recall at lengths 64 and 128: each validation logs both probes at
    both lengths and their time, and summary.json keeps the last values."""
    rows = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    names = [f"probe/{p}/{n}/acc" for p in ("mqar", "passkey") for n in (64, 128)]
    probed = [r for r in rows if "time/probes_s" in r]
    assert [r["step"] for r in probed] == [r["step"] for r in rows if "loss/val" in r] and len(probed) >= 2
    assert all(0 <= r[name] <= 1 for r in probed for name in names)
    summary = json.loads((trained_run / "summary.json").read_text())
    assert {name: summary[name] for name in names} == {name: probed[-1][name] for name in names}


def test_config_checks():
    from hydra import compose, initialize_config_dir

    from k3lab.config import check_config
    from k3lab.errors import ConfigError
    from test_train import ROOT

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        check_config(compose("config", overrides=["probes=recall", "probes.lengths=[64,4096]"]))
        for bad, says in ((["probes.lengths=[64,40]"], "probes.lengths: 40 is shorter than 64"),
                          (["probes.examples=0"], "probes.examples=0 must be >= 1")):
            with pytest.raises(ConfigError, match=says):
                check_config(compose("config", overrides=["probes=recall", *bad]), ["probes=recall", *bad])
