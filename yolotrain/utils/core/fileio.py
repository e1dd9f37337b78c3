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

# What ships with the code (hyps/, data/, models/): the package's folder, in a checkout and installed alike.
ROOT = Path(__file__).resolve().parents[2]
# A checkout is the package's folder with train.py and pyproject.toml beside it (TOP); site-packages has neither.
TOP = ROOT.parent
CHECKOUT = (TOP / "train.py").is_file() and (TOP / "pyproject.toml").is_file()
# A checkout (python train.py) writes runs into its own runs/; an installed tool into ./runs of the working
# directory, as Ultralytics' does, never into site-packages.
RUNS = TOP / "runs" if CHECKOUT else Path("runs")



def shipped(path: str | Path, folder: str) -> Path:
    """A path as typed, or the shipped file it names: ``hyps/hyp.scratch-low.yaml`` (YOLOv5's form, from a
    checkout's top) and ``hyp.scratch-low.yaml`` are the package's ``folder``/name when no such file is here, so the
    same command works in a checkout, from any folder, and installed."""
    path = Path(path)
    if path.exists() or path.is_absolute() or path.parts[:-1] not in ((), (folder,)):
        return path
    bundled = ROOT / folder / path.name
    return bundled if bundled.is_file() else path

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
