#!/usr/bin/env python
"""Train a YOLO detector on a YOLO-format dataset, on one CPU or many GPUs.

    python train.py                                   # built-in shapes dataset, CPU friendly
    torchrun --nproc_per_node 4 train.py --data my.yaml --cfg models/yolov5s.yaml --batch-size 64

The story, top to bottom: arguments -> the resumed run's arguments merged (utils/engine/config.py) ->
devices and process group -> the frozen run config -> everything the run trains with, its state
resumed (utils/engine/setup.py, utils/engine/state.py) -> the epochs (utils/engine/loop.py:
train_one_epoch, a validation on every rank, the results row and checkpoints from rank 0 through
utils/engine/hooks.py) -> one stop reason, acted on here: finish with the end summary, or exit.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from yolotrain.utils.core import dist, precision
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.cli import IMGSZ, SEED, ArgumentParser, Range, WordOrRange, add_cache_flags, add_channels_last_flag, \
    add_device_flags, add_hang_timeout_flag, add_local_rank_flag, add_refused_flags, add_run_folder_flags, \
    add_workers_flag
from yolotrain.utils.core.cpu import tune_malloc
from yolotrain.utils.core.errors import Preempted, UserError, run_entry_point
from yolotrain.utils.core.fileio import RUNS
from yolotrain.utils.core.prologue import RunPrologue
from yolotrain.utils.core.watchdog import Watchdog
from yolotrain.utils.data.config import DEMO_DATA
from yolotrain.utils.data.imgcache import release_ram_caches
from yolotrain.utils.engine.autobatch import BATCH_SIZE
from yolotrain.utils.engine.config import ModelSource, RunConfig, resolve_config, resolve_resume, size_default_help
from yolotrain.utils.engine.faults import check_resumed_data, check_run_folders
from yolotrain.utils.engine.hooks import Hooks, build_hooks
from yolotrain.utils.engine.loop import run_epochs
from yolotrain.utils.engine.preempt import StopRequest
from yolotrain.utils.engine.setup import Training, build_training
from yolotrain.utils.engine.state import SavedRun, StopReason, TrainResult, hand_back, train_result
from yolotrain.utils.engine.plan import BN_BATCH_FLOOR
from yolotrain.utils.engine.summary import log_end_summary, log_start_summary
from yolotrain.utils.engine.track import check_packages
from yolotrain.app.search import Trainer
from yolotrain.app.search.evolve import evolve


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The CLI; every numeric flag is range-checked here, at parse time, on every rank (utils/cli.Range)."""
    p = ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--data", default=str(DEMO_DATA), help="dataset yaml")
    p.add_argument("--cfg", default=None,
                   help="model yaml; a size name such as yolov8n.yaml builds models/yolov8.yaml at scale n (default: the "
                        "--weights checkpoint's model, else yolov8n)")
    p.add_argument("--weights", default=None,
                   help="checkpoint to fine-tune from: yolotrain, YOLOv5 or Ultralytics .pt (matching tensors are "
                        "transferred; nothing is downloaded)")
    p.add_argument("--freeze", nargs="+", type=Range(int, min=0), default=[0],
                   help="freeze the first N layers, or the listed layer indices")
    p.add_argument("--noautoanchor", action="store_true", help="keep the model yaml's anchors")
    p.add_argument("--hyp", default=None,
                   help="hyperparameters yaml (default: hyps/hyp.scratch-low.yaml for anchor heads, hyps/hyp.v8.yaml for "
                        "anchor-free ones)")
    p.add_argument("--epochs", type=Range(int, min=1), default=None,
                   help=f"total training epochs (default: {size_default_help('epochs')})")
    p.add_argument("--batch-size", type=BATCH_SIZE, default=16,
                   help="global batch size, split over all ranks; -1: AutoBatch, the largest that fits every GPU (CUDA)")
    p.add_argument("--imgsz", "--img", "--img-size", type=IMGSZ, default=None,
                   help="train and val image size in pixels, rounded up to the model's stride (default: "
                        f"{size_default_help('imgsz')})")
    p.add_argument("--rect", action="store_true", help="rectangular training batches")
    add_device_flags(p, threads_note=" and at the cores other trainings on the machine leave, fixed for the run")
    add_workers_flag(p)
    p.add_argument("--optimizer", default="auto", choices=("auto", "SGD", "MuSGD", "Adam", "AdamW"),
                   help="auto: SGD for anchor heads (YOLOv5's recipe); for anchor-free heads AdamW with an lr from the "
                        "class count on short schedules, SGD on long ones (the log says which and why); MuSGD: Muon's "
                        "orthogonalised step plus SGD on conv/linear weights, SGD elsewhere")
    p.add_argument("--micro-steps", type=WordOrRange(("auto", "on", "off"), Range(int, min=BN_BATCH_FLOOR)),
                   default="auto",
                   help="a short run's AdamW (--optimizer auto) cuts a batch above 16 into optimizer steps of 16 "
                        "images (on), the batch-16 run's steps, or of N images (a number): more accurate at equal "
                        "epochs, but each step has a fixed cost on a GPU (auto: on for a CPU, where a step costs its "
                        "images, off on CUDA)")
    p.add_argument("--cos-lr", action="store_true", help="cosine LR schedule")
    p.add_argument("--single-cls", action="store_true", help="train multi-class data as single-class")
    p.add_argument("--patience", type=Range(int, min=0), default=100,
                   help="early stop after this many epochs without improvement (0: never)")
    p.add_argument("--val-batch-size", type=Range(int, min=1), default=None,
                   help="validation images per batch over all ranks, like --batch-size (default: twice --batch-size)")
    p.add_argument("--noval", action="store_true", help="only validate the final epoch")
    p.add_argument("--keep-optimizer", action="store_true", help="do not strip the optimizer from best/last.pt at the end")
    p.add_argument("--noplots", action="store_true", help="save no pictures (labels, batches, curves, results)")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm across ranks (CUDA DDP only)")
    add_compute_flags(p)
    add_run_folder_flags(p, RUNS / "train")
    p.add_argument("--seed", type=SEED, default=0, help="global training seed")
    p.add_argument("--evolve", type=Range(int, min=1), nargs="?", const=300, default=None, metavar="N",
                   help="evolve the hyperparameters over N trials, YOLOv5's way (300 when no N): a local Optuna study "
                        "with a genetic sampler in runs/evolve/<name>, writing evolve.csv and hyp_evolve.yaml "
                        "(pip install -r requirements-tune.txt; docs/tuning.md)")
    add_cache_flags(p)
    add_local_rank_flag(p)
    add_stop_and_resume_flags(p)
    add_tracking_flags(p)
    add_refused_flags(p, YOLOV5_REFUSED)
    return p


