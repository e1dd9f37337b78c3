"""Run folders: runs/train/exp, exp2, ...; the results.csv log; finding the latest run to resume."""
from __future__ import annotations

import csv
import glob
import os
from pathlib import Path

from yolotrain.utils.core.dist import DistInfo, broadcast_object


def increment_path(path: str | Path, exist_ok: bool = False) -> Path:
    """runs/train/exp -> runs/train/exp2, exp3, ... unless exist_ok or the path is free."""
    path = Path(path)
    if exist_ok or not path.exists():
        return path
    n = 2
    while (candidate := path.with_name(f"{path.name}{n}")).exists():
        n += 1
    return candidate


def pick_run_dir(project: str | Path, name: str, exist_ok: bool, info: DistInfo, create: bool = False) -> Path:
    """project/name (incremented unless exist_ok), chosen by rank 0 and shared, so every rank writes into one
    folder. ``create``: made on every rank now; else the caller makes it when it has something to write."""
    chosen = increment_path(Path(project) / name, exist_ok=exist_ok) if info.is_main else None
    save_dir = Path(broadcast_object(str(chosen) if chosen else None))
    if create:
        save_dir.mkdir(parents=True, exist_ok=True)
    return save_dir


def latest_checkpoint(search_dir: str | Path = "runs") -> Path | None:
    """The most recently written last.pt under search_dir, or None."""
    found = glob.glob(f"{search_dir}/**/last*.pt", recursive=True)
    return Path(max(found, key=os.path.getmtime)) if found else None


class ResultsCSV:
    """One row per epoch in YOLOv5's results.csv layout (rank 0 only), columns named from the head's losses.

    Rows are dicts keyed by column name, so a column can never shift: train/<loss>_loss for each of
    the criterion's items, the four metrics, val/<loss>_loss, then one learning rate per group.
    """

    METRICS = ("metrics/precision", "metrics/recall", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95")

    def __init__(self, path: str | Path, loss_names: tuple[str, ...] = ("box", "obj", "cls"), lr_groups: int = 3):
        self.path = Path(path)
        self.keys = (*(f"train/{n}_loss" for n in loss_names), *self.METRICS,
                     *(f"val/{n}_loss" for n in loss_names), *(f"x/lr{j}" for j in range(lr_groups)))

    @classmethod
    def metric_row(cls, metrics) -> dict[str, float]:
        """The four metric columns of a DetectionMetrics (zeros for an epoch without validation)."""
        values = (metrics.mp, metrics.mr, metrics.map50, metrics.map) if metrics is not None else (0.0,) * 4
        return dict(zip(cls.METRICS, values))

    def append(self, epoch: int, row: dict[str, float]) -> None:
        if set(row) != set(self.keys):
            raise ValueError(f"results row has columns {sorted(row)}, expected {sorted(self.keys)}")
        new = not self.path.exists()
        with open(self.path, "a", newline="") as f:
            w = csv.writer(f)
            if new:
                w.writerow(("epoch", *self.keys))
            w.writerow((epoch, *(f"{row[k]:.5g}" for k in self.keys)))

    def truncate_after(self, epoch: int) -> None:
        """On resume, drop rows of epochs that will be trained again."""
        if not self.path.exists():
            return
        with open(self.path, newline="") as f:
            rows = list(csv.reader(f))
        keep = rows[:1] + [r for r in rows[1:] if r and int(r[0]) <= epoch]
        with open(self.path, "w", newline="") as f:
            csv.writer(f).writerows(keep)
