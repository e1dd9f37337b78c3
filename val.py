#!/usr/bin/env python
"""Score a detector on a YOLO-format split: P, R, mAP50 and COCO mAP50-95.

    python val.py --weights runs/train/exp/weights/best.pt
    torchrun --nproc_per_node 2 val.py --weights best.pt --data my.yaml --save-json
    python val.py --weights best.pt --task speed

Every rank scores a contiguous shard of whole batches; per-image results are gathered to rank 0,
put back in COCO image-id order (sorted image paths) and evaluated once, so the numbers do not
depend on the world size. ``run()`` is the same function train.py calls each epoch.

Saving (rank 0 only, into runs/val/exp, exp2, ...): --save-txt writes labels/<stem>.txt;
--save-json writes predictions.json and ground_truth.json (COCO, ids as in utils/eval/coco.py, so
pycocotools reproduces the mAP); either also writes metrics.json (metrics, confusion matrix).
"""
from __future__ import annotations

import argparse
import sys
import time
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torch.utils.data import DataLoader
from tqdm import tqdm

from models.yolo import Model
from utils.eval import coco
from utils.core import dist
from utils.core.boxes import non_max_suppression, xyxy2xywhn
from utils.engine.checkpoint import load_checkpoint
from utils.core.cli import IMGSZ, ArgumentParser, Range
from utils.core.fileio import ROOT
from utils.data.config import load_data_config, prepare_dataset
from utils.core.cpu import tune_malloc
from utils.core.errors import UserError, run_entry_point
from utils.data.imgcache import release_ram_caches
from utils.data.loader import create_dataloader
from utils.core.logging import LOGGER, colorstr, setup_logging
from utils.eval.metrics import ConfusionMatrix, DetectionMetrics, ImageStats, evaluate, match_image
from utils.eval.plots import output_to_target, plot_confusion_matrix, plot_curves, plot_images
from utils.core.runs import increment_path

DEFAULT_DATA = ROOT / "data" / "shapes.yaml"


@dataclass
class ValResult:
    """What one validation pass produced, identical on every rank."""

    metrics: DetectionMetrics
    loss: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # box, obj, cls (when computed)
    speed_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)  # pre-process, inference, NMS per image
    images: int = 0
    confusion: np.ndarray | None = None  # (nc + 1, nc + 1) int64 matrix[pred, true] at conf 0.25 / IoU 0.45


@dataclass
class _Shard:
    """What one rank sends to rank 0: per-image records and sums, plus detections when saving."""

    records: list[tuple[int, ImageStats]]
    loss: torch.Tensor
    n_batches: int
    times: np.ndarray
    timed_images: int  # images behind ``times`` (with warmup, not a rank's first batch...)
    cold: tuple[np.ndarray, int]  # ...whose times and images are used only when nothing else was timed
    confusion: np.ndarray
    detections: list[tuple[int, np.ndarray]]  # (dataset index, (n, 6) float32 in original pixels)


def load_model(weights: str | Path, device: torch.device) -> tuple[Model, dict]:
    """Rebuild the model from a checkpoint's yaml and load its EMA weights (raw ones if no EMA)."""
    ckpt = load_checkpoint(weights)
    model = Model(ckpt["model_yaml"])
    state = ckpt.get("ema") or ckpt["model"]
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise UserError(f"{weights}: weights do not fit the model stored in it ({str(e).splitlines()[0]})") from None
    return model.to(device).float().eval(), ckpt


