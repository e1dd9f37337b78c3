"""A split as tar shards plus one index: what a rank needs of the data without a scan or a folder.

Shards use the WebDataset layout: per sample ``<key>.<image suffix>`` (the source file's bytes as they
were) and ``<key>.txt`` (its usable label rows, ``class xc yc w h``), so the ``webdataset`` library and
plain ``tar`` read them. The key is the sample's position in the split, nine digits.

The index is a folder ``<split>.index`` beside the shards: arrays a rank memory-maps (no text to parse)
and one small json. Per sample: its shard, the byte range of its image inside the tar, its upright size
(h, w) and its labels (float64 as the scan read them, one row range per sample), and the source path it
was made from (for messages and COCO file names). The json holds the shard names, the image suffixes,
the class count, the scan's counts and every problem it found. Reading a split from its index gives the
same samples, labels, sizes and order as scanning the folder it came from, so training is the same.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data import remote
from yolotrain.utils.data.labels import LabelTable, ScanResult, img2label_paths
from yolotrain.utils.data.shardcache import ShardCache, budget_bytes

INDEX_SUFFIX = ".index"
INDEX_JSON = "index.json"
INDEX_VERSION = 1
ARRAYS = ("shard", "offset", "size", "suffix", "image_hw", "label_start", "labels", "sources")
BLOCK = 512  # tar's block size: a member's data starts after its header and ends padded to a block


def is_shard_index(path: Any) -> bool:
    """Whether a split names a shard index (a ``.index`` folder, or a folder holding index.json), alone or as a
    one-entry list (a data yaml's split)."""
    if isinstance(path, (list, tuple)):
        if len(path) != 1:
            if any(is_shard_index(p) for p in path):
                raise UserError(f"{', '.join(map(str, path))}: a split is one shard index, or image folders and "
                                "lists, not both")
            return False
        path = path[0]
    if remote.is_url(path):
        return str(path).rstrip("/").endswith(INDEX_SUFFIX)
    p = Path(path)
    return p.suffix == INDEX_SUFFIX or (p / INDEX_JSON).is_file()


def label_text(labels: np.ndarray) -> str:
    """Label rows as text, each float the shortest decimal that reads back the same."""
    return "".join(f"{int(r[0])} {r[1]!r} {r[2]!r} {r[3]!r} {r[4]!r}\n" for r in labels.tolist())


class ShardWriter:
    """Appends members to ``<out>/<split>-NNNNNN.tar`` files, starting a new shard past ``shard_bytes``."""

    def __init__(self, out: Path, split: str, shard_bytes: int) -> None:
        self.out, self.split, self.shard_bytes = out, split, shard_bytes
        self.names: list[str] = []
        self.sizes: list[int] = []  # each closed shard's bytes
        self._tar: tarfile.TarFile | None = None

    def add_sample(self, key: str, suffix: str, image: bytes, labels: str) -> tuple[int, int]:
        """Write one sample's image and labels into the current shard; (shard number, image data offset)."""
        if self._tar is None or self._tar.offset >= self.shard_bytes:
            self._next()
        offset = self._add(f"{key}{suffix}", image)
        self._add(f"{key}.txt", labels.encode())
        return len(self.names) - 1, offset

    def _next(self) -> None:
        self.close()
        self.names.append(f"{self.split}-{len(self.names):06d}.tar")
        self._tar = tarfile.open(self.out / self.names[-1], "w", format=tarfile.USTAR_FORMAT)

    def _add(self, name: str, data: bytes) -> int:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = len(data), 0o644, 0  # the same bytes for the same data
        self._tar.addfile(info, io.BytesIO(data))
        return self._tar.offset - _padded(len(data))  # where this member's data began

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()
            self._tar = None
            self.sizes.append((self.out / self.names[-1]).stat().st_size)


def _padded(n: int) -> int:
    """Bytes a member of ``n`` data bytes takes after its header: whole blocks."""
    return (n + BLOCK - 1) // BLOCK * BLOCK


def write_split(result: ScanResult, out: Path, split: str, nc: int, shard_bytes: int) -> Path:
    """The scan's usable samples as shards in ``out`` and their index ``out/<split>.index``; returns the index."""
    writer = ShardWriter(out, split, shard_bytes)
    suffixes = sorted({Path(f).suffix.lower() for f in result.img_files})
    n = len(result.img_files)
    shard, offset, size = np.zeros(n, np.int32), np.zeros(n, np.int64), np.zeros(n, np.int64)
    suffix = np.zeros(n, np.uint8)
    try:
        for i, (img_file, labels) in enumerate(zip(result.img_files, result.labels)):
            try:
                data = Path(img_file).read_bytes()
            except OSError as e:
                raise UserError(f"{img_file}: cannot read image ({e.strerror or e})") from None
            suffix[i] = suffixes.index(Path(img_file).suffix.lower())
            shard[i], offset[i] = writer.add_sample(f"{i:09d}", suffixes[suffix[i]], data, label_text(labels))
            size[i] = len(data)
    finally:
        writer.close()
    rows, starts = LabelTable.of(result.labels).pack()  # the one packed layout (labels.LabelTable)
    arrays = {"shard": shard, "offset": offset, "size": size, "suffix": suffix,
              "image_hw": np.asarray(result.image_hw, np.int32).reshape(-1, 2),
              "label_start": starts, "labels": rows,
              "sources": np.array([s.encode() for s in result.img_files], dtype=bytes)}
    meta = {"nc": nc, "shards": writer.names, "shard_bytes": writer.sizes, "suffixes": suffixes,
            "counts": result.counts, "msgs": result.msgs}
    return save_index(out / f"{split}{INDEX_SUFFIX}", arrays, meta)


def save_index(index: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Write an index folder: each of ARRAYS as .npy and ``meta`` (nc, shards, shard_bytes, suffixes, counts, msgs)
    as json, with the arrays' content hash as its ``id`` (what a node's local copy of a remote index is known by)."""
    index.mkdir()
    digest = hashlib.sha256()
    for name in ARRAYS:
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name} {a.dtype.str} {a.shape}".encode())
        digest.update(a.data if a.size else b"")
        np.save(index / f"{name}.npy", a, allow_pickle=False)
    meta = {"version": INDEX_VERSION, "id": digest.hexdigest()[:32], **meta}
    (index / INDEX_JSON).write_text(json.dumps(meta, indent=1) + "\n")
    return index


class SourceColumn(Sequence):
    """The index's source paths as a sequence of str, decoded one at a time: a split of millions of images
    keeps them as the index's mapped bytes rather than a Python string each."""

    def __init__(self, sources: np.ndarray, order: np.ndarray | None = None) -> None:
        self.sources, self.order = sources, order

    def __len__(self) -> int:
        return len(self.sources) if self.order is None else len(self.order)

    def __getitem__(self, i: Any) -> str:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        return self.sources[i if self.order is None else self.order[i]].decode()

    def take(self, order: np.ndarray) -> SourceColumn:
        return SourceColumn(self.sources, order if self.order is None else self.order[order])


class LabelPaths(Sequence):
    """Where each source image's label file was (img2label_paths), worked out when asked: messages only."""

    def __init__(self, images: Sequence[str]) -> None:
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return img2label_paths(self.images[i])
        return img2label_paths([self.images[i]])[0]


@dataclass(frozen=True)
class ShardIndex:
    """An opened index: its arrays (memory-mapped from a local folder, read whole from object storage) and
    where its shards are (a local folder or a URL, utils/data/remote.py)."""

    root: str
    meta: dict[str, Any]
    arrays: dict[str, np.ndarray]
    cache: ShardCache | None = None  # a remote index's node-local shard copies (utils/data/shardcache.py)

    @classmethod
    def open(cls, path: Any, nc: int | None = None, cache_dir: Path | None = None) -> ShardIndex:
        """The index a split names (a path or URL, or a data yaml's one-entry list); ``nc``: the classes it must
        have. A missing index, bucket or credentials fail here, before any training. A remote index's arrays are
        copied once to ``cache_dir`` (default: the temp folder) on this node's disk and mapped from there
        (``local_copy``)."""
        root = str(path[0] if isinstance(path, (list, tuple)) else path).rstrip("/")
        meta = index_meta(root)
        if nc is not None and meta.get("nc") != nc:
            raise UserError(f"{root}: made for {meta.get('nc')} classes, the dataset yaml has {nc}")
        folder, cache = Path(root), None
        if remote.is_url(root):
            node = node_folder(cache_dir)
            folder = local_copy(root, meta, node / "yolotrain-indexes")
            cache = ShardCache(node / "yolotrain-shards" / meta["id"], budget_bytes()) if meta.get("id") else None
        try:
            arrays = {k: _load_array(root if folder is None else folder, k) for k in ARRAYS}
        except (OSError, ValueError) as e:
            raise UserError(f"{root}: index arrays unreadable ({e}); make it again") from None
        return cls(root, meta, arrays, cache)

    def __len__(self) -> int:
        return len(self.arrays["shard"])

    def shard_path(self, k: int) -> str:
        name = self.meta["shards"][k]
        return remote.join(remote.parent(self.root), name) if remote.is_url(self.root) else str(
            Path(self.root).parent / name)

    def member(self, i: int) -> str:
        """``<shard>.tar/<key><suffix>``: where sample ``i`` lives, for messages."""
        a = self.arrays
        return f"{self.shard_path(int(a['shard'][i]))}/{i:09d}{self.meta['suffixes'][int(a['suffix'][i])]}"

    def read(self, i: int) -> bytes:
        """Sample ``i``'s image bytes, by its byte range in the shard (a remote shard's node-local copy once
        there is one)."""
        a = self.arrays
        k, start, n = int(a["shard"][i]), int(a["offset"][i]), int(a["size"][i])
        path = self.shard_path(k)
        if remote.is_url(path) and self.cache is not None:
            sizes = self.meta.get("shard_bytes")
            path = str(self.cache.local(path, sizes[k] if sizes else None) or path)
        if remote.is_url(path):
            data = remote.read(path, start, start + n)
        else:
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    data = f.read(n)
            except OSError as e:
                raise UserError(f"{path}: cannot read shard ({e.strerror or e})") from None
        if len(data) != n:
            raise UserError(f"{self.member(i)}: the shard ends {n - len(data)} bytes early (truncated)")
        return data

    def scan_result(self) -> ScanResult:
        """What a scan of the source folder gave, read back from the index as columns over its arrays (nothing
        built per sample, so a split of millions opens at once)."""
        a = self.arrays
        sources = SourceColumn(a["sources"])
        return ScanResult(img_files=sources, label_files=LabelPaths(sources),
                          labels=LabelTable.packed(a["labels"], a["label_start"]),
                          image_hw=a["image_hw"], msgs=list(self.meta.get("msgs", [])),
                          counts=dict(self.meta.get("counts", {})))


def index_meta(path: str | Path) -> dict[str, Any]:
    """An index's json (shard names, class count, the scan's counts and problems), checked for this version: the
    one small read that tells a missing index, bucket or credentials at start."""
    root = str(path).rstrip("/")
    where = remote.join(root, INDEX_JSON) if remote.is_url(root) else str(Path(root) / INDEX_JSON)
    try:
        text = remote.read(where).decode() if remote.is_url(root) else Path(where).read_text()
        meta = json.loads(text)
    except FileNotFoundError:
        raise UserError(f"{root}: not a shard index (no {INDEX_JSON}; make one with {tool_command('shards')})"
                        ) from None
    except (OSError, ValueError) as e:
        raise UserError(f"{where}: unreadable ({e})") from None
    if meta.get("version") != INDEX_VERSION:
        raise UserError(f"{root}: index version {meta.get('version')}, this yolotrain reads {INDEX_VERSION}; "
                        f"make it again with {tool_command('shards')}")
    return meta


def node_folder(cache_dir: str | Path | None) -> Path:
    """Where this node keeps its copies of a shard index's arrays, shards and cached images: --cache-dir
    (node-local disk) when given, else the temp folder."""
    return Path(cache_dir if cache_dir is not None else tempfile.gettempdir())


def local_copy(root: str, meta: dict[str, Any], base: Path) -> Path | None:
    """A remote index's arrays in a folder on this node's disk, named by the index's content id: fetched by the
    first rank of the node to open it (the loader builds datasets on local rank 0 first) and memory-mapped by
    every rank, so a node holds one copy. None (each rank reads the arrays whole) for an index without an id
    or where the disk refuses the copy."""
    ident = meta.get("id")
    if not ident:
        return None
    folder = base / ident
    if all((folder / f"{k}.npy").is_file() for k in ARRAYS):
        return folder
    tmp = base / f".{ident}-{os.getpid()}"
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        for k in ARRAYS:
            (tmp / f"{k}.npy").write_bytes(remote.read(remote.join(root, f"{k}.npy")))
        os.replace(tmp, folder)
    except OSError as e:
        discard(tmp)
        if all((folder / f"{k}.npy").is_file() for k in ARRAYS):  # another process of this node made it first
            return folder
        LOGGER.warning(f"WARNING: {root}: no local copy of the index in {base} ({e}); every rank reads it whole")
        return None
    return folder


def _load_array(root: str | Path, name: str) -> np.ndarray:
    """A local index's array memory-mapped; a remote one's read whole."""
    if remote.is_url(root):
        return np.load(io.BytesIO(remote.read(remote.join(root, f"{name}.npy"))), allow_pickle=False)
    return np.load(Path(root) / f"{name}.npy", mmap_mode="r", allow_pickle=False)


def replace_folder(tmp: Path, out: Path) -> None:
    """Put a finished ``tmp`` folder at ``out`` in one rename (an empty ``out`` is replaced)."""
    if out.exists():
        out.rmdir()  # only ever an empty folder here: the caller refused a non-empty one
    os.replace(tmp, out)


def discard(tmp: Path) -> None:
    shutil.rmtree(tmp, ignore_errors=True)
