"""YOLO-format dataset: file discovery, label verification, the scan cache, and the Dataset.

Every image and label is verified once and each problem reported as ``<path>: <reason>``; a
bad file is skipped and counted, never silently lost or fatal. The scan result is cached next
to the labels as ``.npz`` arrays plus JSON metadata (no pickle), written atomically and keyed by
a hash of every file's path, size and mtime and the class count.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np
import torch
from PIL import Image

from utils.augment import augment_hsv, letterbox, random_flip, resize_long_side
from utils.boxes import xywhn2xyxy, xyxy2xywhn
from utils.errors import UserError
from utils.logging import LOGGER

IMG_SUFFIXES = (".bmp", ".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp")
IMG_FORMATS = {"bmp", "jpeg", "mpo", "png", "tiff", "webp"}  # what PIL reports for those suffixes
CACHE_VERSION = 1
COORD_TOL = 1e-3  # normalised coordinates may stray this far outside [0, 1] (rounding in exports)
MIN_IMAGE_PX = 10
MAX_REPORTED = 20
HYP_DEFAULTS = {"hsv_h": 0.015, "hsv_s": 0.7, "hsv_v": 0.4, "fliplr": 0.5, "flipud": 0.0}


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
def _hyp(hyp: Any, key: str) -> float:
    """A hyperparameter from an object (attribute) or dict, YOLOv5's default when absent."""
    value = hyp.get(key) if isinstance(hyp, dict) else getattr(hyp, key, None)
    return float(HYP_DEFAULTS[key] if value is None else value)


class LoadImagesAndLabels(torch.utils.data.Dataset):
    """Images letterboxed to ``img_size`` (or per-batch rectangles) with normalised labels.

    ``__getitem__`` takes an index or ``(epoch, index)``; augmentation draws from
    ``np.random.default_rng([seed, epoch, index])`` only, so a sample is the same whichever
    worker, rank or resumed run produces it.
    """

    def __init__(self, path: Any, img_size: int = 640, batch_size: int = 16, augment: bool = False,
                 hyp: Any = None, rect: bool = False, stride: int = 32, pad: float = 0.0,
                 single_cls: bool = False, *, nc: int, seed: int = 0, cache_dir: Path | None = None,
                 prefix: str = "", verbose: bool = True) -> None:
        self.path, self.img_size, self.augment, self.hyp = path, img_size, augment, hyp
        self.rect, self.stride, self.pad, self.seed = rect, stride, pad, seed
        img_files = resolve_image_files(path)
        label_files = img2label_paths(img_files)
        result, self.cache_hit = load_or_scan(path, img_files, label_files, nc, cache_dir)
        c, where = result.counts, _describe(path)
        if verbose:
            report_messages(result.msgs, prefix)
            LOGGER.info(f"{prefix}Scanning {where}... {c['images']} images, {c['backgrounds']} backgrounds, "
                        f"{c['corrupt']} corrupt" + (" (from cache)" if self.cache_hit else ""))
        if not c["images"]:
            raise UserError(f"{where}: no usable images ({c['corrupt']} corrupt, see the warnings above)")
        self.im_files, self.label_files = list(result.img_files), list(result.label_files)
        self.labels = [x.astype(np.float32).reshape(-1, 5).copy() for x in result.labels]
        if single_cls:
            for x in self.labels:
                x[:, 0] = 0
        self.shapes = np.asarray(result.shapes, dtype=np.int32).reshape(-1, 2)
        self.counts, self.msgs = dict(c), list(result.msgs)
        self.batch_index = np.arange(len(self.im_files)) // batch_size
        self.batch_shapes: np.ndarray | None = None
        if rect:
            self._set_rect_shapes(batch_size)

    def _set_rect_shapes(self, batch_size: int) -> None:
        """Sort by aspect ratio and give each batch the smallest stride-multiple shape that fits it."""
        ar = self.shapes[:, 1] / self.shapes[:, 0]  # h / w
        order = ar.argsort(kind="stable")
        self.im_files = [self.im_files[i] for i in order]
        self.label_files = [self.label_files[i] for i in order]
        self.labels = [self.labels[i] for i in order]
        self.shapes, ar = self.shapes[order], ar[order]
        nb = math.ceil(len(ar) / batch_size)
        shapes = np.ones((nb, 2))
        for i in range(nb):
            ari = ar[i * batch_size:(i + 1) * batch_size]
            if ari.max() < 1:
                shapes[i] = [ari.max(), 1]
            elif ari.min() > 1:
                shapes[i] = [1, 1 / ari.min()]
        self.batch_shapes = np.ceil(shapes * self.img_size / self.stride + self.pad).astype(int) * self.stride

    def __len__(self) -> int:
        return len(self.im_files)

    def load_image(self, i: int) -> tuple[np.ndarray, tuple[int, int]]:
        """BGR image resized so its long side is img_size, and its original (h, w)."""
        img = cv2.imread(self.im_files[i])
        if img is None:
            raise UserError(f"{self.im_files[i]}: OpenCV cannot read this image")
        return resize_long_side(img, self.img_size, self.augment), img.shape[:2]

    def __getitem__(self, item: int | tuple[int, int]):
        epoch, index = item if isinstance(item, tuple) else (0, item)
        index = int(index)
        rng = np.random.default_rng([self.seed, int(epoch), index])
        img, (h0, w0) = self.load_image(index)
        h, w = img.shape[:2]
        shape = tuple(self.batch_shapes[self.batch_index[index]]) if self.rect else self.img_size
        img, ratio, pad = letterbox(img, shape, auto=False, scaleup=self.augment)
        shapes = (h0, w0), ((h * ratio[1] / h0, w * ratio[0] / w0), pad)
        labels = self.labels[index].copy()
        if len(labels):
            labels[:, 1:] = xywhn2xyxy(labels[:, 1:], ratio[0] * w, ratio[1] * h, padw=pad[0], padh=pad[1])
        if self.augment:  # pixel-space augmentations (mosaic, perspective) will go before HSV
            augment_hsv(img, rng, _hyp(self.hyp, "hsv_h"), _hyp(self.hyp, "hsv_s"), _hyp(self.hyp, "hsv_v"))
        if len(labels):
            labels[:, 1:] = xyxy2xywhn(labels[:, 1:], w=img.shape[1], h=img.shape[0], clip=True)
        if self.augment:
            img, labels = random_flip(img, labels, rng, _hyp(self.hyp, "fliplr"), _hyp(self.hyp, "flipud"))
        labels_out = torch.zeros((len(labels), 6))
        if len(labels):
            labels_out[:, 1:] = torch.from_numpy(labels)
        img = np.ascontiguousarray(img.transpose((2, 0, 1))[::-1])  # HWC BGR -> CHW RGB
        return torch.from_numpy(img), labels_out, self.im_files[index], shapes, index
