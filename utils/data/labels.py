"""Finding a split's images and labels, verifying them, and caching the scan.

Each problem is reported by file (and line) and reason, and nothing good is dropped: a bad label
row is dropped on its own, a bad image skips only that image, and files on disk are only read.
Images are fully decoded by the same function the loader uses (``read_image_bgr``), so whatever
the scan accepts trains with the same pixels and size (EXIF applied). The cache is arrays +
JSON in an .npz (no pickle), written atomically and keyed by a hash of every file's path, size
and mtime plus the class count, so an edited label is always seen.
"""
from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import re
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from utils.core.boxes import xywhn2xyxy, xyxy2xywhn
from utils.core.errors import UserError
from utils.core.fileio import atomic_write
from utils.core.logging import LOGGER

IMG_SUFFIXES = (".bmp", ".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp")
IMG_FORMATS = {"bmp", "jpeg", "mpo", "png", "tiff", "webp"}  # what PIL reports for those suffixes
CACHE_VERSION = 3  # 2: per-row label checks, full decode, new count keys; 3: every message kept (no per-file cap)
COORD_TOL = 1e-3  # normalised coordinates may stray this far outside [0, 1] (rounding in exports)
MIN_IMAGE_PX = 10
MAX_REPORTED = 20  # console lines of problems per split; the report file lists every problem
MAX_ROWS_REPORTED = 5  # console lines per file, so one bad file does not hide the others
MISSING_WARN_MIN = 10  # a training split warns when more than this many, and over half, lack a label file
LABEL_DIR_LIKE = ("label", "annot", "ann", "anns", "anno", "annos", "gt", "yolo", "txt", "bbox", "bboxes", "boxes")
COUNT_KEYS = ("found", "missing", "empty", "corrupt", "duplicates", "dropped", "clipped")


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


# ---------------------------------------------------------------- images
def _orientation(im: Image.Image) -> int | None:
    """EXIF orientation tag (1-8) or None; broken EXIF blocks are common and treated as absent."""
    try:
        value = im.getexif().get(0x0112)
    except Exception:  # PIL raises many types for malformed EXIF
        return None
    return int(value) if isinstance(value, int) else None


def _to_uint8(a: np.ndarray, mode: str) -> np.ndarray:
    """16-bit and 32-bit integer or float pixels scaled to 0-255 (as cv2 does for 16-bit files)."""
    if a.dtype == np.uint8:
        return a
    if mode == "F":  # float images: [0, 1] if they fit there, else already 0-255
        a = a.astype(np.float64)
        finite = a[np.isfinite(a)]
        scale = 255.0 if finite.size and finite.max() <= 1.0 else 1.0
        return np.clip(np.nan_to_num(a * scale), 0, 255).round().astype(np.uint8)
    a = np.clip(a.astype(np.int64), 0, 65535)  # 'I;16*' and 'I' (16-bit PNG/TIFF) are 0-65535
    return ((a * 255 + 32767) // 65535).astype(np.uint8)


def _pil_to_bgr(im: Image.Image) -> np.ndarray:
    """Decoded PIL image -> upright (EXIF applied) BGR uint8 (h, w, 3), whatever the mode.

    Alpha is composited on grey 114, the letterbox padding colour, so transparent areas look
    like padding rather than whatever RGB happens to be stored under them.
    """
    im = ImageOps.exif_transpose(im)
    mode = im.mode
    if mode == "1":
        im, mode = im.convert("L"), "L"
    if mode in ("P", "L", "RGB") and "transparency" in im.info:
        im, mode = im.convert("RGBA"), "RGBA"
    if mode in ("LA", "La", "PA", "RGBA", "RGBa"):
        rgba = np.asarray(im.convert("RGBA"), dtype=np.float32)
        alpha = rgba[..., 3:] / 255.0
        rgb = (rgba[..., :3] * alpha + 114.0 * (1.0 - alpha)).round().astype(np.uint8)
    elif mode.startswith("I") or mode in ("F", "L"):
        grey = _to_uint8(np.asarray(im), mode)
        rgb = np.repeat(grey[..., None], 3, axis=2)
    else:  # RGB, CMYK (PIL undoes Adobe inversion), YCbCr, LAB, HSV, P without transparency
        rgb = np.asarray(im.convert("RGB"))
    return np.ascontiguousarray(rgb[..., ::-1])


def _decode_bgr(data: bytes) -> tuple[np.ndarray, str]:
    """Fully decode image bytes to upright BGR uint8 and a warning; ValueError with the reason.

    The scan and the loader both call this, so an image the scan accepts is read the same way
    (same pixels, same EXIF handling, same size) when training. JPEGs that lack their end marker
    are decoded with one appended in memory (the file is never rewritten). Plain RGB/grey JPEGs
    without an EXIF rotation take cv2's faster decoder; everything else goes through PIL.
    """
    if not data:
        raise ValueError("empty file (0 bytes)")
    warning = ""
    if data[:2] == b"\xff\xd8" and data.rstrip(b"\x00")[-2:] != b"\xff\xd9":
        data, warning = data + b"\xff\xd9", "truncated JPEG (no end marker), still readable"
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = (im.format or "").lower()
            if fmt not in IMG_FORMATS:
                raise ValueError(f"unsupported image format '{fmt}'")
            w, h = im.size
            if min(w, h) < MIN_IMAGE_PX:  # before decoding: cheap, and the size is what matters
                raise ValueError(f"image size {w}x{h} below {MIN_IMAGE_PX} pixels")
            orientation = _orientation(im)
            if fmt in ("jpeg", "mpo") and im.mode in ("RGB", "L") and orientation in (None, 1):
                img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
                if img is not None and img.shape[:2] == (h, w):
                    return img, warning
            im.load()  # the full decode: truncated or broken data raises here
            return _pil_to_bgr(im), warning
    except ValueError:
        raise
    except UnidentifiedImageError:
        raise ValueError("unreadable image (not a recognised image format)") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"image too large ({e})") from None
    except Exception as e:  # PIL raises many types for broken files
        what = "truncated JPEG, not decodable" if warning else "unreadable image"
        raise ValueError(f"{what} ({type(e).__name__}: {e})") from None


