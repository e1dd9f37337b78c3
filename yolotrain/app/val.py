#!/usr/bin/env python
"""Score a detector on a YOLO-format split: P, R, mAP50 and COCO mAP50-95.

    python val.py --weights runs/train/exp/weights/best.pt
    torchrun --nproc_per_node 2 val.py --weights best.pt --data my.yaml --save-json
    python val.py --weights best.pt --task speed
    python val.py --weights best.onnx        # an export.py file: its metadata names the dataset and size

Every rank scores a contiguous shard of whole batches (utils/eval/evaluate.py, the same library
training validates with) at the rect shapes of its global --batch-size, so the numbers do not
depend on the world size (docs/architecture.md says where a backend's batch size moves the last
bits). Rank 0 then saves into runs/val/exp, exp2, ...: --save-txt labels/<stem>.txt; --save-json predictions.json and
ground_truth.json (COCO, ids as in utils/eval/coco.py, so pycocotools reproduces the mAP); either
also metrics.json; and the curves, confusion matrix and batch pictures unless --noplots.

--weights may also be an export.py file (.onnx, .torchscript), run through the same backend as
detect.py (utils/infer/backends.py). A fixed-shape export is scored with square --imgsz inputs
(no rect batches), so compare it with ``val.py --weights best.pt --no-rect``; a --dynamic export
is scored like its checkpoint, rect batches included.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader

from yolotrain.utils.core import dist, precision
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.cli import IMGSZ, ArgumentParser, Range, ResolvedArgs, add_cache_flags, add_channels_last_flag, \
    add_device_flags, add_hang_timeout_flag, add_local_rank_flag, add_run_folder_flags, add_workers_flag
from yolotrain.utils.core.errors import UserError, run_entry_point
from yolotrain.utils.core.fileio import RUNS
from yolotrain.utils.core.logging import LOGGER, colorstr
from yolotrain.utils.core.prologue import RunPrologue
from yolotrain.utils.core.runs import pick_run_dir
from yolotrain.utils.data.config import DEMO_DATA, DataConfig, load_data_config, prepare_dataset
from yolotrain.utils.data.dataset import DatasetSpec
from yolotrain.utils.data.imgcache import release_ram_caches
from yolotrain.utils.data.loader import LoaderSpec, build_loader
from yolotrain.utils.engine.events import ValEvent, metric_summary
from yolotrain.utils.eval import coco
from yolotrain.utils.eval.evaluate import EvalOptions, EvalResult, evaluate_model
from yolotrain.utils.eval.outputs import save_eval_plots, save_json, save_txt
from yolotrain.utils.infer.backends import Backend, load_backend


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The CLI; every numeric flag is range-checked here, at parse time, on every rank (utils/cli.Range)."""
    p = ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--weights", nargs="+", required=True,
                   help="checkpoints (yolotrain, YOLOv5 or Ultralytics .pt) or .onnx/.torchscript files from export.py, "
                        "scored in turn")
    p.add_argument("--data", default=None, help="dataset yaml (default: the one the checkpoint was trained on)")
    p.add_argument("--batch-size", type=Range(int, min=1), default=32,
                   help="images per batch over all ranks (split evenly, as train.py's)")
    p.add_argument("--imgsz", "--img", "--img-size", type=IMGSZ, default=None,
                   help="inference size (default: training size)")
    p.add_argument("--conf-thres", type=Range(float, min=0, max=1), default=0.001, help="confidence threshold")
    p.add_argument("--iou-thres", type=Range(float, min=0, max=1), default=0.6, help="NMS IoU threshold")
    p.add_argument("--max-det", type=Range(int, min=1), default=300, help="maximum detections per image")
    p.add_argument("--end2end", action=argparse.BooleanOptionalAction, default=None,
                   help="score an end-to-end (NMS-free) model's own detections, or its NMS branch (default: the "
                        "model's mode; an export runs only the mode it was exported in)")
    p.add_argument("--rect", action=argparse.BooleanOptionalAction, default=None,
                   help="rectangular batches (default: on, except for fixed-shape exports, which take square inputs)")
    p.add_argument("--task", default="val", choices=("val", "test", "speed"),
                   help="split to score; speed: time the val split at conf 0.25, IoU 0.45, saving nothing")
    add_device_flags(p)
    add_workers_flag(p)
    p.add_argument("--single-cls", action="store_true", help="treat as single-class dataset")
    p.add_argument("--verbose", action="store_true", help="report mAP by class")
    p.add_argument("--save-txt", action="store_true", help="save detections to labels/<stem>.txt (YOLO format)")
    p.add_argument("--save-conf", action="store_true", help="append each detection's confidence in --save-txt files")
    p.add_argument("--save-json", action="store_true",
                   help="save COCO predictions.json, the split's ground_truth.json and metrics.json")
    p.add_argument("--noplots", action="store_true", help="do not save curves, confusion matrix and batch pictures")
    add_run_folder_flags(p, RUNS / "val")
    p.add_argument("--half", action="store_true",
                   help="reduced-precision inference: FP16 on CUDA, bf16 autocast on CPU (boxes decoded in fp32); "
                        "a run trained with --amp on CPU validated this way"),
    add_channels_last_flag(p)
    add_cache_flags(p)
    add_hang_timeout_flag(p)
    add_local_rank_flag(p)
    return p


