"""COCO instances json -> YOLO dataset.

Input: one ``instances_<split>.json`` (any json file; its split is the name after ``instances_``,
else the file's stem), or a folder holding ``annotations/instances_<split>.json`` files (or
``instances_<split>.json`` directly), each one split. Images are looked up, per split, in
``images`` when given (``images/<split>`` first if that exists), else the json's folder,
``<root>/<split>``, ``<root>/images/<split>``, where root is the folder given, or the json's
folder (its parent when that folder is ``annotations``).

Category ids become class indices 0..N-1 in sorted id order (over every split's categories), and
the data yaml records them as ``category_ids`` with each image's id in ``image_ids.json``, so
``val.py --save-json`` writes the source's ids. Crowd boxes are left out and counted.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data.convert.common import (ConvertReport, DatasetPlan, ImageItem, SplitCounts, check_images_exist,
                                       clip_box, finish_split, image_folder, write_dataset)


@dataclass
class CocoFile:
    """One split's instances json, loaded, and where its images are searched."""

    split: str
    path: Path
    root: Path
    doc: dict


def convert_coco(src: str | Path, out: str | Path, *, images: str | Path | None = None,
                 train_split: str | None = None, val_split: str | None = None, exist_ok: bool = False,
                 copy: bool = False) -> ConvertReport:
    """Convert COCO instances json (a file, or a folder of annotations/instances_<split>.json) to a YOLO
    dataset at ``out`` with its data.yaml; every input is checked before anything is written."""
    return write_dataset(read_coco(src, images), out, train_split, val_split, exist_ok, copy)


def read_coco(src: str | Path, images: str | Path | None = None) -> DatasetPlan:
    """Load and validate every split; UserError naming the file and entry on the first problem."""
    files = [_load(split, path, root) for split, path, root in _find_files(Path(src))]
    cats = _categories(files)
    ordered = sorted(cats)
    index = {cid: k for k, cid in enumerate(ordered)}
    splits, counts = {}, {}
    for f in files:
        if f.split in splits:
            raise UserError(f"{f.path}: split '{f.split}' comes from two json files")
        counts[f.split] = SplitCounts()
        items = _split_items(f, index, None if images is None else Path(images), counts[f.split])
        splits[f.split] = finish_split(f.split, items, counts[f.split])
    return DatasetPlan(splits, counts, [cats[c] for c in ordered], "coco", category_ids=ordered)


def _find_files(src: Path) -> list[tuple[str, Path, Path]]:
    """(split, json file, root) for a json file or a COCO folder."""
    if src.is_file():
        root = src.parent.parent if src.parent.name == "annotations" else src.parent
        return [(_split_name(src), src, root)]
    if not src.is_dir():
        raise UserError(f"{src}: not found (expected an instances json file or a COCO folder)")
    found = sorted((src / "annotations").glob("instances_*.json")) or sorted(src.glob("instances_*.json"))
    if not found:
        raise UserError(f"{src}: no annotations/instances_<split>.json (nor instances_<split>.json) in this folder")
    return [(_split_name(f), f, src) for f in found]


def _split_name(path: Path) -> str:
    stem = path.stem
    return stem[len("instances_"):] if stem.startswith("instances_") and len(stem) > len("instances_") else stem


