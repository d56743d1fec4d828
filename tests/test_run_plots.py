"""A run's own figures (k3lab/plots.py): the loss figure says what the run is and where the unigram entropy
lies."""
import numpy as np

from analysis.synthetic import write_run
from k3lab import plots
from k3lab.switches import K3_DEFAULT


def test_run_title_names_the_switches_apart_from_the_default_then_model_data_seed():
    summary = {"switches": {**K3_DEFAULT, "glu": "swiglu", "optim": "adamw"}, "model": "tiny", "data": "sotu",
               "seed": 3}
    assert plots.run_title(summary) == "glu=swiglu, optim=adamw\nmodel tiny, data sotu, seed 3"
    assert plots.run_title({**summary, "switches": dict(K3_DEFAULT)}).startswith("K3 default\n")


def test_the_loss_figure_has_the_run_title_and_the_unigram_entropy_line(tmp_path, monkeypatch):
    run = tmp_path / "k3"
    write_run(run, {**K3_DEFAULT, "glu": "swiglu"}, 0, 1e6, 2e7, 0.0, np.random.default_rng(0))  # unigram 7.0
    figures = []
    monkeypatch.setattr(plots.plt, "close", figures.append)
    plots.write_run_plots(run)
    assert (run / "plots" / "loss.png").exists()
    ax = figures[0].axes[0]
    assert ax.get_title() == "glu=swiglu\nmodel tiny, data synthetic, seed 0"
    [line] = [ln for ln in ax.get_lines() if ln.get_label().startswith("unigram entropy")]
    assert line.get_label() == "unigram entropy 7.000" and set(line.get_ydata()) == {7.0}