def check_opt(opt: argparse.Namespace) -> ResolvedArgs:
    """The arguments with YOLOv5's task rules applied (speed scores the val split at conf 0.25 / IoU 0.45 and
    saves nothing), frozen."""
    opt = ResolvedArgs(**vars(opt))
    if opt.task == "speed":
        if opt.save_txt or opt.save_json:
            LOGGER.warning("--task speed saves nothing: --save-txt and --save-json are ignored")
        opt = opt.replace(conf_thres=0.25, iou_thres=0.45, save_txt=False, save_json=False, noplots=True)
        LOGGER.info("speed: timing the val split at conf 0.25, IoU 0.45 (YOLOv5's speed settings); nothing is saved")
    elif opt.conf_thres > 0.001:
        LOGGER.warning(f"WARNING: --conf-thres {opt.conf_thres} > 0.001 lowers mAP (COCO scores every detection)")
    if opt.exist_ok and len(opt.weights) > 1 and saves_files(opt):
        raise UserError("--exist-ok with several --weights would overwrite each checkpoint's files with the next; "
                        "drop --exist-ok (each checkpoint gets its own project/name folder)")
    return opt


def main(opt: argparse.Namespace, callbacks: Callbacks | None = None) -> list[EvalResult]:
    """Score each --weights in turn; ``callbacks`` hear on_val_end after each, on rank 0 (the Python API's
    add_callback)."""
    with RunPrologue(opt.local_rank, opt.threads) as run:  # rank, logging, threads; device, watchdog, group
        opt = check_opt(opt)
        device = run.start(opt.device, opt.batch_size, opt.hang_timeout)  # no tune_malloc: rect shapes vary
        opt = opt.replace(channels_last=precision.channels_last_default(opt.channels_last, device, half=opt.half))
        return validate_all(opt, run.info, device, callbacks)


def validate_all(opt: ResolvedArgs, info: dist.DistInfo, device: torch.device,
                 callbacks: Callbacks | None) -> list[EvalResult]:
    """Each checkpoint in turn, on loaders shared by those scored on the same split and size."""
    loaders: dict[tuple, DataLoader] = {}
    finished = False
    try:
        results = []
        for w in opt.weights:
            results.append(validate_checkpoint(opt, w, info, device, loaders))
            if callbacks is not None and info.is_main and callbacks.wants("on_val_end"):
                callbacks.run("on_val_end", ValEvent("on_val_end", metric_summary(results[-1]), results[-1]))
        finished = True
        return results
    finally:  # a failed rank does not wait for its peers (they are in a collective it will never join)
        for loader in loaders.values():
            release_ram_caches(info.local_rank, loader.dataset.imgcache, wait=finished)


