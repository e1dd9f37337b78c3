"""One logger for the project; configured once by the entry point, never at import.

Rank 0 logs at INFO; other ranks log warnings and errors only, prefixed with their rank, so a
multi-process run prints one copy of the story and every rank's problems.
"""
from __future__ import annotations

import logging
import sys

LOGGER = logging.getLogger("yolotrain")


def setup_logging(rank: int = 0, world_size: int = 1, verbose: bool = True) -> None:
    """Attach a stream handler to the project logger (idempotent)."""
    level = logging.INFO if (rank == 0 and verbose) else logging.WARNING
    prefix = f"[rank {rank}] " if world_size > 1 and rank != 0 else ""
    for h in list(LOGGER.handlers):
        LOGGER.removeHandler(h)
    handler = logging.StreamHandler(sys.stdout if rank == 0 else sys.stderr)
    handler.setFormatter(logging.Formatter(prefix + "%(message)s"))
    LOGGER.addHandler(handler)
    LOGGER.setLevel(level)
    LOGGER.propagate = False


def colorstr(text: str, color: str = "bold") -> str:
    """Wrap text in an ANSI colour when stdout is a terminal (plain text in logs and CI)."""
    codes = {"bold": "1", "red": "31", "green": "32", "yellow": "33", "blue": "34"}
    if not sys.stdout.isatty():
        return text
    return f"\033[{codes.get(color, '1')}m{text}\033[0m"
