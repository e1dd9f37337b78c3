"""COCO json for YOLO-format splits: ground truth, predictions, and an export command.

pycocotools (or any COCO tool) can score ``val.py --save-json`` output against the split's
ground truth written here, and gets val.py's mAP: both files use the same ids.

- image ids: 1, 2, ... in sorted image-path order of the split's usable images (the order the
  label scan keeps); ``file_name`` holds the image path, ``width``/``height`` its original size.
  val.py evaluates images in this same order, so score ties resolve as COCOeval resolves them.
- category ids: the YOLO class index (0-based, as YOLOv5's predictions.json on custom data).
- a dataset written by ``python -m yolotrain convert`` records its source's ids (``SourceIds``):
  then both files use the source's image and category ids, so predictions.json scores against
  the original instances json directly.
- boxes: ``[x, y, w, h]`` in original-image pixels, GT clipped to the image as val.py does.
- numbers: detections the shortest decimal that reads back as the same float32, i.e. the
  precision the model computed and no noise digits (scores keep their exact order); ground
  truth in float64 rounded to 1e-10 px, so a converted dataset gives its source boxes back.

``python -m yolotrain coco --data data/shapes.yaml --task val --out gt.json`` writes a split's ground truth
(yolotrain/app/coco.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.config import DataConfig, load_data_config, load_image_ids, prepare_dataset
from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels


GT_DECIMALS = 10  # ground truth's pixel rounding: 1e-10 px, far below 1e-6 of any real box, and no float noise


@dataclass(frozen=True)
class SourceIds:
    """A converted dataset's own COCO ids: ``categories[class index]`` and ``images[real path]``."""

    categories: list[int] | None = None
    images: dict[str, int] | None = None

    @classmethod
    def from_data(cls, data: DataConfig, names: Sequence[str]) -> SourceIds:
        """The ids a data yaml records; categories only when ``names`` are the yaml's own (not --single-cls)."""
        cats = data.category_ids if data.category_ids and list(names) == list(data.names) else None
        return cls(cats, load_image_ids(data) if data.image_ids else None)

    def category(self, c: int) -> int:
        return self.categories[c] if self.categories else c


def image_ids(im_files: Sequence[str], source: SourceIds | None = None) -> dict[str, int]:
    """COCO image id of each image path: the source's when it names every image, else the 1-based rank
    in sorted path order (independent of rect sorting)."""
    known = source.images if source is not None and source.images else None
    if known is not None:
        real = {f: os.path.realpath(f) for f in im_files}
        if all(r in known for r in real.values()):
            return {f: known[r] for f, r in real.items()}
        missing = next(f for f, r in real.items() if r not in known)
        LOGGER.warning(f"WARNING: {missing} has no source image id; image ids follow sorted paths instead")
    return {f: i for i, f in enumerate(sorted(im_files), 1)}


def short_floats(x: Any) -> np.ndarray:
    """float64 values that print as the fewest decimals reading back as the same float32 (vectorised)."""
    x32 = np.asarray(x, dtype=np.float32).reshape(-1)
    x64 = x32.astype(np.float64)
    out, done = x64.copy(), ~np.isfinite(x64)
    for decimals in range(13):  # float32 never needs more than 9 significant digits
        r = np.round(x64, decimals)
        ok = ~done & (r.astype(np.float32) == x32)
        out[ok], done = r[ok], done | ok
        if done.all():
            break
    return out.reshape(np.shape(x))


def _xyxy_to_xywh(xyxy: np.ndarray) -> np.ndarray:
    """(n, 4) float32 xyxy -> float32 [x, y, w, h] (width and height computed in float32)."""
    xyxy = np.asarray(xyxy, dtype=np.float32).reshape(-1, 4)
    return np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], 1)


def detections(per_image: Sequence[tuple[int, np.ndarray]], source: SourceIds | None = None) -> list[dict[str, Any]]:
    """COCO results from (image_id, det) pairs, det (n, 6) [x1, y1, x2, y2, score, cls] in original
    pixels; order kept; category ids the source's when given. Numbers are converted in one vectorised
    pass (COCO val: 1.5M detections)."""
    dets = [np.asarray(d, dtype=np.float32).reshape(-1, 6) for _, d in per_image]
    det = np.concatenate(dets) if dets else np.zeros((0, 6), np.float32)
    image = np.repeat([i for i, _ in per_image], [len(d) for d in dets]).tolist()
    boxes = short_floats(_xyxy_to_xywh(det[:, :4])).tolist()
    cat = (source or SourceIds()).category
    return [{"image_id": i, "category_id": cat(int(c)), "bbox": b, "score": s}
            for i, b, s, c in zip(image, boxes, short_floats(det[:, 4]).tolist(), det[:, 5].tolist())]


