"""The learning-rate schedules (k3lab/optim/build.py lr_lambda): WSD's multiplier at every phase boundary and
its two decay shapes, the stable phase alone (a trunk), the optimizer's groups following it, and a WSD key
set under the cosine schedule refused with one line."""
import math
import re

import pytest
from benchmarks.step import compose_config

from k3lab.config import OptimConfig, check_config
from k3lab.errors import ConfigError
from k3lab.optim import build_optimizer, decay_steps, lr_lambda

from test_optim import ToyLM

# every multiplier is a few float64 operations on numbers of order 1: equal to the formula to 1e-12
EXACT = 1e-12


def test_wsd_multiplier_at_every_phase_boundary():
    warmup, total, decay, floor = 10, 100, 20, 0.1
    f = lr_lambda(warmup, total, floor, "wsd", decay, "linear")
    assert f(0) == pytest.approx(1 / warmup, abs=EXACT)
    assert f(warmup - 2) < 1.0 and f(warmup - 1) == 1.0               # the warm-up ends at the peak
    assert all(f(s) == 1.0 for s in range(warmup - 1, total - decay + 1))  # stable, and the decay's first step
    assert f(total - decay + 1) < 1.0                                     # the decay has begun
    assert f(total - decay // 2) == pytest.approx(floor + (1 - floor) * 0.5, abs=EXACT)  # linear: half-way
    assert f(total) == pytest.approx(floor, abs=EXACT) and f(total + 5) == pytest.approx(floor, abs=EXACT)
    values = [f(s) for s in range(total + 1)]
    assert all(a >= b for a, b in zip(values[warmup:], values[warmup + 1:]))  # never rises after the warm-up


@pytest.mark.parametrize("shape, at", [("linear", lambda p: 1 - p), ("sqrt", lambda p: 1 - math.sqrt(p))])
def test_wsd_decay_shapes(shape, at):
    """p = (s - b) / decay: 1 - p (linear), 1 - sqrt(p) (the 1-sqrt cooldown), from 1 to the floor."""
    warmup, total, decay, floor = 4, 64, 16, 0.25
    f = lr_lambda(warmup, total, floor, "wsd", decay, shape)
    start = total - decay
    for s in range(start, total + 1):
        assert f(s) == pytest.approx(floor + (1 - floor) * at((s - start) / decay), abs=EXACT), s
    # 1-sqrt drops faster than linear early in the decay and ends at the same floor
    linear, sqrt = (lr_lambda(warmup, total, floor, "wsd", decay, k) for k in ("linear", "sqrt"))
    assert all(sqrt(s) < linear(s) for s in range(start + 1, total))


def test_wsd_without_decay_is_the_stable_phase_to_the_end():
    """decay_steps 0: the trunk of cooldown branches holds the peak after its warm-up, at every step."""
    f = lr_lambda(5, 50, 0.1, "wsd", 0)
    assert [f(s) for s in range(5)] == [pytest.approx((s + 1) / 5) for s in range(5)]
    assert all(f(s) == 1.0 for s in range(4, 60))


def test_a_decay_longer_than_the_run_after_warmup_starts_at_the_warmups_end():
    f = lr_lambda(warmup_steps=8, total_steps=10, min_lr_ratio=0.0, schedule="wsd", decay_steps=7)  # a debug run
    assert f(3) < 1.0 and f(4) == 1.0 == f(5)  # the warm-up capped at 5 steps; the decay starts at step 5, not 3
    assert f(6) == pytest.approx(1 - math.sqrt(1 / 5), abs=EXACT) and f(10) == 0.0


def test_decay_steps_follow_the_run_length():
    cfg = OptimConfig(schedule="wsd", decay_frac=0.2)
    assert [decay_steps(cfg, t) for t in (10, 12, 13, 1006)] == [2, 2, 3, 201]  # rounded to the nearest step
    assert decay_steps(OptimConfig(), 1006) == 0  # cosine: no WSD decay


@pytest.mark.parametrize("name", ["muon_per_head", "adamw"])
def test_every_group_follows_the_wsd_schedule(name):
    cfg = OptimConfig(name=name, warmup_steps=4, schedule="wsd", decay_frac=0.25, decay_shape="linear",
                      min_lr_ratio=0.0)
    opt, sched = build_optimizer(ToyLM(), cfg, total_steps=40)
    peaks = {g["name"]: g["lr"] / lr_lambda(4, 40, 0.0)(0) for g in opt.param_groups}  # lr at step 0 = peak / 4
    seen = []
    for _ in range(41):
        seen.append({g["name"]: g["lr"] for g in opt.param_groups})
        opt.step()
        sched.step()
    for group, peak in peaks.items():
        lr = [row[group] for row in seen]
        assert lr[3] == pytest.approx(peak) and lr[30] == pytest.approx(peak)  # stable until step 30 = 40 - 10
        assert lr[35] == pytest.approx(peak / 2) and lr[40] == 0.0


def compose_run(*overrides: str):
    return compose_config(list(overrides))


@pytest.mark.parametrize("overrides, message", [
    (["optim.decay_frac=0.3"], "optim.decay_frac=0.3 acts with optim.schedule=wsd only (optim.schedule=cosine)"),
    (["optim.decay_shape=linear"], "optim.decay_shape=linear acts with optim.schedule=wsd only"),
    (["optim.schedule=step"], "optim.schedule"),
    (["optim.schedule=wsd", "optim.decay_shape=cosine"], "optim.decay_shape"),
    (["optim.schedule=wsd", "optim.decay_frac=1.0"], "optim.decay_frac=1.0 must be < 1"),
])
def test_bad_schedule_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        check_config(compose_run(*overrides))
    assert "\n" not in str(err.value)


def test_every_optim_option_takes_the_wsd_keys():
    for name in ("muon_per_head", "muon", "adamw"):
        check_config(compose_run(f"optim={name}", "optim.schedule=wsd", "optim.decay_frac=0.1",
                                 "optim.decay_shape=linear"))
