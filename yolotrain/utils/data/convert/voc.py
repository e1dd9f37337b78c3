"""Pascal VOC xml -> YOLO dataset.

Input: a VOC year folder (``VOCdevkit/VOC2012``: ``Annotations/*.xml``, ``JPEGImages/``, and
``ImageSets/Main/<split>.txt`` naming each split's ids; per-class lists such as
``aeroplane_train.txt`` are ignored; without split lists every xml is one split ``all``), or a
folder of xml files (one split ``all``, images beside them or in ``../JPEGImages``).

VOC boxes are 1-based inclusive pixel indices: a box covering pixel columns 1..W has xmin 1 and
xmax W. In continuous pixel coordinates (0 at the image's left edge) that is x1 = xmin - 1,
x2 = xmax, and likewise for y. Difficult objects are dropped unless ``keep_difficult``.
"""
from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from yolotrain.utils.core.errors import UserError, did_you_mean
from yolotrain.utils.data.convert.common import (ConvertReport, DatasetPlan, ImageItem, SplitCounts, clip_box, finish_split,
                                       write_dataset)
from yolotrain.utils.data.images import verify_image


@dataclass
class VocObject:
    name: str
    difficult: bool
    box: tuple[float, float, float, float]  # xmin, ymin, xmax, ymax as written (1-based inclusive)


@dataclass
class VocRecord:
    """One parsed annotation file."""

    xml: Path
    filename: str
    width: int | None
    height: int | None
    objects: list[VocObject] = field(default_factory=list)


def convert_voc(src: str | Path, out: str | Path, *, names: Sequence[str] | None = None,
                keep_difficult: bool = False, images: str | Path | None = None, train_split: str | None = None,
                val_split: str | None = None, exist_ok: bool = False, copy: bool = False) -> ConvertReport:
    """Convert a VOC folder to a YOLO dataset at ``out``; ``names`` fixes the class list (else the sorted
    names found). Every input is checked before anything is written."""
    plan = read_voc(src, names=names, keep_difficult=keep_difficult, images=images)
    return write_dataset(plan, out, train_split, val_split, exist_ok, copy)