def gt_xyxy(labels: np.ndarray, w: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """YOLO rows (cls, xc, yc, w, h) normalised -> float64 xyxy pixels clipped to the image, int64 classes.

    The one conversion behind both val.py's matching and ground_truth.json, so they see the same boxes.
    """
    lb = np.asarray(labels, dtype=np.float64).reshape(-1, 5)
    xyxy = np.stack([lb[:, 1] - lb[:, 3] / 2, lb[:, 2] - lb[:, 4] / 2,
                     lb[:, 1] + lb[:, 3] / 2, lb[:, 2] + lb[:, 4] / 2], 1) * (w, h, w, h)
    return np.clip(xyxy, 0, (w, h, w, h)), lb[:, 0].astype(np.int64)


def ground_truth(im_files: Sequence[str], labels: Sequence[np.ndarray], image_hw: np.ndarray,
                 names: Sequence[str], description: str = "", source: SourceIds | None = None) -> dict[str, Any]:
    """COCO ground truth for a scanned split: labels are YOLO rows (cls, xc, yc, w, h) normalised,
    ``image_hw`` (n, 2) each image's original size (h, w).

    Images are listed by id (sorted paths), including those without labels: their detections are
    false positives in COCOeval as in val.py. Annotation ids start at 1 (COCOeval treats 0 as
    "unmatched"). Boxes are float64 (w = x2 - x1 in float32 loses 1e-5 of a small box far from the
    origin), rounded to GT_DECIMALS.
    """
    ids, cat = image_ids(im_files, source), (source or SourceIds()).category
    order = sorted(range(len(im_files)), key=lambda i: ids[im_files[i]])
    images, boxes, classes, owners = [], [], [], []
    for i in order:
        h, w = (int(v) for v in image_hw[i])
        images.append({"id": ids[im_files[i]], "file_name": str(im_files[i]), "width": w, "height": h})
        xyxy, cls = gt_xyxy(labels[i], w, h)
        boxes.append(xyxy)
        classes += [cat(c) for c in cls.tolist()]
        owners += [ids[im_files[i]]] * len(cls)
    xyxy = np.concatenate(boxes) if boxes else np.zeros((0, 4))
    xywh = np.concatenate([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], 1)
    area = np.round(xywh[:, 2] * xywh[:, 3], GT_DECIMALS).tolist()
    annotations = [{"id": k, "image_id": i, "category_id": c, "bbox": b, "area": a, "iscrowd": 0}
                   for k, (i, c, b, a) in enumerate(zip(owners, classes, np.round(xywh, GT_DECIMALS).tolist(), area), 1)]
    return {"info": {"description": description}, "images": images, "annotations": annotations,
            "categories": [{"id": cat(i), "name": str(n)} for i, n in enumerate(names)]}


def dataset_ground_truth(dataset: LoadImagesAndLabels, names: Sequence[str],
                         source: SourceIds | None = None) -> dict[str, Any]:
    """ground_truth() of a LoadImagesAndLabels (rect-sorted or not: the ids do not change)."""
    return ground_truth(dataset.im_files, dataset.labels, dataset.image_hw, names,
                        description=f"yolotrain ground truth of {dataset.source.where}", source=source)


def write_json(obj: Any, path: str | Path) -> None:
    """Write json atomically (yolotrain.utils.core.fileio), so a reader never sees half a file."""
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(json.dumps(obj, separators=(",", ":")))  # one C-encoder pass: json.dump streams in Python


def export_split(data_file: str | Path, task: str, out: str | Path, single_cls: bool = False,
                 cache_dir: str | Path | None = None) -> dict[str, Any]:
    """Scan one split of a data yaml (generating a built-in dataset if needed) and write its COCO GT."""
    data = load_data_config(data_file)
    split = getattr(data, task)
    if not split:
        raise UserError(f"{data.file}: no '{task}' split")
    prepare_dataset(data)
    names = ["item"] if single_cls else data.names
    ds = LoadImagesAndLabels(DatasetSpec(split, nc=len(data.names), single_cls=single_cls, rect=False),
                             cache_dir=Path(cache_dir) if cache_dir else None, prefix=f"{task}: ")
    gt = dataset_ground_truth(ds, names, SourceIds.from_data(data, names))
    write_json(gt, out)
    return gt
