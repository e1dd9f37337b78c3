"""``--cache ram|disk``: every image decoded and resized once, in one memory-mapped file per node.

Why one file and ``np.memmap(mode='r')`` rather than a list of arrays per process (YOLOv5's way):
pages of a read-only file mapping live once in the OS page cache and are shared by every rank and
every DataLoader worker on the node, so memory does not grow with ranks x workers. The node's
local rank 0 builds the file under ``torch_distributed_zero_first``; the others open it.

Layout (no pickle anywhere):
- ``<name>.imgcache.npy``: one flat uint8 ``.npy`` array, image ``i`` at ``offset[i]`` as an
  ``h x w x 3`` BGR block, resized exactly as ``LoadImagesAndLabels.load_image`` does.
- ``<name>.imgcache.index.npz``: ``index`` (N x 5 int64: offset, h, w, h0, w0; offset -1 = not
  cached, read from disk instead), JSON ``meta`` and JSON ``files`` (paths, read only for those).
  Written last, atomically, so a data file without its index is an interrupted build (rebuilt).
``<name>`` carries a hash of the images as their ``CacheSource`` names them (image files: their paths in order,
sizes and mtimes; a shard index: its id and the split's order), img_size and resize mode, so every rank of a node
derives the same name and a changed image means a new file.

An ``ImageCache`` pickles as its paths only; each process maps the file on first access.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import numpy as np
from PIL import Image

from yolotrain.utils.core import watchdog
from yolotrain.utils.core.cpu import usable_cpus
from yolotrain.utils.core.dist import barrier, torch_distributed_zero_first
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.augment import resize_long_side, resized_hw_all
from yolotrain.utils.data.labelcache import cache_paths, files_hash
from yolotrain.utils.data.labels import img2label_paths

CACHE_VERSION = 1
MODES = ("ram", "disk")
SHM = Path("/dev/shm")
MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")  # v2: memory.max at its root (a container's own); v1: under memory/
MARGIN_FRACTION, MARGIN_BYTES = 0.10, 256 * 2**20  # left free after the cache: the OS and training need room

ResizeFn = Callable[[np.ndarray, int, bool], np.ndarray]
ReadFn = Callable[[int], np.ndarray]  # image i decoded (BGR); a UserError when it cannot be


class CacheSource(Protocol):
    """What --cache keys, reads and places a split's images by (its source's ``cache_source``, utils/data/split.py):
    ``read(i)`` decodes image i of the dataset's order (a UserError if it cannot); ``hash(img_size, augment)``
    names the images, their order and the resize (the cache file's name); ``place(mode)``: the folder the cache
    file goes in and the split name it carries."""

    def read(self, i: int) -> np.ndarray: ...

    def hash(self, img_size: int, augment: bool) -> str: ...

    def place(self, mode: str) -> tuple[Path, str]: ...


def header_hw(im_files: Sequence[str]) -> np.ndarray:
    """(N, 2) of (h, w) read from image headers with PIL (no decoding); (0, 0) when unreadable."""
    out = np.zeros((len(im_files), 2), dtype=np.int64)
    for i, f in enumerate(im_files):
        try:
            with Image.open(f) as im:
                out[i] = im.size[::-1]  # PIL's size is (w, h)
        except (OSError, ValueError):
            pass
    return out


def images_hash(im_files: Sequence[str], img_size: int, augment: bool) -> str:
    """sha256 over the cache version, img_size, resize mode and every image's path, size and mtime_ns."""
    return files_hash(f"yolotrain-imgcache v{CACHE_VERSION} {img_size} augment={bool(augment)}", im_files)


def available_ram() -> int:
    """Bytes of RAM available now: MemAvailable (counts reclaimable page cache), else SC_AVPHYS_PAGES, capped
    by this container's cgroup memory limit (the kernel OOM-kills past it, however much the host has free)."""
    host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        host = next(int(line.split()[1]) * 1024 for line in MEMINFO.read_text().splitlines()
                    if line.startswith("MemAvailable:"))
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    room = cgroup_room()
    return host if room is None else min(host, room)


def cgroup_room() -> int | None:
    """Bytes left under the cgroup memory limit (limit - usage + reclaimable inactive page cache), or None
    when unlimited or unreadable: v2's memory.max / memory.current, else v1's memory.limit_in_bytes."""
    for folder, limit, usage, inactive in ((CGROUP, "memory.max", "memory.current", "inactive_file"),
                                           (CGROUP / "memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                                            "total_inactive_file")):
        try:
            text = (folder / limit).read_text().strip()
            if text == "max" or int(text) >= 1 << 60:  # v1 writes "unlimited" as a page-rounded 2^63
                return None
            stat = dict(line.split() for line in (folder / "memory.stat").read_text().splitlines() if " " in line)
            return max(0, int(text) - int((folder / usage).read_text()) + int(stat.get(inactive, 0)))
        except (OSError, ValueError):
            continue
    return None


def free_bytes(folder: Path, mode: str) -> tuple[int, str]:
    """Bytes the cache may use in ``folder`` and a phrase saying what limits it.

    A module function so tests can patch it. ram is limited by both /dev/shm's free space and the
    RAM available now (tmpfs pages are RAM); disk by the folder's file system.
    """
    disk = shutil.disk_usage(folder).free
    if mode == "ram":
        ram = available_ram()
        if ram < disk:
            return ram, "of RAM is available"
    return disk, f"is free in {folder}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return os.access(folder, os.W_OK)
    except OSError:
        return False


def ram_folder() -> Path:
    """Where ram caches go: /dev/shm (RAM-backed) when present, else the temp folder."""
    return SHM if SHM.is_dir() and os.access(SHM, os.W_OK) else Path(tempfile.gettempdir())


def cache_folder(im_files: Sequence[str], mode: str, cache_dir: Path | None, path: Any = None) -> tuple[Path, str]:
    """Folder and split name for the cache file.

    ram: /dev/shm (RAM-backed) when present, else the temp folder. disk: ``cache_dir`` when given,
    else next to the label cache (``labels/<split>.cache.npz`` -> ``labels/<split>.<hash>.imgcache.npy``),
    else ~/.cache/yolotrain when that folder is read-only.
    """
    split = Path(im_files[0]).parent.name or "images"
    if mode == "ram":
        return ram_folder(), split
    if cache_dir is not None:
        return Path(cache_dir), split
    label_files = img2label_paths(list(im_files[:1]))
    labels_dir = Path(label_files[0]).parent  # without ``path``: next to the first label folder
    folder, split, fallback = labels_dir.parent, labels_dir.name, Path.home() / ".cache" / "yolotrain" / "x"
    if path is not None:
        try:
            primary, fallback = cache_paths(path, label_files, None)
            folder, split = primary.parent, primary.name.split(".")[0] or split
        except Exception:  # cache_paths' rules changed or path is odd: keep the label-folder rule
            pass
    return (folder if _writable(folder) else fallback.parent), split


class ImageCache:
    """Read-only view of a built cache file; ``get(i)`` is what ``load_image(i)`` returns uncached.

    Holds only paths until first use in a process, so pickling it to DataLoader workers (fork or
    spawn) costs a few hundred bytes and every worker maps the same pages.
    """

    def __init__(self, file: Path, index_file: Path, mode: str) -> None:
        self.file, self.index_file, self.mode = Path(file), Path(index_file), mode
        self.built = False  # True in the process that built the file (tests and logs)
        self._data: np.ndarray | None = None
        self._index: np.ndarray | None = None
        self._meta: dict | None = None

    def __getstate__(self) -> dict:
        return {"file": self.file, "index_file": self.index_file, "mode": self.mode, "built": self.built}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["file"], state["index_file"], state["mode"])
        self.built = state["built"]

    def _open(self) -> None:
        with np.load(self.index_file, allow_pickle=False) as z:
            self._index, self._meta = z["index"], json.loads(z["meta"].tobytes().decode())
        self._data = np.load(self.file, mmap_mode="r", allow_pickle=False)

    @property
    def meta(self) -> dict:
        if self._meta is None:
            self._open()
        return self._meta  # type: ignore[return-value]

    @property
    def nbytes(self) -> int:
        return int(self.meta["nbytes"])

    def __len__(self) -> int:
        return int(self.meta["n"])

    def get(self, i: int) -> tuple[np.ndarray, tuple[int, int]] | None:
        """Image ``i`` (BGR, long side img_size; a writable copy: augmentation works in place) and its original
        (h, w); None for one the build could not hold (unreadable, or not its header's size): the dataset reads it."""
        if self._data is None:
            self._open()
        off, h, w, h0, w0 = (int(v) for v in self._index[i])  # type: ignore[index]
        if off < 0:
            return None
        return self._data[off:off + h * w * 3].reshape(h, w, 3).copy(), (h0, w0)  # type: ignore[index]

    def is_complete(self, n: int, hash_: str) -> bool:
        """True when the index exists, matches this hash and image count, and the data file has every byte."""
        try:
            meta = self.meta
            ok = (meta.get("version") == CACHE_VERSION and meta.get("hash") == hash_ and meta.get("n") == n
                  and self._data is not None and self._data.size == meta["nbytes"])
        except (OSError, ValueError, KeyError, TypeError, EOFError, zipfile.BadZipFile):
            ok = False
        if not ok:
            self._data = self._index = self._meta = None
        return ok

    def remove(self) -> None:
        """Delete the files (for ram caches at the end of training: /dev/shm outlives the process).

        Safe while others still map it: an unlinked file's pages stay until the last mapping goes.
        """
        for f in (self.index_file, self.file):
            f.unlink(missing_ok=True)


def _family(im_files: Sequence[str], split: str, img_size: int, augment: bool) -> str:
    """ram name prefix shared by every version of one dataset split at one size and resize mode.

    /dev/shm is shared by every job on the node, so the prefix carries the dataset's folder: a
    stale-cache sweep must never touch another dataset's (or another size's) live cache.
    """
    where = hashlib.sha256(str(Path(im_files[0]).resolve().parent).encode()).hexdigest()[:8]
    return f"yolotrain-{split}-{where}-{img_size}{'L' if augment else 'A'}"


def _paths(folder: Path, family: str, split: str, hash_: str, mode: str) -> tuple[Path, Path]:
    stem = f"{family}.{hash_[:16]}" if mode == "ram" else f"{split}.{hash_[:16]}"
    return folder / f"{stem}.imgcache.npy", folder / f"{stem}.imgcache.index.npz"


def _check_room(need: int, n: int, img_size: int, folder: Path, mode: str, workers_shm: int = 0) -> None:
    """Refuse a cache that would not leave the margin free; for ram, the margin also holds the batches the
    node's DataLoader workers pass through /dev/shm (``workers_shm``), which would otherwise SIGBUS."""
    have, where = free_bytes(folder, mode)
    workers_shm = workers_shm if mode == "ram" else 0
    margin = max(MARGIN_FRACTION * need, MARGIN_BYTES) + workers_shm
    if need + margin > have:
        other = "--cache disk or no cache" if mode == "ram" else "a cache folder on a bigger disk, or no cache"
        loaders = f", {_gb(workers_shm)} of it for the loader workers' shared-memory batches" if workers_shm else ""
        raise UserError(f"--cache {mode} needs {_gb(need)} for {n} images at {img_size} px but only {_gb(have)} "
                        f"{where} ({_gb(margin)} must stay free{loaders}); use {other}")


def _cached_hw(image_hw: np.ndarray, img_size: int) -> np.ndarray:
    """(n, 2) each image's size in the cache (``resized_hw_all``), (0, 0) where no size is known."""
    hw = np.asarray(image_hw, np.int64).reshape(-1, 2)
    return np.where((hw > 0).all(1, keepdims=True), resized_hw_all(np.maximum(hw, 1), img_size), 0)


def _build(cache: ImageCache, read: ReadFn, n: int, img_size: int, augment: bool, hash_: str,
           image_hw: np.ndarray, resize: ResizeFn, num_threads: int) -> None:
    """Decode + resize every image in threads into a preallocated temp .npy, then rename it and the index in."""
    hw = _cached_hw(image_hw, img_size)
    nbytes_each = hw[:, 0] * hw[:, 1] * 3
    offsets = np.concatenate([[0], np.cumsum(nbytes_each)[:-1]]).astype(np.int64)
    total = int(nbytes_each.sum())
    index = np.zeros((n, 5), dtype=np.int64)
    index[:, 0] = offsets
    tag = f"{socket.gethostname()}-{os.getpid()}"
    tmp = cache.file.with_name(f".{cache.file.name}.tmp-{tag}")
    try:
        data = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=(max(total, 1),))

        def one(i: int) -> None:
            try:
                img = read(i)
            except UserError:
                index[i, 0] = -1  # left to the uncached path, which reports it
                return
            out = resize(img, img_size, augment)
            index[i, 1:] = (*out.shape[:2], *img.shape[:2])
            if out.size != nbytes_each[i]:  # the header lied (rare): keep this one uncached
                index[i, 0] = -1
                return
            data[offsets[i]:offsets[i] + out.size] = out.reshape(-1)

        with watchdog.phase("cache images"), ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            list(watchdog.beats(pool.map(one, range(n))))  # each image is progress
        data.flush()
        del data
        os.replace(tmp, cache.file)
    finally:
        tmp.unlink(missing_ok=True)
    meta = {"version": CACHE_VERSION, "hash": hash_, "n": n, "nbytes": max(total, 1), "img_size": img_size,
            "augment": bool(augment), "uncached": int((index[:, 0] < 0).sum())}
    with atomic_write(cache.index_file) as f:
        np.savez(f, index=index, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    if meta["uncached"]:
        LOGGER.warning(f"WARNING: {meta['uncached']} image(s) did not match their header size or could not be "
                       f"read; they are read and decoded each time")


def _remove_stale(folder: Path, keep: Path, family: str, mode: str) -> None:
    """ram only: drop older versions of this exact cache (changed images) from /dev/shm, where they
    would hold RAM until reboot. Processes still mapping one keep its pages until they exit."""
    if mode != "ram":
        return
    for f in folder.glob(f"{family}.*.imgcache*"):
        if not f.name.startswith(keep.name.split(".imgcache")[0]):
            try:
                f.unlink()
                LOGGER.info(f"Removed stale image cache {f}")
            except OSError:
                pass


def build_or_open(im_files: Sequence[str], img_size: int, augment: bool, mode: str, source: CacheSource,
                  local_rank: int = 0, num_threads: int | None = None, *, image_hw: np.ndarray | None = None,
                  resize: ResizeFn | None = None, prefix: str = "", workers_shm: int = 0) -> ImageCache:
    """The node's cache for these images: reuse a complete one, else local rank 0 builds it.

    ``source`` keys, reads and places them (``CacheSource``). ``image_hw`` (N, 2 of h, w; the label scan's) avoids
    re-reading headers for the size estimate. ``workers_shm``: bytes the node's loader workers keep in /dev/shm
    (``loader_shm_bytes``). Every rank calls it, with the same ``im_files`` in the same order."""
    if mode not in MODES:
        raise UserError(f"--cache {mode}: expected one of {', '.join(MODES)} (or leave it off)")
    if not len(im_files):
        raise UserError("--cache: no images to cache")
    resize = resize or resize_long_side
    hash_, (folder, split) = source.hash(img_size, augment), source.place(mode)
    family = _family(im_files, split, img_size, augment)
    file, index_file = _paths(folder, family, split, hash_, mode)
    cache = ImageCache(file, index_file, mode)
    with torch_distributed_zero_first(local_rank):
        if local_rank == 0 and not cache.is_complete(len(im_files), hash_):
            try:
                folder.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise UserError(f"--cache {mode}: cannot create the cache folder {folder} ({e.strerror or e})") from e
            sizes = header_hw(im_files) if image_hw is None else np.asarray(image_hw, dtype=np.int64).reshape(-1, 2)
            if len(sizes) != len(im_files):
                raise ValueError(f"image_hw has {len(sizes)} rows for {len(im_files)} images")
            need = int(_cached_hw(sizes, img_size).prod(1).sum()) * 3
            _check_room(need, len(im_files), img_size, folder, mode, workers_shm)
            LOGGER.info(f"{prefix}Caching images ({_gb(need)}, {mode} {file}) ...")
            t0 = time.time()
            _build(cache, source.read, len(im_files), img_size, augment, hash_, sizes, resize,
                   num_threads or min(8, usable_cpus()))
            cache.built = True
            _remove_stale(folder, file, family, mode)
            LOGGER.info(f"{prefix}Cached {len(im_files)} images in {time.time() - t0:.1f}s")
        elif local_rank == 0:
            LOGGER.info(f"{prefix}Using cached images ({_gb(cache.nbytes)}, {mode} {file})")
    if not cache.is_complete(len(im_files), hash_):
        raise UserError(f"{file}: image cache missing or incomplete after local rank 0 built it "
                        f"(is {folder} shared by the ranks of this node?)")
    return cache


def loader_shm_bytes(ranks: int, workers: int, batch_size: int, img_size: int, slots: int = 4) -> int:
    """/dev/shm held by the node's loader workers: each writes its rank's uint8 batches (mosaic's size) into
    ``slots`` buffers (utils/data/batch.py)."""
    return ranks * workers * slots * batch_size * 3 * img_size * img_size


def release_ram_caches(local_rank: int, *caches: "ImageCache | None", wait: bool = True) -> None:
    """Delete /dev/shm caches once every rank is done (mapped copies stay valid until exit), so
    RAM is not held after the run, as with YOLOv5's in-process cache. Disk caches are kept.
    ``wait`` False: this rank failed, and its peers may never reach the barrier; delete without it."""
    if wait:
        barrier()
    if local_rank == 0:
        for cache in caches:
            if cache is not None and cache.mode == "ram":
                cache.remove()

