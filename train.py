#!/usr/bin/env python
"""Train a YOLO detector on a YOLO-format dataset, on one CPU or many GPUs.

    python train.py                                   # built-in shapes dataset, CPU friendly
    torchrun --nproc_per_node 4 train.py --data my.yaml --cfg models/yolov5s.yaml --batch-size 64

The story, top to bottom: arguments -> devices and process group -> everything the run trains
with (utils/engine/setup.py: run folder, data, model, loaders, anchors, optimizer, DDP) -> epochs
of train_one_epoch (utils/engine/loop.py) and a validation on every rank (utils/eval/evaluate.py)
-> the epoch's results row and checkpoints from rank 0 (utils/engine/hooks.py) -> the end summary.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from utils.core import dist
from utils.core.cli import IMGSZ, SEED, ArgumentParser, Range, add_cache_flags, add_channels_last_flag, \
    add_device_flags, add_local_rank_flag, add_run_folder_flags, add_workers_flag
from utils.core.cpu import tune_malloc
from utils.core.errors import EXIT_PREEMPTED, Preempted, UserError, run_entry_point
from utils.core.fileio import ROOT
from utils.core.logging import LOGGER, setup_logging
from utils.core.runs import latest_checkpoint
from utils.core.watchdog import Watchdog
from utils.data.imgcache import release_ram_caches
from utils.engine.hooks import Checkpointer, EpochEnd, RunPlots, SaveClock, TimeBudget
from utils.engine.loop import LoopState, train_one_epoch
from utils.engine.preempt import StopRequest
from utils.engine.recover import NanRecovery
from utils.engine.setup import Training, build_training
from utils.engine.summary import log_end_summary, log_start_summary
from utils.eval.evaluate import EvalOptions, EvalResult, evaluate_model
from utils.weights.checkpoint import load_checkpoint, to_plain


# Arguments that may differ on --resume without changing what the run computes (or, for
# epochs, only by the user's explicit wish to train longer); bookkeeping ones are never compared.
RESUME_HARMLESS = {"device", "workers", "epochs", "time", "nan_recover", "hang_timeout", "patience", "cache", "cache_dir",
                   "noval", "save_period", "save_interval", "keep_optimizer", "noplots", "threads"}
RESUME_BOOKKEEPING = {"resume", "allow_changes", "local_rank", "project", "name", "exist_ok", "save_dir"}


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The CLI; every numeric flag is range-checked here, at parse time, on every rank (utils/cli.Range)."""
    p = ArgumentParser(description=__doc__.splitlines()[1], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default=str(ROOT / "data" / "shapes.yaml"), help="dataset yaml")
    p.add_argument("--cfg", default=None, help="model yaml (default: the --weights checkpoint's model, else models/yolov8n.yaml)")
    p.add_argument("--weights", default=None, help="yolotrain checkpoint to fine-tune from (matching tensors are transferred)")
    p.add_argument("--freeze", nargs="+", type=Range(int, min=0), default=[0],
                   help="freeze the first N layers, or the listed layer indices")
    p.add_argument("--noautoanchor", action="store_true", help="keep the model yaml's anchors")
    p.add_argument("--hyp", default=None,
                   help="hyperparameters yaml (default: hyps/hyp.scratch-low.yaml for anchor heads, hyps/hyp.v8.yaml for "
                        "anchor-free ones)")
    p.add_argument("--epochs", type=Range(int, min=1), default=15,
                   help="total training epochs (sized for the quick built-in run)")
    p.add_argument("--time", type=Range(float, min=0, max=1e6), default=0.0,
                   help="training budget in hours: train the epochs that fit instead of --epochs, the LR schedule and "
                        "close_mosaic fitted to them (0: off)")
    p.add_argument("--batch-size", type=Range(int, min=1), default=16, help="global batch size, split over all ranks")
    p.add_argument("--imgsz", "--img", "--img-size", type=IMGSZ, default=320, help="train and val image size (pixels)")
    p.add_argument("--rect", action="store_true", help="rectangular training batches")
    add_device_flags(p)
    add_workers_flag(p)
    p.add_argument("--optimizer", default="auto", choices=("auto", "SGD", "Adam", "AdamW"),
                   help="auto: SGD for anchor heads (YOLOv5's recipe); for anchor-free heads AdamW with an lr from the "
                        "class count on short schedules, SGD on long ones (the log says which and why)")
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
    p.add_argument("--nan-recover", type=Range(int, min=0), default=0,
                   help="on a NaN/inf loss, roll every rank back to the state before the last optimizer step, skip the "
                        "batch and halve the LR for the rest of the epoch, up to N times (0: stop the run, the default)")
    p.add_argument("--hang-timeout", type=Range(float, min=0), default=30.0,
                   help="minutes without progress (a batch fetched, a step, a collective, a validation batch) after "
                        "which every rank names the phase it is stuck in and exits with code 124 (0: off)")
    p.add_argument("--keep-optimizer", action="store_true", help="do not strip the optimizer from best/last.pt at the end")
    p.add_argument("--noplots", action="store_true", help="save no pictures (labels, batches, curves, results)")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (CUDA DDP only)")
    add_channels_last_flag(p)
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="mixed precision: fp16 autocast with loss scaling on CUDA, bf16 autocast on CPU (default: on for CUDA "
                        "and for CPUs with native bf16, AMX or AVX512-BF16, where it measured faster; --no-amp for fp32)")
    p.add_argument("--multi-scale", action="store_true", help="vary the training image size by +/- 50%% per step")
    add_run_folder_flags(p, ROOT / "runs" / "train")
    p.add_argument("--seed", type=SEED, default=0, help="global training seed")
    p.add_argument("--resume", nargs="?", const=True, default=False,
                   help="resume the latest run, a given last.pt, or 'auto': this run's last.pt if it exists "
                        "(for torchrun --max-restarts), else start it")
    p.add_argument("--allow-changes", action="store_true",
                   help="on --resume, accept arguments that change the training math (data, model, batch, hyp...)")
    add_cache_flags(p)
    add_local_rank_flag(p)
    return p


