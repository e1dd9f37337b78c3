"""Run folders: runs/train/exp, exp2, ...; the results.csv log; finding the latest run to resume."""
from __future__ import annotations

import csv
import glob
import os
from pathlib import Path


def increment_path(path: str | Path, exist_ok: bool = False) -> Path:
    """runs/train/exp -> runs/train/exp2, exp3, ... unless exist_ok or the path is free."""
    path = Path(path)
    if exist_ok or not path.exists():
        return path
    n = 2
    while (candidate := path.with_name(f"{path.name}{n}")).exists():
        n += 1
    return candidate


def latest_checkpoint(search_dir: str | Path = "runs") -> Path | None:
    """The most recently written last.pt under search_dir, or None."""
    found = glob.glob(f"{search_dir}/**/last*.pt", recursive=True)
    return Path(max(found, key=os.path.getmtime)) if found else None


class ResultsCSV:
    """One row per epoch in YOLOv5's results.csv layout (rank 0 only)."""

    KEYS = ("train/box_loss", "train/obj_loss", "train/cls_loss", "metrics/precision", "metrics/recall",
            "metrics/mAP_0.5", "metrics/mAP_0.5:0.95", "val/box_loss", "val/obj_loss", "val/cls_loss",
            "x/lr0", "x/lr1", "x/lr2")

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def append(self, epoch: int, values: list[float]) -> None:
        if len(values) != len(self.KEYS):
            raise ValueError(f"results row has {len(values)} values, expected {len(self.KEYS)}")
        new = not self.path.exists()
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(("epoch", *self.KEYS))
            w.writerow((epoch, *(f"{v:.5g}" for v in values)))

    def truncate_after(self, epoch: int) -> None:
        """On resume, drop rows of epochs that will be trained again."""
        if not self.path.exists():
            return
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        keep = rows[:1] + [r for r in rows[1:] if r and int(r[0]) <= epoch]
        with open(self.path, "w", newline="") as f:
            csv.writer(f).writerows(keep)