@torch.no_grad()
def run(
    model: torch.nn.Module,
    dataloader,
    device: torch.device,
    names: list[str],
    conf_thres: float = 0.001,
    iou_thres: float = 0.6,
    max_det: int = 300,
    compute_loss=None,
    half: bool = False,
    verbose: bool = False,
    fuse: bool = True,
    prefix: str = "val: ",
    save_dir: Path | None = None,
    save_txt: bool = False,
    save_conf: bool = False,
    save_json: bool = False,
    warmup: bool = False,
    plots: bool = False,
    channels_last: bool = False,
) -> ValResult:
    """Score ``model`` on this rank's shard of ``dataloader`` and return metrics for the whole split.

    With ``save_txt``/``save_json`` every rank's detections go to rank 0 too, which writes them
    under ``save_dir`` (see _save). ``warmup`` leaves each rank's first batch (one-off allocations
    and kernel selection) out of the speed figures, instead of running it twice.
    ``plots``: rank 0 draws its first three batches (labels and predictions), the P/R/F1/PR curves
    and the confusion matrix into ``save_dir``.
    """
    was_training = model.training
    net = deepcopy(model).fuse() if fuse else model
    net.eval()
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    net.to(memory_format=memory_format)
    half &= device.type == "cuda"
    if half:
        net.half()
    keep_dets = save_txt or save_json
    if (keep_dets or plots) and save_dir is None:
        raise ValueError("save_txt, save_json and plots need a save_dir")
    plot_here = plots and dist.get_rank() == 0
    dataset = dataloader.dataset
    records, detections, confusion = [], [], ConfusionMatrix(len(names))
    loss, n_batches, times, timed_images, cold = torch.zeros(3, device=device), 0, np.zeros(3), 0, (np.zeros(3), 0)
    bar = tqdm(dataloader, desc=f"{prefix}{'Class':>20}{'Images':>11}{'Instances':>11}{'P':>11}{'R':>11}"
               f"{'mAP50':>11}{'mAP50-95':>11}", bar_format="{l_bar}{bar:10}{r_bar}",
               disable=not dist.get_rank() == 0, leave=False)
    for batch in bar:
        t0 = time.perf_counter()
        imgs = batch.images.to(device, non_blocking=True)
        imgs = (imgs.half() if half else imgs.float()).div_(255).contiguous(memory_format=memory_format)
        targets = batch.targets.to(device)
        t1 = time.perf_counter()
        preds, train_out = net(imgs)
        if compute_loss is not None:
            loss += compute_loss([x.float() for x in train_out], targets)[1]
        t2 = time.perf_counter()
        dets = non_max_suppression(preds.float(), conf_thres, iou_thres, multi_label=True, max_det=max_det)
        t3 = time.perf_counter()
        if warmup and n_batches == 0:
            cold = (np.array((t1 - t0, t2 - t1, t3 - t2)), len(imgs))
        else:
            times += (t1 - t0, t2 - t1, t3 - t2)
            timed_images += len(imgs)
        if plot_here and n_batches < 3:  # rank 0 holds the split's first batches (if it has any)
            plot_images(batch.images, batch.targets, batch.paths, names, save_dir / f"val_batch{n_batches}_labels.jpg")
            plot_images(batch.images, output_to_target(dets), batch.paths, names,
                        save_dir / f"val_batch{n_batches}_pred.jpg")
        n_batches += 1
        for si, det in enumerate(dets):
            index = int(batch.indices[si])
            (h0, w0), ratio_pad = batch.shapes[si]
            pred = _unletterbox(det, h0, w0, ratio_pad)
            gt, gt_cls = coco.gt_xyxy(dataset.labels[index], w0, h0)  # as in ground_truth.json
            records.append((index, match_image(pred[:, :4], pred[:, 4], pred[:, 5], gt, gt_cls)))
            confusion.process_image(pred, gt, gt_cls)
            if keep_dets:
                detections.append((index, pred))
    if was_training:
        model.train()
    shard = _Shard(records, loss.cpu(), n_batches, times, timed_images, cold, confusion.matrix, detections)
    result, all_detections = _reduce(shard, names, verbose, prefix, dataset.im_files)
    if keep_dets and all_detections is not None:  # rank 0, after the broadcast: a write error stalls no rank
        _save(all_detections, dataset, names, Path(save_dir), save_txt, save_conf, save_json)
    if plot_here:
        plot_curves(result.metrics, save_dir)
        plot_confusion_matrix(result.confusion, names, Path(save_dir) / "confusion_matrix.png")
    return result


def _unletterbox(det: torch.Tensor, h0: int, w0: int, ratio_pad) -> np.ndarray:
    """Detections (n, 6) from the letterboxed image to original pixels (float32, clipped).

    Each axis uses its own gain: the loader rounds the resized width and height separately, so
    one gain for both axes (as YOLOv5's scale_boxes does) shifts boxes by up to a pixel against the labels.
    """
    (gain_h, gain_w), (pad_w, pad_h) = ratio_pad
    d = det.float().cpu().numpy().copy()
    d[:, [0, 2]] = np.clip((d[:, [0, 2]] - np.float32(pad_w)) / np.float32(gain_w), 0, w0)
    d[:, [1, 3]] = np.clip((d[:, [1, 3]] - np.float32(pad_h)) / np.float32(gain_h), 0, h0)
    return d