def main(opt: argparse.Namespace) -> None:
    info = dist.dist_info(opt.local_rank)
    stop = StopRequest().install()  # SIGTERM / SIGUSR1 from here on: save mid-epoch and leave (utils/engine/preempt.py)
    setup_logging(info.rank, info.world_size)
    dist.set_cpu_threads(info, opt.threads)
    ckpt = resolve_resume(opt) if opt.resume else None
    device = dist.select_device(opt.device, opt.batch_size, info)
    opt.channels_last = dist.channels_last_default(opt.channels_last, device)  # resolved: saved with the run
    opt.amp = dist.amp_default(opt.amp, device, legacy=ckpt is not None and "amp" not in ckpt["args"])
    if device.type == "cpu":
        tune_malloc()  # large CPU tensors stay mapped between batches (utils/core/cpu.py)
    with Watchdog(info.rank, opt.hang_timeout * 60, peers=info.distributed) as watch:  # hangs name themselves
        with watch.phase("init process group"):
            # collectives outlast the watchdog and its grace: a rank waiting on a stalled one reports, then exits 124
            dist.init_distributed(info, device, min_timeout_s=watch.timeout_s + watch.grace_s + 120)
        try:
            train(opt, info, device, ckpt, stop, watch)
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
    if "converted_from" in ckpt:
        raise UserError(f"{path}: a converted YOLOv5/Ultralytics checkpoint has no training state to resume; "
                        f"fine-tune from it with --weights {path}")
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
    if "epochs" in changed and (opt.time or saved.get("time")):  # --epochs only planned a --time run's first epoch
        LOGGER.info(f"--time: --epochs {changed.pop('epochs')} ignored; the run's refitted count, {saved['epochs']}, "
                    "stands")
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


