"""User-facing errors.

A ``UserError`` is a problem with what the user gave us (a file, a flag, a yaml key). The
entry points print its message without a traceback and exit non-zero on every rank.
"""
from __future__ import annotations

import difflib
import sys
from collections.abc import Callable, Iterable

from utils.core.logging import LOGGER


class UserError(Exception):
    """Bad input from the user: the message must name the file or flag and the problem."""


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

    Every rank runs this, so each one exits non-zero with the reason instead of hanging.
    """
    try:
        main()
    except UserError as e:
        if LOGGER.handlers:
            LOGGER.error(f"ERROR: {e}")
        else:
            print(f"ERROR: {e}", file=sys.stderr)
        return 1
    except Preempted as e:
        LOGGER.warning(str(e))
        return EXIT_PREEMPTED
    return 0
