"""What `python run.py` prints when something goes wrong, and with which exit status.

A `UserError` is a failure whose message says everything the user needs: a bad value, a misspelt key
or option, a path that does not exist, a busy run directory, a checkpoint that cannot be read, data
that cannot be read, a loss that stopped being finite. The command prints it as one line
`error: <message>` on stderr and exits with status 2. A misspelt key or option caught by Hydra while it
composes the config is reported the same way, with the closest valid name, and so is a full disk (the
file it could not write, and that the same command resumes the run). Any other exception is a bug
or a failure of the machine and keeps its traceback (status 1). `HYDRA_FULL_ERROR=1` shows the complete
traceback of every error instead.

Within a multirun each failed run is reported when it ends (`k3lab.sweep.SweepReport`) and the sweep
goes on; the sweep's closing table follows.
"""
from __future__ import annotations

import contextlib
import difflib
import errno
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterable, Sequence

USER_ERROR_STATUS = 2
FULL_ERROR = "HYDRA_FULL_ERROR"
_USER_CHOICE = "K3LAB_FULL_ERROR"  # the user's HYDRA_FULL_ERROR, inherited by the processes a run starts (DDP)


class UserError(Exception):
    """A failure its message explains fully: printed as one line, no traceback."""


class ConfigError(UserError, ValueError):
    """A setting that cannot work: an unknown key, a value of the wrong type or out of range, no such option."""


class DataError(UserError):
    """The data a run names cannot be read (the message names the file and what is wrong with it)."""


@contextlib.contextmanager
def reading_data():
    """Around the code that reads a run's data: a ValueError or OSError raised there is about the files
    it names (a malformed record, a folder with no text, a full cache disk) and becomes a DataError."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, OSError) as err:
        raise DataError(" ".join(str(err).split())) from err


def did_you_mean(word: str, candidates: Iterable[str]) -> str | None:
    """The candidate closest to `word` (difflib), or None when none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return close[0] if close else None


def not_an_option(key: str, value: str, options: Sequence[str], quote: bool = True) -> str:
    """`decay.name='sigmod' is not an option; did you mean 'sigmoid'? valid options: sigmoid, softplus`.
    quote=False writes it as a command-line choice: `decay=sigmod ... did you mean decay=sigmoid?`."""
    shown = repr(value) if quote else value
    guess = did_you_mean(str(value), options)
    hint = "" if guess is None else f" did you mean {guess!r}?" if quote else f" did you mean {key}={guess}?"
    return f"{key}={shown} is not an option;{hint} valid options: {', '.join(options)}"


def _children(keys: set[str], parent: str) -> list[str]:
    """The names directly under `parent` ('' for the top level) among dotted `keys`."""
    if not parent:
        return sorted({k.split(".")[0] for k in keys})
    return sorted({k[len(parent) + 1:].split(".")[0] for k in keys if k.startswith(parent + ".")})


def not_a_key(key: str, keys: Iterable[str]) -> str:
    """`train.max_stepz is not a key; did you mean train.max_steps?`: each part of the dotted key that is
    not there is matched against the names at its level, so a misspelt group (`trian.max_steps`) is found too."""
    keys = set(keys)
    fixed: list[str] = []
    for part in key.split("."):
        names = _children(keys, ".".join(fixed))
        guess = part if part in names else did_you_mean(part, names)
        if guess is None:
            where = ".".join(fixed)
            if where and names:
                return f"{key} is not a key; the keys of {where}: {', '.join(names)}"
            nested = {k.rsplit(".", 1)[-1]: k for k in sorted(keys, key=len, reverse=True)}  # leaf -> its shortest key
            leaf = did_you_mean(key.rsplit(".", 1)[-1], nested)
            if leaf is not None:
                return f"{key} is not a key; did you mean {nested[leaf]}?"
            return f"{key} is not a key (python run.py --cfg job prints every key)"
        fixed.append(guess)
    return f"{key} is not a key; did you mean {'.'.join(fixed)}?"


def dotted_keys(node, prefix: str = "") -> list[str]:
    """Every key of an OmegaConf mapping as a dotted path (`train`, `train.max_steps`, ...), the Hydra node left out."""
    from omegaconf import DictConfig

    keys = []
    for key in node.keys() if isinstance(node, DictConfig) else ():
        if not prefix and key == "hydra":
            continue
        path = f"{prefix}{key}"
        keys.append(path)
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            keys.extend(dotted_keys(child, path + "."))
    return keys