def read_image_bgr(path: str | Path) -> np.ndarray:
    """Image as upright BGR uint8 (h, w, 3): EXIF orientation applied, any mode converted.

    16-bit -> 8-bit (scaled), greyscale -> 3 channels, palette/alpha -> RGB composited on grey
    114, CMYK -> BGR; a JPEG missing its end marker is read as far as it goes. Labels refer to
    this upright image, and the scan records its size, so the loader must read images with this
    (plain cv2.imread returns None for truncated JPEGs and drops alpha without compositing).
    Raises UserError naming the file when it cannot be read.
    """
    try:
        data = Path(path).read_bytes()
        return _decode_bgr(data)[0]
    except OSError as e:
        raise UserError(f"{path}: cannot read image ({e.strerror or e})") from None
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def _verify_image(path: str) -> tuple[tuple[int, int], str]:
    """Upright size (w, h) after a full decode and a warning ('' if none); ValueError when unusable."""
    if not os.path.isfile(path):
        raise ValueError("image not found")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read file ({e.strerror or e})") from None
    img, warning = _decode_bgr(data)
    h, w = img.shape[:2]
    if min(w, h) < MIN_IMAGE_PX:  # EXIF rotation cannot change this, but a decoder might disagree
        raise ValueError(f"image size {w}x{h} below {MIN_IMAGE_PX} pixels")
    return (w, h), warning


# ---------------------------------------------------------------- labels
@dataclass
class LabelRead:
    """Good rows of one label file (n, 5), a message per problem, and row counts for the summary."""

    labels: np.ndarray
    msgs: list[str]
    dropped: int = 0
    duplicates: int = 0
    clipped: int = 0
    blank: bool = False  # no rows at all (an empty or whitespace-only file)


def _row_problem(parts: list[str], nc: int) -> tuple[list[float] | None, str]:
    """(class xc yc w h) from one row's tokens, or None and why the row is unusable.

    Polygon rows (class x1 y1 x2 y2 ...) become their bounding box, as YOLOv5 reads them.
    """
    n = len(parts)
    if n != 5 and not (n >= 7 and n % 2 == 1):
        return None, f"expected 5 columns (class xc yc w h) or a polygon, found {n}"
    vals = []
    for t in parts:
        try:
            if "_" in t:  # float() accepts 1_000; a label writer never does
                raise ValueError
            vals.append(float(t))
        except ValueError:
            return None, f"non-numeric value '{t[:20]}'"
    a = np.array(vals)
    if not np.isfinite(a).all():
        return None, "non-finite value"
    c = a[0]
    if c != round(c):
        return None, f"class {c:g} is not an integer"
    if not 0 <= c < nc:
        return None, f"class outside [0, {nc - 1}]"
    coords = a[1:]
    if ((coords < -COORD_TOL) | (coords > 1 + COORD_TOL)).any():
        return None, "coordinates not normalised to [0, 1]"
    if n > 5:  # polygon -> box
        xs, ys = coords[0::2], coords[1::2]
        a = np.array([c, (xs.min() + xs.max()) / 2, (ys.min() + ys.max()) / 2, np.ptp(xs), np.ptp(ys)])
    if a[3] <= 0 or a[4] <= 0:
        return None, "width and height must be > 0"
    return a.tolist(), ""