def train(opt: argparse.Namespace, info: dist.DistInfo, device: torch.device, ckpt: dict | None,
          stop: StopRequest, watch: Watchdog) -> None:
    t0 = time.time()
    with watch.phase("setup"):  # the data scan inside names itself ("setup > scan")
        t = build_training(opt, info, device, ckpt)  # run folder, data, model, loaders, anchors, optimizer, DDP
        plots = RunPlots(t.save_dir, t.names, enabled=info.is_main and not opt.noplots)
        plots.labels(t.train_loader.dataset)
    recovery = NanRecovery(opt.nan_recover, t.model, t.ema, t.optimizer, t.scaler)
    if ckpt is not None:
        recovery.load_state_dict(ckpt.get("nan_recovery"))  # the count and the rollback copy of the saved run
        if opt.time and "mosaic_off_from_epoch" in ckpt:  # where --time had moved close_mosaic
            t.train_loader.sampler.mosaic_off_from_epoch = ckpt["mosaic_off_from_epoch"]
    checkpointer = Checkpointer(t.weights_dir, info, opt.save_period, recovery)
    end_epoch, clock, budget = EpochEnd(t, checkpointer), SaveClock(opt.save_interval), TimeBudget(opt.time)
    if info.is_main:
        log_start_summary(t)
    state = LoopState.start(t, t0)
    early_stop, epoch = False, t.start.epoch
    while epoch < opt.epochs:  # --time may change opt.epochs after each epoch
        state.epoch, t_epoch, first = epoch, time.time(), state.first_batch
        t.train_loader.sampler.set_epoch(epoch, skip=first * t.batch)
        if epoch == t.train_loader.sampler.mosaic_off_from_epoch:
            LOGGER.info(f"Closing mosaic: the last {opt.epochs - epoch} epochs train without it")
        mloss = train_one_epoch(t, state, clock, checkpointer, plots, stop, recovery, watch)  # phases loader, step, save
        if state.preempted_at is not None:
            break
        lrs = [g["lr"] for g in t.optimizer.param_groups]
        t.scheduler.step()
        with watch.phase("validation", f"epoch {epoch + 1}"):  # each batch is progress
            result = validate(t, epoch)
            seconds = None if first else time.time() - t_epoch  # a resumed part of an epoch is no epoch's time
            budget.refit(t, state, seconds)  # --time: the epochs that fit, before the checkpoint
            if seconds is not None:
                state.epoch_seconds.append(seconds)  # before the checkpoint, which carries them to a resume
            if result is None and epoch + 1 == opt.epochs:  # --noval, and --time just made this epoch the last
                result = validate(t, epoch)
        with watch.phase("save", f"epoch {epoch + 1}"):
            early_stop = end_epoch(state, mloss, lrs, result)  # results.csv row, early stop, last/best.pt
            if result is not None and epoch + 1 == opt.epochs:
                plots.validation(result)
        clock.restart()
        if early_stop or state.stopping:
            break
        epoch += 1
    with watch.phase("finish"):
        release_ram_caches(info.local_rank, t.train_loader.dataset.imgcache, t.val_loader.dataset.imgcache)
    if state.preempted_at is not None or (state.stopping and not early_stop and state.epoch + 1 < opt.epochs):
        where = (f"epoch {state.epoch + 1}, batch {state.preempted_at}/{t.batches_per_epoch}"
                 if state.preempted_at is not None else f"the end of epoch {state.epoch + 1}")
        raise Preempted(f"{stop.signal or 'a stop signal on another rank'}: saved {checkpointer.last} at {where}; "
                        f"exiting with code {EXIT_PREEMPTED} (requeue); the same command with --resume auto, or "
                        f"--resume {checkpointer.last}, continues exactly")
    checkpointer.finish(strip=not opt.keep_optimizer)
    if info.is_main:
        plots.results()
        log_end_summary(t, state.epoch - t.start.epoch + 1, time.time() - state.t_start)


def validate(t: Training, epoch: int) -> EvalResult | None:
    """The EMA model on the val split, on every rank; --noval validates only the final epoch."""
    final = epoch + 1 == t.opt.epochs
    if t.opt.noval and not final:
        return None
    options = EvalOptions(channels_last=t.opt.channels_last, half=t.val_half,
                          keep_batches=3 if final and not t.opt.noplots else 0)
    return evaluate_model(t.ema.ema, t.val_loader, t.device, t.names, t.info, options, criterion=t.criterion)


@record
def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(parse_opt(argv)))


if __name__ == "__main__":
    sys.exit(cli())
