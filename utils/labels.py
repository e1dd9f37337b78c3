"""Finding a split's images and labels, verifying them, and caching the scan.

Each problem is reported by file and reason and nothing good is dropped. The cache is arrays +
JSON in an .npz (no pickle), written atomically and keyed by a hash of every file's path, size
and mtime plus the class count, so an edited label is always seen.
"""
from __future__ import annotations

import hashlib
import json
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from utils.boxes import xywhn2xyxy, xyxy2xywhn
from utils.errors import UserError
from utils.logging import LOGGER

IMG_SUFFIXES = (".bmp", ".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp")
IMG_FORMATS = {"bmp", "jpeg", "mpo", "png", "tiff", "webp"}  # what PIL reports for those suffixes
CACHE_VERSION = 1
COORD_TOL = 1e-3  # normalised coordinates may stray this far outside [0, 1] (rounding in exports)
MIN_IMAGE_PX = 10
MAX_REPORTED = 20


def img2label_paths(img_paths: Sequence[str]) -> list[str]:
    """Label path for each image: last ``/images/`` becomes ``/labels/``, suffix becomes ``.txt``."""
    sa, sb = f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"
    out = []
    for p in img_paths:
        p = str(p)
        if sa in p:
            head, tail = p.rsplit(sa, 1)
            p = head + sb + tail
        out.append(os.path.splitext(p)[0] + ".txt")
    return out


def _describe(path: Any) -> str:
    """A path or list of paths as the user wrote it, for messages."""
    return ", ".join(str(p) for p in path) if isinstance(path, (list, tuple)) else str(path)


def resolve_image_files(path: str | Path | Sequence[str | Path]) -> list[str]:
    """Image files from a folder (recursive), a ``.txt`` list, or a list of those; sorted."""
    entries = list(path) if isinstance(path, (list, tuple)) else [path]
    files: list[str] = []
    for entry in entries:
        p = Path(entry).expanduser()
        if p.is_dir():
            files += [str(f) for f in p.rglob("*") if f.suffix.lower() in IMG_SUFFIXES and f.is_file()]
        elif p.is_file() and p.suffix.lower() == ".txt":
            try:
                lines = p.read_text().splitlines()
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"{p}: cannot read image list ({e})") from None
            for line in (s.strip() for s in lines):
                if line and not line.startswith("#"):
                    f = Path(line).expanduser()
                    files.append(str(f if f.is_absolute() else p.parent / f))
        elif p.is_file() and p.suffix.lower() in IMG_SUFFIXES:
            files.append(str(p))
        elif p.exists():
            raise UserError(f"{p}: expected an image folder, a .txt list of images, or an image file")
        else:
            raise UserError(f"{p}: does not exist")
    files = sorted(f for f in files if Path(f).suffix.lower() in IMG_SUFFIXES)
    if not files:
        raise UserError(f"{_describe(path)}: no images found (looked for {', '.join(IMG_SUFFIXES)})")
    return files


@dataclass
class ScanResult:
    """Usable images with their labels (n, 5) and sizes (w, h), plus what was wrong and counts."""

    img_files: list[str]
    label_files: list[str]
    labels: list[np.ndarray]
    shapes: np.ndarray
    msgs: list[str]
    counts: dict[str, int]


def _exif_size(im: Image.Image) -> tuple[int, int]:
    """(w, h) as displayed: EXIF orientations 5-8 swap width and height (cv2 applies them too)."""
    w, h = im.size
    try:
        orientation = im.getexif().get(0x0112)
    except Exception:  # broken EXIF blocks are common and harmless for the size
        orientation = None
    return (h, w) if orientation in (5, 6, 7, 8) else (w, h)


