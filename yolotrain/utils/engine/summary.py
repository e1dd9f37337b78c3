"""What rank 0 says before the first step and after the last: the run's start and end summaries."""
from __future__ import annotations

import torch

from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core import precision
from yolotrain.utils.core.hyp import Hyp, load_hyp
from yolotrain.utils.core.logging import LOGGER, colorstr
from yolotrain.utils.engine.config import DEFAULT_MODEL, SIZE_DEFAULTS
from yolotrain.utils.engine.recipe import RECIPES
from yolotrain.utils.engine.setup import Training
from yolotrain.utils.engine.state import saved_metrics
from yolotrain.utils.engine.plan import BN_BATCH_FLOOR, StepPlan, explain, sync_bn_applies


def log_start_summary(t: Training) -> None:
    """One block before the first step: where, on what, with which data, model and settings."""
    info, opt, plan = t.info, t.cfg, t.plan
    steps, unused = explain(plan, t.optimizer_choice, opt.micro_steps, "micro_steps" in (opt.by_device or []))
    kind = (f"CUDA x {info.world_size} rank(s) on {info.world_size // max(info.local_world_size, 1)} node(s)"
            if t.device.type == "cuda" else f"CPU x {info.world_size} rank(s), {torch.get_num_threads()} threads each")
    lines = [colorstr("Run: ") + f"{t.save_dir} (opt.yaml, hyp.yaml, results.csv, weights/)",
             colorstr("Devices: ") + kind,
             colorstr("Batch: ") + f"global {plan.global_batch} = {info.world_size} x {plan.per_rank_batch} per rank, "
             f"{t.batches_per_epoch} batches per epoch per rank",
             colorstr("Steps: ") + steps,
             colorstr("Data: ") + str(t.data.file)]
    for split, loader in (("train", t.train_loader), ("val", t.val_loader)):
        c = loader.dataset.counts
        lines.append(f"  {split:5} {c['images']} images, {c['instances']} instances, {c['backgrounds']} backgrounds, "
                     f"{c['corrupt']} corrupt")
    mi = t.model_info
    layout = "NHWC (channels-last)" if opt.channels_last else "NCHW"
    numerics = f"{str(precision.amp_dtype(t.device)).removeprefix('torch.')} autocast (--amp)" if t.amp else "fp32"
    lines.append(colorstr("Model: ") + f"{opt.cfg or opt.weights or DEFAULT_MODEL.name}: {mi.layers} layers, "
                 f"{mi.parameters:,} parameters, {mi.gflops:.1f} GFLOPs at {t.imgsz} px, {layout}, {numerics}")
    family = RECIPES[t.step.model.detect.family].hyp
    changed = hyp_changes(t.hyp, load_hyp(family))
    lines.append(colorstr("Hyperparameters: ") + f"{opt.hyp}; " + (
        f"differing from {family.name}: " + ", ".join(f"{k}={v:g} ({d:g})" for k, (v, d) in changed.items())
        if changed else f"the family's defaults ({family.name})"))
    c = t.optimizer_choice
    lines.append(colorstr("Optimizer: ") + f"{c.name} lr {c.lr:g}, momentum {c.momentum:g}, warmup {t.step.lr.warmup.iters} "
                 f"{'optimizer steps' if plan.parts > 1 else 'iterations'} (bias lr from "
                 f"{c.warmup_bias_lr:g}); {c.reason}")
    epoch, batches = t.state.epoch, t.state.batches_done
    where = f"epoch {epoch + 1}" + (f", batch {batches + 1}" if batches else "")
    plan = (f"for {opt.time:g} h (--time: the epochs that fit, refitted after each epoch; {t.state.epochs} planned until "
            "the first is timed)" if opt.time else f"{t.state.epochs} epochs")
    lines.append(f"Training {plan} of {t.imgsz} px images" + (f", resuming at {where}" if epoch or batches else "")
                 + sizing_note(opt))
    LOGGER.info("\n".join(lines))
    if unused and not t.state.resumed:
        LOGGER.warning(unused)
    small = small_batch_warning(t.plan, sync_bn_applies(opt.sync_bn, info, t.device))
    if small:
        LOGGER.warning(small)


def small_batch_warning(plan: StepPlan, sync_bn: bool) -> str | None:
    """The start's warning when each of several ranks normalises over fewer than BN_BATCH_FLOOR images (a global
    --batch-size, such as the default 16, spread over many GPUs), and what to do; None otherwise."""
    world_size = plan.world_size
    if world_size < 2 or sync_bn or plan.per_rank_batch >= BN_BATCH_FLOOR:
        return None
    return (f"WARNING: each rank's batch is {plan.per_rank_batch} images (global --batch-size {plan.global_batch} "
            f"over {world_size} ranks): BatchNorm's statistics from so few images are noisy and can cost accuracy. "
            f"Give at least {BN_BATCH_FLOOR} per rank (--batch-size {BN_BATCH_FLOOR * world_size}), or --sync-bn on "
            "CUDA to normalise over every rank's images")


def sizing_note(opt) -> str:
    """Which --imgsz/--epochs defaults applied (a fresh run that left one out), and why."""
    demo, yours = (f"{SIZE_DEFAULTS[k]['imgsz']} px, {SIZE_DEFAULTS[k]['epochs']} epochs"
                   for k in ("demo", "your data"))
    if opt.sized_for == "demo":
        return f" (the built-in demo's defaults: {demo}; your own --data defaults to {yours})"
    if opt.sized_for == "your data":
        return f" (defaults for your own data, as YOLOv5 and Ultralytics: {yours}; --imgsz, --epochs to change)"
    return ""


def hyp_changes(hyp: Hyp, baseline: Hyp | None = None) -> dict[str, tuple[float, float]]:
    """Hyperparameters that differ from ``baseline`` (the built-in defaults when None): name -> (value, baseline)."""
    default = (baseline or Hyp()).as_dict()
    return {k: (v, default[k]) for k, v in hyp.as_dict().items() if v != default[k]}


def log_end_summary(t: Training, epochs_done: int, seconds: float) -> None:
    """Time, the best epoch and its metrics, where the files are, and the val.py command that repeats them."""
    weights = t.weights_dir
    best, last = weights / "best.pt", weights / "last.pt"
    m = saved_metrics(best)
    scores = (f": P {m['mp']:.3f} R {m['mr']:.3f} mAP50 {m['map50']:.4f} mAP50-95 {m['map']:.4f}" if m else "")
    pictures = sorted(p.name for p in t.save_dir.iterdir() if p.suffix in (".png", ".jpg"))
    LOGGER.info(f"\n{epochs_done} epochs completed in {seconds / 3600:.3f} hours ({seconds:.0f} s); best epoch "
                f"{t.state.stopper.best_epoch + 1}{scores}\nCheckpoints: {best}, {last}\n"
                f"Results: {t.save_dir / 'results.csv'}"
                + (f"\nPlots in {t.save_dir}: {', '.join(pictures)}" if pictures else "")
                + f"\nReproduce the best epoch's metrics with:\n"
                f"  {tool_command('val')} --weights {best} --data {t.data.file} --imgsz {t.imgsz} "
                f"--batch-size {t.cfg.val_batch_size}" + (" --half" if t.val_half else ""))