# YOLOv5 train.py flags this trainer does not take, each with what to type instead (docs/training.md,
# "Coming from YOLOv5"); --img, --noautoanchor, --noval, --noplots, --evolve and the rest are taken as YOLOv5's.
YOLOV5_REFUSED = {
    "--nosave": "last.pt and best.pt are always written (a resume and val.py read them); drop the flag "
                "(--save-period stays off unless given)",
    "--label-smoothing": "set label_smoothing: EPS in the --hyp file (the anchor heads' loss reads it; anchor-free "
                         "heads have no class label smoothing)",
    "--image-weights": "class-weighted image sampling is not available; train without it",
    "--quad": "the quad collate is not available; train at a larger --imgsz, or with --multi-scale",
}


def add_compute_flags(p: argparse.ArgumentParser) -> None:
    """How the step computes: memory format, precision, determinism, compile, image sizes, augmentation's device."""
    add_channels_last_flag(p)
    p.add_argument("--amp", action=argparse.BooleanOptionalAction, default=None,
                   help="mixed precision: fp16 autocast with loss scaling on CUDA, bf16 autocast on CPU (default: on for CUDA "
                        "and for CPUs with native bf16, AMX or AVX512-BF16, where it measured faster; --no-amp for fp32)")
    p.add_argument("--deterministic", action="store_true",
                   help="deterministic CUDA kernels (cuDNN, cuBLAS, torch's index ops): a resumed CUDA run repeats the "
                        "uninterrupted one exactly, at some speed cost (CPU runs are deterministic without it)")
    p.add_argument("--compile", action="store_true", help="torch.compile the training model (the first steps are slow)")
    p.add_argument("--cuda-graphs", action="store_true",
                   help="replay the training forward, loss and backward as CUDA graphs on each rank (fixed input "
                        "shape, an optimizer step per batch): fewer kernel launches for the host per step")
    p.add_argument("--multi-scale", action="store_true", help="vary the training image size by +/- 50%% per step")
    p.add_argument("--augment-on", choices=("auto", "workers", "device"), default="auto",
                   help="where training augmentation draws its pixels: 'workers' (the loader processes, OpenCV) or "
                        "'device' (the training device, torch: the workers only read and pack images); the same draws "
                        "and labels either way (auto: device on CUDA, workers on a CPU)")


