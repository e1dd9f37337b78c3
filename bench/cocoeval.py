"""One scorer for the side-by-side benches: pycocotools' COCOeval on each tool's detections (not a script).

compare_ultralytics.py and convert_parity.py score every tool's predictions.json with ``coco_map``, so a gap
between tools is never a gap between scorers. pycocotools is a test-only dependency, imported on use.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np


def coco_map(gt_file: str | Path, dets: list[dict], max_det: int = 300) -> tuple[float, float]:
    """(mAP50-95, mAP50) of COCO-format ``dets`` by COCOeval at maxDets ``max_det``; quiet.

    Read from COCOeval's precision array (area 'all', the largest maxDets), as summarize() does: summarize's
    mAP50-95 line is hard-wired to maxDets 100, which would cut the tools' 300.
    """
    try:
        from pycocotools.coco import COCO
        from pycocotools.cocoeval import COCOeval
    except ImportError:
        raise SystemExit("pycocotools is needed to score detections with COCOeval: pip install pycocotools") from None
    if not dets:  # loadRes refuses an empty list; no detections score 0
        return 0.0, 0.0
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(gt_file))
        ev = COCOeval(gt, gt.loadRes(dets), "bbox")
        ev.params.maxDets = [1, 10, max_det]
        ev.evaluate()
        ev.accumulate()
    prec = ev.eval["precision"][:, :, :, 0, -1]  # (IoU thresholds, recall points, classes)

    def mean(x: np.ndarray) -> float:  # -1 marks classes without ground truth, left out as summarize() does
        return float(np.mean(x[x > -1])) if (x > -1).any() else 0.0

    return mean(prec), mean(prec[0])  # IoU thresholds 0.50:0.95, then 0.50 alone
