"""The label-scan cache: arrays + JSON in an .npz (no pickle), written atomically.

It is keyed by a hash of every image and label file's path, size and mtime plus the class count and
the cache version, so an edited label is always seen. It sits next to the labels
(``labels/<split>.cache.npz``), or in a cache folder when that one is read-only.
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from yolotrain.utils.core import watchdog
from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.labels import FileColumn, LabelTable, ScanResult, img2label_paths, scan_labels

# 2: per-row label checks, full decode, new count keys; 3: every message kept (no per-file cap);
# 4: image sizes stored as image_hw, (h, w); 5: labels in float64
CACHE_VERSION = 5


def files_hash(header: str, files: Sequence[str]) -> str:
    """sha256 of a header and every file's path, size and mtime_ns (or 'missing'), in order: any
    edit, even one that keeps the size, changes it. Shared by the label and image caches."""
    h = hashlib.sha256(f"{header}\n".encode())
    for f in watchdog.beats(files):  # a stat per file: long on a big dataset over a network file system
        try:
            st = os.stat(f)
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{f}\0missing\n".encode())
    return h.hexdigest()


def dataset_hash(img_files: Sequence[str], label_files: Sequence[str], nc: int) -> str:
    """The label cache key: every image and label file, plus nc and the cache version."""
    return files_hash(f"yolotrain-cache v{CACHE_VERSION} nc={nc}", list(img_files) + list(label_files))


def cache_paths(path: Any, label_files: Sequence[str], cache_dir: Path | None) -> tuple[Path, Path]:
    """Primary cache file next to the labels (``labels/train.cache.npz``) and the fallback in cache_dir."""
    sources = list(path) if isinstance(path, (list, tuple)) else [path]
    first = Path(sources[0]).expanduser() if len(sources) == 1 else None
    if first is not None and first.is_file():  # a .txt list: next to it
        primary = first.with_name(first.stem + ".cache.npz")
    elif first is not None and first.is_dir():  # a folder: its labels counterpart
        labels_dir = Path(img2label_paths([str(first / "x.jpg")])[0]).parent
        primary = labels_dir.with_name(labels_dir.name + ".cache.npz")
    else:  # a list of sources: next to the first label folder
        labels_dir = Path(label_files[0]).parent
        primary = labels_dir.with_name(labels_dir.name + ".cache.npz")
    key = hashlib.sha256(str(primary.resolve()).encode()).hexdigest()[:16]
    fallback = Path(cache_dir or Path.home() / ".cache" / "yolotrain") / f"{key}.cache.npz"
    return primary, fallback


def save_cache(file: Path, result: ScanResult, hash_: str) -> None:
    """Write arrays + JSON metadata atomically (yolotrain.utils.core.fileio)."""
    rows, starts = LabelTable.of(result.labels).pack()  # the one packed layout (labels.LabelTable)
    meta = {"version": CACHE_VERSION, "hash": hash_, "img_files": list(result.img_files),
            "label_files": list(result.label_files), "msgs": result.msgs, "counts": result.counts}
    with atomic_write(file) as f:
        np.savez(f, labels=rows, offsets=starts, image_hw=result.image_hw.astype(np.int32),
                 meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))


def load_cache(file: Path, hash_: str) -> ScanResult | None:
    """The cached scan if ``file`` holds one for this hash; None when absent, stale or unreadable."""
    if not file.is_file():
        return None
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            if meta.get("version") != CACHE_VERSION or meta.get("hash") != hash_:
                return None
            labels, offsets, image_hw = z["labels"], z["offsets"], z["image_hw"]
        table = LabelTable.packed(labels, offsets)
        if len(table) != len(meta["img_files"]) or len(image_hw) != len(table):
            raise ValueError("array lengths disagree")
        return ScanResult(FileColumn(meta["img_files"]), meta["label_files"], table, image_hw, meta["msgs"], meta["counts"])
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        LOGGER.warning(f"WARNING: {file}: unreadable cache ({type(e).__name__}: {e}), rescanning")
        return None


def load_or_scan(path: Any, img_files: Sequence[str], label_files: Sequence[str], nc: int,
                 cache_dir: Path | None = None) -> tuple[ScanResult, bool]:
    """Scan result from a valid cache (primary, then fallback) or a fresh scan that is then cached."""
    hash_ = dataset_hash(img_files, label_files, nc)
    primary, fallback = cache_paths(path, label_files, cache_dir)
    for file in (primary, fallback):
        cached = load_cache(file, hash_)
        if cached is not None:
            return cached, True
    result = scan_labels(img_files, label_files, nc)
    try:
        save_cache(primary, result, hash_)
    except OSError as e:
        try:
            fallback.parent.mkdir(parents=True, exist_ok=True)
            save_cache(fallback, result, hash_)
            LOGGER.warning(f"WARNING: cannot write {primary} ({e.strerror or e}); label cache saved to {fallback}")
        except OSError as e2:
            LOGGER.warning(f"WARNING: cannot write label cache to {primary} or {fallback} "
                           f"({e2.strerror or e2}); continuing without a cache")
    return result, False