def _reduce(shard: _Shard, names: list[str], verbose: bool, prefix: str,
            im_files: list[str]) -> tuple[ValResult, list[tuple[int, np.ndarray]] | None]:
    """Gather every rank's shard to rank 0, evaluate once in COCO image-id order, broadcast.

    The order is the images' sorted paths (utils.eval.coco ids), not the loader's rect order, so score
    ties across images resolve as COCOeval resolves them on val.py's json files. Returns the
    result (every rank) and, on rank 0 only, all detections in that order.
    """
    gathered = dist.gather_object(shard)
    result, detections = None, None
    if gathered is not None:
        image_id = coco.image_ids(im_files)

        def order(item: tuple) -> int:
            return image_id[im_files[item[0]]]

        records = sorted((r for part in gathered for r in part.records), key=order)
        detections = sorted((d for part in gathered for d in part.detections), key=order)
        metrics = evaluate([s for _, s in records], nc=len(names), names=names)
        total_batches = max(sum(p.n_batches for p in gathered), 1)
        mean_loss = (sum(p.loss for p in gathered) / total_batches).tolist()
        timed, spent = sum(p.timed_images for p in gathered), sum(p.times for p in gathered)
        if not timed:  # every rank had a single batch: report the cold ones rather than nothing
            timed, spent = sum(p.cold[1] for p in gathered), sum(p.cold[0] for p in gathered)
        speed = tuple(float(v) for v in (spent / max(timed, 1) * 1e3))
        confusion = np.sum([p.confusion for p in gathered], axis=0, dtype=np.int64)  # integers: any order
        result = ValResult(metrics=metrics, loss=mean_loss, speed_ms=speed, images=len(records), confusion=confusion)
        _log(result, names, verbose, prefix)
    return dist.broadcast_object(result), detections


def _save(detections: list[tuple[int, np.ndarray]], dataset, names: list[str], save_dir: Path,
          save_txt: bool, save_conf: bool, save_json: bool) -> None:
    """Rank 0 writes what was asked, in image-id order, so files do not depend on the world size.

    save_txt: labels/<stem>.txt, one ``cls xc yc w h [conf]`` row per detection, normalised to the
    original image (YOLOv5's format; images without detections get no file).
    save_json: predictions.json (COCO results) and ground_truth.json (COCO GT, same ids).
    """
    if save_txt:
        rows: dict[str, list[str]] = {}  # stem -> lines; stems repeated across folders share a file
        for index, det in detections:
            h0, w0 = (int(v) for v in dataset.shapes[index][::-1])
            xywhn = xyxy2xywhn(det[:, :4].astype(np.float64), w=w0, h=h0)
            for (*xywh, conf, cls) in np.concatenate([xywhn, det[:, 4:6]], 1).tolist():
                line = (int(cls), *xywh, conf) if save_conf else (int(cls), *xywh)
                rows.setdefault(Path(dataset.im_files[index]).stem, []).append(("%g " * len(line)).rstrip() % line)
        (save_dir / "labels").mkdir(parents=True, exist_ok=True)
        for stem, lines in rows.items():
            (save_dir / "labels" / f"{stem}.txt").write_text("\n".join(lines) + "\n")
        LOGGER.info(f"{len(rows)} label files saved to {save_dir / 'labels'}")
    if save_json:
        ids = coco.image_ids(dataset.im_files)
        preds = coco.detections([(ids[dataset.im_files[index]], det) for index, det in detections])
        coco.write_json(preds, save_dir / "predictions.json")
        coco.write_json(coco.dataset_ground_truth(dataset, names), save_dir / "ground_truth.json")
        LOGGER.info(f"{len(preds)} COCO detections saved to {save_dir / 'predictions.json'}, "
                    f"ground truth to {save_dir / 'ground_truth.json'}")


