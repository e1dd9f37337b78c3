"""The end of a detect run: every rank's ShardReport gathered to rank 0, logged once, saved as summary.json.

Rank 0 alone writes summary.json. Its counts are integer sums and its list of skipped files is
sorted by path, so only the timings depend on the world size.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from yolotrain.utils.core import dist
from yolotrain.utils.core.logging import LOGGER, colorstr
from yolotrain.utils.infer.loop import ShardReport


@dataclass
class RunSummary:
    """What one detect run did, over all ranks."""

    images: int
    frames: int
    videos: int
    detections: dict[str, int]  # class name -> boxes, every class listed
    skipped: list[tuple[str, str]]  # (path, reason), sorted by path
    speed_ms: tuple[float, float, float]  # pre-process, inference, NMS per image or frame
    wall_s: float  # from the first batch to the gathered result
    world_size: int
    imgsz: int
    batch_size: int
    save_dir: str
    label_files: int

    @property
    def per_second(self) -> float:
        """Images and frames per second of wall time (all ranks together)."""
        return (self.images + self.frames) / max(self.wall_s, 1e-9)


def merge(reports: list[ShardReport], names: list[str], wall_s: float, imgsz: int, batch_size: int,
          save_dir: Path) -> RunSummary:
    """One summary from the ranks' reports (in rank order)."""
    done = sum(r.images + r.frames for r in reports)
    times = sum((r.times for r in reports), np.zeros(3))
    per_class = sum((r.per_class for r in reports), np.zeros(len(names), np.int64))
    return RunSummary(images=sum(r.images for r in reports), frames=sum(r.frames for r in reports),
                      videos=sum(r.videos for r in reports),
                      detections={n: int(c) for n, c in zip(names, per_class.tolist())},
                      skipped=sorted(s for r in reports for s in r.skipped),
                      speed_ms=tuple(float(v) for v in times / max(done, 1) * 1e3),  # type: ignore[arg-type]
                      wall_s=wall_s, world_size=len(reports), imgsz=imgsz, batch_size=batch_size,
                      save_dir=str(save_dir), label_files=sum(r.label_files for r in reports))


def finish(report: ShardReport, names: list[str], started: float, imgsz: int, batch_size: int, save_dir: Path,
           info: dist.DistInfo) -> RunSummary | None:
    """Gather every rank's report; rank 0 logs the summary, writes summary.json and returns it (others: None)."""
    reports = dist.gather_object(report)
    if reports is None:
        return None
    summary = merge(reports, names, time.perf_counter() - started, imgsz, batch_size, save_dir)
    log_summary(summary)
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=1) + "\n")
    return summary


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def log_summary(s: RunSummary) -> None:
    what = [_plural(s.images, "image")] + ([f"{_plural(s.videos, 'video')} ({s.frames} frames)"] if s.videos else [])
    LOGGER.info(f"detect: {', '.join(what)}, {len(s.skipped)} skipped, in {s.wall_s:.1f}s "
                f"({s.per_second:.1f} images/s on {s.world_size} rank(s))")
    found = {n: c for n, c in s.detections.items() if c}
    total = sum(found.values())
    LOGGER.info(f"Detections: {total}" + (f" ({', '.join(f'{n} {c}' for n, c in found.items())})" if found else ""))
    pre, inf, nms = s.speed_ms
    LOGGER.info(f"Speed: {pre:.1f}ms pre-process, {inf:.1f}ms inference, {nms:.1f}ms NMS per image at shape "
                f"({s.batch_size}, 3, {s.imgsz}, {s.imgsz})")
    if s.skipped:
        LOGGER.warning(f"WARNING: {len(s.skipped)} source(s) skipped:")
        for path, reason in s.skipped:
            LOGGER.warning(f"  {path}: {reason}")
    labels = f", {s.label_files} label files in labels/" if s.label_files else ""
    LOGGER.info(f"Results saved to {colorstr(s.save_dir)}{labels}")
