"""Benchmark: our COCO-exact evaluator (utils/eval/metrics.py) against pycocotools' COCOeval.

    python bench/metrics_speed.py [--images 5000] [--classes 80] [--seed 0]

Generates a seeded, COCO-sized prediction set (about 7 GT and 30 detections per image:
jittered copies of the GT, some with the wrong class, plus random false positives), then
times per-image matching + evaluate() and COCOeval.evaluate() + accumulate() (default params),
and prints both times, their ratio and both mAPs (which should agree to ~1e-12).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

import numpy as np


def make_images(n_images: int, nc: int, seed: int) -> list[dict[str, np.ndarray]]:
    """Seeded synthetic GT and predictions in pixels of a 640x640 image, xyxy float64."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(n_images):
        m = int(rng.poisson(7))
        xy, wh = rng.uniform(0, 560, (m, 2)), rng.uniform(4, 300, (m, 2))
        gt = np.c_[xy, np.minimum(xy + wh, 640)]
        gcls = rng.integers(0, nc, m)
        src = np.repeat(np.arange(m), rng.integers(0, 3, m))  # 0-2 copies of each GT
        size = np.tile(gt[src, 2:] - gt[src, :2], 2)
        tp = gt[src] + rng.normal(0, 0.07, (len(src), 4)) * size
        tcls = np.where(rng.random(len(src)) < 0.1, rng.integers(0, nc, len(src)), gcls[src])
        nfp = max(0, 30 - len(src) + int(rng.integers(-5, 6)))
        fxy = rng.uniform(0, 560, (nfp, 2))
        fp = np.c_[fxy, fxy + rng.uniform(4, 200, (nfp, 2))]
        boxes = np.r_[tp, fp]
        boxes[:, 2:] = np.maximum(boxes[:, 2:], boxes[:, :2] + 1)
        scores = np.r_[rng.uniform(0.2, 1.0, len(src)), rng.uniform(0.001, 0.7, nfp)]
        perm = rng.permutation(len(boxes))
        images.append({"gt_boxes": gt, "gt_cls": gcls, "pred_boxes": boxes[perm],
                       "pred_cls": np.r_[tcls, rng.integers(0, nc, nfp)][perm], "pred_scores": scores[perm]})
    return images


def run_ours(images: list[dict[str, np.ndarray]], nc: int) -> tuple[float, float, float, float]:
    """-> (matching seconds, evaluate seconds, mAP50, mAP50-95)."""
    from yolotrain.utils.eval.metrics import evaluate, match_image

    t0 = time.perf_counter()
    stats = [match_image(**im) for im in images]
    t1 = time.perf_counter()
    m = evaluate(stats, nc)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, m.map50, m.map


def to_coco(images: list[dict[str, np.ndarray]], nc: int) -> tuple[dict, list[dict]]:
    """COCO GT dict and result list; image ids follow our image order (COCOeval sorts them)."""
    gt: dict = {"images": [], "annotations": [], "categories": [{"id": c + 1, "name": str(c)} for c in range(nc)]}
    dets: list[dict] = []
    for i, im in enumerate(images, 1):
        gt["images"].append({"id": i, "width": 640, "height": 640})
        for b, c in zip(im["gt_boxes"].tolist(), im["gt_cls"].tolist()):
            w, h = b[2] - b[0], b[3] - b[1]
            gt["annotations"].append({"id": len(gt["annotations"]) + 1, "image_id": i, "category_id": c + 1,
                                      "bbox": [b[0], b[1], w, h], "area": w * h, "iscrowd": 0})
        for b, c, s in zip(im["pred_boxes"].tolist(), im["pred_cls"].tolist(), im["pred_scores"].tolist()):
            dets.append({"image_id": i, "category_id": c + 1, "bbox": [b[0], b[1], b[2] - b[0], b[3] - b[1]],
                         "score": s})
    return gt, dets


def run_coco(images: list[dict[str, np.ndarray]], nc: int) -> tuple[float, float, float, float]:
    """-> (loading seconds, evaluate+accumulate seconds, mAP50, mAP50-95) from pycocotools."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    gt, dets = to_coco(images, nc)
    with contextlib.redirect_stdout(io.StringIO()):
        t0 = time.perf_counter()
        cgt = COCO()
        cgt.dataset = gt
        cgt.createIndex()
        E = COCOeval(cgt, cgt.loadRes(dets), "bbox")
        t1 = time.perf_counter()
        E.evaluate()
        E.accumulate()
        t2 = time.perf_counter()
    s = E.eval["precision"][:, :, :, 0, 2]  # area 'all', maxDets 100
    return t1 - t0, t2 - t1, float(np.mean(s[0][s[0] > -1])), float(np.mean(s[s > -1]))


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's (import here: see __main__)."""
    from yolotrain.utils.core.cli import ArgumentParser, Range

    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=Range(int, min=1), default=5000)
    ap.add_argument("--classes", type=Range(int, min=1), default=80)
    ap.add_argument("--seed", type=Range(int, min=0), default=0)
    return ap


def main() -> None:
    """Parse flags, run both evaluators on the same data and print the comparison."""
    args = build_parser().parse_args()
    images = make_images(args.images, args.classes, args.seed)
    n_gt = sum(len(im["gt_cls"]) for im in images)
    n_det = sum(len(im["pred_cls"]) for im in images)
    print(f"{args.images} images, {args.classes} classes, {n_gt} GT ({n_gt / args.images:.1f}/image), "
          f"{n_det} detections ({n_det / args.images:.1f}/image)")
    t_match, t_eval, ours50, ours = run_ours(images, args.classes)
    t_load, t_coco, coco50, coco = run_coco(images, args.classes)
    ours_total = t_match + t_eval
    print(f"ours:        match {t_match:.3f}s + evaluate {t_eval:.3f}s = {ours_total:.3f}s   "
          f"mAP50 {ours50:.6f}  mAP50-95 {ours:.6f}")
    print(f"pycocotools: evaluate+accumulate {t_coco:.3f}s (loading {t_load:.3f}s not counted)   "
          f"mAP50 {coco50:.6f}  mAP50-95 {coco:.6f}")
    print(f"speed-up {t_coco / ours_total:.1f}x;  |diff| mAP50 {abs(ours50 - coco50):.2e}  "
          f"mAP50-95 {abs(ours - coco):.2e}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
    main()