def _verify_image(path: str) -> tuple[tuple[int, int], str]:
    """Size (w, h) and a warning ('' if none); ValueError with the reason when unusable."""
    if not os.path.isfile(path):
        raise ValueError("image not found")
    try:
        with Image.open(path) as im:
            im.verify()
        with Image.open(path) as im:  # verify() leaves the object unusable
            fmt = (im.format or "").lower()
            shape = _exif_size(im)
    except Exception as e:  # PIL raises many types for broken files
        raise ValueError(f"unreadable image ({type(e).__name__}: {e})") from None
    if fmt not in IMG_FORMATS:
        raise ValueError(f"unsupported image format '{fmt}'")
    if min(shape) < MIN_IMAGE_PX:
        raise ValueError(f"image size {shape[0]}x{shape[1]} below {MIN_IMAGE_PX} pixels")
    warning = ""
    if fmt == "jpeg":
        with open(path, "rb") as f:
            f.seek(-2, 2)
            if f.read() != b"\xff\xd9":
                warning = "truncated JPEG (no end marker), used as decoded"
    return shape, warning


def _parse_rows(text: str) -> list[list[float]]:
    """Rows of floats; polygon rows (cls x1 y1 x2 y2 ...) become boxes as YOLOv5 reads them."""
    rows = []
    for k, line in enumerate(text.splitlines(), 1):
        parts = line.split()
        if not parts:
            continue
        try:
            vals = [float(v) for v in parts]
        except ValueError:
            raise ValueError(f"line {k}: non-numeric value in '{line.strip()[:60]}'") from None
        if len(vals) >= 7 and len(vals) % 2 == 1:  # segment polygon
            xs, ys = np.array(vals[1::2]), np.array(vals[2::2])
            vals = [vals[0], (xs.min() + xs.max()) / 2, (ys.min() + ys.max()) / 2, np.ptp(xs), np.ptp(ys)]
        elif len(vals) != 5:
            raise ValueError(f"line {k}: expected 5 columns (class xc yc w h), found {len(vals)}")
        rows.append(vals + [k])
    return rows


def _check_labels(a: np.ndarray, nc: int) -> None:
    """Raise ValueError naming the first bad line: finite, integer class in range, coords in [0, 1]."""
    checks = (
        (~np.isfinite(a[:, :5]).all(1), "non-finite value"),
        (a[:, 0] != np.round(a[:, 0]), "class is not an integer"),
        ((a[:, 0] < 0) | (a[:, 0] >= nc), f"class outside [0, {nc - 1}]"),
        (((a[:, 1:5] < -COORD_TOL) | (a[:, 1:5] > 1 + COORD_TOL)).any(1), "coordinates not normalised to [0, 1]"),
        ((a[:, 3] <= 0) | (a[:, 4] <= 0), "width and height must be > 0"),
    )
    for bad, reason in checks:
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"line {int(a[i, 5])}: {reason} ({' '.join(f'{v:g}' for v in a[i, :5])})")


