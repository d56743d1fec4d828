"""Long-context recall probes, scored at every validation (`probes=recall`) on synthetic sequences made in place.

Two probes, each at several sequence lengths, each scored as the accuracy of a choice among candidates whose
count fixes the chance level:

  mqar     multi-query associative recall (Zoology, arXiv:2312.04927), the layout of `k3lab.data.mqar.make_mqar`
           with `pairs` key-value pairs and query positions uniform over the rest of the sequence (power_a = 1),
           so the distance from a pair to its query grows with the length. The model's guess at a query is its
           most likely token among the example's `pairs` values: chance 1 / pairs.
  passkey  a needle in a haystack: a marker of 2 tokens and a passkey of `passkey_digits` digits at a uniformly
           random depth of filler, and at the end the marker and the passkey again; at each passkey digit of
           the end the guess is the most likely of the example's 10 digit tokens: chance 1/10.

Token identities. Every example draws its own tokens from the model's vocabulary (the end-of-document token
left out): MQAR's keys and values (`make_mqar` over a sub-vocabulary of at most 256 ids, mapped onto that
draw), the marker and digits, and the filler, which never holds a key, value, marker or digit. So a text model
is probed with nothing it was trained to expect but the recall itself, as in Olsson et al.'s induction tests
(arXiv:2209.11895) on repeated random tokens. A model that cannot carry information from the context to the
guess (untrained, or blind to its context) scores chance: the candidates are exchangeable under the draw.

The sequences are the same for every run and every validation (fixed seeds per probe and length), so the
metrics `probe/<probe>/<length>/acc` compare across steps, variants and seeds like the loss; summary.json
keeps their last values. `time/probes_s` logs what each validation's probes took.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import lightning as L
import numpy as np
import torch

from k3lab.config import ProbesConfig
from k3lab.data.mqar import IGNORE_INDEX, make_mqar

PROBES = ("mqar", "passkey")
MQAR_MAX_VOCAB = 256   # Zoology's default MQAR vocabulary: 127 keys, 128 values
DIGITS = 10
MARKER = 2
SEED = 54              # of every probe sequence: one set for every run


@dataclass
class ProbeSet:
    """Sequences of one probe at one length: x [N, L] token ids, y [N, L] the target at scored positions
    (IGNORE_INDEX elsewhere), candidates [N, C] the ids the guess is chosen among."""
    x: np.ndarray
    y: np.ndarray
    candidates: np.ndarray

    @property
    def chance(self) -> float:
        return 1.0 / self.candidates.shape[1]


def _token_draws(rng: np.random.Generator, n: int, vocab_size: int, exclude: tuple[int, ...]) -> np.ndarray:
    """[n, U]: per example, a random order of the vocabulary's ids other than `exclude`."""
    usable = np.setdiff1d(np.arange(vocab_size), np.asarray(exclude, dtype=np.int64))
    return usable[np.argsort(rng.random((n, len(usable))), axis=1)]


