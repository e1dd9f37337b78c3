#!/usr/bin/env python
"""Train a YOLO detector on a YOLO-format dataset, on one CPU or many GPUs.

    python train.py                                   # built-in shapes dataset, CPU friendly
    torchrun --nproc_per_node 4 train.py --data my.yaml --cfg models/yolov5s.yaml --batch-size 64

The story, top to bottom: devices and process group -> run folder -> data -> model -> optimizer
-> (resume) -> epochs of train_one_epoch + val.run on every rank -> checkpoints from rank 0.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from torch.distributed.elastic.multiprocessing.errors import record
from tqdm import tqdm

import val as validate
from models.yolo import Model, de_parallel
from utils.core import dist
from utils.engine.autoanchor import anchors_per_level, check_anchors, set_anchors
from utils.engine.checkpoint import (fp32_state_dict, load_checkpoint, now_iso, rng_states, save_checkpoint,
                              set_rng_states, strip_optimizer, to_plain, versions)
from utils.core.cli import IMGSZ, SEED, ArgumentParser, Range
from utils.core.fileio import ROOT
from utils.core.hyp import Hyp, load_hyp
from utils.data.config import load_data_config, prepare_dataset
from utils.core.cpu import tune_malloc
from utils.core.errors import UserError, run_entry_point
from utils.data.imgcache import release_ram_caches
from utils.data.loader import create_dataloader
from utils.core.logging import LOGGER, colorstr, setup_logging
from models.heads.anchor_loss import ComputeLoss
from utils.engine.optim import (NOMINAL_BATCH, EarlyStopping, ModelEMA, Warmup, accumulate_steps, lr_lambda,
                         smart_optimizer)
from utils.eval.plots import plot_images, plot_labels, plot_results
from utils.core.runs import ResultsCSV, increment_path, latest_checkpoint


# Arguments that may differ on --resume without changing what the run computes (or, for
# epochs, only by the user's explicit wish to train longer); bookkeeping ones are never compared.
RESUME_HARMLESS = {"device", "workers", "epochs", "patience", "cache", "cache_dir", "noval", "save_period",
                   "save_interval", "keep_optimizer", "noplots", "threads"}
RESUME_BOOKKEEPING = {"resume", "allow_changes", "local_rank", "project", "name", "exist_ok", "save_dir"}


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The CLI; every numeric flag is range-checked here, at parse time, on every rank (utils/cli.Range)."""
    p = ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=str(ROOT / "data" / "shapes.yaml"), help="dataset yaml")
    p.add_argument("--cfg", default=None, help="model yaml (default: the --weights checkpoint's model, else models/yolov5n.yaml)")
    p.add_argument("--weights", default=None, help="yolotrain checkpoint to fine-tune from (matching tensors are transferred)")
    p.add_argument("--freeze", nargs="+", type=Range(int, min=0), default=[0],
                   help="freeze the first N layers, or the listed layer indices")
    p.add_argument("--noautoanchor", action="store_true", help="keep the model yaml's anchors")
    p.add_argument("--hyp", default=str(ROOT / "hyps" / "hyp.scratch-low.yaml"), help="hyperparameters yaml")
    p.add_argument("--epochs", type=Range(int, min=1), default=15,
                   help="total training epochs (sized for the quick built-in run)")
    p.add_argument("--batch-size", type=Range(int, min=1), default=16, help="global batch size, split over all ranks")
    p.add_argument("--imgsz", "--img", "--img-size", type=IMGSZ, default=320, help="train and val image size (pixels)")
    p.add_argument("--rect", action="store_true", help="rectangular training batches")
    p.add_argument("--device", default="", help="cuda device, i.e. 0 or 0,1,2,3 or cpu")
    p.add_argument("--workers", type=Range(int, min=0), default=8, help="max dataloader workers (per rank)")
    p.add_argument("--threads", type=Range(int, min=0), default=0,
                   help="CPU threads per rank (0: torch's default, capped so ranks x threads <= cores)")
    p.add_argument("--optimizer", default="SGD", choices=("SGD", "Adam", "AdamW"))
    p.add_argument("--cos-lr", action="store_true", help="cosine LR schedule")
    p.add_argument("--single-cls", action="store_true", help="train multi-class data as single-class")
    p.add_argument("--patience", type=Range(int, min=0), default=100,
                   help="early stop after this many epochs without improvement (0: never)")
    p.add_argument("--val-batch-size", type=Range(int, min=1), default=32,
                   help="validation images per batch (per rank)")
    p.add_argument("--noval", action="store_true", help="only validate the final epoch")
    p.add_argument("--save-period", type=Range(int), default=-1,
                   help="also keep weights/epochN.pt every N epochs (< 1: off)")
    p.add_argument("--save-interval", type=Range(float, min=0), default=0.0,
                   help="also save last.pt mid-epoch every this many minutes; a resume skips the batches done (0: off)")
    p.add_argument("--keep-optimizer", action="store_true", help="do not strip the optimizer from best/last.pt at the end")
    p.add_argument("--noplots", action="store_true", help="save no pictures (labels, batches, curves, results)")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (CUDA DDP only)")
    p.add_argument("--channels-last", action="store_true",
                   help="NHWC memory format (about 1.25x faster steps on CPU here; rounding differs from NCHW)")
    p.add_argument("--multi-scale", action="store_true", help="vary the training image size by +/- 50%% per step")
    p.add_argument("--project", default=str(ROOT / "runs" / "train"), help="save to project/name")
    p.add_argument("--name", default="exp", help="save to project/name")
    p.add_argument("--exist-ok", action="store_true", help="existing project/name ok, do not increment")
    p.add_argument("--seed", type=SEED, default=0, help="global training seed")
    p.add_argument("--resume", nargs="?", const=True, default=False,
                   help="resume the latest run, a given last.pt, or 'auto': this run's last.pt if it exists "
                        "(for torchrun --max-restarts), else start it")
    p.add_argument("--allow-changes", action="store_true",
                   help="on --resume, accept arguments that change the training math (data, model, batch, hyp...)")
    p.add_argument("--cache", nargs="?", const="ram", choices=["ram", "disk"], default=None,
                   help="cache resized images in RAM (/dev/shm) or on disk, one copy shared by every rank and worker of a node")
    p.add_argument("--cache-dir", default=None, help="where label caches go when the dataset folder is read-only")
    p.add_argument("--local-rank", "--local_rank", type=Range(int, min=-1), default=-1, help=argparse.SUPPRESS)
    return p


