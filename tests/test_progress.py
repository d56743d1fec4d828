"""The terminal display (k3lab.progress.RichProgress): a Rich bar that carries what the log lines carry, the
training loss, the last validation loss, tokens/s, elapsed time and ETA, up to the run's last step."""
import io
import re
from types import SimpleNamespace

from rich.console import Console

import k3lab.progress as progress


def test_the_bar_shows_loss_validation_and_pace_and_the_last_validation(monkeypatch):
    screen = io.StringIO()
    monkeypatch.setattr(progress, "console", lambda width: Console(file=screen, width=width, force_terminal=True))
    trainer = SimpleNamespace(global_step=0, is_global_zero=True, sanity_checking=False)
    module = SimpleNamespace(last_train_loss=float("nan"), last_val={}, tokens_per_step=4096)
    bar = progress.RichProgress(max_steps=4)
    bar.on_train_start(trainer, module)
    for step in range(1, 5):
        trainer.global_step, module.last_train_loss = step, 5.0 - step / 10
        bar.on_train_batch_end(trainer, module, None, None, step - 1)
        if step in (2, 4):  # validations at step 2 and at the last step, after its batch
            module.last_val = {"loss/val": 4.0 - step / 100, "acc/val": 0.25}
            bar.on_validation_end(trainer, module)
    task = bar.progress.tasks[bar.task]
    assert task.completed == 4 and task.fields["loss"] == "4.600" and task.fields["val"] == "3.960"
    assert task.fields["tok_s"].endswith("k") and task.fields["eta"] == "0:00"
    bar.on_train_end(trainer, module)
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen.getvalue())  # the text, without the styling
    assert "step 2: val loss 3.9800 acc 0.250" in shown and "step 4: val loss 3.9600 acc 0.250" in shown
    assert "val 3.960" in shown  # the bar's last drawing carries the last validation