def _log(result: ValResult, names: list[str], verbose: bool, prefix: str) -> None:
    m = result.metrics
    fmt = "%22s" + "%11i" * 2 + "%11.3g" * 4
    LOGGER.info(prefix + fmt % ("all", result.images, int(m.nt.sum()), m.mp, m.mr, m.map50, m.map))
    if int(m.nt.sum()) == 0:
        LOGGER.warning(f"{prefix}no labels found in the split; metrics are zero")
    if verbose and len(names) > 1:
        for c in m.ap_class:
            LOGGER.info(prefix + fmt % (names[c], m.ni[c], m.nt[c], m.p[c], m.r[c], m.ap50[c], m.ap[c]))


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The CLI; every numeric flag is range-checked here, at parse time, on every rank (utils/cli.Range)."""
    p = ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--weights", nargs="+", required=True, help="checkpoint path(s) written by train.py, scored in turn")
    p.add_argument("--data", default=None, help="dataset yaml (default: the one the checkpoint was trained on)")
    p.add_argument("--batch-size", type=Range(int, min=1), default=32, help="images per batch (per rank)")
    p.add_argument("--imgsz", "--img", "--img-size", type=IMGSZ, default=None,
                   help="inference size (default: training size)")
    p.add_argument("--conf-thres", type=Range(float, min=0, max=1), default=0.001, help="confidence threshold")
    p.add_argument("--iou-thres", type=Range(float, min=0, max=1), default=0.6, help="NMS IoU threshold")
    p.add_argument("--max-det", type=Range(int, min=1), default=300, help="maximum detections per image")
    p.add_argument("--task", default="val", choices=("val", "test", "speed"),
                   help="split to score; speed: time the val split at conf 0.25, IoU 0.45, saving nothing")
    p.add_argument("--device", default="", help="cuda device, i.e. 0 or 0,1 or cpu")
    p.add_argument("--workers", type=Range(int, min=0), default=8, help="max dataloader workers (per rank)")
    p.add_argument("--threads", type=Range(int, min=0), default=0,
                   help="CPU threads per rank (0: torch's default, capped so ranks x threads <= cores)")
    p.add_argument("--single-cls", action="store_true", help="treat as single-class dataset")
    p.add_argument("--verbose", action="store_true", help="report mAP by class")
    p.add_argument("--save-txt", action="store_true", help="save detections to labels/<stem>.txt (YOLO format)")
    p.add_argument("--save-conf", action="store_true", help="append each detection's confidence in --save-txt files")
    p.add_argument("--save-json", action="store_true",
                   help="save COCO predictions.json, the split's ground_truth.json and metrics.json")
    p.add_argument("--noplots", action="store_true", help="do not save curves, confusion matrix and batch pictures")
    p.add_argument("--project", default=str(ROOT / "runs" / "val"), help="save results to project/name")
    p.add_argument("--name", default="exp", help="save results to project/name")
    p.add_argument("--exist-ok", action="store_true", help="reuse project/name instead of incrementing it")
    p.add_argument("--half", action="store_true", help="FP16 inference (CUDA only)")
    p.add_argument("--channels-last", action="store_true", help="NHWC memory format (faster on CPU; rounding differs)")
    p.add_argument("--cache", nargs="?", const="ram", choices=["ram", "disk"], default=None,
                   help="cache resized images in RAM (/dev/shm) or on disk, one copy shared by every rank and worker of a node")
    p.add_argument("--cache-dir", default=None, help="where label caches go when the dataset folder is read-only")
    p.add_argument("--local-rank", "--local_rank", type=Range(int, min=-1), default=-1, help=argparse.SUPPRESS)
    return p


def check_opt(opt: argparse.Namespace) -> argparse.Namespace:
    """YOLOv5's task rules: speed scores the val split at conf 0.25 / IoU 0.45 and saves nothing."""
    if opt.task == "speed":
        if opt.save_txt or opt.save_json:
            LOGGER.warning("--task speed saves nothing: --save-txt and --save-json are ignored")
        opt.conf_thres, opt.iou_thres, opt.save_txt, opt.save_json, opt.noplots = 0.25, 0.45, False, False, True
        LOGGER.info("speed: timing the val split at conf 0.25, IoU 0.45 (YOLOv5's speed settings); nothing is saved")
    elif opt.conf_thres > 0.001:
        LOGGER.warning(f"WARNING: --conf-thres {opt.conf_thres} > 0.001 lowers mAP (COCO scores every detection)")
    if opt.exist_ok and len(opt.weights) > 1 and saves_files(opt):
        raise UserError("--exist-ok with several --weights would overwrite each checkpoint's files with the next; "
                        "drop --exist-ok (each checkpoint gets its own project/name folder)")
    return opt


def main(opt: argparse.Namespace) -> list[ValResult]:
    info = dist.dist_info(opt.local_rank)
    setup_logging(info.rank, info.world_size)
    dist.set_cpu_threads(info, opt.threads)
    check_opt(opt)
    device = dist.select_device(opt.device, info=info)
    if device.type == "cpu":
        tune_malloc()  # large CPU tensors stay mapped between batches (utils/core/cpu.py)
    dist.init_distributed(info, device)
    loaders: dict[tuple, DataLoader] = {}  # checkpoints scored on the same split and size share one loader
    try:
        return [validate_checkpoint(opt, w, info, device, loaders) for w in opt.weights]
    finally:
        for loader in loaders.values():
            release_ram_caches(info.local_rank, loader.dataset.imgcache)
        dist.cleanup_distributed()


def saves_files(opt: argparse.Namespace) -> bool:
    """Whether this val.py run writes anything (labels, json or pictures) into project/name."""
    return opt.save_txt or opt.save_json or not opt.noplots


