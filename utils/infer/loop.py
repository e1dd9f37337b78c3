"""detect.py's work on one rank: its shard of the images, then the videos it owns.

Images: ``InferenceSampler`` deals contiguous whole batches to ranks (as val.py does), and a
DataLoader's workers decode and letterbox them. Videos: ``assign_videos`` gives each video whole
to one rank (longest first, to the rank with the least work), which decodes its frames in order,
in batches, and writes its annotated .mp4 and frame labels alone. Every image and frame is
letterboxed on its own to the same square input and goes through per-image NMS, so its
detections, and so every file, are the same for any world size. What was done is returned as a
``ShardReport`` for rank 0's summary (utils/infer/summary.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from utils.core import watchdog
from utils.core.cpu import usable_cpus
from utils.core.dist import DistInfo
from utils.core.logging import LOGGER
from utils.data.loader import InferenceSampler
from utils.data.sources import (Item, LetterboxedImages, Sources, VideoInfo, assign_videos, collate_items,
                                UnreadableVideo, probe_video, read_video)
from utils.infer.predict import Predictor
from utils.infer.save import VideoSink, Writer


@dataclass
class ShardReport:
    """What one rank did: counts, detections per class, skipped files with reasons, time per stage."""

    nc: int
    images: int = 0
    frames: int = 0
    videos: int = 0
    per_class: np.ndarray = field(init=False)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    times: np.ndarray = field(default_factory=lambda: np.zeros(3))
    label_files: int = 0

    def __post_init__(self) -> None:
        self.per_class = np.zeros(self.nc, np.int64)

    def count(self, det: np.ndarray) -> None:
        self.per_class += np.bincount(det[:, 5].astype(np.int64), minlength=self.nc)[: self.nc]

    def skip(self, path: str, reason: str) -> None:
        LOGGER.warning(f"WARNING: skipped {path}: {reason}")
        self.skipped.append((path, reason))


@dataclass(frozen=True)
class ShardSettings:
    imgsz: int
    batch_size: int
    workers: int


def _worker_init(_worker_id: int) -> None:
    """One thread per worker: the workers are the parallelism."""
    torch.set_num_threads(1)


def image_loader(files: list[str], settings: ShardSettings, keep_original: bool, info: DistInfo) -> DataLoader:
    """This rank's contiguous whole batches of ``files`` (InferenceSampler), decoded and letterboxed by workers."""
    dataset = LetterboxedImages(files, settings.imgsz, keep_original)
    batch_size = min(settings.batch_size, len(files))
    ranks_here = info.local_world_size if info.world_size > 1 else 1
    nw = min(usable_cpus() // max(ranks_here, 1), batch_size if batch_size > 1 else 0, settings.workers)
    if nw > 0:
        cv2.setNumThreads(0)  # OpenCV's thread pool does not survive fork into workers (utils/data/loader.py)
    return DataLoader(dataset, batch_size=batch_size, num_workers=nw, collate_fn=collate_items,
                      sampler=InferenceSampler(len(files), batch_size, info.rank, info.world_size),
                      worker_init_fn=_worker_init if nw > 0 else None)


def my_videos(sources: Sources, image_loads: list[int], info: DistInfo) -> list[tuple[str, VideoInfo]]:
    """The videos this rank owns, with their headers; every rank computes the same deal."""
    probes = [probe_video(v) for v in sources.videos]
    owner = assign_videos([p.frames for p in probes], info.world_size, image_loads)
    return [(v, p) for v, p, r in zip(sources.videos, probes, owner) if r == info.rank]


def run_shard(sources: Sources, predictor: Predictor, writer: Writer, settings: ShardSettings,
              info: DistInfo) -> ShardReport:
    """Detect on this rank's images and videos, writing each one's files; returns the report."""
    report = ShardReport(nc=len(writer.names))
    loader = image_loader(sources.images, settings, writer.opts.needs_original, info) if sources.images else None
    loads = [len(InferenceSampler(len(sources.images), max(min(settings.batch_size, len(sources.images)), 1), r,
                                  info.world_size)) for r in range(info.world_size)]
    videos = my_videos(sources, loads, info)
    total = loads[info.rank] + sum(p.frames for _, p in videos)
    with tqdm(total=total, desc="detect", unit="img", disable=not info.is_main, leave=False) as bar:
        if loader is not None:
            for batch in watchdog.beats(loader):  # each batch is progress: a long run is not a hang
                for item in batch.failed:
                    report.skip(item.path, item.error)
                if batch.images is not None:
                    _images(batch.images, batch.items, predictor, writer, sources, report)
                bar.update(len(batch.items) + len(batch.failed))
        for path, probe in videos:
            _video(path, probe, predictor, writer, sources.stems[path], settings, report, bar)
    report.times = predictor.times.copy()
    report.label_files = writer.label_files
    return report


def _images(images: torch.Tensor, items: list[Item], predictor: Predictor, writer: Writer, sources: Sources,
            report: ShardReport) -> None:
    dets = predictor(images, [it.placement for it in items])
    for it, det in zip(items, dets):
        stem = sources.stems[it.path]
        writer.detections(det, it.placement.orig_hw, stem, it.original)
        if it.original is not None:
            writer.image(it.original, det, stem + Path(it.path).suffix)
        report.count(det)
        report.images += 1


def _video(path: str, probe: VideoInfo, predictor: Predictor, writer: Writer, stem: str, settings: ShardSettings,
           report: ShardReport, bar: tqdm) -> None:
    """One video, frame batch by frame batch; the annotated .mp4 keeps the source's frame rate and size."""
    if probe.error:
        report.skip(path, probe.error)
        return
    sink: VideoSink | None = None
    frames = 0
    try:
        for batch in read_video(path, settings.imgsz, settings.batch_size, writer.opts.needs_original):
            dets = predictor(torch.stack([it.image for it in batch]), [it.placement for it in batch])
            for it, det in zip(batch, dets):
                writer.detections(det, it.placement.orig_hw, f"{stem}_{it.index}", it.original)
                if writer.opts.save_img:
                    if sink is None:
                        sink = VideoSink(writer.dir / f"{stem}.mp4", probe.fps, it.original.shape[:2])
                    sink.write(writer.annotate(it.original, det))
                report.count(det)
            frames += len(batch)
            bar.update(len(batch))
            watchdog.beat()
    except UnreadableVideo as e:
        report.skip(path, str(e))
        return
    finally:
        if sink is not None:
            sink.close()
    report.frames += frames
    report.videos += 1
