"""The training step (utils/engine/step.py): N ranks train what one process trains."""
from __future__ import annotations

import json

import pytest

from tests.helpers import ROOT, TORCHRUN, run

TOLERANCE = 1e-5  # the largest gradient difference over the largest gradient; float32 sums in another order
# move the last bits (about 1e-7 here), while a per-rank normaliser moves gradients by 10 % to 50 %


@pytest.mark.slow
@pytest.mark.dist
def test_two_ranks_take_the_one_process_step_for_every_loss_family(tmp_path):
    """One step's gradients on 2 CPU ranks (DDP, gloo), each with half a batch whose halves hold 20 and 4 objects,
    equal the one-process step's on the whole batch for the anchor-based (yolov5n), anchor-free (yolov8n) and
    end-to-end (yolo26n) losses, with BatchNorm on equal statistics (--sync-bn's part): each rank divides its
    sums by its share of every rank's count (models/heads/base.Ranks). The control, each rank's own count (what
    Ultralytics does), is far outside the tolerance: the test can tell the two apart."""
    out = tmp_path / "grads.jsonl"
    run([*TORCHRUN, ROOT / "tests" / "scripts" / "normaliser_ranks.py", out], timeout=300)
    reports = {r["model"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(reports) == ["yolo26n", "yolov5n", "yolov8n"]
    for name, r in reports.items():
        assert r["global"] < TOLERANCE, (name, r)
        assert r["per-rank"] > 1000 * TOLERANCE, (name, r)
