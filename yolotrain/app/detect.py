#!/usr/bin/env python
"""Run a detector on images, folders, globs, .txt lists and videos; save annotated files and labels.

    python detect.py --weights runs/train/exp/weights/best.pt --source photos/ clip.mp4
    python detect.py --weights best.onnx --source "data/**/*.jpg" --save-txt --save-conf
    torchrun --nproc_per_node 2 detect.py --weights best.pt --source big_folder/

--weights is a yolotrain checkpoint or a file written by export.py (.onnx, .torchscript). Every
image and frame is letterboxed to a square --imgsz input with val.py's own steps, decoded and
NMS'd per image (an end-to-end model's own detections are kept by score and class instead), so
its boxes never depend on its batch. Under torchrun each rank takes a
contiguous shard of the images and whole videos (each output file has one writer), and rank 0
logs the summary and writes summary.json. Results go to runs/detect/exp, exp2, ...: annotated
images (same name) and videos (<stem>.mp4, source frame rate), --save-txt labels/<stem>.txt
(<stem>_<frame>.txt for video frames), --save-crop crops/<class>/<stem>.jpg.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from torch.distributed.elastic.multiprocessing.errors import record

from yolotrain.models.yolo import round_to_stride
from yolotrain.utils.core import dist, precision
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.cli import IMGSZ, ArgumentParser, Range, add_device_flags, add_hang_timeout_flag, add_local_rank_flag, \
    add_run_folder_flags, add_workers_flag
from yolotrain.utils.core.errors import UserError, run_entry_point
from yolotrain.utils.core.fileio import RUNS
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.core.prologue import RunPrologue
from yolotrain.utils.core.runs import pick_run_dir
from yolotrain.utils.data.sources import resolve_sources
from yolotrain.utils.infer.backends import ModelMeta, load_backend
from yolotrain.utils.infer.loop import ShardReport, ShardSettings, run_shard
from yolotrain.utils.infer.predict import PredictOptions, Predictor
from yolotrain.utils.infer.results import batch_listener
from yolotrain.utils.infer.save import SaveOptions, Writer
from yolotrain.utils.infer.summary import RunSummary, finish


def build_parser() -> argparse.ArgumentParser:
    """YOLOv5 detect.py's flags where they fit; numbers are range-checked at parse time (utils/core/cli.Range)."""
    p = ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--weights", required=True,
                   help="checkpoint (yolotrain, YOLOv5 or Ultralytics .pt), or an exported .onnx / .torchscript file")
    p.add_argument("--source", nargs="+", required=True,
                   help="images, folders (not recursive), globs (quote them; ** recurses), .txt lists, videos")
    p.add_argument("--imgsz", "--img", "--img-size", type=IMGSZ, default=None,
                   help="square inference size (default: the model's; a fixed-shape export takes only its own)")
    p.add_argument("--conf-thres", type=Range(float, min=0, max=1), default=0.25, help="confidence threshold")
    p.add_argument("--iou-thres", type=Range(float, min=0, max=1), default=0.45, help="NMS IoU threshold")
    p.add_argument("--max-det", type=Range(int, min=1), default=1000, help="maximum detections per image")
    p.add_argument("--classes", nargs="+", type=Range(int, min=0), default=None,
                   help="keep only these class ids: --classes 0, or --classes 0 2 3")
    p.add_argument("--agnostic-nms", action="store_true", help="class-agnostic NMS")
    p.add_argument("--multi-label", action="store_true",
                   help="a box may carry several classes (val.py's setting; default one class per box, as YOLOv5)")
    p.add_argument("--end2end", action=argparse.BooleanOptionalAction, default=None,
                   help="an end-to-end (NMS-free) model's own detections, or its NMS branch (default: the model's "
                        "mode; an export runs only the mode it was exported in)")
    p.add_argument("--batch-size", type=Range(int, min=1), default=8,
                   help="images or frames per batch over all ranks (split evenly)")
    add_device_flags(p)
    add_workers_flag(p, reads="images")
    p.add_argument("--half", action="store_true",
                   help="reduced-precision inference of a checkpoint: FP16 on CUDA, bf16 autocast on CPU")
    p.add_argument("--save-txt", action="store_true", help="save labels/<stem>.txt (YOLO format, normalised)")
    p.add_argument("--save-conf", action="store_true", help="append each box's confidence in --save-txt files")
    p.add_argument("--save-crop", action="store_true", help="save each box's crop to crops/<class>/")
    p.add_argument("--nosave", action="store_true", help="do not save annotated images and videos")
    p.add_argument("--line-thickness", type=Range(int, min=0), default=0,
                   help="box line width in pixels (0: scaled with the image)")
    p.add_argument("--hide-labels", action="store_true", help="draw boxes without class names")
    p.add_argument("--hide-conf", action="store_true", help="draw class names without confidences")
    add_run_folder_flags(p, RUNS / "detect")
    add_hang_timeout_flag(p)
    add_local_rank_flag(p)
    return p


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def input_size(requested: int | None, meta: ModelMeta) -> int:
    """The square input side: a fixed-shape export's own; else --imgsz (or the model's) rounded up to the stride."""
    if not meta.dynamic:
        if requested is not None and requested != meta.imgsz:
            raise UserError(f"--imgsz {requested}: this export takes {meta.input_rule()}; re-export with "
                            f"--imgsz {requested} or --dynamic")
        return meta.imgsz
    return round_to_stride(requested or meta.imgsz, meta.stride)