def add_tracking_flags(p: argparse.ArgumentParser) -> None:
    """Experiment trackers, opt-in per run, rank 0 only; a tracker that fails only warns (docs/tracking.md)."""
    p.add_argument("--tensorboard", action="store_true",
                   help="TensorBoard event files in the run folder's tensorboard/ (pip install -r requirements-track.txt)")
    p.add_argument("--mlflow", nargs="?", const=True, default=None, metavar="URI",
                   help="log to MLflow: the URI given, else $MLFLOW_TRACKING_URI, else sqlite <project>/mlflow.db "
                        "(pip install -r requirements-track.txt)")


def add_stop_and_resume_flags(p: argparse.ArgumentParser) -> None:
    """When a run saves, stops and continues: --time, checkpoints, NaN recovery, the watchdog, --resume."""
    p.add_argument("--time", type=Range(float, min=0, max=1e6), default=0.0,
                   help="training budget in hours: train the epochs that fit instead of --epochs, the LR schedule and "
                        "close_mosaic fitted to them (0: off)")
    p.add_argument("--save-period", type=Range(int), default=-1,
                   help="also keep weights/epochN.pt every N epochs (< 1: off)")
    p.add_argument("--save-interval", type=Range(float, min=0), default=0.0,
                   help="also save last.pt mid-epoch every this many minutes; a resume skips the batches done (0: off)")
    p.add_argument("--nan-recover", type=Range(int, min=0), default=0,
                   help="on a NaN/inf loss, roll every rank back to the state before the last optimizer step, skip "
                        "the batches since and halve the LR for the rest of the epoch, up to N times (0: stop the run)")
    add_hang_timeout_flag(p)
    p.add_argument("--resume", nargs="?", const=True, default=False,
                   help="resume the latest run, a given last.pt, or 'auto': this run's last.pt if it exists "
                        "(for torchrun --max-restarts), else start it")
    p.add_argument("--allow-changes", action="store_true",
                   help="on --resume, accept arguments that change the training math (data, model, batch, hyp...)")


