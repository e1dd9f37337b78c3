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

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader
from tqdm import tqdm

from yolotrain.utils.core import watchdog
from yolotrain.utils.core.cpu import usable_cpus
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.loader import InferenceSampler
from yolotrain.utils.data.sources import (LetterboxedImages, Sources, VideoInfo, assign_videos, collate_items,
                                UnreadableVideo, probe_video, read_video)
from yolotrain.utils.infer.predict import Predictor
from yolotrain.utils.infer.save import VideoSink, Writer


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


@dataclass(frozen=True)
class Prediction:
    """One image or video frame's detections: ``det`` (n, 6) [x1, y1, x2, y2, conf, cls] in original pixels."""

    path: str
    stem: str  # the unique output stem; a video frame's ends in _<frame>
    det: np.ndarray
    hw: tuple[int, int]  # the original (height, width)
    original: np.ndarray | None  # BGR as read, when asked for
    frame: int | None = None  # a video's frame number (from 1); None for an image
    fps: float = 0.0  # a video's frame rate


def image_loads(sources: Sources, settings: ShardSettings, info: DistInfo) -> list[int]:
    """Images per rank (InferenceSampler's deal)."""
    batch = max(min(settings.batch_size, len(sources.images)), 1)
    return [len(InferenceSampler(len(sources.images), batch, r, info.world_size)) for r in range(info.world_size)]


def predict_batches(sources: Sources, predictor: Predictor, settings: ShardSettings, info: DistInfo,
                    keep_original: bool, report: ShardReport,
                    videos: list[tuple[str, VideoInfo]] | None = None) -> Iterator[list[Prediction]]:
    """This rank's images, then its videos (``videos``: my_videos' deal, when already made), a batch of
    Predictions at a time: detect.py writes them, the Python API hands them out as they come. Counts and
    skipped files go to ``report``."""
    loader = image_loader(sources.images, settings, keep_original, info) if sources.images else None
    videos = my_videos(sources, image_loads(sources, settings, info), info) if videos is None else videos
    for batch in watchdog.beats(loader or ()):  # each batch is progress: a long run is not a hang
        for item in batch.failed:
            report.skip(item.path, item.error)
        if batch.images is not None:
            dets = predictor(batch.images, [it.placement for it in batch.items])
            yield [Prediction(it.path, sources.stems[it.path], det, it.placement.orig_hw, it.original)
                   for it, det in zip(batch.items, dets)]
            report.images += len(dets)
    for path, probe in videos:
        yield from _video(path, probe, predictor, sources.stems[path], settings, keep_original, report)


def _video(path: str, probe: VideoInfo, predictor: Predictor, stem: str, settings: ShardSettings, keep_original: bool,
           report: ShardReport) -> Iterator[list[Prediction]]:
    """One video, frame batch by frame batch, in order."""
    if probe.error:
        report.skip(path, probe.error)
        return
    frames = 0
    try:
        for batch in read_video(path, settings.imgsz, settings.batch_size, keep_original):
            dets = predictor(torch.stack([it.image for it in batch]), [it.placement for it in batch])
            yield [Prediction(path, f"{stem}_{it.index}", det, it.placement.orig_hw, it.original, it.index, probe.fps)
                   for it, det in zip(batch, dets)]
            frames += len(batch)
            watchdog.beat()
    except UnreadableVideo as e:
        report.skip(path, str(e))
        return
    report.frames += frames
    report.videos += 1


def run_shard(sources: Sources, predictor: Predictor, writer: Writer, settings: ShardSettings,
              info: DistInfo, on_batch: Callable[[int, list[Prediction]], None] | None = None) -> ShardReport:
    """Detect on this rank's images and videos, writing each one's files; returns the report. ``on_batch``
    hears each batch (its index in this rank's share, from 0) after its files are written."""
    report = ShardReport(nc=len(writer.names))
    loads = image_loads(sources, settings, info)
    videos = my_videos(sources, loads, info)
    total = loads[info.rank] + sum(p.frames for _, p in videos)
    sinks = VideoSinks(writer)
    with tqdm(total=total, desc="detect", unit="img", disable=not info.is_main, leave=False) as bar:
        try:
            originals = writer.opts.needs_original or on_batch is not None  # a listener's Results hold the image
            for k, batch in enumerate(predict_batches(sources, predictor, settings, info, originals, report, videos)):
                for p in batch:
                    write_prediction(p, writer, sinks)
                    report.count(p.det)
                if on_batch is not None:
                    on_batch(k, batch)
                bar.update(len(batch))
        finally:
            sinks.close()
    report.times = predictor.times.copy()
    report.label_files = writer.label_files
    return report


def write_prediction(p: Prediction, writer: Writer, sinks: VideoSinks) -> None:
    """An image's or frame's files: labels and crops, and its annotated picture or video frame."""
    writer.detections(p.det, p.hw, p.stem, p.original)
    if p.original is None:
        return
    if p.frame is None:
        writer.image(p.original, p.det, p.stem + Path(p.path).suffix)
    elif writer.opts.save_img:
        sinks.get(p).write(writer.annotate(p.original, p.det))


class VideoSinks:
    """The annotated video being written: a video's frames arrive in order, one video after another."""

    def __init__(self, writer: Writer) -> None:
        self.writer, self.path, self.sink = writer, None, None

    def get(self, p: Prediction) -> VideoSink:
        if p.path != self.path:
            self.close()
            stem = p.stem.rsplit("_", 1)[0]
            self.path, self.sink = p.path, VideoSink(self.writer.dir / f"{stem}.mp4", p.fps, p.original.shape[:2])
        return self.sink

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()
        self.path, self.sink = None, None
