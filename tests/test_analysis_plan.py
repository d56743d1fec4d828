"""The planner (analysis.plan): seeds for a minimum detectable effect against statsmodels' power, the pilot's
seed spread against its runs, the validation-window term recovered from training losses with a known
noise, and the cost of a plan."""
import numpy as np
import pandas as pd
import pytest
from scipy import stats
from statsmodels.stats.power import TTestPower

from analysis.plan import (PilotNoise, PlannedRun, main, pilot_noise, plan_cost, plan_runs, seeds_for_mde,
                           upper_bound, window_sd)
from analysis.stats import paired_power
from analysis.synthetic import write_ablation_sweep

@pytest.mark.parametrize("sd, mde, k", [(0.03, 0.03, 1), (0.03, 0.03, 2), (0.0319, 0.03, 2), (0.01, 0.05, 6)])
def test_seeds_are_the_fewest_with_power_08_at_alpha_over_k(sd, mde, k):
    n = seeds_for_mde(sd, mde, k, min_seeds=2)
    assert paired_power(mde / sd, n, 0.05 / k)[0] >= 0.8
    if n > 2:
        assert paired_power(mde / sd, n - 1, 0.05 / k)[0] < 0.8
    assert seeds_for_mde(sd, mde, k, min_seeds=25) == max(n, 25)


def test_paired_power_is_statsmodels_power_and_a_simulated_tests():
    """Against TTestPower where scipy's noncentral t is finite (1e-9), and against 200,000 simulated paired
    t-tests where it is not (d = 5, n = 3: the Monte Carlo error of the rate is 0.0007)."""
    for d, n, alpha in ((1.0, 10, 0.05), (0.94, 14, 0.025), (0.3, 40, 0.01), (5.0, 2, 0.05 / 6)):
        assert paired_power(d, n, alpha)[0] == pytest.approx(TTestPower().power(effect_size=d, nobs=n, alpha=alpha),
                                                          abs=1e-9)
    rng = np.random.default_rng(0)
    x = rng.normal(5.0, 1.0, (200_000, 3))
    t = x.mean(1) / (x.std(1, ddof=1) / np.sqrt(3))
    rate = np.mean(np.abs(t) > stats.t.ppf(1 - 0.05 / 12, 2))
    assert paired_power(5.0, 3, 0.05 / 6)[0] == pytest.approx(rate, abs=0.004)


def test_the_upper_bound_of_a_spread_covers_it_90_percent_of_the_time():
    """sd sqrt(dof / chi2_{0.10, dof}) lies above the true sd in 90% of samples (100,000 samples of 4 values:
    the Monte Carlo error of the rate is 0.001)."""
    rng = np.random.default_rng(0)
    sds = rng.normal(0, 2.0, (100_000, 4)).std(1, ddof=1)
    assert np.mean(upper_bound(sds, 3) >= 2.0) == pytest.approx(0.90, abs=0.005)


def test_the_pilot_spread_is_the_pooled_sd_of_its_per_seed_differences(tmp_path):
    truth = write_ablation_sweep(tmp_path / "sweep", broken=False, seed_noise=0.01)
    args = _args()
    noise = pilot_noise([str(tmp_path / "sweep")], args)
    diffs = {f"{sw}-{opt}": [truth[f"{sw}-{opt}-s{s}"] - truth[f"baseline-s{s}"] for s in range(3)]
             for sw, opt in (("glu", "swiglu"), ("balance", "sign"), ("balance", "aux"), ("residual", "standard"),
                             ("optim", "adamw"))}
    pooled = np.sqrt(np.mean([np.var(d, ddof=1) for d in diffs.values()]))
    assert len(noise.comparisons) == 5 and noise.dof == 10
    assert noise.sd_diff == pytest.approx(pooled, rel=1e-9)
    assert noise.val_windows == 65536 / 256  # data.val_tokens / data.seq_len


