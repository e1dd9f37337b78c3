"""Where a split's images and labels come from: one interface, the split's kind decided once (``open_split``).

The dataset reads a split only through a ``SplitSource``:

- ``check()``: is the split there at all (at start, before any scan): a problem, or None;
- ``count()``: how many images it lists, without reading a label or an image (a refusal that depends on the
  schedule's length needs it before the run starts);
- ``scan(nc, cache_dir)``: every usable image with its labels (one packed ``LabelTable``) and upright size, and
  what was wrong; from a label cache, a fresh scan or an index, and which (``Scan.known``, for the log);
- ``read(row)``: image ``row`` of the scan, decoded BGR as the scan decoded it (EXIF, alpha, 16-bit, truncation);
- ``cache_source(rows, cache_dir, read)``: what --cache keys, reads and places the images by (``CacheSource``: image
  files by path, size and mtime, ``FileCacheSource``; other images by a key, ``KeyedCacheSource``).

Image folders, ``.txt`` lists and image files are ``ImageFiles``; a shard index (a local folder or a URL) is
``ShardSplit``. A new format is one class with these methods and a line in ``open_split``; a source of your own
(images in memory, a database) can be handed to ``create_dataloader`` as it is (docs/architecture.md).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from yolotrain.utils.data import remote
from yolotrain.utils.data.images import IMG_SUFFIXES, decode_image_bgr, read_image_bgr
from yolotrain.utils.data.imgcache import CacheSource, cache_folder, images_hash, ram_folder
from yolotrain.utils.data.labelcache import load_or_scan
from yolotrain.utils.data.labels import ScanResult, describe_source, img2label_paths, resolve_image_files
from yolotrain.utils.data.shards import ShardIndex, index_meta, is_shard_index, node_folder


@dataclass(frozen=True)
class Scan:
    """A split's scan and how it was known: " (from cache)", " (from the shard index)", or "" (scanned now)."""

    result: ScanResult
    known: str = ""


@dataclass(frozen=True)
class Missing:
    """Why a split is not there: ``path`` and the ``reason`` ("url": a URL that names no shard index, "missing",
    "empty": a folder without images); the data config says it with the yaml's own words."""

    path: str
    reason: str


@runtime_checkable
class SplitSource(Protocol):
    """A split's images and labels (see the module docstring). ``where``: the split as the user named it."""

    where: str

    def check(self) -> Missing | None: ...

    def count(self) -> int: ...

    def scan(self, nc: int, cache_dir: Path | None) -> Scan: ...

    def read(self, row: int) -> np.ndarray: ...

    def cache_source(self, rows: np.ndarray, cache_dir: Path | None,
                     read: Callable[[int], np.ndarray]) -> CacheSource: ...


def open_split(path: Any) -> SplitSource:
    """The source a split names: a shard index, else image files (a source given as it is stays). The one place
    a split's kind is decided; nothing is read until it is checked, counted or scanned."""
    if isinstance(path, SplitSource):
        return path
    return ShardSplit(path) if is_shard_index(path) else ImageFiles(path)


class ImageFiles:
    """Image folders (recursive), ``.txt`` lists of images and image files, each with its YOLO label file; the
    scan is cached beside the labels (utils/data/labelcache.py)."""

    def __init__(self, path: Any) -> None:
        self.path, self.where = path, describe_source(path)
        self.files: list[str] = []  # the scan's usable images, in its order

    def check(self) -> Missing | None:
        for p in self.path if isinstance(self.path, (list, tuple)) else [self.path]:
            if remote.is_url(p):  # object storage holds shard indexes only
                return Missing(str(p), "url")
            if not Path(p).exists():
                return Missing(str(p), "missing")
            if not _has_images(Path(p)):
                return Missing(str(p), "empty")
        return None

    def count(self) -> int:
        return len(resolve_image_files(self.path))

    def scan(self, nc: int, cache_dir: Path | None) -> Scan:
        files = resolve_image_files(self.path)
        result, hit = load_or_scan(self.path, files, img2label_paths(files), nc, cache_dir)
        self.files = list(result.img_files)
        return Scan(result, " (from cache)" if hit else "")

    def read(self, row: int) -> np.ndarray:
        return read_image_bgr(self.files[row])

    def cache_source(self, rows: np.ndarray, cache_dir: Path | None,
                     read: Callable[[int], np.ndarray]) -> CacheSource:
        """The images by path, size and mtime, in the split's order (``rows``); a disk cache beside the label cache."""
        return FileCacheSource([self.files[r] for r in rows], path=self.path)


