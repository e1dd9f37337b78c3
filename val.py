#!/usr/bin/env python
"""Score a detector on a YOLO-format split: P, R, mAP50 and COCO mAP50-95.

    python val.py --weights runs/train/exp/weights/best.pt
    torchrun --nproc_per_node 2 val.py --weights best.pt --data my.yaml

Every rank scores a contiguous shard of whole batches; per-image results are gathered to rank 0,
put back in dataset order and evaluated once, so the numbers do not depend on the world size.
``run()`` is the same function train.py calls each epoch.
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
from tqdm import tqdm

from models.yolo import Model
from utils import dist
from utils.boxes import non_max_suppression, scale_boxes, xywh2xyxy
from utils.checkpoint import load_checkpoint
from utils.config import ROOT, load_data_config, prepare_dataset
from utils.errors import UserError, run_entry_point
from utils.imgcache import release_ram_caches
from utils.loader import create_dataloader
from utils.logging import LOGGER, setup_logging
from utils.metrics import DetectionMetrics, ImageStats, evaluate, match_image

DEFAULT_DATA = ROOT / "data" / "shapes.yaml"


@dataclass
class ValResult:
    """What one validation pass produced, identical on every rank."""

    metrics: DetectionMetrics
    loss: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])  # box, obj, cls (when computed)
    speed_ms: tuple[float, float, float] = (0.0, 0.0, 0.0)  # pre-process, inference, NMS per image
    images: int = 0


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
) -> ValResult:
    """Score ``model`` on this rank's shard of ``dataloader`` and return metrics for the whole split."""
    was_training = model.training
    net = deepcopy(model).fuse() if fuse else model
    net.eval()
    half &= device.type == "cuda"
    if half:
        net.half()
    records: list[tuple[int, ImageStats]] = []
    loss = torch.zeros(3, device=device)
    n_batches, times = 0, np.zeros(3)
    bar = tqdm(dataloader, desc=f"{prefix}{'Class':>20}{'Images':>11}{'Instances':>11}{'P':>11}{'R':>11}"
               f"{'mAP50':>11}{'mAP50-95':>11}", bar_format="{l_bar}{bar:10}{r_bar}",
               disable=not dist.get_rank() == 0, leave=False)
    for batch in bar:
        t0 = time.perf_counter()
        imgs = batch.images.to(device, non_blocking=True)
        imgs = (imgs.half() if half else imgs.float()) / 255
        targets = batch.targets.to(device)
        t1 = time.perf_counter()
        preds, train_out = net(imgs)
        if compute_loss is not None:
            loss += compute_loss([x.float() for x in train_out], targets)[1]
        t2 = time.perf_counter()
        dets = non_max_suppression(preds.float(), conf_thres, iou_thres, multi_label=True, max_det=max_det)
        t3 = time.perf_counter()
        times += (t1 - t0, t2 - t1, t3 - t2)
        n_batches += 1
        height, width = imgs.shape[2:]
        for si, det in enumerate(dets):
            records.append((int(batch.indices[si]), _image_stats(det, targets, si, batch.shapes[si], (height, width))))
    if was_training:
        model.train()
    return _reduce(records, loss.cpu(), n_batches, times, names, verbose, prefix)


def _image_stats(det: torch.Tensor, targets: torch.Tensor, si: int, shape, img_hw: tuple[int, int]) -> ImageStats:
    """Match one image's detections to its labels, both mapped back to the original image pixels."""
    labels = targets[targets[:, 0] == si, 1:]
    h, w = img_hw
    gt = xywh2xyxy(labels[:, 1:5]) * torch.tensor((w, h, w, h), device=labels.device)
    scale_boxes(img_hw, gt, shape[0], shape[1])
    pred = det.clone()
    scale_boxes(img_hw, pred[:, :4], shape[0], shape[1])
    return match_image(pred[:, :4].cpu().numpy(), pred[:, 4].cpu().numpy(), pred[:, 5].cpu().numpy(),
                       gt.cpu().numpy(), labels[:, 0].cpu().numpy())


