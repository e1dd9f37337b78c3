"""Reading shards and indexes from object storage: ``s3://`` (and any other fsspec URL: ``gs://``, ``file://``).

fsspec is the one layer: s3fs for S3-compatible stores (AWS, MinIO, Ceph, R2...), gcsfs for ``gs://``, its own
``file://``; each is optional (requirements-s3.txt), and a missing one is named in one line. Credentials come
from the usual environment (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``...), the endpoint of
an S3-compatible server from ``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``.

A read that fails for a transient reason (a dropped connection, a 5xx, a timeout) is retried with
exponential backoff and logged once per object; a store still failing after ``YOLOTRAIN_STORAGE_PATIENCE``
seconds (default 300) is a UserError naming the object and the endpoint, on the rank that read it. What
retrying cannot change is said at once: a missing object or bucket, refused credentials or access, a request
the store rejects; and a byte range that starts past an object's end reads no bytes, as a local file's read
does, so the caller names what is missing (a shard cut short: its member and the bytes it lacks).
"""
from __future__ import annotations

import errno
import os
import posixpath
import time
from pathlib import Path
from typing import Any, Callable

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER

try:  # optional (requirements-s3.txt): only URLs need it
    import fsspec.core
except ModuleNotFoundError:
    fsspec = None

PATIENCE_ENV = "YOLOTRAIN_STORAGE_PATIENCE"
DEFAULT_PATIENCE_S = 300.0
PACKAGES = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}


def is_url(path: Any) -> bool:
    """A ``scheme://`` location (object storage or fsspec's ``file://``), not a local path."""
    return isinstance(path, str) and "://" in path


def join(url: str, *parts: str) -> str:
    """``url``/``parts``, keeping the scheme's ``//`` and normalised as a local path would be (``..`` allowed)."""
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{posixpath.normpath(posixpath.join(rest, *parts))}"


def parent(url: str) -> str:
    scheme, rest = url.split("://", 1)
    return f"{scheme}://{posixpath.dirname(rest.rstrip('/'))}"


def _s3_endpoint(url: str) -> str | None:
    """An S3-compatible server's address for an s3:// URL, from the environment (None: AWS itself)."""
    if not url.startswith(("s3://", "s3a://")):
        return None
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def endpoint(url: str) -> str:
    """Where a URL is read from, for messages."""
    if url.startswith(("s3://", "s3a://")):
        return _s3_endpoint(url) or "AWS S3"
    return url.split("://", 1)[0]


def _filesystem(url: str) -> tuple[Any, str]:
    scheme = url.split("://", 1)[0]
    if fsspec is None:
        raise UserError(f"{url}: reading {scheme}:// needs the 'fsspec' package: pip install -r requirements-s3.txt")
    server = _s3_endpoint(url)
    options: dict[str, Any] = {"client_kwargs": {"endpoint_url": server}} if server else {}
    try:
        return fsspec.core.url_to_fs(url, **options)
    except ImportError:
        package = PACKAGES.get(scheme, f"the fsspec backend for {scheme}://")
        raise UserError(f"{url}: reading {scheme}:// needs the '{package}' package: pip install -r "
                        "requirements-s3.txt") from None
    except ValueError as e:
        raise UserError(f"{url}: {e}") from None


class _PastTheEnd(Exception):
    """A byte range that starts at or past the object's end (HTTP 416): there are no such bytes."""


def read(url: str, start: int | None = None, end: int | None = None) -> bytes:
    """The object's bytes (``start``:``end`` when given; fewer where the object ends first, none where it ends
    before ``start``), retried with backoff while the store is failing."""
    fs, path = _filesystem(url)
    try:
        return _retrying(url, lambda: fs.cat_file(path, start=start, end=end))
    except _PastTheEnd:
        return b""


def download(url: str, dest: str | os.PathLike) -> None:
    """The whole object into the local file ``dest``, in one attempt (a background copy that fails leaves the reads
    to ``read``, which retries)."""
    fs, path = _filesystem(url)
    fs.get_file(path, os.fspath(dest))


def upload(folder: str | os.PathLike, url: str, first: Callable[[str], bool] = lambda name: True) -> None:
    """Every file under the local ``folder`` to ``url``/<relative path>, each retried as ``read`` is: those
    ``first`` picks, then the rest (a reader that finds the last files finds the first ones whole)."""
    fs, root = _filesystem(url)
    files = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())
    for name in [f for f in files if first(f)] + [f for f in files if not first(f)]:
        _retrying(join(url, name), lambda: fs.put_file(os.path.join(folder, name), posixpath.join(root, name)))


def is_empty(url: str) -> bool:
    """Whether nothing is stored under the prefix ``url``."""
    fs, path = _filesystem(url)
    return not _retrying(url, lambda: fs.find(path, maxdepth=1) if fs.isdir(path) else fs.exists(path))


def _retrying(url: str, call: Callable[[], Any]) -> Any:
    """``call()``, retried with exponential backoff for up to the patience; a missing object and refused
    credentials are UserErrors at once."""
    patience = float(os.environ.get(PATIENCE_ENV, DEFAULT_PATIENCE_S))
    deadline, delay, told = time.monotonic() + patience, 0.5, False
    while True:
        try:
            return call()
        except FileNotFoundError:
            raise UserError(f"{url}: no such object at {endpoint(url)} (a missing bucket or key)") from None
        except PermissionError as e:
            raise UserError(f"{url}: access denied at {endpoint(url)} ({e}); check the credentials "
                            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY or AWS_PROFILE)") from None
        except Exception as e:  # connection, timeout, 5xx: each backend raises its own types
            if _is_refusal(e):
                raise UserError(f"{url}: {endpoint(url)} refused the request ({e}); check the credentials") from None
            if _past_the_end(e):
                raise _PastTheEnd() from None
            if isinstance(e, OSError) and e.errno == errno.EINVAL:  # a 4xx the store gives every time
                raise UserError(f"{url}: {endpoint(url)} rejected the request ({e})") from None
            if not told:
                LOGGER.warning(f"WARNING: {url}: {type(e).__name__}: {e}; retrying with backoff for up to "
                               f"{patience:g} s")
                told = True
            if time.monotonic() + delay > deadline:
                raise UserError(f"{url}: the store at {endpoint(url)} failed for {patience:g} s "
                                f"({PATIENCE_ENV}): {type(e).__name__}: {e}") from None
            time.sleep(delay)
            delay = min(delay * 2, 30.0)


def _past_the_end(e: Exception) -> bool:
    """A range request that starts past the object's end: S3's 416 (s3fs: OSError EINVAL, "The requested range
    is not satisfiable"; botocore: InvalidRange)."""
    text = f"{type(e).__name__} {e}"
    return "range is not satisfiable" in text or "InvalidRange" in text


def _is_refusal(e: Exception) -> bool:
    """Credentials the store rejects: retrying cannot help."""
    text = f"{type(e).__name__} {e}"
    return any(s in text for s in ("NoCredentialsError", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                   "Unable to locate credentials"))
