"""File IO: where shipped and written files live, safe yaml reading, and atomic writes.

Atomic writes are the one way this project replaces a file readers may be looking at.

A kill at any moment leaves either the previous file or the new one, never a torn file: the
data goes to a temp file in the same folder, is fsynced, renamed over the target, and the
folder is fsynced so the rename itself survives a power cut.
"""
from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

import yaml

from yolotrain.utils.core.errors import UserError

# What ships with the code (hyps/, data/, models/): the checkout's top folder, or the installed package's folder.
ROOT = Path(__file__).resolve().parents[2]
# A checkout (python train.py) writes runs into its own runs/; an installed tool into ./runs of the working
# directory, as Ultralytics' does, never into site-packages.
CHECKOUT = (ROOT / "train.py").is_file()
RUNS = ROOT / "runs" if CHECKOUT else Path("runs")


@contextmanager
def atomic_write(path: str | Path, mode: str = "wb", encoding: str | None = None) -> Iterator[IO]:
    """Open a temp file beside ``path`` for writing; on a clean exit it replaces ``path``.

    The temp file is created with open(..., 'x'), so the result gets the user's usual permissions
    (mkstemp would make it owner-only). On any exception, including KeyboardInterrupt, the temp
    file is removed and ``path`` is untouched.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write writes whole files: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, mode.replace("w", "x"), encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load_yaml(path: str | Path) -> dict:
    """safe_load a yaml mapping; UserError naming the file when it is missing, broken or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    try:
        text = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot be read: {e}") from None
    return parse_yaml(text, str(path))


def parse_yaml(text: bytes, name: str) -> dict:
    """safe_load a yaml mapping read from ``name`` (a file or a URL); UserError naming it when it is broken or not
    a mapping."""
    try:
        data = yaml.safe_load(text.decode("utf-8"))
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise UserError(f"{name}: not valid yaml{at}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError as e:
        raise UserError(f"{name}: cannot be read: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{name}: expected a mapping of keys to values, got {type(data).__name__}")
    return data
