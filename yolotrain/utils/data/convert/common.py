"""What the COCO and VOC readers share: the plan of a converted dataset, box clipping, and writing it.

A reader validates every input file first and returns a ``DatasetPlan``; only then does
``write_dataset`` touch the disk, into a temporary folder beside OUT that is renamed into place at
the end, so bad input or a crash never leaves half a dataset at OUT.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import yaml

from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER


@dataclass
class SplitCounts:
    """One split's tally: what was written, and what was left out or changed on the way."""

    images: int = 0
    labels: int = 0  # label files with at least one row
    instances: int = 0  # label rows written
    backgrounds: int = 0  # images without a row (an empty label file)
    crowd: int = 0  # COCO iscrowd boxes left out
    clipped: int = 0  # boxes cut to the image
    difficult: int = 0  # VOC difficult objects dropped


@dataclass
class ConvertReport:
    """What a conversion wrote: the data yaml, the classes, and per split counts."""

    data_yaml: Path
    names: list[str]
    train: str
    val: str
    splits: dict[str, SplitCounts] = field(default_factory=dict)
    linked: int = 0  # images hard-linked
    copied: int = 0  # images copied (another file system, or copy=True)

    def summary(self) -> list[str]:
        """One line per split and one for the whole, for the CLI's log."""
        lines = [f"{name}: {c.images} images ({c.backgrounds} backgrounds), {c.instances} boxes, {c.crowd} crowd "
                 f"left out, {c.clipped} clipped, {c.difficult} difficult dropped" for name, c in self.splits.items()]
        return lines + [f"{self.data_yaml}: {len(self.names)} classes, train '{self.train}', val '{self.val}'; "
                        f"{self.linked} images linked, {self.copied} copied"]


@dataclass
class ImageItem:
    """One image to write: its file, output name, size and boxes (class, x1, y1, x2, y2 in pixels)."""

    src: Path
    name: str
    width: int
    height: int
    boxes: list[tuple[int, float, float, float, float]] = field(default_factory=list)
    source_id: int | None = None


@dataclass
class DatasetPlan:
    """A whole conversion, validated: splits of images, class names, and the source's ids if any."""

    splits: dict[str, list[ImageItem]]
    counts: dict[str, SplitCounts]
    names: list[str]
    source: str
    category_ids: list[int] | None = None


def clip_box(box: tuple[float, float, float, float], width: int, height: int,
             where: str) -> tuple[tuple[float, float, float, float], bool]:
    """(x1, y1, x2, y2) pixels cut to the image, and whether it was cut; UserError naming ``where`` for a
    box without area or one entirely outside the image."""
    x1, y1, x2, y2 = box
    if not all(map(_finite, box)) or x2 <= x1 or y2 <= y1:
        raise UserError(f"{where}: box has no positive width and height ({x1:g}, {y1:g}, {x2:g}, {y2:g})")
    c = (max(x1, 0.0), max(y1, 0.0), min(x2, float(width)), min(y2, float(height)))
    if c[2] <= c[0] or c[3] <= c[1]:
        raise UserError(f"{where}: box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) lies entirely outside the "
                        f"{width}x{height} image")
    return c, c != (x1, y1, x2, y2)


def _finite(v: float) -> bool:
    return v == v and abs(v) != float("inf")


def check_unique_stems(split: str, items: Sequence[ImageItem]) -> None:
    """Two images whose names share a stem would share one label file: refuse, naming both sources."""
    seen: dict[str, Path] = {}
    for item in items:
        stem = Path(item.name).stem
        if stem in seen:
            raise UserError(f"{item.src}: same file name stem '{stem}' as {seen[stem]} in split '{split}'; both "
                            f"would write labels/{split}/{stem}.txt")
        seen[stem] = item.src


def choose_splits(splits: Sequence[str], train: str | None, val: str | None) -> tuple[str, str]:
    """(train, val) split names: those given, else the ones named train*/val*; one split serves both."""
    for given in (train, val):
        if given is not None and given not in splits:
            raise UserError(f"split '{given}' not found; the input has {', '.join(splits)}")
    train = train or next((s for s in splits if s.startswith("train")), None)
    val = val or next((s for s in splits if s.startswith("val")), None)
    if len(splits) == 1 or (train is None and val is None):
        train, val = train or val or splits[0], val or train or splits[0]
    train, val = train or val, val or train
    if train == val:
        LOGGER.warning(f"WARNING: one split '{train}' serves as both train and val; choose others with "
                       "--train-split/--val-split")
    return train, val