def main(opt: argparse.Namespace) -> None:
    info = dist.dist_info(opt.local_rank)
    setup_logging(info.rank, info.world_size)
    dist.set_cpu_threads(info, opt.threads)
    ckpt = resolve_resume(opt) if opt.resume else None
    device = dist.select_device(opt.device, opt.batch_size, info)
    if device.type == "cpu":
        tune_malloc()  # large CPU tensors stay mapped between batches (utils/core/cpu.py)
    dist.init_distributed(info, device)
    try:
        train(opt, info, device, ckpt)
    finally:
        dist.cleanup_distributed()


def resolve_resume(opt: argparse.Namespace) -> dict | None:
    """Find the checkpoint to continue and restore the run's saved arguments into opt.

    Arguments given now that differ from the saved run are listed; harmless ones apply, ones that
    would change the training math need --allow-changes. ``--resume auto`` starts the run
    (in its fixed folder) when it has no last.pt yet, so a restarted job picks up its own.
    """
    if opt.resume == "auto":
        path = Path(opt.project) / opt.name / "weights" / "last.pt"
        if not path.is_file():
            LOGGER.info(f"--resume auto: no {path} yet; starting the run")
            opt.resume, opt.exist_ok = False, True
            return None
    else:
        path = latest_checkpoint(opt.project) if opt.resume is True else Path(opt.resume)
    if path is None:
        raise UserError(f"--resume: no last.pt found under {opt.project}")
    ckpt = load_checkpoint(path)
    if "optimizer" not in ckpt:
        raise UserError(f"{path}: this run finished (its optimizer state was stripped); nothing to resume")
    saved, defaults = ckpt["args"], vars(build_parser().parse_args([]))
    changed = {k: v for k, v in vars(opt).items()
               if k not in RESUME_BOOKKEEPING and k in saved and v != defaults.get(k) and not _same_arg(v, saved[k])}
    math = sorted(k for k in changed if k not in RESUME_HARMLESS)
    if math and not opt.allow_changes:
        listed = ", ".join(f"--{k.replace('_', '-')} {changed[k]} (run has {saved[k]})" for k in math)
        raise UserError(f"{path}: resuming with {listed} would change the training math; "
                        "drop them, or pass --allow-changes to continue with them")
    if changed.get("epochs") is not None and changed["epochs"] <= ckpt["epoch"] + 1:
        raise UserError(f"{path}: --epochs {changed['epochs']} but {ckpt['epoch'] + 1} epochs are already done")
    if changed:
        LOGGER.info("Resuming with changed arguments: " + ", ".join(
            f"{k}: {saved[k]} -> {v}" for k, v in sorted(changed.items())))
    vars(opt).update(saved)
    vars(opt).update(changed, local_rank=opt.local_rank, resume=str(path), save_dir=str(Path(path).parent.parent))
    part = f", batch {ckpt['batches_done'] + 1}" if ckpt.get("batches_done") else ""
    LOGGER.info(f"Resuming {path} from epoch {ckpt['epoch'] + 2}{part} of {opt.epochs}")
    return ckpt