def _read_labels(path: str, nc: int) -> LabelRead:
    """Every good row of a label file; each bad row is reported by line and dropped on its own.

    Boxes may poke out of the image by COORD_TOL (rounding in exporters) silently; further out
    they are clipped with a warning. Exact duplicate rows are removed with a warning. Raises
    ValueError only when the file as a whole cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # a BOM is an editor artefact, not data
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable label file ({e})") from None
    rows, lines, problems = [], [], []
    for k, line in enumerate(text.splitlines(), 1):  # handles \n, \r\n and \r
        parts = line.split()
        if not parts:
            continue
        row, why = _row_problem(parts, nc)
        if row is None:
            problems.append(f"{path}: line {k}: {why} ({line.strip()[:60]}); row dropped")
        else:
            rows.append(row)
            lines.append(k)
    out = LabelRead(np.zeros((0, 5), np.float32), [], dropped=len(problems), blank=not rows and not problems)
    if rows:
        a = np.array(rows, dtype=np.float64)
        xyxy = xywhn2xyxy(a[:, 1:5], 1.0, 1.0)
        far = ((xyxy < -COORD_TOL) | (xyxy > 1 + COORD_TOL)).any(1)
        a[:, 1:5] = xyxy2xywhn(np.clip(xyxy, 0.0, 1.0), 1.0, 1.0)
        flat = (a[:, 3] <= 0) | (a[:, 4] <= 0)
        for i in np.flatnonzero(far & ~flat):
            problems.append(f"{path}: line {lines[i]}: box extends outside the image, clipped to it")
        for i in np.flatnonzero(flat):
            problems.append(f"{path}: line {lines[i]}: box lies outside the image; row dropped")
        out.clipped, out.dropped = int((far & ~flat).sum()), out.dropped + int(flat.sum())
        keep = np.flatnonzero(~flat)
        lb = a[keep, :5].astype(np.float32)
        _, first = np.unique(lb, axis=0, return_index=True)
        if len(first) < len(lb):
            dup = sorted(set(range(len(lb))) - set(first.tolist()))
            out.duplicates = len(dup)
            problems.append(f"{path}: {len(dup)} duplicate label row(s) removed "
                            f"(line{'s' if len(dup) > 1 else ''} {', '.join(str(lines[keep[j]]) for j in dup[:10])})")
            lb = lb[np.sort(first)]
        out.labels = lb
    out.msgs = problems  # all of them: the console shows a few (report_messages), the report file every one
    return out


def _verify_pair(img_file: str, label_file: str, nc: int) -> tuple[str, LabelRead | None, tuple[int, int] | None, list[str]]:
    """(status, label read, shape, messages); status is found, missing, empty or corrupt."""
    try:
        shape, warning = _verify_image(img_file)
    except ValueError as e:
        return "corrupt", None, None, [f"{img_file}: {e}; image skipped"]
    msgs = [f"{img_file}: {warning}"] if warning else []
    if not os.path.isfile(label_file):
        return "missing", LabelRead(np.zeros((0, 5), np.float32), []), shape, msgs
    try:
        read = _read_labels(label_file, nc)
    except ValueError as e:
        return "corrupt", None, None, msgs + [f"{label_file}: {e}; image skipped"]
    return ("empty" if read.blank else "found"), read, shape, msgs + read.msgs


def scan_labels(img_files: Sequence[str], label_files: Sequence[str], nc: int, num_workers: int | None = None) -> ScanResult:
    """Verify every image (full decode) and label in parallel; keep usable images, record every problem.

    Threads suffice: image decoding releases the GIL. Nothing on disk is written or changed.
    """
    workers = num_workers or min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(pool.map(lambda pair: _verify_pair(pair[0], pair[1], nc), zip(img_files, label_files)))
    counts = dict.fromkeys(COUNT_KEYS, 0)
    keep_img, keep_lb, labels, shapes, msgs = [], [], [], [], []
    for (img, lbf), (status, read, shape, msg) in zip(zip(img_files, label_files), results):
        counts[status] += 1
        msgs += msg
        if read is None:
            continue
        counts["dropped"] += read.dropped
        counts["duplicates"] += read.duplicates
        counts["clipped"] += read.clipped
        keep_img.append(img)
        keep_lb.append(lbf)
        labels.append(read.labels)
        shapes.append(shape)
    counts.update(images=len(keep_img), backgrounds=sum(len(x) == 0 for x in labels),
                  instances=int(sum(len(x) for x in labels)))
    shape_arr = np.array(shapes, dtype=np.int32).reshape(-1, 2)
    return ScanResult(keep_img, keep_lb, labels, shape_arr, msgs, counts)


SUMMARY_COLUMNS = (("images", "images"), ("backgrounds", "backgrounds"), ("instances", "boxes"),
                   ("found", "found"), ("missing", "missing"), ("empty", "empty"), ("corrupt", "corrupt"),
                   ("duplicates", "dup rows"), ("dropped", "bad rows"), ("clipped", "clipped"))


def format_summary(counts: dict[str, int], split_name: str) -> str:
    """Two-line table of a split's scan counts, for rank 0 to log after the scan.

    found/missing/empty count label files; corrupt counts skipped images; dup/bad/clipped count
    label rows (duplicates removed, bad rows dropped, boxes clipped to the image).
    """
    heads = ["split"] + [h for _, h in SUMMARY_COLUMNS]
    cells = [str(split_name)] + [str(int(counts.get(k, 0))) for k, _ in SUMMARY_COLUMNS]
    widths = [max(len(h), len(c)) for h, c in zip(heads, cells)]

    def line(xs: list[str]) -> str:
        return "  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in enumerate(zip(xs, widths)))

    return line(heads) + "\n" + line(cells)


def require_usable(result: ScanResult, where: str) -> None:
    """UserError naming the split when no image is usable: one clear fatal error, not a crash later.

    Deterministic from the scan alone, so every rank reaches the same verdict without talking
    to the others (no barrier, hence no hang).
    """
    if result.counts.get("images", len(result.img_files)):
        return
    c = result.counts
    first = "; ".join(result.msgs[:3])
    raise UserError(f"{where}: no usable images ({c.get('corrupt', 0)} corrupt of "
                    f"{sum(c.get(k, 0) for k in ('found', 'missing', 'empty', 'corrupt'))} found"
                    + (f"; first problems: {first}" if first else "") + ")")


def _console_lines(msgs: Sequence[str]) -> tuple[list[str], int]:
    """At most MAX_REPORTED lines, at most MAX_ROWS_REPORTED problems per file, and how many problems they show.

    A file's messages are consecutive and start with its path, so one flooded label file
    cannot hide the problems of the files after it.
    """
    lines: list[str] = []
    shown = 0
    for file, group in itertools.groupby(msgs, key=lambda m: m.split(": ", 1)[0]):
        items = list(group)
        take = items[:min(MAX_ROWS_REPORTED, MAX_REPORTED - len(lines))]
        lines += take
        shown += len(take)
        if len(lines) >= MAX_REPORTED:
            break
        if len(items) > len(take):
            lines.append(f"{file}: ... and {len(items) - len(take)} more problem(s) in this file")
    return lines, shown


def report_messages(msgs: Sequence[str], prefix: str = "", report: Path | None = None) -> None:
    """Log scan problems as warnings: a short list on the console, pointing at ``report`` (every problem)."""
    if not msgs:
        return
    shown, n_shown = _console_lines(msgs)
    where = f" (all listed in {report})" if report else ""
    if n_shown < len(msgs):
        shown.append(f"... and {len(msgs) - n_shown} more" + (f": see {report}" if report else ""))
    LOGGER.warning(f"{prefix}WARNING: {len(msgs)} dataset problem(s){where}:\n" + "\n".join(shown))


def write_problem_report(msgs: Sequence[str], report_dir: Path, split: str, source: str) -> Path | None:
    """Every problem of a split, one a line, in ``report_dir/dataset_problems_<split>.txt``; None if there are none.

    The console shows only the first few, so this file is where the rest can be read. Called by
    rank 0 only, also for a cached scan. A run without problems removes an older run's report
    from the same folder (resume, --exist-ok) so that it cannot be mistaken for this run's.
    """
    name = re.sub(r"[^\w.-]", "_", split) or "split"
    path = Path(report_dir) / f"dataset_problems_{name}.txt"
    try:
        if not msgs:
            path.unlink(missing_ok=True)
            return None
        with atomic_write(path, "w", encoding="utf-8") as f:
            f.write(f"# dataset problems, split {split}: {source}\n"
                    f"# {len(msgs)} problem(s), one per line: file[: line N]: reason; what was done\n")
            f.writelines(" ".join(m.splitlines()) + "\n" for m in msgs)
    except OSError as e:
        LOGGER.warning(f"WARNING: cannot write {path} ({e.strerror or e}); the problems are only in the log")
        return None
    return path


# ---------------------------------------------------------------- splits without labels
def _folders(files: Sequence[str], limit: int = 3) -> str:
    """Distinct parent folders of ``files`` (first ``limit``, in order), for messages."""
    parents = list(dict.fromkeys(os.path.dirname(f) + os.sep for f in files))
    more = f" (and {len(parents) - limit} more folders)" if len(parents) > limit else ""
    return ", ".join(parents[:limit]) + more


def _label_dir_like(name: str) -> bool:
    """Whether a folder name looks like one meant to hold annotations (label/, Labels/, annotations/...)."""
    low = name.lower()
    return "label" in low or "annot" in low or low in LABEL_DIR_LIKE


def _label_like_dirs(parent: Path, tail: str, skip: str | None) -> list[tuple[Path, str]]:
    """Label-like folders in ``parent`` (at most 3), each with a note when it holds the label ``tail`` names."""
    try:
        names = sorted(d for d in os.listdir(parent) if d != skip and _label_dir_like(d) and (parent / d).is_dir())
    except OSError:
        return []
    out = []
    for d in names[:3]:
        held = parent / d / (os.path.splitext(tail)[0] + ".txt") if tail else None
        out.append((parent / d, f", which holds {held}" if held is not None and held.is_file() else ""))
    return out


def _sibling_hints(img: str) -> list[str]:
    """Label-like folders where the images/ -> labels/ rule did not look, near one image."""
    sa = f"{os.sep}images{os.sep}"
    if sa in img:
        head, tail = img.rsplit(sa, 1)
        return [f"found {d}{os.sep} beside the expected {Path(head) / 'labels'}{os.sep}{held}: "
                f"the folder must be named exactly 'labels'"
                for d, held in _label_like_dirs(Path(head), tail, "labels")]
    folder = Path(img).parent
    hints = [f"the image path {folder}{os.sep} has a folder named '{p}': the rule needs exactly 'images'"
             for p in folder.parts if p.lower() == "images"][:1]
    for parent in [q for q in list(folder.parents)[:2] if q != q.parent]:
        dirs = _label_like_dirs(parent, "", None)
        if dirs:
            hints.append(f"found {', '.join(f'{d}{os.sep}' for d, _ in dirs)}, but the image path {folder}{os.sep} "
                         f"has no 'images' folder, so labels are looked for beside the images: put the images under "
                         f"an 'images' folder with the labels in the matching 'labels' folder")
            break
    return hints


def _beside_hints(imgs: Sequence[str], label_files: Sequence[str]) -> list[str]:
    """Annotation files with the images' names lying beside the images (where the rule does not look)."""
    hints = []
    for ext, what in ((".txt", "move them to {folder} (the images/ -> labels/ rule)"),
                      (".xml", "Pascal VOC annotations: convert them to YOLO .txt rows in {folder}"),
                      (".json", "json annotations (LabelMe, COCO...): convert them to YOLO .txt rows in {folder}")):
        hits = [(os.path.splitext(i)[0] + ext, lf) for i, lf in zip(imgs, label_files)
                if os.path.splitext(i)[0] + ext != lf and os.path.isfile(os.path.splitext(i)[0] + ext)]
        if hits:
            hints.append(f"{len(hits)} {ext} file(s) lie beside the images (e.g. {hits[0][0]}): "
                         + what.format(folder=_folders([lf for _, lf in hits], limit=1)))
    return hints