def label_line(cls: int, box: tuple[float, float, float, float], width: int, height: int) -> str:
    """``cls xc yc w h`` normalised, each number as repr: the shortest text that reads back as the same float64."""
    x1, y1, x2, y2 = box
    return f"{cls} {(x1 + x2) / 2 / width!r} {(y1 + y2) / 2 / height!r} {(x2 - x1) / width!r} {(y2 - y1) / height!r}"


def prepare_out(out: Path, exist_ok: bool) -> Path:
    """The temporary folder to write into, beside ``out``; refuses a non-empty ``out`` unless ``exist_ok``."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not exist_ok:
        raise UserError(f"{out}: exists and is not empty; pass --exist-ok (exist_ok=True) to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.converting-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _place_image(src: Path, dst: Path, copy: bool) -> bool:
    """Hard-link ``src`` at ``dst`` (True), or copy it when linking is not possible or not wanted (False)."""
    if not copy:
        try:
            os.link(src, dst)
            return True
        except OSError:
            pass
    shutil.copy2(src, dst)
    return False


def _write_split(tmp: Path, split: str, items: Sequence[ImageItem], copy: bool,
                 report: ConvertReport) -> dict[str, int]:
    """images/<split>/ and labels/<split>/ for one split; returns {image path relative to OUT: source id}."""
    (tmp / "images" / split).mkdir(parents=True)
    (tmp / "labels" / split).mkdir(parents=True)
    ids = {}
    for item in items:
        rel = f"images/{split}/{item.name}"
        linked = _place_image(item.src, tmp / rel, copy)
        report.linked, report.copied = report.linked + linked, report.copied + (not linked)
        lines = [label_line(c, box, item.width, item.height) for c, *box in item.boxes]
        (tmp / "labels" / split / f"{Path(item.name).stem}.txt").write_text("".join(f"{x}\n" for x in lines))
        if item.source_id is not None:
            ids[rel] = item.source_id
    return ids


def _data_yaml(plan: DatasetPlan, train: str, val: str, has_ids: bool) -> str:
    """data.yaml: the folder is its own root (path: .), so the dataset can move as a whole."""
    doc = {"path": ".", "train": f"images/{train}", "val": f"images/{val}", "names": list(plan.names)}
    if plan.category_ids is not None:
        doc["category_ids"] = list(plan.category_ids)
    if has_ids:
        doc["image_ids"] = "image_ids.json"
    head = f"# written by {tool_command('convert')} {plan.source}; splits: {', '.join(plan.splits)}\n"
    return head + yaml.safe_dump(doc, sort_keys=False, allow_unicode=True)


def write_dataset(plan: DatasetPlan, out: str | Path, train: str | None = None, val: str | None = None,
                  exist_ok: bool = False, copy: bool = False) -> ConvertReport:
    """Write a validated plan as a YOLO dataset at ``out``: all of it, or (on any error) nothing."""
    out = Path(out).absolute()
    train, val = choose_splits(list(plan.splits), train, val)
    tmp = prepare_out(out, exist_ok)
    report = ConvertReport(out / "data.yaml", list(plan.names), train, val, dict(plan.counts))
    try:
        ids: dict[str, int] = {}
        for split, items in plan.splits.items():
            ids.update(_write_split(tmp, split, items, copy, report))
        if ids:
            (tmp / "image_ids.json").write_text(json.dumps(ids, indent=0, sort_keys=True) + "\n")
        (tmp / "data.yaml").write_text(_data_yaml(plan, train, val, bool(ids)), encoding="utf-8")
        _swap_in(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def _swap_in(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (exist_ok) is moved aside first and removed after."""
    old = None
    if out.exists():
        old = out.with_name(f".{out.name}.replaced-{os.getpid()}")
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except OSError:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old) if old.is_dir() else old.unlink()


def finish_split(split: str, items: list[ImageItem], counts: SplitCounts) -> list[ImageItem]:
    """Check one split's output names are distinct and count its images, boxes and backgrounds."""
    check_unique_stems(split, items)
    counts.images = len(items)
    counts.labels = sum(bool(i.boxes) for i in items)
    counts.backgrounds = counts.images - counts.labels
    counts.instances = sum(len(i.boxes) for i in items)
    return items


def image_folder(candidates: Sequence[Path], first: str, what: str) -> Path:
    """The first candidate folder holding ``first`` (an image's relative name); UserError listing them all."""
    for folder in candidates:
        if (folder / first).is_file():
            return folder
    tried = ", ".join(str(c) for c in candidates)
    raise UserError(f"{what}: image '{first}' not found in any of: {tried}; point --images at its folder")


def check_images_exist(items: Sequence[ImageItem], what: str) -> None:
    """Every image must be on disk: the error names the first missing ones and how many there are."""
    missing = [str(i.src) for i in items if not i.src.is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserError(f"{what}: {len(missing)} image(s) missing on disk: {', '.join(missing[:3])}{more}")
