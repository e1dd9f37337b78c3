"""User-facing errors.

A ``UserError`` is a problem with what the user gave us (a file, a flag, a yaml key). The
entry points print its message without a traceback and exit non-zero on every rank.
"""
from __future__ import annotations

import difflib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable

from yolotrain.utils.core.logging import LOGGER


class UserError(Exception):
    """Bad input from the user: the message must name the file or flag and the problem."""

    def __str__(self) -> str:
        """The message itself, also when a DataLoader worker raised it: torch hands it back to the main process
        rebuilt around the worker's traceback, whose last line is the original message."""
        text = super().__str__()
        if text.startswith("Caught UserError in DataLoader worker"):
            last = text.rstrip().splitlines()[-1]
            return last.split("UserError: ", 1)[-1]
        return text


EXIT_PREEMPTED = 75  # sysexits' EX_TEMPFAIL: "temporary failure, retry" -- requeue and --resume auto
EXIT_HUNG = 124  # timeout(1)'s code: a rank made no progress for --hang-timeout minutes (utils/core/watchdog.py)


class Preempted(Exception):
    """Training stopped on a scheduler's signal after saving a checkpoint to resume from."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """Return " Did you mean 'x'?" for the closest choice, or '' when none is close."""
    close = difflib.get_close_matches(str(word).strip(), list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{close[0]}'?" if close else ""


def run_entry_point(main: Callable[[], object]) -> int:
    """Run a CLI's main(): a UserError becomes its message on stderr (no traceback) and exit code 1.

    Every rank runs this, so each one exits non-zero with the reason instead of hanging. Under torchrun (or the
    Python API's launcher) the message also goes to torchelastic's error file, where the launcher reads it.
    """
    try:
        main()
    except UserError as e:
        if LOGGER.handlers:
            LOGGER.error(f"ERROR: {e}")
        else:
            print(f"ERROR: {e}", file=sys.stderr)
        _tell_launcher(e)
        return 1
    except Preempted as e:
        LOGGER.warning(str(e))
        _tell_launcher(e)
        return EXIT_PREEMPTED
    return 0


def _tell_launcher(e: Exception) -> None:
    """torchelastic's error-file format with the bare message (a user error needs no traceback): torchrun's
    summary shows it, and yolotrain/launch.py raises it again (the exit code says which exception)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                json.dump({"message": str(e), "timestamp": int(time.time())}, f)
        except OSError:
            pass  # the launcher then reports the exit code alone
