"""Files made from an evaluation: YOLO label txt, COCO json, and the validation pictures.

Written by rank 0 only (the caller checks), in image-id order, so the files do not depend on the
world size. ``utils/eval/evaluate.py`` computes; this module writes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from yolotrain.utils.core.boxes import xyxy2xywhn
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.eval import coco
from yolotrain.utils.eval.evaluate import EvalResult
from yolotrain.utils.eval.plots import output_to_target, plot_confusion_matrix, plot_curves, plot_images


def label_rows(det: np.ndarray, hw: tuple[int, int], save_conf: bool) -> list[str]:
    """(n, 6) original-pixel detections -> YOLO label lines ``cls xc yc w h [conf]`` normalised to the
    (h, w) image, ``%g`` as YOLOv5 writes them; val.py and detect.py both write these."""
    h0, w0 = hw
    xywhn = xyxy2xywhn(det[:, :4].astype(np.float64), w=w0, h=h0)
    lines = []
    for (*xywh, conf, cls) in np.concatenate([xywhn, det[:, 4:6]], 1).tolist():
        line = (int(cls), *xywh, conf) if save_conf else (int(cls), *xywh)
        lines.append(("%g " * len(line)).rstrip() % line)
    return lines


def save_txt(detections: list[tuple[int, np.ndarray]], dataset, save_dir: Path, save_conf: bool) -> Path:
    """labels/<stem>.txt, one ``cls xc yc w h [conf]`` row per detection, normalised to the original
    image (YOLOv5's format; images without detections get no file)."""
    rows: dict[str, list[str]] = {}  # stem -> lines; stems repeated across folders share a file
    for index, det in detections:
        h0, w0 = (int(v) for v in dataset.image_hw[index])
        if len(det):
            rows.setdefault(Path(dataset.im_files[index]).stem, []).extend(label_rows(det, (h0, w0), save_conf))
    folder = Path(save_dir) / "labels"
    folder.mkdir(parents=True, exist_ok=True)
    for stem, lines in rows.items():
        (folder / f"{stem}.txt").write_text("\n".join(lines) + "\n")
    LOGGER.info(f"{len(rows)} label files saved to {folder}")
    return folder


def save_json(detections: list[tuple[int, np.ndarray]], dataset, names: list[str], save_dir: Path,
              source: coco.SourceIds | None = None) -> None:
    """predictions.json (COCO results) and ground_truth.json (COCO GT) with the same ids: the source's
    image and category ids for a converted dataset that records them."""
    ids = coco.image_ids(dataset.im_files, source)
    preds = coco.detections([(ids[dataset.im_files[index]], det) for index, det in detections], source)
    coco.write_json(preds, Path(save_dir) / "predictions.json")
    coco.write_json(coco.dataset_ground_truth(dataset, names, source), Path(save_dir) / "ground_truth.json")
    LOGGER.info(f"{len(preds)} COCO detections saved to {Path(save_dir) / 'predictions.json'}, "
                f"ground truth to {Path(save_dir) / 'ground_truth.json'}")


def save_eval_plots(result: EvalResult, names: list[str], save_dir: Path) -> None:
    """val_batch*_labels/_pred.jpg from the kept batches, the P/R/F1/PR curves and the confusion matrix."""
    save_dir = Path(save_dir)
    for k, b in enumerate(result.batches):
        plot_images(b.images, b.targets, b.paths, names, save_dir / f"val_batch{k}_labels.jpg")
        plot_images(b.images, output_to_target(b.detections), b.paths, names, save_dir / f"val_batch{k}_pred.jpg")
    plot_curves(result.metrics, save_dir)
    plot_confusion_matrix(result.confusion, names, save_dir / "confusion_matrix.png")
