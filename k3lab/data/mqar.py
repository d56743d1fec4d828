"""Multi-query associative recall (MQAR), the synthetic task of Zoology (arXiv:2312.04927).

Layout, as in Zoology's `multiquery_ar` generator (HazyResearch/zoology), for a sequence of
`seq_len` inputs, `n` = `n_kv_pairs`, vocabulary size `V`:

- keys are drawn from [1, V//2) and values from [V//2, V), each without replacement inside one
  example (so `n` distinct keys and `n` distinct values); token 0 is the filler;
- positions 0 .. 2n-1 hold the pairs `k1 v1 k2 v2 ... kn vn`;
- the remaining `seq_len - 2n` positions are filler, except that every key appears exactly once
  more as a query, at position `2n + 2*g` where the gap slots `g` are drawn without replacement
  from range((seq_len - 2n) // 2) with probability proportional to `(g + 1) ** (power_a - 1)`
  (power law, `power_a` = 0.01 by default, so queries tend to come soon after the pairs);
- the target at a query position (the prediction for the next token) is that key's value; every
  other target is -100 (no loss, no accuracy). The input after a query is filler, not the value.
- `random_non_queries=True` replaces every filler 0 by a token uniform over [0, V), as Zoology's
  option of the same name does.

Example (V=12, n=2, seq_len=16, no random filler):

    x: 2    8    4    7    0    0    4    0    0    0    0    0    2    0    0    0
    y: -100 -100 -100 -100 -100 -100 7    -100 -100 -100 -100 -100 8    -100 -100 -100

Differences from Zoology: sampling uses a numpy `Generator` and is vectorised (keys and values by
sorting uniform noise, the weighted gaps by the Gumbel-top-k trick, which has the same law as
numpy's sequential `choice(replace=False, p=...)`), so the random streams differ from theirs while
the distribution is the same. Zoology asserts `V > seq_len`; we only need `V//2 - 1 >= n`.

The default `conf/data/mqar.yaml` setting: seq_len 128, 16 pairs, V = 256 (127 keys, 128 values),
power_a 0.01, zero filler, 100k training and 2k validation examples from different seeds.
"""
from __future__ import annotations

import math

import numpy as np

IGNORE_INDEX = -100


def _random_subsets(rng: np.random.Generator, n_rows: int, pool: int, k: int) -> np.ndarray:
    """For each row, k distinct integers from range(pool) in uniformly random order."""
    return np.argsort(rng.random((n_rows, pool)), axis=1)[:, :k]


def make_mqar(
    n_examples: int,
    seq_len: int,
    vocab_size: int,
    n_kv_pairs: int,
    seed: int | list[int],
    power_a: float = 0.01,
    random_non_queries: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Return `(x, y)`, each `[n_examples, seq_len]` (int16 when the vocabulary fits, else int32)."""
    n = n_kv_pairs
    n_keys = vocab_size // 2 - 1
    if n < 1 or n_keys < n or vocab_size - vocab_size // 2 < n:
        raise ValueError(f"mqar: vocab {vocab_size} has {n_keys} keys, too few for {n} key-value pairs")
    if 4 * n > seq_len:
        raise ValueError(f"mqar: seq_len {seq_len} < 4 * n_kv_pairs ({4 * n}): no room for the queries")
    if power_a <= 0:
        raise ValueError(f"mqar: power_a must be > 0, got {power_a}")
    rng = np.random.default_rng(seed)
    rows = np.arange(n_examples)[:, None]

    keys = 1 + _random_subsets(rng, n_examples, n_keys, n)
    values = vocab_size // 2 + _random_subsets(rng, n_examples, vocab_size - vocab_size // 2, n)

    space = (seq_len - 2 * n) // 2
    log_p = (power_a - 1.0) * np.log(np.arange(1, space + 1))
    gumbel = -np.log(-np.log(rng.random((n_examples, space))))
    gaps = np.argsort(-(log_p + gumbel), axis=1)[:, :n]   # weighted sampling without replacement
    query_pos = 2 * n + 2 * gaps

    x = np.zeros((n_examples, seq_len), dtype=np.int64)
    x[:, 0:2 * n:2] = keys
    x[:, 1:2 * n:2] = values
    x[rows, query_pos] = keys
    y = np.full((n_examples, seq_len), IGNORE_INDEX, dtype=np.int64)
    y[rows, query_pos] = values
    if random_non_queries:
        filler = x == 0
        x[filler] = rng.integers(0, vocab_size, size=int(filler.sum()))
    dtype = np.int16 if vocab_size <= np.iinfo(np.int16).max else np.int32
    return x.astype(dtype), y.astype(dtype)


def answer_entropy(vocab_size: int) -> float:
    """Loss (nats) of a uniform guess over the value range: log(V - V//2). MQAR's floor of meaning."""
    return math.log(vocab_size - vocab_size // 2)