def _reduce(records, loss, n_batches, times, names, verbose, prefix) -> ValResult:
    """Gather every rank's per-image records to rank 0, evaluate in dataset order, broadcast."""
    gathered = dist.gather_object((records, loss, n_batches, times))
    result = None
    if gathered is not None:
        all_records = sorted((r for part in gathered for r in part[0]), key=lambda r: r[0])
        metrics = evaluate([s for _, s in all_records], nc=len(names), names=names)
        total_batches = max(sum(p[2] for p in gathered), 1)
        mean_loss = (sum(p[1] for p in gathered) / total_batches).tolist()
        n_images = len(all_records)
        speed = tuple(float(v) for v in (sum(p[3] for p in gathered) / max(n_images, 1) * 1e3))
        result = ValResult(metrics=metrics, loss=mean_loss, speed_ms=speed, images=n_images)
        _log(result, names, verbose, prefix)
    return dist.broadcast_object(result)


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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--weights", nargs="+", required=True, help="checkpoint path(s) written by train.py")
    p.add_argument("--data", default=None, help="dataset yaml (default: the one the checkpoint was trained on)")
    p.add_argument("--batch-size", type=int, default=32, help="images per batch (per rank)")
    p.add_argument("--imgsz", "--img", "--img-size", type=int, default=None, help="inference size (default: training size)")
    p.add_argument("--conf-thres", type=float, default=0.001, help="confidence threshold")
    p.add_argument("--iou-thres", type=float, default=0.6, help="NMS IoU threshold")
    p.add_argument("--max-det", type=int, default=300, help="maximum detections per image")
    p.add_argument("--task", default="val", choices=("val", "test"), help="which split to score")
    p.add_argument("--device", default="", help="cuda device, i.e. 0 or 0,1 or cpu")
    p.add_argument("--workers", type=int, default=8, help="max dataloader workers (per rank)")
    p.add_argument("--single-cls", action="store_true", help="treat as single-class dataset")
    p.add_argument("--verbose", action="store_true", help="report mAP by class")
    p.add_argument("--half", action="store_true", help="FP16 inference (CUDA only)")
    p.add_argument("--cache", nargs="?", const="ram", choices=["ram", "disk"], default=None,
                   help="cache resized images in RAM (/dev/shm) or on disk, one copy shared by every rank and worker of a node")
    p.add_argument("--cache-dir", default=None, help="where label caches go when the dataset folder is read-only")
    p.add_argument("--local-rank", "--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(opt: argparse.Namespace) -> list[ValResult]:
    info = dist.dist_info(opt.local_rank)
    setup_logging(info.rank, info.world_size)
    device = dist.select_device(opt.device, info=info)
    dist.init_distributed(info, device)
    try:
        return [validate_checkpoint(opt, w, info, device) for w in opt.weights]
    finally:
        dist.cleanup_distributed()


def validate_checkpoint(opt: argparse.Namespace, weights: str, info: dist.DistInfo, device: torch.device) -> ValResult:
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
    split = getattr(data, opt.task)
    if not split:
        raise UserError(f"{data.file}: no '{opt.task}' split")
    loader, _ = create_dataloader(split, imgsz, opt.batch_size, stride, single_cls=single_cls, rect=True, pad=0.5,
                                  rank=info.rank, world_size=info.world_size, local_rank=info.local_rank,
                                  workers=opt.workers, nc=len(names), cache=opt.cache, cache_dir=opt.cache_dir,
                                  prefix=f"{opt.task}: ")
    LOGGER.info(f"{weights}: epoch {int(ckpt.get('epoch', -1)) + 1}, {len(names)} classes, imgsz {imgsz}")
    result = run(model, loader, device, names, opt.conf_thres, opt.iou_thres, opt.max_det,
                 half=opt.half, verbose=opt.verbose, prefix=f"{opt.task}: ")
    release_ram_caches(info.local_rank, loader.dataset.imgcache)
    pre, inf, nms = result.speed_ms
    LOGGER.info(f"Speed: {pre:.1f}ms pre-process, {inf:.1f}ms inference, {nms:.1f}ms NMS per image at "
                f"shape ({opt.batch_size}, 3, {imgsz}, {imgsz})")
    LOGGER.info(f"Results: mAP50 {result.metrics.map50:.4f}  mAP50-95 {result.metrics.map:.4f}")
    return result


@record
def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(parse_opt(argv)))

if __name__ == "__main__":
    sys.exit(cli())