def _same_arg(given, saved) -> bool:
    """Compare a CLI value with its saved form (paths resolved, tuples as lists)."""
    given = to_plain(given)
    if isinstance(given, str) and isinstance(saved, str) and (Path(given).exists() or Path(saved).exists()):
        return Path(given).resolve() == Path(saved).resolve()
    return given == saved


def train(opt: argparse.Namespace, info: dist.DistInfo, device: torch.device, ckpt: dict | None) -> None:
    # Run folder: chosen on rank 0, shared so every rank agrees on it.
    save_dir = Path(opt.save_dir) if ckpt else increment_path(Path(opt.project) / opt.name, opt.exist_ok)
    save_dir = Path(dist.broadcast_object(str(save_dir)))
    weights_dir = save_dir / "weights"
    hyp = Hyp(**ckpt["hyp"]) if ckpt else load_hyp(opt.hyp)
    na = None if ckpt else anchors_per_level(hyp.anchors, opt.hyp, opt.noautoanchor)  # hyp 'anchors' (YOLOv5)
    opt.save_dir = str(save_dir)
    if info.is_main:
        weights_dir.mkdir(parents=True, exist_ok=True)
        if not ckpt:
            _write_yaml(save_dir / "hyp.yaml", hyp.as_dict())
            _write_yaml(save_dir / "opt.yaml", to_plain(vars(opt)))

    # Data description (a built-in dataset is generated once per node).
    with dist.torch_distributed_zero_first(info.local_rank):
        data = load_data_config(opt.data)
        prepare_dataset(data)
    names = ["item"] if opt.single_cls else data.names
    nc = len(names)

    # Model: identical initial weights on every rank (DDP also broadcasts rank 0's at wrap time).
    init_seeds(opt.seed)
    model = build_model(opt, ckpt, nc, data.anchors, na).to(device)
    freeze_layers(model, opt.freeze)
    memory_format = torch.channels_last if opt.channels_last else torch.contiguous_format
    model.to(memory_format=memory_format)  # before EMA and DDP copy it
    model_info = model.info(opt.imgsz)
    gs = max(int(model.stride.max()), 32)
    imgsz = check_img_size(opt.imgsz, gs)

    # Data loaders: batch size per rank; the train sampler reshuffles each epoch from the seed.
    batch = opt.batch_size // info.world_size
    common = dict(stride=gs, single_cls=opt.single_cls, rank=info.rank, world_size=info.world_size,
                  local_rank=info.local_rank, workers=opt.workers, seed=opt.seed, nc=len(data.names),
                  cache_dir=opt.cache_dir,  # the scan checks the file's classes; single_cls then maps them to 0
                  report_dir=save_dir)  # rank 0 lists every scan problem in save_dir/dataset_problems_<split>.txt
    train_loader, train_set = create_dataloader(data.train, imgsz, batch, hyp=hyp, augment=True, rect=opt.rect,
                                                shuffle=True, cache=opt.cache, prefix="train: ", **common)
    val_loader, val_set = create_dataloader(data.val, imgsz, opt.val_batch_size, rect=True, pad=0.5, cache=opt.cache,
                                            prefix="val: ", **common)
    if hyp.close_mosaic > 0:  # set before the first pass: persistent workers copy the dataset once
        train_set.mosaic_off_from_epoch = max(opt.epochs - int(hyp.close_mosaic), 0)
    _check_labels(train_set, nc, data.file)
    plots = info.is_main and not opt.noplots
    if plots and not (save_dir / "labels.jpg").exists():
        plot_labels(train_set.labels, names, save_dir / "labels.jpg")
    if not ckpt and not opt.noautoanchor:  # before EMA and DDP copy the model; resume keeps its anchors
        new_anchors = None
        if info.is_main:
            fit = check_anchors(train_set, model, thr=hyp.anchor_t, imgsz=imgsz, seed=opt.seed, force=na is not None)
            new_anchors = fit.anchors_px if fit.replaced else None
        new_anchors = dist.broadcast_object(new_anchors)  # computed once, the same on every rank
        if new_anchors is not None and not info.is_main:
            set_anchors(model, new_anchors)

    # Optimizer, schedule, EMA, loss.
    accumulate = accumulate_steps(opt.batch_size)
    decay = hyp.weight_decay * opt.batch_size * accumulate / NOMINAL_BATCH
    optimizer = smart_optimizer(model, opt.optimizer, hyp.lr0, hyp.momentum, decay)
    lf = lr_lambda(opt.epochs, hyp.lrf, opt.cos_lr)
    ema = ModelEMA(model)
    amp = device.type == "cuda"
    scaler = torch.amp.GradScaler("cuda", enabled=amp)
    stopper = EarlyStopping(patience=opt.patience)
    start_epoch, best_fitness, batches_done = 0, 0.0, 0
    if ckpt:
        start_epoch, best_fitness = restore_training_state(ckpt, optimizer, ema, scaler, stopper)
        batches_done = int(ckpt.get("batches_done", 0))  # a mid-epoch checkpoint (--save-interval)
    scheduler = make_scheduler(optimizer, lf, start_epoch)
    if opt.sync_bn and info.distributed and device.type == "cuda":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        LOGGER.info("Using SyncBatchNorm")
    elif opt.sync_bn:
        LOGGER.warning("WARNING: --sync-bn needs CUDA and more than one rank; using plain BatchNorm")
    model = dist.smart_DDP(model, device)
    compute_loss = ComputeLoss(model, loss_hyp(hyp, de_parallel(model).detect.nl, nc, imgsz))
    nb = len(train_loader)
    warmup = Warmup(iters=max(round(hyp.warmup_epochs * nb), 100), bias_lr=hyp.warmup_bias_lr,
                    momentum0=hyp.warmup_momentum, momentum=hyp.momentum)
    results_csv = ResultsCSV(save_dir / "results.csv")
    if info.is_main and ckpt:
        results_csv.truncate_after(start_epoch - 1)
    if info.is_main:
        log_start_summary(opt, info, device, save_dir, hyp, data, (train_set, val_set), model_info, batch,
                          accumulate, nb, imgsz, (start_epoch, batches_done))

    t_start = time.time()
    metrics, epoch = None, start_epoch - 1

    def save_mid_epoch(epoch: int, batches: int, mloss: torch.Tensor) -> None:
        """--save-interval: last.pt at an optimizer step inside ``epoch``, with the batches done."""
        if info.is_main:
            ckpt_out = make_checkpoint(model, ema, optimizer, scaler, stopper, epoch - 1, best_fitness, hyp, opt,
                                       names, metrics, info.world_size)
            ckpt_out.update(batches_done=batches, mloss=mloss.tolist())
            save_checkpoint(ckpt_out, weights_dir / "last.pt")
            LOGGER.info(f"Saved {weights_dir / 'last.pt'} at epoch {epoch + 1}, batch {batches}/{nb}")

    state = dict(last_opt_step=start_epoch * nb + batches_done - 1, accumulate=accumulate,
                 accumulate_max=accumulate, multi_scale=(imgsz, gs, opt.seed) if opt.multi_scale else None,
                 memory_format=memory_format, first_batch=batches_done,
                 mloss=torch.tensor(ckpt["mloss"], device=device) if batches_done else None,
                 save_seconds=opt.save_interval * 60, next_save=time.monotonic() + opt.save_interval * 60,
                 save_pending=False, save_mid_epoch=save_mid_epoch, epoch_seconds=[],
                 plot_batch=(lambda b, k: plot_images(b.images, b.targets, b.paths, names,
                                                      save_dir / f"train_batch{k}.jpg")) if plots else None)
    for epoch in range(start_epoch, opt.epochs):
        t_epoch = time.time()
        train_loader.sampler.set_epoch(epoch, skip=state["first_batch"] * batch)
        if epoch == train_set.mosaic_off_from_epoch:
            LOGGER.info(f"Closing mosaic: the last {opt.epochs - epoch} epochs train without it")
        mloss = train_one_epoch(model, train_loader, optimizer, ema, scaler, compute_loss, warmup, lf,
                                epoch, opt.epochs, device, amp, state)
        lrs = [g["lr"] for g in optimizer.param_groups]
        scheduler.step()
        final = epoch + 1 == opt.epochs
        result = None
        if not opt.noval or final:
            result = validate.run(ema.ema, val_loader, device, names, compute_loss=compute_loss, prefix="val: ",
                                  save_dir=save_dir, plots=final and not opt.noplots, channels_last=opt.channels_last)
            metrics = result.metrics
        fitness = metrics.fitness() if result else 0.0
        # only validated epochs count towards early stopping (with --noval none do until the last)
        stop = dist.broadcast_object(result is not None and stopper(epoch, fitness) and not final)
        is_best = fitness >= best_fitness and result is not None
        best_fitness = max(best_fitness, fitness)
        if info.is_main:
            m = metrics
            row = [*mloss.tolist(), *([m.mp, m.mr, m.map50, m.map] if result else [0.0] * 4),
                   *(result.loss if result else [0.0] * 3), *lrs]
            results_csv.append(epoch, row)
            LOGGER.info(f"epoch {epoch + 1}/{opt.epochs}: box {row[0]:.4f} obj {row[1]:.4f} cls {row[2]:.4f}"
                        + (f" | P {m.mp:.3f} R {m.mr:.3f} mAP50 {m.map50:.3f} mAP50-95 {m.map:.4f}" if result else "")
                        + f" | {time.time() - t_start:.0f}s")
            ckpt_out = make_checkpoint(model, ema, optimizer, scaler, stopper, epoch, best_fitness, hyp, opt,
                                       names, metrics, info.world_size)
            save_checkpoint(ckpt_out, weights_dir / "last.pt")
            if is_best:
                save_checkpoint(ckpt_out, weights_dir / "best.pt")
            if opt.save_period > 0 and (epoch + 1) % opt.save_period == 0:
                save_checkpoint(ckpt_out, weights_dir / f"epoch{epoch + 1}.pt")
        state["save_pending"], state["next_save"] = False, time.monotonic() + state["save_seconds"]
        state["epoch_seconds"].append(time.time() - t_epoch)
        if stop:
            break

    release_ram_caches(info.local_rank, train_set.imgcache, val_set.imgcache)
    if info.is_main:
        if plots:
            plot_results(save_dir / "results.csv")
        finish(save_dir, weights_dir, epoch - start_epoch + 1, time.time() - t_start, stopper,
               f"--data {data.file} --imgsz {imgsz} --batch-size {opt.val_batch_size}", strip=not opt.keep_optimizer)