def main(opt: argparse.Namespace, callbacks: Callbacks | None = None) -> RunSummary | None:
    """Predict --source with --weights; ``callbacks`` hear on_predict_batch_end after each batch's files are
    written (under torchrun, each rank its own share)."""
    with RunPrologue(opt.local_rank, opt.threads) as run:  # rank, logging, threads; device, watchdog, group
        sources = resolve_sources(opt.source)  # first: a wrong --source is the only line printed
        device = run.start(opt.device, opt.batch_size, opt.hang_timeout)
        return detect(opt, sources, device, run.info, callbacks)


@dataclass(frozen=True)
class Pipeline:
    """What predicting takes, built once from detect's flags: the model's card, the input size, the predictor,
    the writer (None when nothing is saved) and the loader settings. detect.py and YOLO.predict both run it."""

    meta: ModelMeta
    imgsz: int
    predictor: Predictor
    writer: Writer | None
    settings: ShardSettings


def build_pipeline(opt: argparse.Namespace, device: torch.device, info: dist.DistInfo, writes: bool) -> Pipeline:
    """Backend -> input size -> predictor -> writer (``writes``: into a new run folder that every rank shares)."""
    backend = load_backend(opt.weights, device, opt.end2end, opt.max_det)
    meta = backend.meta
    imgsz = input_size(opt.imgsz, meta)
    writer = None
    if writes:
        save_dir = pick_run_dir(opt.project, opt.name, opt.exist_ok, info, create=True)  # every rank writes into it
        writer = Writer(save_dir, meta.names, save_options(opt))
    settings = ShardSettings(imgsz, dist.per_rank_batch(opt.batch_size, info), opt.workers)
    return Pipeline(meta, imgsz, Predictor(backend, device, predict_options(opt, meta, device)), writer, settings)


def detect(opt: argparse.Namespace, sources, device: torch.device, info: dist.DistInfo,
           callbacks: Callbacks | None = None) -> RunSummary | None:
    """Load the model, predict this rank's share of the sources writing each output once, and report on rank 0."""
    run = build_pipeline(opt, device, info, writes=True)
    meta = run.meta
    numerics = (", bf16" if device.type == "cpu" else ", fp16") if opt.half and meta.format == "pytorch" else ""
    mode = f", end-to-end, {meta.max_det} per image" if meta.end2end else ""
    LOGGER.info(f"{opt.weights}: {meta.format} ({meta.family}{mode}){numerics}, {meta.nc} classes, "
                f"input {run.imgsz}x{run.imgsz}; {len(sources.images)} images, {len(sources.videos)} videos")
    started = time.perf_counter()
    report = run_shard(sources, run.predictor, run.writer, run.settings, info,
                       batch_listener(callbacks, list(meta.names)))
    if info.is_main:
        note_problems(sources.problems, sources.duplicates, report)
    return finish(report, list(meta.names), started, run.imgsz, opt.batch_size, run.writer.dir, info)


def predict_options(opt: argparse.Namespace, meta: ModelMeta, device: torch.device) -> PredictOptions:
    """The flags that decide which boxes come out (shared with the Python API's predict)."""
    return PredictOptions(conf_thres=opt.conf_thres, iou_thres=opt.iou_thres, max_det=opt.max_det,
                          classes=tuple(opt.classes) if opt.classes else None, agnostic=opt.agnostic_nms,
                          multi_label=opt.multi_label, half=opt.half,
                          channels_last=meta.format == "pytorch" and precision.channels_last_default(None, device,
                                                                                                half=opt.half))


def save_options(opt: argparse.Namespace) -> SaveOptions:
    """The flags that decide which files are written and how pictures look."""
    return SaveOptions(save_img=not opt.nosave, save_txt=opt.save_txt, save_conf=opt.save_conf,
                       save_crop=opt.save_crop, line_width=opt.line_thickness, hide_labels=opt.hide_labels,
                       hide_conf=opt.hide_conf)


def note_problems(problems: list[tuple[str, str]], duplicates: int, report: ShardReport) -> None:
    """Rank 0 counts the list entries that named nothing usable (every rank found the same ones)."""
    for path, reason in problems:
        report.skip(path, reason)
    if duplicates:
        LOGGER.info(f"{duplicates} source path(s) named more than once were used once")


@record
def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(parse_opt(argv)))


if __name__ == "__main__":
    sys.exit(cli())