def label_hints(imgs: Sequence[str], label_files: Sequence[str], sample: int = 200) -> list[str]:
    """Likely reasons why these images' label files were not found (misnamed folder, files beside the images)."""
    imgs, label_files = list(imgs)[:sample], list(label_files)[:sample]
    hints: list[str] = []
    for parent_img in dict.fromkeys(os.path.dirname(i) for i in imgs[:50]):
        first = next(i for i in imgs if os.path.dirname(i) == parent_img)
        hints += [h for h in _sibling_hints(first) if h not in hints]
        if len(hints) >= 3:
            break
    return hints[:3] + _beside_hints(imgs, label_files)


LABEL_RULE = ("the last 'images' folder of an image path becomes 'labels' and the suffix .txt ({img} -> {lbl}); "
              "an image path without an 'images' folder has its labels beside the image")
NO_LABELS_POLICY = ("There is no option to train without labels: a detector trained on zero boxes learns nothing. "
                    "Images without a label file are fine as background images mixed with labelled ones.")


def _no_labels_detail(result: ScanResult) -> str | None:
    """Why no usable image has a box, naming where labels were looked for; None when some image has one."""
    if any(len(x) for x in result.labels):
        return None
    c, n = result.counts, len(result.img_files)
    pairs = [(i, lf) for i, lf in zip(result.img_files, result.label_files) if not os.path.isfile(lf)]
    if len(pairs) == n:
        text = f"no label file found for any of its {n} images"
    else:
        text = (f"no usable label in any of its {n} images: {c.get('empty', 0)} label file(s) empty, "
                f"{c.get('found', 0)} with only bad rows ({c.get('dropped', 0)} rows dropped, see the dataset "
                f"problems)" + (f", {len(pairs)} image(s) without a label file" if pairs else ""))
    imgs, label_files = zip(*pairs) if pairs else (result.img_files, result.label_files)
    text += f". Looked for label files in {_folders(label_files)}: {LABEL_RULE.format(img=imgs[0], lbl=label_files[0])}"
    hints = label_hints(imgs, label_files) if pairs else []
    return text + (". Likely cause: " + "; ".join(hints) if hints else "")