def train_one_epoch(model, loader, optimizer, ema, scaler, compute_loss, warmup, lf, epoch, epochs, device,
                    amp, state) -> torch.Tensor:
    """One pass over this rank's shard; returns the mean [box, obj, cls] loss averaged over ranks.

    A run resumed from a mid-epoch checkpoint starts at ``state["first_batch"]`` with the saved
    running loss; every later epoch starts at batch 0.
    """
    model.train()
    first = state["first_batch"]
    nb = first + len(loader)
    mloss = state["mloss"] if state["mloss"] is not None else torch.zeros(3, device=device)
    state["first_batch"], state["mloss"] = 0, None
    world = dist.get_world_size()
    t0 = time.monotonic()
    bar = tqdm(enumerate(loader, start=first), total=nb, initial=first, disable=dist.get_rank() != 0,
               bar_format="{l_bar}{bar:10}{r_bar}", desc=f"{epoch + 1}/{epochs}")
    for i, batch in bar:
        ni = i + nb * epoch  # integrated batch count since the start of training
        imgs = batch.images.to(device, non_blocking=True).float().div_(255)
        imgs = imgs.contiguous(memory_format=state["memory_format"])  # no copy in the default format
        if state["multi_scale"]:
            imgs = rescale_batch(imgs, *state["multi_scale"], epoch=epoch, i=i)
        warmup.apply(optimizer, ni, lf, epoch)
        if ni <= warmup.iters:
            state["accumulate"] = max(1, round(float(np.interp(ni, [0, warmup.iters], [1, state["accumulate_max"]]))))
        if state["plot_batch"] and ni < 3:
            state["plot_batch"](batch, ni)
        with torch.autocast(device.type, enabled=amp):
            pred = model(imgs)
            loss, loss_items = compute_loss(pred, batch.targets.to(device))
        state["save_pending"] |= check_step(loss_items, epoch, i, state)
        mloss = (mloss * i + loss_items) / (i + 1)
        if world > 1:
            loss = loss * world  # DDP averages gradients over ranks; YOLOv5's loss is a sum over the batch
        scaler.scale(loss).backward()
        # Each epoch ends on an optimizer step: a checkpoint then never holds half-accumulated
        # gradients, so a resumed run continues exactly where the interrupted one would have.
        if ni - state["last_opt_step"] >= state["accumulate"] or i == nb - 1:
            optimizer_step(model, optimizer, scaler, ema)
            state["last_opt_step"] = ni
            if state["save_pending"] and i < nb - 1:  # the epoch's end saves anyway
                state["save_pending"] = False
                state["next_save"] = time.monotonic() + state["save_seconds"]
                state["save_mid_epoch"](epoch, i + 1, dist.reduce_mean(mloss))
        if not bar.disable:
            seconds = (time.monotonic() - t0) / (i + 1 - first)  # per batch, this epoch so far
            left = seconds * (nb - i - 1) + (epochs - epoch - 1) * _epoch_estimate(state["epoch_seconds"], seconds * nb)
            bar.set_postfix_str(f"box {mloss[0]:.4f} obj {mloss[1]:.4f} cls {mloss[2]:.4f} | "
                                f"{batch.targets.shape[0]} inst {imgs.shape[-1]}px | "
                                f"{len(batch.images) * world / seconds:.0f} img/s | run ETA {_hms(left)}", refresh=False)
    return dist.reduce_mean(mloss).cpu()


