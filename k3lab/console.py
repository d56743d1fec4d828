"""The Rich console k3lab prints its tables with (the run header, a sweep's closing table)."""
from __future__ import annotations

import sys

from rich.console import Console


def console(width: int) -> Console:
    """A console on stdout that styles only a terminal: a log file (SLURM, nohup, CI) gets plain text
    without colour codes, whatever the environment says (FORCE_COLOR included)."""
    return Console(width=width, force_terminal=sys.stdout.isatty())