def _load(split: str, path: Path, root: Path) -> CocoFile:
    """Parse one json; a broken file is named with the parser's line and column."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}): {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot be read: {e}") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a COCO object with 'images', 'annotations' and 'categories'")
    for key in ("images", "annotations", "categories"):
        if not isinstance(doc.get(key), list):
            raise UserError(f"{path}: '{key}' must be a list (is this a COCO instances file?)")
    return CocoFile(split, path, root, doc)


def _categories(files: list[CocoFile]) -> dict[int, str]:
    """{category id: name} over every file; an id named differently in two files is an error."""
    cats: dict[int, str] = {}
    for f in files:
        for k, c in enumerate(f.doc["categories"]):
            if not isinstance(c, dict) or not _is_int(c.get("id")) or not isinstance(c.get("name"), str):
                raise UserError(f"{f.path}: categories[{k}] needs an integer 'id' and a string 'name'")
            if cats.setdefault(c["id"], c["name"]) != c["name"]:
                raise UserError(f"{f.path}: category id {c['id']} is '{c['name']}' here but '{cats[c['id']]}' "
                                "in another file")
    if not cats:
        raise UserError(f"{files[0].path}: no categories")
    return cats


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _image_entries(f: CocoFile, images: Path | None) -> dict[int, ImageItem]:
    """{image id: ImageItem} in file order, with each image's path resolved and checked."""
    entries: dict[int, ImageItem] = {}
    for k, im in enumerate(f.doc["images"]):
        if not isinstance(im, dict) or not _is_int(im.get("id")) or not isinstance(im.get("file_name"), str):
            raise UserError(f"{f.path}: images[{k}] needs an integer 'id' and a string 'file_name'")
        w, h = im.get("width"), im.get("height")
        if not (_is_int(w) and _is_int(h) and w > 0 and h > 0):
            raise UserError(f"{f.path}: image id {im['id']} ({im['file_name']}): width and height must be "
                            f"positive integers, got {w!r} x {h!r}")
        if im["id"] in entries:
            raise UserError(f"{f.path}: image id {im['id']} is listed twice")
        entries[im["id"]] = ImageItem(Path(im["file_name"]), Path(im["file_name"]).name, w, h, source_id=im["id"])
    if entries:
        folder = image_folder(_image_dirs(f, images), str(next(iter(entries.values())).src), str(f.path))
        for item in entries.values():
            item.src = folder / item.src
        check_images_exist(list(entries.values()), str(f.path))
    return entries


def _image_dirs(f: CocoFile, images: Path | None) -> list[Path]:
    """Where a split's images are searched, in order (see the module docstring)."""
    if images is not None:
        return [images / f.split, images]
    return [f.path.parent, f.root / f.split, f.root / "images" / f.split]


def _split_items(f: CocoFile, index: dict[int, int], images: Path | None, counts: SplitCounts) -> list[ImageItem]:
    """The split's images with their boxes: crowd left out, the rest clipped to the image."""
    entries = _image_entries(f, images)
    for k, a in enumerate(f.doc["annotations"]):
        where = f"{f.path}: annotation id {a.get('id', f'#{k}') if isinstance(a, dict) else f'#{k}'}"
        if not isinstance(a, dict):
            raise UserError(f"{where}: not an object")
        if not _is_int(a.get("category_id")) or a["category_id"] not in index:
            raise UserError(f"{where}: unknown category_id {a.get('category_id')!r} (categories: "
                            f"{', '.join(map(str, sorted(index)))})")
        item = entries.get(a.get("image_id")) if _is_int(a.get("image_id")) else None
        if item is None:
            raise UserError(f"{where}: image_id {a.get('image_id')!r} is not in 'images'")
        if a.get("iscrowd", 0):
            counts.crowd += 1
            continue
        box = _xyxy(a.get("bbox"), where)
        (x1, y1, x2, y2), clipped = clip_box(box, item.width, item.height, f"{where} (image {item.src.name})")
        counts.clipped += clipped
        item.boxes.append((index[a["category_id"]], x1, y1, x2, y2))
    return list(entries.values())


def _xyxy(bbox: Any, where: str) -> tuple[float, float, float, float]:
    """COCO [x, y, w, h] (pixels, continuous) -> (x1, y1, x2, y2); w and h must be positive."""
    if (not isinstance(bbox, list) or len(bbox) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox)):
        raise UserError(f"{where}: 'bbox' must be [x, y, width, height] numbers, got {bbox!r}")
    x, y, w, h = (float(v) for v in bbox)
    if w <= 0 or h <= 0:
        raise UserError(f"{where}: box has no positive width and height ({w:g} x {h:g})")
    return x, y, x + w, y + h