def optimizer_step(model, optimizer, scaler, ema) -> None:
    """Unscale, clip the gradient norm to 10, step, clear the gradients, update the EMA (YOLOv5's order)."""
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    ema.update(model)


def _epoch_estimate(done: list[float], train_only: float) -> float:
    """Seconds per remaining epoch: the mean of finished ones (validation included), else this one's training."""
    return sum(done) / len(done) if done else train_only


def _hms(seconds: float) -> str:
    m, sec = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{sec:02d}"


def build_model(opt: argparse.Namespace, ckpt: dict | None, nc: int, anchors: list | None,
                na: int | None = None) -> Model:
    """The model to train: a resumed run's own, or one built from --cfg (or --weights' yaml) with
    the tensors of --weights that fit transferred."""
    if ckpt:  # resume: exactly the saved model
        model = Model(ckpt["model_yaml"])
        model.load_state_dict(ckpt["model"])
        return model
    source = load_checkpoint(opt.weights) if opt.weights else None
    cfg = opt.cfg or (source["model_yaml"] if source else ROOT / "models" / "yolov5n.yaml")
    model = Model(cfg, nc=nc, anchors=anchors, na=na)
    if source:
        state = source.get("ema") or source["model"]
        own = model.state_dict()
        fits = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
        model.load_state_dict(fits, strict=False)
        skipped = sorted(k for k in own if k not in fits)
        shown = ", ".join(skipped[:12]) + (f" and {len(skipped) - 12} more" if len(skipped) > 12 else "")
        LOGGER.info(f"Transferred {len(fits)}/{len(own)} items from {opt.weights}"
                    + (f"; not transferred (new shape or name): {shown}" if skipped else ""))
    return model