def test_the_window_term_is_recovered_from_the_training_losses_of_same_seed_runs():
    """Two runs of one seed whose logged training losses differ by a smooth trend plus the mean difference over
    400 windows, each window's difference N(0, 0.07): the estimate is 0.07 within the sampling error of a
    variance from 1,000 second differences (about 6% on the sd; 20% allowed)."""
    rng = np.random.default_rng(1)
    steps = np.arange(25, 2 * 1000 * 25 + 1, 25)
    trend = 3.0 * (steps / steps[0]) ** -0.1
    a = trend + rng.normal(0, 0.03, len(steps))  # the batch's own difficulty, common to both runs
    b = a + 0.05 * np.exp(-steps / 1e4) + rng.normal(0, 0.07 / np.sqrt(400), len(steps))
    curves = pd.DataFrame({"run_id": np.repeat(["a", "b"], len(steps)), "step": np.tile(steps, 2),
                           "metric": "loss/train", "value": np.concatenate([a, b])})
    runs = pd.DataFrame({"run_id": ["a", "b"], "config.train.log_every": 25, "tokens_per_step": 16 * 2048,
                         "config.data.seq_len": 2048})
    sd, used = window_sd([(0, "b", "a")], runs, curves)
    assert used == 1 and sd == pytest.approx(0.07, rel=0.2)


def test_validation_windows_shrink_only_the_window_term():
    noise = PilotNoise(sd_diff=0.032, dof=12, sd_window=0.063, pairs=18, val_windows=32, comparisons=pd.DataFrame())
    assert noise.sd_at(32) == pytest.approx(0.032)
    assert noise.sd_seed() == pytest.approx(np.sqrt(0.032 ** 2 - 0.063 ** 2 / 32))
    assert noise.sd_seed() < noise.sd_at(512) < noise.sd_at(128) < noise.sd_at(32)


def test_the_cost_of_a_plan_adds_up_its_runs():
    runs = plan_runs([("small", 1e7, 5e5), ("big", 1e8, 1e5)], ["base", "var"], seeds=4, tokens_per_param=20,
                     tune_runs=3)
    assert len(runs) == 2 * 2 * (4 + 3) and {r.purpose for r in runs} == {"tuning", "reported"}
    cost = plan_cost(runs, slice_minutes=25).set_index("size")
    assert cost.loc["small", "runs"] == 14 and cost.loc["small", "tuning"] == 6
    assert cost.loc["small", "run_minutes"] == pytest.approx(20 * 1e7 / 5e5 / 60)
    assert cost.loc["big", "device_minutes"] == pytest.approx(14 * 20 * 1e8 / 1e5 / 60)
    assert bool(cost.loc["small", "fits_a_slice"]) and not bool(cost.loc["big", "fits_a_slice"])
    assert cost.loc["all", "device_minutes"] == pytest.approx(sum(r.minutes for r in runs))
    assert PlannedRun("s", 1e6, "c", 0, "reported", 6e6, 1e5).minutes == pytest.approx(1.0)


def test_plan_from_a_given_spread_and_bad_input_in_one_line(tmp_path, capsys):
    text = main(["--sd-diff", "0.03", "--window-sd", "0.06", "--val-windows", "32", "--mde", "0.03",
                 "--primaries", "2", "--size", "d4:6590476:471816", "--md", str(tmp_path / "plan.md")])
    assert "| 1048576 " in text and "**Cost**" in text and (tmp_path / "plan.md").read_text().startswith("**Seed")
    for bad, says in ((["--sd-diff", "-1", "--mde", "0.03"], "analysis.plan: --sd-diff -1.0: must be > 0"),
                      (["--mde", "0.03"], "analysis.plan: give a pilot's run directories or --sd-diff")):
        with pytest.raises(SystemExit) as stop:
            main(bad)
        assert str(stop.value).startswith(says) and "\n" not in str(stop.value)
    with pytest.raises(SystemExit):
        main(["--sd-diff", "0.03", "--mde", "0.03", "--size", "d4:x:1"])
    assert "--size 'd4:x:1': expected LABEL:N:TOKENS_PER_S" in capsys.readouterr().err.splitlines()[-1]


def _args():
    from analysis.plan import build_parser

    return build_parser().parse_args(["--mde", "0.03", "x"])