def composition_message(err: BaseException) -> str | None:
    """One line for an error Hydra raises while composing the config from the command line, or None
    when `err` is not one (then it is reported as any other exception)."""
    from hydra.errors import CompactHydraException, MissingConfigException, OverrideParseException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

    if isinstance(err, MissingConfigException) and err.missing_cfg_file and err.options is not None:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return not_an_option(group, option, sorted(err.options), quote=False)
    cause = err.__cause__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)) and cause.parent_node is not None:
        named = re.match(r"Could not override '([^']+)'", str(err))
        key = named.group(1) if named else str(cause.full_key)
        return not_a_key(key, dotted_keys(cause.parent_node._get_root()))
    if isinstance(cause, ValidationError) and cause.full_key:  # a value of the wrong type for its schema field
        from k3lab.config import wrong_value

        return wrong_value(str(cause.full_key), cause.value)
    if isinstance(err, OverrideParseException):
        reason = str(err.message).splitlines()[0]
        return f"cannot read the override {err.override!r}: {reason} (grammar: https://hydra.cc/docs/advanced/override_grammar/basic/)"
    if isinstance(err, CompactHydraException):
        text = str(err) if cause is None else f"{err} {cause}"
        return " ".join(line.strip() for line in text.splitlines() if line.strip())
    return None


def user_message(err: BaseException) -> str | None:
    """The one line that reports `err` (user errors, Hydra's composition errors, a full disk), or None for
    any other error."""
    if isinstance(err, UserError):
        return " ".join(str(err).split())
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{err.strerror} writing {err.filename}: free some space, then run the same command again "
                "(the run resumes from its last checkpoint)")
    return composition_message(err)


def full_tracebacks() -> bool:
    """True when the user asked for complete tracebacks (HYDRA_FULL_ERROR=1)."""
    return os.environ.get(_USER_CHOICE, os.environ.get(FULL_ERROR, "")) == "1"


def prog_error(prog: str, err: UserError) -> int:
    """A command-line tool's one line for a user error on stderr (`prog: error: ...`, argparse's form);
    returns the exit status, 2."""
    print(f"{prog}: error: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
    return USER_ERROR_STATUS


_reported: list[BaseException] = []  # errors already printed (a multirun's failed runs, when each ended)


def report(err: BaseException) -> int:
    """Print `err` once (one line for a user error, else its traceback from the task function down) and
    return the exit status it deserves: 2 for a user error, 1 for anything else."""
    message = user_message(err)
    status = USER_ERROR_STATUS if message is not None else 1
    if any(err is seen for seen in _reported):
        return status
    _reported.append(err)
    if message is not None and not full_tracebacks():
        print(f"error: {message}", file=sys.stderr, flush=True)
        return status
    tb = err.__traceback__
    if not full_tracebacks():
        frame = tb
        while frame is not None and frame.tb_frame.f_code.co_name != "run_job":  # Hydra's frames above the task
            frame = frame.tb_next
        tb = tb if frame is None else frame.tb_next
    traceback.print_exception(type(err), err, tb)
    return status


@contextlib.contextmanager
def task_errors(single_run: bool):
    """Around the task function of `@hydra.main`. In a single run an error is reported here and the
    process exits with its status (Hydra would first print a line of its own); in a multirun it goes up,
    so that Hydra records the run failed and launches the next (k3lab.sweep.SweepReport reports it)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - reported once, with the status it deserves
        if not single_run:
            raise
        sys.exit(report(err))


def run_command(hydra_main: Callable[[], object]) -> None:
    """Run a `@hydra.main` function and exit: errors are reported by `report`, not by Hydra.

    Hydra prints a shortened traceback of any error unless HYDRA_FULL_ERROR=1, in which case it re-raises;
    so it is set here, and the user's own choice is kept in K3LAB_FULL_ERROR (inherited by the DDP
    workers Lightning starts with the same command)."""
    os.environ.setdefault(_USER_CHOICE, os.environ.get(FULL_ERROR, ""))
    os.environ[FULL_ERROR] = "1"
    try:
        hydra_main()
    except BrokenPipeError:  # `python run.py --help | head`: the reader has gone, say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    except Exception as err:  # noqa: BLE001 - every error is reported here, once
        sys.exit(report(err))