def freeze_layers(model: Model, freeze: list[int]) -> None:
    """--freeze N freezes layers 0..N-1; several numbers freeze exactly those layer indices."""
    layers = list(range(freeze[0])) if len(freeze) == 1 else freeze
    if not layers:
        return
    prefixes = tuple(f"model.{i}." for i in layers)
    frozen = 0
    for name, p in model.named_parameters():
        if name.startswith(prefixes):
            p.requires_grad_(False)
            frozen += 1
    LOGGER.info(f"Froze {frozen} parameter tensors in layers {layers[0]}..{layers[-1]}" if len(freeze) == 1
                else f"Froze {frozen} parameter tensors in layers {layers}")


def rescale_batch(imgs: torch.Tensor, imgsz: int, gs: int, seed: int, epoch: int, i: int) -> torch.Tensor:
    """--multi-scale: resize the batch to a size in [0.5, 1.5] x imgsz (a multiple of the stride),
    drawn from (seed, epoch, step) so every rank agrees and a resumed run repeats it. Targets are
    normalised, so they need no change."""
    size = int(np.random.default_rng([seed, epoch, i]).integers(int(imgsz * 0.5), int(imgsz * 1.5) + gs)) // gs * gs
    sf = size / max(imgs.shape[2:])
    if sf == 1:
        return imgs
    shape = [math.ceil(x * sf / gs) * gs for x in imgs.shape[2:]]
    return torch.nn.functional.interpolate(imgs, size=shape, mode="bilinear", align_corners=False)