def main(opt: argparse.Namespace, callbacks: Callbacks | None = None) -> TrainResult:
    """Train as ``opt`` says; ``callbacks`` hear the run's events on rank 0 (the Python API's add_callback)."""
    if getattr(opt, "evolve", None):
        raise UserError("--evolve runs from the command line (python train.py --evolve N); from Python, YOLO.tune")
    # SIGTERM / SIGUSR1 from here on: save mid-epoch and leave (utils/engine/preempt.py); rank, logging and
    # this run's CPU threads, then the device, watchdog and process group (utils/core/prologue.py)
    with StopRequest() as stop, RunPrologue(opt.local_rank, opt.threads, claim=True) as run:
        resume = resolve_resume(opt, defaults=vars(build_parser().parse_args([])))  # the saved run's arguments merged
        check_packages(resume.args)  # --tensorboard, --mlflow: their packages, before anything starts
        device = run.start(resume.args.device, 0, resume.args.hang_timeout)  # the batch: checked in resolve_config
        precision.set_determinism(resume.args.deterministic,
                                  fixed_shapes=not (resume.args.rect or resume.args.multi_scale))
        if device.type == "cpu":
            tune_malloc()  # large CPU tensors stay mapped between batches (utils/core/cpu.py)
        cfg = resolve_config(resume, device, run.info)  # frozen from here: precision, layout, hyp file, run folder
        return train(cfg, run.info, device, resume.saved, stop, run.watch, callbacks, resume.model)


def train(cfg: RunConfig, info: dist.DistInfo, device: torch.device, saved: SavedRun | None, stop: StopRequest,
          watch: Watchdog, callbacks: Callbacks | None = None, source: ModelSource | None = None) -> TrainResult:
    """Build the run, train its epochs, then act on why they ended: finish, or exit for a requeue or a NaN.
    ``source``: a fresh run's model yaml and --weights, read once when the arguments were merged."""
    started = time.time()
    check_run_folders(cfg.save_dir, cfg.cache_dir, info)  # writable, on every rank, before any work
    with watch.phase("setup"):  # the data scan inside names itself ("setup > scan")
        t = build_training(cfg, info, device, saved, started, source)  # data, model, loaders, optimizer, state, DDP
        check_resumed_data(t, saved)  # a resume whose images went missing (or came) since: refused
        hooks = build_hooks(t, callbacks, stop)  # checkpoints, pictures, the epoch's end, events, trackers, --save-interval
    with hooks:  # the trackers close on every end: finished, preempted, failed
        return fit(t, hooks, stop, watch, started)


def fit(t: Training, hooks: Hooks, stop: StopRequest, watch: Watchdog, started: float) -> TrainResult:
    """The epochs, then the stop reason acted on: the end summary, or Preempted / UserError for the entry point."""
    info = t.info
    with watch.phase("setup"):
        hooks.plots.labels(t.train_loader.dataset)
        hooks.checkpointer.clear_preempted()  # this run continues whatever stopped it
    if info.is_main:
        log_start_summary(t)
    hooks.events.emit("on_train_start")
    end = run_epochs(t, hooks, stop, watch)  # phases loader, step, validation, save
    with watch.phase("finish"):
        release_ram_caches(info.local_rank, t.train_loader.dataset.imgcache, t.val_loader.dataset.imgcache)
    if end.reason is StopReason.NAN_BUDGET:
        raise UserError(end.message)
    if end.reason is StopReason.PREEMPTED and stop.faulted:  # a killed loader or a vanished image: fix, resume
        raise UserError(stop.faulted)
    if end.reason is StopReason.PREEMPTED:
        hooks.checkpointer.mark_preempted(end.message)  # <run>/PREEMPTED: what a requeueing batch script tests
        raise Preempted(end.message)
    hooks.checkpointer.finish(strip=not t.cfg.keep_optimizer)
    result = train_result(t.save_dir, end)
    if info.is_main:
        hooks.plots.results()
        log_end_summary(t, end.epochs, time.time() - started)
    hooks.events.emit("on_train_end", path=result.best, metrics=result.metrics)
    return result


@record
def cli(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    opt = parse_opt(argv)
    if opt.evolve:  # YOLOv5's habit: trials of this run's flags (yolotrain/app/search/evolve.py)
        return run_entry_point(lambda: evolve(opt, argv, Trainer(build_parser, main)))
    return run_entry_point(lambda: hand_back(main(opt), dist.dist_info().is_main))


if __name__ == "__main__":
    sys.exit(cli())