def validate_checkpoint(opt: argparse.Namespace, weights: str, info: dist.DistInfo, device: torch.device,
                        loaders: dict[tuple, DataLoader] | None = None) -> EvalResult:
    """Score one checkpoint or exported file: its model, the split it names (or --data), one evaluation,
    the files asked for."""
    # a checkpoint's model is fused here, in place (val.py's own copy), its head set to --end2end / --max-det
    model = load_backend(weights, device, opt.end2end, opt.max_det)
    meta = model.meta
    data, names, single_cls = load_split_config(opt, {"data": meta.data, "single_cls": meta.single_cls}, info)
    if meta.nc != len(names):
        raise UserError(f"{weights}: model has {meta.nc} classes but {data.file} has {len(names)}")
    imgsz, rect = input_shape(opt, model, weights)
    # before the scan: its problem report goes there; not created, so a run that writes nothing leaves no folder
    run_dir = pick_run_dir(opt.project, opt.name, opt.exist_ok, info)
    loader = get_loader(opt, data, single_cls, imgsz, max(meta.stride, 32), info, run_dir,
                        {} if loaders is None else loaders, rect)
    kind = "" if meta.format == "pytorch" else f", {meta.format} export" + ("" if rect else " (square inputs)")
    kind += f", end-to-end (no NMS, {meta.max_det} per image)" if meta.end2end else ""
    LOGGER.info(f"{weights}: epoch {meta.epoch + 1}, {len(names)} classes, imgsz {imgsz}{kind}")
    save_dir = make_save_dir(opt, info, run_dir)
    if meta.val_precision != "fp32" and not opt.half:
        LOGGER.info(f"{weights}: its run validated in {meta.val_precision} (--amp); scoring in fp32, add --half to "
                    "repeat its logged metrics exactly")
    options = EvalOptions(conf_thres=opt.conf_thres, iou_thres=opt.iou_thres, max_det=opt.max_det, half=opt.half,
                          channels_last=opt.channels_last, fuse=False, keep_detections=opt.save_txt or opt.save_json,
                          keep_batches=0 if opt.noplots else 3, skip_first_timing=True, verbose=opt.verbose,
                          prefix=f"{task_split(opt)}: ")
    result = evaluate_model(model, loader, device, names, info, options)
    pre, inf, nms = result.speed_ms
    LOGGER.info(f"Speed: {pre:.1f}ms pre-process, {inf:.1f}ms inference, {nms:.1f}ms NMS per image at "
                f"shape ({dist.per_rank_batch(opt.batch_size, info)}, 3, {imgsz}, {imgsz})")
    LOGGER.info(f"Results: mAP50 {result.metrics.map50:.4f}  mAP50-95 {result.metrics.map:.4f}")
    if save_dir is not None and info.is_main:  # after the evaluation's broadcast: a write error stalls no rank
        save_outputs(opt, result, loader.dataset, names, save_dir, weights, data, imgsz, meta.end2end)
    return result


def input_shape(opt: argparse.Namespace, model: Backend, weights: str) -> tuple[int, bool]:
    """The size and batching scored: --imgsz (or the model's), rect unless --no-rect; a fixed-shape export
    takes only its own square size."""
    meta = model.meta
    if meta.dynamic:
        return opt.imgsz or meta.imgsz, opt.rect is not False
    if opt.imgsz not in (None, meta.imgsz) or opt.rect:
        raise UserError(f"{weights}: a fixed-shape export takes {meta.input_rule()}; drop --imgsz/--rect or "
                        "re-export with --dynamic")
    return meta.imgsz, False


def task_split(opt: argparse.Namespace) -> str:
    """The split a task scores: --task speed times the val split."""
    return "val" if opt.task == "speed" else opt.task


