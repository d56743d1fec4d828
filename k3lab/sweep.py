"""The closing table of a multirun: which runs completed, were skipped, resumed or failed, and why.

A Hydra callback (conf/config.yaml, `hydra.callbacks`), so it works with any launcher. A run that fails
is reported when it ends (`k3lab.errors.report`: one line `error: ...` for a bad setting, else the
traceback) and the sweep goes on. Hydra then re-raises the first failure, which run.py does not print
again, and exits non-zero without calling `on_multirun_end`; so the table is printed at interpreter exit
unless the sweep ended cleanly. It is what a researcher reads before re-running the same command (completed runs
are then skipped, killed or failed runs resumed from their last checkpoint: k3lab.rundir.prepare_run_dir).
"""
from __future__ import annotations

import atexit
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.experimental.callback import Callback
from omegaconf import DictConfig
from rich.table import Table

from k3lab.console import console
from k3lab.errors import report, user_message

OUTCOME = {"new": "completed", "restart": "completed (restarted)", "resume": "completed (resumed)",
           "skip": "skipped (completed before)"}


class SweepReport(Callback):
    def __init__(self) -> None:
        self.rows: list[tuple[tuple[str, ...], str, str]] = []  # (overrides, outcome, result or error)
        self.sweep_dir = ""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.rows, self.sweep_dir = [], str(config.hydra.sweep.dir)
        atexit.register(self.print_table)

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        overrides = tuple(job_return.overrides or ())
        if job_return.status == JobStatus.COMPLETED:
            summary = job_return.return_value or {}
            loss = summary.get("loss_val_final")
            self.rows.append((overrides, OUTCOME.get(summary.get("outcome"), "completed"),
                              f"val loss {loss:.4f}" if isinstance(loss, float) else ""))
        else:
            err = job_return._return_value  # the exception; .return_value would re-raise it
            report(err)
            self.rows.append((overrides, "FAILED", (user_message(err) or f"{type(err).__name__}: {err}")[:200]))

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        atexit.unregister(self.print_table)
        self.print_table()

    def print_table(self) -> None:
        if not self.rows:
            return
        common = set.intersection(*(set(r[0]) for r in self.rows))
        table = Table(title=f"sweep {self.sweep_dir}: {' '.join(o for o in self.rows[0][0] if o in common)}",
                      show_lines=False)
        table.add_column("run (the overrides that differ)", overflow="fold")
        table.add_column("outcome", no_wrap=True)
        table.add_column("result / error", overflow="fold")
        for overrides, outcome, result in self.rows:
            table.add_row(" ".join(o for o in overrides if o not in common) or "(the only run)", outcome, result,
                          style="red" if outcome == "FAILED" else None)
        failed = sum(r[1] == "FAILED" for r in self.rows)
        skipped = sum(r[1].startswith("skipped") for r in self.rows)
        out = console(140)
        out.print(table)
        out.print(f"{len(self.rows) - failed - skipped} completed, {skipped} skipped, {failed} failed"
                      + ("; run the same command again to retry the failed runs (completed ones are skipped)"
                         if failed else ""))