def _filler(rng: np.random.Generator, pool: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """[N, L] ids drawn uniformly from each example's row of `pool` [N, P]."""
    return np.take_along_axis(pool, rng.integers(0, pool.shape[1], size=shape), axis=1)


def mqar_probe(n: int, length: int, vocab_size: int, pairs: int, exclude: tuple[int, ...] = (),
               seed: int | list[int] = SEED) -> ProbeSet:
    """`make_mqar` over a sub-vocabulary of M = min(256, U // 2) ids (U usable ids), mapped onto each
    example's own random ids, its filler drawn from the other U - M ids."""
    rng = np.random.default_rng(seed)
    draws = _token_draws(rng, n, vocab_size, exclude)
    m = min(MQAR_MAX_VOCAB, draws.shape[1] // 2) // 2 * 2
    x, y = make_mqar(n, length, m, pairs, seed=[*map(int, np.atleast_1d(seed)), 1], power_a=1.0)
    x, y = x.astype(np.int64), y.astype(np.int64)
    mapped = np.take_along_axis(draws, x, axis=1)       # id 0 (filler) maps to draws[:, 0], replaced next
    mapped = np.where(x == 0, _filler(rng, draws[:, m:], x.shape), mapped)
    scored = y != IGNORE_INDEX
    target = np.where(scored, np.take_along_axis(draws, np.where(scored, y, 0), axis=1), IGNORE_INDEX)
    return ProbeSet(mapped, target, mapped[:, 1:2 * pairs:2])


def passkey_probe(n: int, length: int, vocab_size: int, digits: int, exclude: tuple[int, ...] = (),
                  seed: int | list[int] = SEED) -> ProbeSet:
    """Filler, the needle (marker + passkey) at a uniform depth, and the marker + passkey at the end; the
    scored positions are those whose next token is a passkey digit of the end."""
    needle = MARKER + digits
    if length < 2 * needle:
        raise ValueError(f"passkey probe: length {length} < {2 * needle}, twice the marker and passkey")
    rng = np.random.default_rng([*map(int, np.atleast_1d(seed)), 2])
    draws = _token_draws(rng, n, vocab_size, exclude)
    marker, alphabet, pool = draws[:, :MARKER], draws[:, MARKER:MARKER + DIGITS], draws[:, MARKER + DIGITS:]
    key = np.take_along_axis(alphabet, rng.integers(0, DIGITS, size=(n, digits)), axis=1)
    x = _filler(rng, pool, (n, length))
    rows = np.arange(n)[:, None]
    depth = rng.integers(0, length - 2 * needle + 1, size=n)[:, None] + np.arange(needle)
    x[rows, depth] = np.concatenate([marker, key], axis=1)
    x[:, length - needle:] = np.concatenate([marker, key], axis=1)
    y = np.full((n, length), IGNORE_INDEX, dtype=np.int64)
    y[:, length - digits - 1:length - 1] = key
    return ProbeSet(x, y, alphabet)


@torch.no_grad()
def probe_accuracy(model, probe: ProbeSet, batch_size: int, device: torch.device) -> tuple[int, int]:
    """(correct guesses, scored positions) of `model` (a K3Model) on `probe`, batch_size sequences a call."""
    correct = count = 0
    for start in range(0, len(probe.x), batch_size):
        x, y, cand = (torch.from_numpy(a[start:start + batch_size]).to(device)
                      for a in (probe.x, probe.y, probe.candidates))
        scored = y != IGNORE_INDEX
        logits = model(x, logits_at=scored)                                        # [M, V]
        options = cand[scored.nonzero()[:, 0]]                                     # [M, C]
        guess = options.gather(1, logits.gather(1, options).argmax(1, keepdim=True))[:, 0]
        correct += int((guess == y[scored]).sum())
        count += int(scored.sum())
    return correct, count


class RecallProbes(L.Callback):
    """At the end of every validation (before its checkpoint is written), logs `probe/<probe>/<length>/acc`
    for each probe and length of `cfg`, and `time/probes_s`, in the validation's precision, eagerly (a
    compiled model is not retraced for the probes' shapes). Every rank runs every sequence: under FSDP the
    ranks' forwards must pair up; `lengths` the resolved lengths (ProbesConfig.resolved_lengths)."""

    def __init__(self, cfg: ProbesConfig, lengths: list[int], vocab_size: int, exclude: tuple[int, ...] = ()):
        self.cfg = cfg
        self.sets = {}
        for length in lengths:
            self.sets[f"probe/mqar/{length}/acc"] = mqar_probe(cfg.examples, length, vocab_size, cfg.mqar_pairs,
                                                               exclude, seed=[SEED, length])
            self.sets[f"probe/passkey/{length}/acc"] = passkey_probe(cfg.examples, length, vocab_size,
                                                                     cfg.passkey_digits, exclude, seed=[SEED, length])

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        t0 = time.perf_counter()
        metrics = {}
        with torch.compiler.set_stance("force_eager"), trainer.precision_plugin.forward_context():
            for name, probe in self.sets.items():
                correct, count = probe_accuracy(pl_module.model, probe, self.cfg.batch_size, pl_module.device)
                metrics[name] = correct / count
        pl_module.log_metrics({**metrics, "time/probes_s": time.perf_counter() - t0})