def _read_labels(path: str, nc: int) -> tuple[np.ndarray, str]:
    """Labels (n, 5) float32 clipped to the image and a warning; ValueError when any row is bad."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable label file ({e})") from None
    rows = _parse_rows(text)
    if not rows:
        return np.zeros((0, 5), np.float32), ""
    a = np.array(rows, dtype=np.float64)
    _check_labels(a, nc)
    xyxy = np.clip(xywhn2xyxy(a[:, 1:5], 1.0, 1.0), 0.0, 1.0)  # boxes may poke out of the image
    a[:, 1:5] = xyxy2xywhn(xyxy, 1.0, 1.0)
    flat = (a[:, 3] <= 0) | (a[:, 4] <= 0)
    if flat.any():
        raise ValueError(f"line {int(a[np.argmax(flat), 5])}: box lies outside the image")
    lb = a[:, :5].astype(np.float32)
    _, first = np.unique(lb, axis=0, return_index=True)
    if len(first) < len(lb):
        dropped = len(lb) - len(first)
        return lb[np.sort(first)], f"{dropped} duplicate label row(s) removed"
    return lb, ""


def _verify_pair(img_file: str, label_file: str, nc: int) -> tuple[str, np.ndarray | None, tuple[int, int] | None, str]:
    """(status, labels, shape, message); status is found, missing, empty or corrupt."""
    try:
        shape, warning = _verify_image(img_file)
    except ValueError as e:
        return "corrupt", None, None, f"{img_file}: {e}; image skipped"
    if not os.path.isfile(label_file):
        msg = f"{img_file}: {warning}" if warning else ""
        return "missing", np.zeros((0, 5), np.float32), shape, msg
    try:
        labels, label_warning = _read_labels(label_file, nc)
    except ValueError as e:
        return "corrupt", None, None, f"{label_file}: {e}; image skipped"
    msgs = [f"{img_file}: {warning}" if warning else "", f"{label_file}: {label_warning}" if label_warning else ""]
    return ("found" if len(labels) else "empty"), labels, shape, "\n".join(m for m in msgs if m)


def scan_labels(img_files: Sequence[str], label_files: Sequence[str], nc: int, num_workers: int | None = None) -> ScanResult:
    """Verify every image and label in parallel; keep usable images, record every problem."""
    workers = num_workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda pair: _verify_pair(pair[0], pair[1], nc), zip(img_files, label_files)))
    counts = {"found": 0, "missing": 0, "empty": 0, "corrupt": 0}
    keep_img, keep_lb, labels, shapes, msgs = [], [], [], [], []
    for (img, lbf), (status, lb, shape, msg) in zip(zip(img_files, label_files), results):
        counts[status] += 1
        if msg:
            msgs += msg.split("\n")
        if status != "corrupt":
            keep_img.append(img)
            keep_lb.append(lbf)
            labels.append(lb)
            shapes.append(shape)
    counts.update(images=len(keep_img), backgrounds=counts["missing"] + counts["empty"],
                  instances=int(sum(len(x) for x in labels)))
    shape_arr = np.array(shapes, dtype=np.int32).reshape(-1, 2)
    return ScanResult(keep_img, keep_lb, labels, shape_arr, msgs, counts)


def report_messages(msgs: Sequence[str], prefix: str = "") -> None:
    """Log scan problems as warnings, at most MAX_REPORTED lines plus a count of the rest."""
    if not msgs:
        return
    shown = list(msgs[:MAX_REPORTED])
    if len(msgs) > MAX_REPORTED:
        shown.append(f"... and {len(msgs) - MAX_REPORTED} more")
    LOGGER.warning(f"{prefix}WARNING: {len(msgs)} dataset problem(s):\n" + "\n".join(shown))


# ---------------------------------------------------------------- cache
def dataset_hash(img_files: Sequence[str], label_files: Sequence[str], nc: int) -> str:
    """sha256 over every file's path, size and mtime_ns (or 'missing'), plus nc and the cache version."""
    h = hashlib.sha256(f"yolotrain-cache v{CACHE_VERSION} nc={nc}\n".encode())
    for f in list(img_files) + list(label_files):
        try:
            st = os.stat(f)
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            h.update(f"{f}\0missing\n".encode())
    return h.hexdigest()


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
    """Write arrays + JSON metadata atomically (temp file in the same folder, then os.replace)."""
    lens = [len(x) for x in result.labels]
    labels = np.concatenate(result.labels).astype(np.float32) if sum(lens) else np.zeros((0, 5), np.float32)
    meta = {"version": CACHE_VERSION, "hash": hash_, "img_files": result.img_files,
            "label_files": result.label_files, "msgs": result.msgs, "counts": result.counts}
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, labels=labels, offsets=np.cumsum([0] + lens, dtype=np.int64),
                     shapes=result.shapes.astype(np.int32),
                     meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, file)
    finally:
        if tmp.exists():
            tmp.unlink(missing_ok=True)


def load_cache(file: Path, hash_: str) -> ScanResult | None:
    """The cached scan if ``file`` holds one for this hash; None when absent, stale or unreadable."""
    if not file.is_file():
        return None
    try:
        with np.load(file, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            if meta.get("version") != CACHE_VERSION or meta.get("hash") != hash_:
                return None
            labels, offsets, shapes = z["labels"], z["offsets"], z["shapes"]
        parts = [labels[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
        if len(parts) != len(meta["img_files"]) or len(shapes) != len(parts):
            raise ValueError("array lengths disagree")
        return ScanResult(meta["img_files"], meta["label_files"], parts, shapes, meta["msgs"], meta["counts"])
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


# ---------------------------------------------------------------- dataset
