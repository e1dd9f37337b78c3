"""Real images, real weights: YOLOv5's released yolov5n.pt on COCO128's val2017 photos, scored by val.py, gives
the figures docs/benchmarks.md records ("Real images"), by its own mAP and by pycocotools on its detections.

The data and weights are not shipped (their licences): they are read where the workplace keeps them, beside the
checkout (``../shared``), and the test skips with one line where they are absent. Nothing is copied.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, run_env

SHARED = ROOT.parent / "shared"
DATA = SHARED / "data" / "coco128" / "coco128.yaml"
WEIGHTS = SHARED / "weights" / "yolov5n.pt"
BENCHMARKS = ROOT / "docs" / "benchmarks.md"


def recorded_row() -> list[str]:
    """The cells of benchmarks.md's yolotrain row in "Real images": tool, detections, own mAP50, own mAP50-95,
    COCOeval mAP50, COCOeval mAP50-95 (bold marks dropped)."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    section = text[text.index("## Real images"):]
    line = next(row for row in section.splitlines() if row.startswith("| yolotrain val.py |"))
    return [c.strip().strip("*") for c in line.strip("|").split("|")]


def test_the_recorded_row_reads():
    tool, detections, *figures = recorded_row()
    assert tool == "yolotrain val.py" and int(detections.replace(",", "")) > 0
    assert all(0 < float(f) < 1 for f in figures) and len(figures) == 4


@pytest.mark.slow
def test_released_yolov5n_on_coco128_scores_as_recorded(tmp_path):
    if not (DATA.is_file() and WEIGHTS.is_file()):
        pytest.skip(f"no COCO128 and yolov5n.pt in {SHARED} (real data and weights are not shipped)")
    pytest.importorskip("pycocotools")
    cmd = [sys.executable, str(ROOT / "val.py"), "--weights", str(WEIGHTS), "--data", str(DATA), "--imgsz", "640",
           "--batch-size", "32", "--conf-thres", "0.001", "--iou-thres", "0.6", "--max-det", "300", "--workers", "0",
           "--noplots", "--device", "cpu", "--save-json", "--project", str(tmp_path), "--name", "val", "--exist-ok",
           "--cache-dir", str(tmp_path / "cache")]
    out = subprocess.run(cmd, env=run_env(OMP_NUM_THREADS="2"), cwd=tmp_path, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # the summary line: "all  128  898  P  R  mAP50  mAP50-95"
    summary = re.search(r"\ball\s+128\s+898\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+([\d.]+)", out.stdout + out.stderr)
    assert summary, "val.py printed no 'all 128 898 ...' line: " + (out.stdout + out.stderr)[-2000:]
    from bench.cocoeval import coco_map

    run = tmp_path / "val"
    detections = json.loads((run / "predictions.json").read_text())
    coco, coco50 = coco_map(run / "ground_truth.json", detections, 300)
    _, n, own50, own, rec50, rec = recorded_row()
    # the same machine repeats every digit; another CPU's fp32 sums may move a few boxes at the 0.001 threshold
    assert len(detections) == pytest.approx(int(n.replace(",", "")), rel=0.01)
    assert (float(summary[1]), float(summary[2])) == pytest.approx((float(own50), float(own)), abs=1e-3)
    assert (coco50, coco) == pytest.approx((float(rec50), float(rec)), abs=1e-3)
