"""Finding a split's images and labels and verifying every one of them.

Each problem is reported by file (and line) and reason, and nothing good is dropped: a bad label
row is dropped on its own, a bad image skips only that image, and files on disk are only read.
Images are verified by the loader's own decoder (utils/data/images.py), so the size recorded here,
(h, w), is the one training sees. Caching the scan: utils/data/labelcache.py; telling the user
about its problems: utils/data/problems.py.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from yolotrain.utils.core import watchdog
from yolotrain.utils.core.boxes import xywhn2xyxy, xyxy2xywhn
from yolotrain.utils.core.cpu import usable_cpus
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data.images import IMG_SUFFIXES, verify_image

COORD_TOL = 1e-3  # normalised coordinates may stray this far outside [0, 1] (rounding in exports)
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


def describe_source(path: Any) -> str:
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
        raise UserError(f"{describe_source(path)}: no images found (looked for {', '.join(IMG_SUFFIXES)})")
    return files


class LabelTable(Sequence):
    """Every image's label rows (cls, xc, yc, w, h) in one (N, 5) float64 array, image ``i``'s rows being
    ``rows[begin[i]:end[i]]``: a sequence of per-image views. One array instead of one per image lets a
    shard index's labels stay memory-mapped (one copy per node, nothing per sample to build) and a reorder
    (rectangular batches) move two index arrays instead of the rows.

    The one packed layout on disk, for the label cache and the shard index alike: ``rows`` and ``starts``
    (n + 1 offsets, image ``i``'s rows being ``rows[starts[i]:starts[i + 1]]``): ``pack`` writes it, ``packed``
    reads it back."""

    def __init__(self, rows: np.ndarray, begin: np.ndarray, end: np.ndarray) -> None:
        if len(begin) != len(end):
            raise ValueError(f"{len(begin)} row starts but {len(end)} row ends")
        self.rows, self.begin, self.end = rows, begin, end

    @classmethod
    def of(cls, labels: Sequence[np.ndarray]) -> LabelTable:
        """A table of per-image arrays (a scan's), copied; a table as it is."""
        if isinstance(labels, LabelTable):
            return labels
        counts = np.array([len(x) for x in labels], np.int64)
        end = np.cumsum(counts)
        rows = np.concatenate([np.asarray(x, np.float64).reshape(-1, 5) for x in labels]) if len(labels) else (
            np.zeros((0, 5)))
        return cls(rows, end - counts, end)

    @classmethod
    def packed(cls, rows: np.ndarray, starts: np.ndarray) -> LabelTable:
        """A table over the packed layout (the arrays as they are: a memory map stays one)."""
        return cls(rows, starts[:-1], starts[1:])

    def pack(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows in image order (N, 5) float64, starts (n + 1) int64): the layout ``packed`` reads."""
        counts = self.counts()
        return np.asarray(self.stacked(), np.float64), np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        return len(self.begin)

    def __getitem__(self, i: Any) -> np.ndarray:
        if isinstance(i, slice):
            raise TypeError("a LabelTable takes one index; take(order) for several")
        return self.rows[self.begin[i]:self.end[i]]

    def take(self, order: np.ndarray) -> LabelTable:
        """The images in ``order`` (their rows stay where they are)."""
        return LabelTable(self.rows, self.begin[order], self.end[order])

    def with_class(self, c: int) -> LabelTable:
        """Every row's class set to ``c`` (--single-cls), on a copy of the rows."""
        rows = np.array(self.rows, np.float64)
        rows[:, 0] = c
        return LabelTable(rows, self.begin, self.end)

    def counts(self) -> np.ndarray:
        """(n,) each image's number of rows."""
        return np.asarray(self.end) - np.asarray(self.begin)

    def stacked(self) -> np.ndarray:
        """(N, 5) every image's rows in image order, one array."""
        counts = self.counts()
        if not len(counts):
            return np.zeros((0, 5))
        first = np.repeat(np.asarray(self.begin) - (np.cumsum(counts) - counts), counts)
        return np.asarray(self.rows)[first + np.arange(int(counts.sum()))]


class FileColumn(list):
    """A scan's image paths: a list of str with a column's ``take(order)``, as a shard index's ``SourceColumn``
    (utils/data/shards.py), so the dataset reorders either kind the same way."""

    def take(self, order: Sequence[int]) -> FileColumn:
        return FileColumn(self[i] for i in order)


@dataclass
class ScanResult:
    """Usable images with their labels (n, 5) and upright sizes (n, 2) int32 (h, w), plus what was
    wrong and counts. ``img_files``: a column of paths (``FileColumn``, a shard index's ``SourceColumn``: a
    sequence of str with ``take(order)``)."""

    img_files: Sequence[str]
    label_files: Sequence[str]
    labels: LabelTable
    image_hw: np.ndarray
    msgs: list[str]
    counts: dict[str, int]


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
    out = LabelRead(np.zeros((0, 5)), [], dropped=len(problems), blank=not rows and not problems)
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
        lb = a[keep, :5]  # float64: ground truth gives the written boxes back (utils/eval/coco.py)
        _, first = np.unique(lb.astype(np.float32), axis=0, return_index=True)  # duplicates as trained
        if len(first) < len(lb):
            dup = sorted(set(range(len(lb))) - set(first.tolist()))
            out.duplicates = len(dup)
            problems.append(f"{path}: {len(dup)} duplicate label row(s) removed "
                            f"(line{'s' if len(dup) > 1 else ''} {', '.join(str(lines[keep[j]]) for j in dup[:10])})")
            lb = lb[np.sort(first)]
        out.labels = lb
    out.msgs = problems  # all of them: the console shows a few (report_messages), the report file every one
    return out


def _verify_pair(img_file: str, label_file: str,
                 nc: int) -> tuple[str, LabelRead | None, tuple[int, int] | None, list[str]]:
    """(status, label read, image (h, w), messages); status is found, missing, empty or corrupt."""
    try:
        hw, warning = verify_image(img_file)
    except ValueError as e:
        return "corrupt", None, None, [f"{img_file}: {e}; image skipped"]
    msgs = [f"{img_file}: {warning}"] if warning else []
    if not os.path.isfile(label_file):
        return "missing", LabelRead(np.zeros((0, 5)), []), hw, msgs
    try:
        read = _read_labels(label_file, nc)
    except ValueError as e:
        return "corrupt", None, None, msgs + [f"{label_file}: {e}; image skipped"]
    return ("empty" if read.blank else "found"), read, hw, msgs + read.msgs


def scan_labels(img_files: Sequence[str], label_files: Sequence[str], nc: int,
                num_workers: int | None = None) -> ScanResult:
    """Verify every image (full decode) and label in parallel; keep usable images, record every problem.

    Threads suffice: image decoding releases the GIL. Nothing on disk is written or changed.
    """
    workers = num_workers or min(8, usable_cpus())
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        results = list(watchdog.beats(pool.map(lambda pair: _verify_pair(pair[0], pair[1], nc),
                                               zip(img_files, label_files))))  # each file is progress
    counts = dict.fromkeys(COUNT_KEYS, 0)
    keep_img, keep_lb, labels, sizes, msgs = [], [], [], [], []
    for (img, lbf), (status, read, hw, msg) in zip(zip(img_files, label_files), results):
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
        sizes.append(hw)
    counts.update(images=len(keep_img), backgrounds=sum(len(x) == 0 for x in labels),
                  instances=int(sum(len(x) for x in labels)))
    image_hw = np.array(sizes, dtype=np.int32).reshape(-1, 2)
    return ScanResult(FileColumn(keep_img), keep_lb, LabelTable.of(labels), image_hw, msgs, counts)


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
