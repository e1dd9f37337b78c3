"""The run's storage failing under it: folders checked writable before any work, and a write that fails mid-run
told in one line.

``check_writable`` makes a folder (and its parents) and writes and removes a probe file in it, so a read-only
file system, a missing permission or a full disk is named before the scan, the model build or any rank's work.
``write_failure`` turns the error of a failed write (an ``OSError``, or torch's serializer error raised while
one was being handled) into words: the file, what went wrong, the free space where it can be read.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

# errors of the storage itself, not of the program: what a full disk, a quota, a read-only remount, a removed
# folder or a stale NFS handle give a write
STORAGE_ERRNOS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                  errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                  errno.EPERM: "operation not permitted", errno.ENOENT: "the folder is gone",
                  errno.ESTALE: "stale file handle (the NFS export changed under the job)",
                  errno.EIO: "input/output error", errno.EFBIG: "file too large for the file system"}


def storage_error(e: BaseException) -> OSError | None:
    """The storage ``OSError`` behind ``e``: ``e`` itself, or one in its chain (torch's serializer raises a
    RuntimeError while handling the OSError of its write); None when the failure is not the storage's."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return e
        e = e.__cause__ or e.__context__
    return None


def in_words(e: OSError) -> str:
    """``no space left on the device (ENOSPC)``."""
    code = errno.errorcode.get(e.errno or 0, str(e.errno))
    return f"{STORAGE_ERRNOS.get(e.errno, e.strerror or str(e))} ({code})"


def free_space(path: Path) -> str:
    """``12.3 MB free of 2.0 GB on <folder>`` for the nearest existing folder of ``path``; '' where unreadable."""
    folder = Path(path)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return ""
    return f"{_size(usage.free)} free of {_size(usage.total)} on {folder}"


def _size(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def write_failure(path: Path, e: OSError) -> str:
    """``<path>: cannot be written: no space left on the device (ENOSPC; 0 B free of 2.1 MB on <folder>)``."""
    space = free_space(Path(path).parent)
    return f"{path}: cannot be written: {in_words(e)}" + (f"; {space}" if space else "")


def check_writable(folder: Path, what: str, flags: str) -> str | None:
    """Make ``folder`` and write a probe file in it; None when that works, else one line naming the folder, ``what``
    it is (the run folder, --cache-dir), the reason, and the ``flags`` that choose another."""
    folder = Path(folder)
    probe = folder / f".write-check.{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        where = Path(e.filename) if getattr(e, "filename", None) and Path(e.filename) != probe else folder
        space = free_space(where) if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
        return (f"{folder}: {what} is not writable: {in_words(e)}" + (f" at {where}" if where != folder else "")
                + (f"; {space}" if space else "") + f"; choose another folder ({flags}) or make this one writable")
    finally:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    return None