def read_names_file(path: str | Path) -> list[str]:
    """Class names, one per line (blank lines skipped), for ``--names-file``."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the names file: {e}") from None
    names = [x.strip() for x in lines if x.strip()]
    if not names:
        raise UserError(f"{path}: no class names in the names file")
    return names


def read_voc(src: str | Path, names: Sequence[str] | None = None, keep_difficult: bool = False,
             images: str | Path | None = None) -> DatasetPlan:
    """Parse and check every xml of every split; UserError naming the file and object on the first problem."""
    src = Path(src)
    if not src.is_dir():
        raise UserError(f"{src}: not a folder (expected a VOC folder with Annotations/ or a folder of xml files)")
    splits, img_dirs = _split_files(src), _image_dirs(src, images)
    parsed = {x: _parse(x) for xmls in splits.values() for x in xmls}
    if names is not None and (len(set(names)) != len(names) or not names):
        raise UserError(f"the class list must be non-empty names without repeats, got {list(names)}")
    names = list(names) if names is not None else sorted({o.name for r in parsed.values() for o in r.objects})
    if not names:
        raise UserError(f"{src}: no objects in any xml file, so no class names; give them with --names")
    index = {n: k for k, n in enumerate(names)}
    out, counts = {}, {}
    for split, xmls in splits.items():
        counts[split] = SplitCounts()
        items = [_item(parsed[x], index, img_dirs, keep_difficult, counts[split]) for x in xmls]
        out[split] = finish_split(split, items, counts[split])
    return DatasetPlan(out, counts, names, "voc")


def _split_files(src: Path) -> dict[str, list[Path]]:
    """{split: xml files}: ImageSets/Main/<split>.txt lists in a VOC folder, else every xml as 'all'."""
    ann = src / "Annotations"
    if not ann.is_dir():
        xmls = sorted(src.glob("*.xml"))
        if not xmls:
            raise UserError(f"{src}: no Annotations/ folder and no .xml files")
        return {"all": xmls}
    lists = sorted(p for p in (src / "ImageSets" / "Main").glob("*.txt") if "_" not in p.stem)
    if not lists:
        return {"all": sorted(ann.glob("*.xml"))}
    splits = {}
    for lst in lists:
        ids = [(k, line.split()[0]) for k, line in enumerate(lst.read_text().splitlines(), 1) if line.strip()]
        for k, i in ids:
            if not (ann / f"{i}.xml").is_file():
                raise UserError(f"{lst}: line {k}: no annotation {ann / f'{i}.xml'}")
        splits[lst.stem] = [ann / f"{i}.xml" for _, i in ids]
    return splits


def _image_dirs(src: Path, images: str | Path | None) -> list[Path]:
    if images is not None:
        return [Path(images)]
    if (src / "Annotations").is_dir():
        return [src / "JPEGImages"]
    return [src, src.parent / "JPEGImages"]


def _parse(xml: Path) -> VocRecord:
    """One annotation file; a broken one is named with the parser's line and column."""
    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError as e:
        line, col = e.position
        raise UserError(f"{xml}: not valid XML (line {line}, column {col + 1}): {str(e).split(':')[0]}") from None
    except OSError as e:
        raise UserError(f"{xml}: cannot be read: {e}") from None
    if root.tag != "annotation":
        raise UserError(f"{xml}: root element is <{root.tag}>, expected a VOC <annotation>")
    size = root.find("size")
    w, h = (_int(xml, size, k) if size is not None else None for k in ("width", "height"))
    filename = (root.findtext("filename") or "").strip() or f"{xml.stem}.jpg"
    rec = VocRecord(xml, filename, w or None, h or None)
    for k, obj in enumerate(root.iter("object"), 1):
        name = (obj.findtext("name") or "").strip()
        box = obj.find("bndbox")
        if not name or box is None:
            raise UserError(f"{xml}: object {k}: needs a <name> and a <bndbox>")
        coords = tuple(_float(xml, k, box, t) for t in ("xmin", "ymin", "xmax", "ymax"))
        rec.objects.append(VocObject(name, (obj.findtext("difficult") or "0").strip() == "1", coords))
    return rec


def _int(xml: Path, parent: ET.Element, tag: str) -> int | None:
    text = (parent.findtext(tag) or "").strip()
    try:
        return int(float(text)) if text else None
    except ValueError:
        raise UserError(f"{xml}: <size><{tag}> is not a number: {text!r}") from None


def _float(xml: Path, k: int, box: ET.Element, tag: str) -> float:
    text = (box.findtext(tag) or "").strip()
    try:
        return float(text)
    except ValueError:
        raise UserError(f"{xml}: object {k}: <{tag}> is not a number: {text!r}") from None


def _item(rec: VocRecord, index: dict[str, int], img_dirs: list[Path], keep_difficult: bool,
          counts: SplitCounts) -> ImageItem:
    """The image of one record with its boxes in continuous pixels; its size from the xml, else the file."""
    src = next((d / rec.filename for d in img_dirs if (d / rec.filename).is_file()), img_dirs[0] / rec.filename)
    if not src.is_file():
        raise UserError(f"{rec.xml}: image '{rec.filename}' missing on disk (looked in "
                        f"{', '.join(map(str, img_dirs))}; --images names another folder)")
    w, h = rec.width, rec.height
    if w is None or h is None:
        try:
            (h, w), _ = verify_image(str(src))
        except ValueError as e:
            raise UserError(f"{rec.xml}: no <size> and its image {src} cannot be read: {e}") from None
    item = ImageItem(src, Path(rec.filename).name, w, h)
    for k, obj in enumerate(rec.objects, 1):
        if obj.name not in index:
            raise UserError(f"{rec.xml}: object {k}: class '{obj.name}' is not in the class list "
                            f"({', '.join(index)}).{did_you_mean(obj.name, index)}")
        if obj.difficult and not keep_difficult:
            counts.difficult += 1
            continue
        xmin, ymin, xmax, ymax = obj.box
        box, clipped = clip_box((xmin - 1, ymin - 1, xmax, ymax), w, h, f"{rec.xml}: object {k}")
        counts.clipped += clipped
        item.boxes.append((index[obj.name], *box))
    return item
