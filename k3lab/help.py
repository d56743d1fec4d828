"""`python run.py --help` (also `python -m k3lab.help`): the three commands a newcomer needs, then every
config group with what it does, its options and its default.

Nothing here is a fact of its own: the switches, their descriptions and the other groups' come from
k3lab/switches.py (SWITCHES, GROUPS), every group's options and default from conf/ (conf_options,
conf_defaults). run.py registers `register()`'s resolver, which conf/config.yaml's `hydra.help.template` calls.
"""
from __future__ import annotations

import textwrap
from pathlib import Path

from omegaconf import OmegaConf

from k3lab.switches import CONF, GROUPS, SWITCHES, conf_defaults, conf_options

WIDTH = 100

COMMANDS = [
    ("python run.py", "train the K3 default (every K3 option on, tiny model, State of the Union text, CPU)"),
    ("python run.py -m sweep=ablate_decay", "a sweep from sweeps/ (each option x 3 seeds); the same command "
                                            "again skips completed runs and resumes killed ones"),
    ("python run.py resume=last", "continue the most recent unfinished run from its last checkpoint; resume=<run "
                                  "dir> continues that one, written as k3lab prints it (= and , need no quotes)"),
]


def _entry(group: str, options: list[str], default: str | None, what: str, indent: int) -> str:
    shown = [f"*{o}" if o == default else o for o in options]
    if default is None:
        shown.append("(none by default)")
    lines = textwrap.wrap("  ".join(shown), WIDTH - indent, break_on_hyphens=False) or [""]
    first = f"  {group:<{indent - 2}}{lines[0]}"
    rest = [" " * indent + line for line in lines[1:]]
    desc = textwrap.wrap(what, WIDTH - indent - 2, break_on_hyphens=False)
    return "\n".join([first, *rest, *(" " * (indent + 2) + line for line in desc)])


def help_text(conf: Path = CONF) -> str:
    """The whole help page, as plain text."""
    defaults = conf_defaults(conf)
    others = [g for g in defaults if g not in SWITCHES]
    indent = 2 + max(len(g) for g in [*SWITCHES, *others]) + 2
    command_width = max(len(c) for c, _ in COMMANDS) + 3
    out = ["k3lab: ablations and scaling laws for the Kimi K3 architecture. Each run writes one directory,",
           "<out_dir>/<group>/<run_name>/, that is enough to analyse it (docs/run_directory.md).", "",
           "Commands"]
    for command, what in COMMANDS:
        wrapped = textwrap.wrap(what, WIDTH - 2 - command_width)
        out.append(f"  {command:<{command_width}}{wrapped[0]}")
        out.extend(" " * (2 + command_width) + line for line in wrapped[1:])
    out += ["", "Switches: group=option, one K3 innovation each (* marks the K3 default)"]
    out += [_entry(name, list(s.options), s.options[0], s.what, indent) for name, s in SWITCHES.items()]
    out += ["", "Other groups (* marks the default)"]
    out += [_entry(g, list(conf_options(g, conf)), defaults[g], GROUPS[g], indent) for g in others]
    out += ["", "Settings",
            "  Any key of the config, e.g.  python run.py train.max_steps=500 data.batch_size=32 seed=1",
            "  python run.py --cfg job prints every key with its value. A bad key, option or value fails at once",
            "  with one line `error: ...` (exit status 2; HYDRA_FULL_ERROR=1 shows the traceback).",
            "  Hydra's own flags: python run.py --hydra-help"]
    return "\n".join(out)


def register() -> None:
    """Make `${k3lab.help:}` (conf/config.yaml's hydra.help.template) resolve to this page. Hydra fills the
    template with string.Template, so a literal `$` is doubled."""
    if not OmegaConf.has_resolver("k3lab.help"):
        OmegaConf.register_new_resolver("k3lab.help", lambda: help_text().replace("$", "$$"))


if __name__ == "__main__":
    print(help_text())