def check_label_presence(result: ScanResult, where: str, role: str | None, prefix: str = "",
                         verbose: bool = True) -> None:
    """A training split without any box is a UserError; a validation split without any box, or a training
    split where most images lack a label file, is one loud warning (on the ``verbose`` rank).

    Deterministic from the scan alone, like require_usable, so every rank reaches the same verdict.
    ``role`` is "train", "val" (any evaluation split) or None (no check, for direct use).
    """
    if role not in (None, "train", "val"):
        raise ValueError(f"role must be 'train', 'val' or None, not {role!r}")
    if role is None or (role == "val" and not verbose):
        return
    detail = _no_labels_detail(result)
    if detail is not None and role == "train":
        raise UserError(f"{where}: {detail}. Training cannot start. {NO_LABELS_POLICY}")
    if detail is not None and verbose:
        LOGGER.warning(f"{prefix}WARNING: {where}: {detail}. Every metric will be zero.")
    if detail is None and role == "train" and verbose:
        warn_missing_labels(result, where, prefix)


def warn_missing_labels(result: ScanResult, where: str, prefix: str = "") -> None:
    """One warning when over half of a training split's images (and more than MISSING_WARN_MIN) lack a label file."""
    n, n_missing = len(result.img_files), int(result.counts.get("missing", 0))
    if n_missing <= MISSING_WARN_MIN or 2 * n_missing <= n:
        return
    pairs = [(i, lf) for i, lf, lb in zip(result.img_files, result.label_files, result.labels)
             if not len(lb) and not os.path.isfile(lf)]
    if not pairs:
        return
    imgs, missing = zip(*pairs)
    hints = label_hints(imgs, missing)
    LOGGER.warning(f"{prefix}WARNING: {where}: {len(missing)} of {n} images have no label file and train as "
                   f"background images. Looked for their label files in {_folders(missing)}: "
                   f"{LABEL_RULE.format(img=imgs[0], lbl=missing[0])}"
                   + (". Likely cause: " + "; ".join(hints) if hints else "")
                   + ". If they are meant as backgrounds, all is well.")


# ---------------------------------------------------------------- cache
def files_hash(header: str, files: Sequence[str]) -> str:
    """sha256 of a header and every file's path, size and mtime_ns (or 'missing'), in order: any
    edit, even one that keeps the size, changes it. Shared by the label and image caches."""
    h = hashlib.sha256(f"{header}\n".encode())
    for f in files:
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
    """Write arrays + JSON metadata atomically (utils.core.fileio)."""
    lens = [len(x) for x in result.labels]
    labels = np.concatenate(result.labels).astype(np.float32) if sum(lens) else np.zeros((0, 5), np.float32)
    meta = {"version": CACHE_VERSION, "hash": hash_, "img_files": result.img_files,
            "label_files": result.label_files, "msgs": result.msgs, "counts": result.counts}
    with atomic_write(file) as f:
        np.savez(f, labels=labels, offsets=np.cumsum([0] + lens, dtype=np.int64),
                 shapes=result.shapes.astype(np.int32), meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))


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