class ShardSplit:
    """A shard index (utils/data/shards.py), local or in object storage: its json and arrays replace the scan,
    each image is a byte range of a shard (a remote shard's node-local copy once there is one)."""

    def __init__(self, path: Any) -> None:
        self.path, self.where = path, describe_source(path)
        self.root = str(path[0] if isinstance(path, (list, tuple)) else path).rstrip("/")
        self.index: ShardIndex | None = None

    def check(self) -> Missing | None:
        index_meta(self.root)  # a missing index, bucket or credentials: a UserError naming it
        return None

    def count(self) -> int:
        return int(index_meta(self.root)["counts"]["images"])

    def scan(self, nc: int, cache_dir: Path | None) -> Scan:
        self.index = ShardIndex.open(self.root, nc, cache_dir)  # a remote one's arrays are fetched here
        return Scan(self.index.scan_result(), " (from the shard index)")

    def read(self, row: int) -> np.ndarray:
        return decode_image_bgr(self.index.read(row), self.index.member(row))

    def cache_source(self, rows: np.ndarray, cache_dir: Path | None,
                     read: Callable[[int], np.ndarray]) -> CacheSource:
        """The images by their byte ranges, known by the index's id and the split's order (``rows``)."""
        key = hashlib.sha256(f"{self.index.meta.get('id') or self.index.root}\n".encode() + rows.tobytes()).hexdigest()
        return KeyedCacheSource(read=read, key=key, folder=node_folder(cache_dir) / "yolotrain-images",
                                split=Path(self.index.root).stem)


@dataclass(frozen=True)
class FileCacheSource:
    """Image files for --cache: keyed by their paths in order, sizes and mtimes (``imgcache.images_hash``); a disk
    cache goes in ``cache_dir`` when given, else beside the label cache of ``path`` (the split as scanned), else
    beside the first image's label folder (``imgcache.cache_folder``)."""

    files: Sequence[str]
    path: Any = None
    cache_dir: Path | None = None

    def read(self, i: int) -> np.ndarray:
        return read_image_bgr(self.files[i])

    def hash(self, img_size: int, augment: bool) -> str:
        return images_hash(self.files, img_size, augment)

    def place(self, mode: str) -> tuple[Path, str]:
        return cache_folder(self.files, mode, self.cache_dir, self.path)


@dataclass(frozen=True)
class KeyedCacheSource:
    """Images that are not files (a shard index's) for --cache: ``read(i)`` decodes image i (a UserError if it
    cannot), ``key`` names the set and its order, ``folder`` holds a disk cache, ``split`` names it."""

    read: Callable[[int], np.ndarray]
    key: str
    folder: Path
    split: str

    def hash(self, img_size: int, augment: bool) -> str:
        return hashlib.sha256(f"{self.key} {img_size} augment={bool(augment)}".encode()).hexdigest()

    def place(self, mode: str) -> tuple[Path, str]:
        return (ram_folder() if mode == "ram" else self.folder), self.split


def _has_images(path: Path) -> bool:
    """Cheap emptiness check (stops at the first image): a folder with an image, a non-empty list, an image."""
    if path.is_dir():
        return any(f.suffix.lower() in IMG_SUFFIXES for f in path.rglob("*"))
    if path.suffix.lower() == ".txt":
        return any(line.strip() for line in path.read_text(errors="replace").splitlines())
    return path.suffix.lower() in IMG_SUFFIXES