def load_split_config(opt: argparse.Namespace, args: dict, info: dist.DistInfo) -> tuple[DataConfig, list[str], bool]:
    """The data yaml (--data, else the checkpoint's), prepared once per node, with the class names scored."""
    with dist.torch_distributed_zero_first(info.local_rank):
        data = load_data_config(opt.data or args.get("data") or DEMO_DATA)
        prepare_dataset(data)
    single_cls = opt.single_cls or bool(args.get("single_cls", False))
    if not getattr(data, task_split(opt)):
        raise UserError(f"{data.file}: no '{task_split(opt)}' split")
    return data, (["item"] if single_cls else data.names), single_cls


def get_loader(opt: argparse.Namespace, data: DataConfig, single_cls: bool, imgsz: int, stride: int,
               info: dist.DistInfo, run_dir: Path, loaders: dict[tuple, DataLoader], rect: bool = True) -> DataLoader:
    """The split's loader, shared by the checkpoints scored on the same split and size.

    New workers forked from a process whose heap already holds a validation's activations make
    every page they write a copy-on-write fault, and the label cache need not be read again.
    """
    task = task_split(opt)
    key = (str(data.file), task, imgsz, stride, single_cls, rect)
    if key not in loaders:  # nc is the file's class count: single-cls relabels rows to 0 after the scan
        what = DatasetSpec(data.sources[task], nc=len(data.names), img_size=imgsz, stride=stride,
                           single_cls=single_cls, rect=rect, pad=0.5)
        loaders[key] = build_loader(LoaderSpec(
            what, dist.batch_split(opt.batch_size, info), info=info, workers=opt.workers, cache=opt.cache,
            cache_dir=opt.cache_dir, prefix=f"{task}: ", report_dir=run_dir,
            reuse_memory=True))  # evaluation clones the batches it keeps
    return loaders[key]


def saves_files(opt: argparse.Namespace) -> bool:
    """Whether this val.py run writes anything (labels, json or pictures) into project/name."""
    return opt.save_txt or opt.save_json or not opt.noplots


def make_save_dir(opt: argparse.Namespace, info: dist.DistInfo, save_dir: Path | None = None) -> Path | None:
    """The run folder (``save_dir`` or a new pick), created by rank 0, when this run saves files; else None."""
    if not saves_files(opt):
        return None
    save_dir = save_dir or pick_run_dir(opt.project, opt.name, opt.exist_ok, info)
    if info.is_main:
        save_dir.mkdir(parents=True, exist_ok=True)
    return save_dir


def save_outputs(opt: argparse.Namespace, result: EvalResult, dataset, names: list[str], save_dir: Path,
                 weights: str, data: DataConfig, imgsz: int, end2end: bool = False) -> None:
    """Rank 0: the labels, COCO json, pictures and metrics.json this run was asked for (``end2end``: the
    detections are the model's own, not NMS's; recorded beside the thresholds)."""
    if opt.save_txt:
        save_txt(result.detections, dataset, save_dir, opt.save_conf)
    if opt.save_json:
        save_json(result.detections, dataset, names, save_dir, coco.SourceIds.from_data(data, names))
    if not opt.noplots:
        save_eval_plots(result, names, save_dir)
    coco.write_json({"weights": str(weights), "data": str(data.file), "task": task_split(opt), "imgsz": imgsz,
                     "batch_size": opt.batch_size, "conf_thres": opt.conf_thres, "iou_thres": opt.iou_thres,
                     "max_det": opt.max_det, "end2end": end2end, "images": result.images,
                     "speed_ms": list(result.speed_ms), "metrics": result.metrics.as_dict(),
                     "confusion_matrix": result.confusion.tolist()},
                    save_dir / "metrics.json")
    LOGGER.info(f"Results saved to {colorstr(str(save_dir))}")


@record
def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(parse_opt(argv)))


if __name__ == "__main__":
    sys.exit(cli())