def pick_save_dir(opt: argparse.Namespace, info: dist.DistInfo) -> Path:
    """project/name (incremented unless --exist-ok), chosen by rank 0 and shared; not created here, so a
    run that writes nothing (no saved files, no dataset problems to report) leaves no folder."""
    save_dir = increment_path(Path(opt.project) / opt.name, exist_ok=opt.exist_ok) if info.is_main else None
    return Path(dist.broadcast_object(str(save_dir) if save_dir else None))


def make_save_dir(opt: argparse.Namespace, info: dist.DistInfo, save_dir: Path | None = None) -> Path | None:
    """The run folder (``save_dir`` or a new pick), created by rank 0, when this run saves files; else None."""
    if not saves_files(opt):
        return None
    save_dir = save_dir or pick_save_dir(opt, info)
    if info.is_main:
        save_dir.mkdir(parents=True, exist_ok=True)
    return save_dir


def validate_checkpoint(opt: argparse.Namespace, weights: str, info: dist.DistInfo, device: torch.device,
                        loaders: dict[tuple, DataLoader] | None = None) -> ValResult:
    """Score one checkpoint. ``loaders`` keeps loaders for the next checkpoints of the same split:
    new workers forked from a process whose heap already holds a validation's activations make
    every page it writes a copy-on-write fault (the 2nd and 3rd of three checkpoints ran 25-45%
    slower), and the label cache need not be read again."""
    loaders = {} if loaders is None else loaders
    model, ckpt = load_model(weights, device)
    args = ckpt.get("args", {})
    data_file = opt.data or args.get("data") or DEFAULT_DATA
    with dist.torch_distributed_zero_first(info.local_rank):
        data = load_data_config(data_file)
        prepare_dataset(data)
    single_cls = opt.single_cls or bool(args.get("single_cls", False))
    names = ["item"] if single_cls else data.names
    if model.detect.nc != len(names):
        raise UserError(f"{weights}: model has {model.detect.nc} classes but {data.file} has {len(names)}")
    stride = max(int(model.stride.max()), 32)
    imgsz = opt.imgsz or int(args.get("imgsz", 640))
    task = "val" if opt.task == "speed" else opt.task
    split = getattr(data, task)
    if not split:
        raise UserError(f"{data.file}: no '{task}' split")
    # nc is the dataset's class count: single-cls relabels rows to 0 after the scan checks them
    key = (str(data.file), task, imgsz, stride, single_cls)
    run_dir = pick_save_dir(opt, info)  # before the scan: its problem report goes there (only if it has problems)
    if key not in loaders:
        loaders[key], _ = create_dataloader(split, imgsz, opt.batch_size, stride, single_cls=single_cls, rect=True,
                                            pad=0.5, rank=info.rank, world_size=info.world_size,
                                            local_rank=info.local_rank, workers=opt.workers, nc=len(data.names),
                                            cache=opt.cache, cache_dir=opt.cache_dir, prefix=f"{task}: ",
                                            report_dir=run_dir)
    loader = loaders[key]
    LOGGER.info(f"{weights}: epoch {int(ckpt.get('epoch', -1)) + 1}, {len(names)} classes, imgsz {imgsz}")
    save_dir = make_save_dir(opt, info, run_dir)
    model.fuse()  # in place: this model is val.py's own, so run() need not copy it
    result = run(model, loader, device, names, opt.conf_thres, opt.iou_thres, opt.max_det, fuse=False,
                 half=opt.half, verbose=opt.verbose, prefix=f"{task}: ", save_dir=save_dir, save_txt=opt.save_txt,
                 save_conf=opt.save_conf, save_json=opt.save_json, warmup=True, plots=not opt.noplots,
                 channels_last=opt.channels_last)
    pre, inf, nms = result.speed_ms
    LOGGER.info(f"Speed: {pre:.1f}ms pre-process, {inf:.1f}ms inference, {nms:.1f}ms NMS per image at "
                f"shape ({opt.batch_size}, 3, {imgsz}, {imgsz})")
    LOGGER.info(f"Results: mAP50 {result.metrics.map50:.4f}  mAP50-95 {result.metrics.map:.4f}")
    if save_dir is not None and info.is_main:
        coco.write_json({"weights": str(weights), "data": str(data.file), "task": task, "imgsz": imgsz,
                         "batch_size": opt.batch_size, "conf_thres": opt.conf_thres, "iou_thres": opt.iou_thres,
                         "max_det": opt.max_det, "images": result.images, "speed_ms": list(result.speed_ms),
                         "metrics": result.metrics.as_dict(), "confusion_matrix": result.confusion.tolist()},
                        save_dir / "metrics.json")
        LOGGER.info(f"Results saved to {colorstr(str(save_dir))}")
    return result


@record
def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(parse_opt(argv)))

if __name__ == "__main__":
    sys.exit(cli())