def make_scheduler(optimizer: torch.optim.Optimizer, lf, start_epoch: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Epoch LR schedule, positioned for ``start_epoch``.

    An uninterrupted run enters epoch e with last_epoch == e (the constructor counts as step 0), so
    a resumed one must too; YOLOv5's ``start_epoch - 1`` gives every resumed epoch after warmup the
    previous epoch's LR. The optimizer's saved lr already holds epoch e's value.
    """
    saved = [g["lr"] for g in optimizer.param_groups]
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=lf)
    if start_epoch:
        scheduler.last_epoch = start_epoch
        for g, lr in zip(optimizer.param_groups, saved):
            g["lr"] = lr
    return scheduler


def check_step(loss_items: torch.Tensor, epoch: int, i: int, state: dict) -> bool:
    """One all-reduce per step carries every rank's NaN/inf flag and rank 0's --save-interval clock.

    A non-finite loss on any rank stops every rank at the same step (decided together, so no rank
    waits in a collective for one that has stopped; earlier checkpoints stay intact). Returns
    whether a mid-epoch save is due, the same answer on every rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    flags = torch.zeros(world + 1, device=loss_items.device)
    flags[rank] = float(not torch.isfinite(loss_items).all())
    flags[world] = float(rank == 0 and state["save_seconds"] > 0 and time.monotonic() >= state["next_save"])
    flags = dist.all_reduce_sum(flags)
    bad = flags[:world]
    if bad.any():
        ranks = ", ".join(str(r) for r in bad.nonzero().flatten().tolist())
        raise UserError(f"epoch {epoch + 1}, batch {i + 1}: the loss became NaN/inf on rank(s) {ranks} "
                        f"(box, obj, cls = {[round(v, 4) for v in loss_items.tolist()]}); checkpoints of earlier "
                        "epochs are intact. Lower lr0 in the hyp yaml, or check the labels.")
    return bool(flags[world])


def loss_hyp(hyp: Hyp, nl: int, nc: int, imgsz: int) -> Hyp:
    """Scale the loss gains to the number of detection layers, classes and image size (YOLOv5 rules)."""
    return dataclasses.replace(hyp, box=hyp.box * 3 / nl, cls=hyp.cls * nc / 80 * 3 / nl,
                               obj=hyp.obj * (imgsz / 640) ** 2 * 3 / nl)


def make_checkpoint(model, ema, optimizer, scaler, stopper, epoch, best_fitness, hyp, opt, names, metrics,
                    world_size) -> dict:
    """Everything an exact continuation needs, in weights_only-safe types."""
    return {
        "epoch": epoch,
        "best_fitness": float(best_fitness),
        "model_yaml": to_plain(de_parallel(model).yaml),
        "model": fp32_state_dict(de_parallel(model)),
        "ema": fp32_state_dict(ema.ema),
        "ema_updates": ema.updates,
        "optimizer": optimizer.state_dict(),
        "scaler": scaler.state_dict(),
        "early_stop": stopper.state_dict(),
        "rng": rng_states(),
        "seed": opt.seed,
        "world_size": world_size,
        "hyp": hyp.as_dict(),
        "args": to_plain(vars(opt)),
        "names": list(names),
        "metrics": metrics.as_dict() if metrics else {},
        "versions": versions(),
        "date": now_iso(),
    }


def restore_training_state(ckpt, optimizer, ema, scaler, stopper) -> tuple[int, float]:
    optimizer.load_state_dict(ckpt["optimizer"])
    ema.ema.load_state_dict(ckpt["ema"])
    ema.updates = ckpt["ema_updates"]
    if ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    stopper.best_fitness = ckpt["early_stop"]["best_fitness"]
    stopper.best_epoch = ckpt["early_stop"]["best_epoch"]
    set_rng_states(ckpt["rng"])
    return ckpt["epoch"] + 1, ckpt["best_fitness"]


def log_start_summary(opt, info, device, save_dir, hyp, data, sets, model_info, batch, accumulate, nb, imgsz,
                      start) -> None:
    """One block before the first step: where, on what, with which data, model and settings."""
    kind = (f"CUDA x {info.world_size} rank(s) on {info.world_size // max(info.local_world_size, 1)} node(s)"
            if device.type == "cuda" else f"CPU x {info.world_size} rank(s), {torch.get_num_threads()} threads each")
    lines = [colorstr("Run: ") + f"{save_dir} (opt.yaml, hyp.yaml, results.csv, weights/)",
             colorstr("Devices: ") + kind,
             colorstr("Batch: ") + f"global {batch * info.world_size} = {info.world_size} x {batch} per rank, "
             f"accumulate {accumulate} (nominal {NOMINAL_BATCH}); {nb} batches per epoch per rank",
             colorstr("Data: ") + str(data.file)]
    for split, ds in zip(("train", "val"), sets):
        c = ds.counts
        lines.append(f"  {split:5} {c['images']} images, {c['instances']} instances, {c['backgrounds']} backgrounds, "
                     f"{c['corrupt']} corrupt")
    lines.append(colorstr("Model: ") + f"{opt.cfg or opt.weights or 'models/yolov5n.yaml'}: {model_info.layers} "
                 f"layers, {model_info.parameters:,} parameters, {model_info.gflops:.1f} GFLOPs at {imgsz} px")
    changed = hyp_changes(hyp)
    lines.append(colorstr("Hyperparameters: ") + f"{opt.hyp}; " + (
        "differing from the defaults: " + ", ".join(f"{k}={v:g} (default {d:g})" for k, (v, d) in changed.items())
        if changed else "all YOLOv5 scratch-low defaults"))
    epoch, batches = start
    where = f"epoch {epoch + 1}" + (f", batch {batches + 1}" if batches else "")
    lines.append(f"Training {opt.epochs} epochs of {imgsz} px images" + (f", resuming at {where}" if epoch or batches
                                                                          else ""))
    LOGGER.info("\n".join(lines))


def hyp_changes(hyp: Hyp) -> dict[str, tuple[float, float]]:
    """Hyperparameters that differ from the defaults: name -> (value, default)."""
    default = Hyp().as_dict()
    return {k: (v, default[k]) for k, v in hyp.as_dict().items() if v != default[k]}


def finish(save_dir: Path, weights_dir: Path, epochs_done: int, seconds: float, stopper, val_args: str,
           strip: bool = True) -> None:
    """Strip the optimizer from the final checkpoints and say what the run left behind."""
    best, last = weights_dir / "best.pt", weights_dir / "last.pt"
    for f in (last, best):
        if strip and f.exists():
            strip_optimizer(f)
    m = load_checkpoint(best)["metrics"] if best.exists() else {}
    scores = (f": P {m['mp']:.3f} R {m['mr']:.3f} mAP50 {m['map50']:.4f} mAP50-95 {m['map']:.4f}" if m else "")
    pictures = sorted(p.name for p in save_dir.iterdir() if p.suffix in (".png", ".jpg"))
    LOGGER.info(f"\n{epochs_done} epochs completed in {seconds / 3600:.3f} hours ({seconds:.0f} s); best epoch "
                f"{stopper.best_epoch + 1}{scores}\nCheckpoints: {best}, {last}\nResults: {save_dir / 'results.csv'}"
                + (f"\nPlots in {save_dir}: {', '.join(pictures)}" if pictures else "")
                + f"\nReproduce the best epoch's metrics with:\n"
                f"  python val.py --weights {best} {val_args}")


def init_seeds(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_img_size(imgsz: int, stride: int) -> int:
    size = max(math.ceil(imgsz / stride) * stride, stride)
    if size != imgsz:
        LOGGER.warning(f"--imgsz {imgsz} must be a multiple of the stride {stride}; using {size}")
    return size


def _check_labels(dataset, nc: int, data_file: Path) -> None:
    labels = [l for l in dataset.labels if len(l)]
    if labels:
        mlc = int(np.concatenate(labels, 0)[:, 0].max())
        if mlc >= nc:
            raise UserError(f"{data_file}: a label has class {mlc} but the dataset names only {nc} classes")


def _write_yaml(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)


@record
def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(parse_opt(argv)))

if __name__ == "__main__":
    sys.exit(cli())
