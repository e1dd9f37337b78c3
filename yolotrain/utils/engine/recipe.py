"""One recipe per model family: what a family trains with when the run does not say otherwise.

A head class names its family (``Head.family``: anchor-based, anchor-free, end-to-end); its ``Recipe`` is
everything the engine, tune and the start summary ask of a family: the default hyp file (the loss gains
are on each family's own scale), the default search space, whether autoanchor runs, and --optimizer
auto's rule. Adding a family is one Recipe here plus its head in models/heads.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from yolotrain.models.parse import load_model_yaml
from yolotrain.models.registry import head_class
from yolotrain.utils.core.dist import BatchSplit
from yolotrain.utils.core.fileio import ROOT
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.engine.optim import NOMINAL_BATCH, SHORT_RUN_BATCH, OptimizerChoice
from yolotrain.utils.engine.plan import BN_BATCH_FLOOR, images_per_step

AUTO_SGD_ITERATIONS = 10_000  # --optimizer auto: longer schedules (in nominal-batch steps) use SGD
SHORT_LR_GAIN = 4.0  # the short-run AdamW LR over Ultralytics' 0.002 * 5 / (4 + nc) (docs/training.md)
SHORT_LR_MAX = 0.004  # no gain lifts a short-run AdamW LR above this (the highest measured, at 11 classes: 0.0053)
MUSGD_CLASS_LR_GAIN = 3.0  # MuSGD trains the class branches at 3x the LR, as Ultralytics 8.4 does

AutoRule = Callable[["Recipe", Hyp, int, int, BatchSplit, int, int], OptimizerChoice]  # recipe, hyp, nc, images,
# the batch split, epochs, step_images


@dataclass(frozen=True)
class Recipe:
    """How one family trains by default."""

    family: str  # Head.family of the heads it trains
    hyp: Path  # default --hyp
    space: Path  # default tune.py --space
    autoanchor: bool  # anchors fitted to the data before training (YOLOv5's check)
    auto: AutoRule  # --optimizer auto
    short_lr_gain: float = 1.0  # the short-run AdamW LR over Ultralytics' rule

    def optimizer(self, requested: str, hyp: Hyp, nc: int, n_images: int, batch: BatchSplit,
                  epochs: int, step_images: int = SHORT_RUN_BATCH) -> OptimizerChoice:
        """Resolve --optimizer: ``auto`` by this family's rule; a named optimizer with the hyp file's lr0,
        momentum and warmup_bias_lr as written, and 64 (MuSGD also gives the head's class branches
        MUSGD_CLASS_LR_GAIN times the LR). ``step_images``: a short run may cut a large batch into
        optimizer steps of that many images (--micro-steps, resolved per device; 0: one step per batch)."""
        if requested != "auto":
            return OptimizerChoice(requested, hyp.lr0, hyp.momentum, hyp.warmup_bias_lr, "as requested",
                                   class_lr_gain=MUSGD_CLASS_LR_GAIN if requested == "MuSGD" else 1.0)
        return self.auto(self, hyp, nc, n_images, batch, epochs, step_images)


def yolov5_sgd(recipe: Recipe, hyp: Hyp, nc: int, n_images: int, batch: BatchSplit, epochs: int,
               step_images: int = SHORT_RUN_BATCH) -> OptimizerChoice:
    """Anchor-based heads: SGD with the hyp file's lr0, momentum and warmup, as YOLOv5 trains."""
    return OptimizerChoice("SGD", hyp.lr0, hyp.momentum, hyp.warmup_bias_lr,
                           "auto: anchor-based head, YOLOv5's SGD recipe with the hyp file's lr0")


def short_run_adamw(recipe: Recipe, hyp: Hyp, nc: int, n_images: int, batch: BatchSplit,
                    epochs: int, step_images: int = SHORT_RUN_BATCH) -> OptimizerChoice:
    """Anchor-free and end-to-end heads. Short schedules (<= AUTO_SGD_ITERATIONS optimizer steps at the
    nominal batch of 64) use AdamW at lr 0.002 * 5 / (4 + nc) (Ultralytics' rule) x the recipe's
    ``short_lr_gain`` (at most SHORT_LR_MAX: from scratch or fine-tuned, such a model is still far from
    fitted after a short schedule at Ultralytics' LR), beta1 0.9 and no bias warmup, which learns much
    faster in few steps, and step every SHORT_RUN_BATCH images instead of
    accumulating to 64: a short run is short of updates, and AdamW's per-parameter step size does not
    grow with the batch, so four times the steps is about four times the learning at the same images/s
    (measured: docs/benchmarks.md, "Against Ultralytics"). A global batch above SHORT_RUN_BATCH is cut
    into micro-steps of ``step_images`` (``steps_per_batch``: an optimizer step per part of each rank's batch;
    16, the batch-16 run's steps, by default on a CPU, where a step's cost is its images; 0, one step per batch,
    on CUDA, where each step has a fixed cost: docs/benchmarks.md, "GPU training"), and what a step sees
    beyond SHORT_RUN_BATCH gives the LR x large_batch_gain, at most SHORT_LR_MAX. Long schedules use SGD
    at lr 0.01, momentum 0.9 with the hyp file's bias warmup and the nominal 64 (Ultralytics 8.3's choice;
    8.4 picks MuSGD there, which --optimizer MuSGD offers)."""
    batch_size = batch.global_batch
    step = max(batch_size, NOMINAL_BATCH)  # the schedule counts steps of 64 images, or of one larger batch
    iterations = math.ceil(n_images / step) * epochs
    if iterations > AUTO_SGD_ITERATIONS:
        return OptimizerChoice("SGD", 0.01, 0.9, hyp.warmup_bias_lr,
                               f"auto: {iterations} steps of {step} images > {AUTO_SGD_ITERATIONS}, a long schedule")
    fit = round(0.002 * 5 / (4 + nc), 6)
    gained = recipe.short_lr_gain != 1.0
    lr = max(fit, min(fit * recipe.short_lr_gain, SHORT_LR_MAX)) if gained else fit
    parts = steps_per_batch(batch, step_images) if step_images else 1
    # a step of one batch, or of a part: below SHORT_RUN_BATCH images a batch accumulates to it at the LR as it is
    gain = large_batch_gain(images_per_step(batch_size, 1, parts))
    lr = max(lr, min(round(lr * gain, 7), SHORT_LR_MAX))
    family = f" x {recipe.short_lr_gain:g} (at most {SHORT_LR_MAX:g})" if gained else ""
    return OptimizerChoice("AdamW", lr, 0.9, 0.0,
                           f"auto: {iterations} steps of {step} images <= {AUTO_SGD_ITERATIONS}, a short schedule; "
                           f"lr 0.002 * 5 / (4 + {nc} classes){family}"
                           + _step_note(batch_size, parts, gain, step_images),
                           nominal_batch=SHORT_RUN_BATCH, steps_per_batch=parts)


def steps_per_batch(batch: BatchSplit, step_images: int = SHORT_RUN_BATCH) -> int:
    """Optimizer steps per batch in a short run: a global batch above ``step_images`` takes one per that many
    images (at SHORT_RUN_BATCH the batch-16 run's steps, measured to learn more in a short schedule than fewer
    steps at a higher LR: docs/benchmarks.md, "Large batches"), as long as each rank's part keeps
    BN_BATCH_FLOOR images. The loader and the host sync still work per batch."""
    return max(1, min(batch.global_batch // max(step_images, 1), batch.per_rank // BN_BATCH_FLOOR))


def large_batch_gain(step_images: float) -> float:
    """The short-run AdamW LR's multiplier for a step of more than SHORT_RUN_BATCH images (global): a run
    takes that many times fewer steps, and the LR grows in proportion (the linear rule; the square root,
    Adam's usual rule, learned less in these few steps: docs/benchmarks.md, "Large batches"). 1 at or below."""
    return max(step_images / SHORT_RUN_BATCH, 1.0)


def _step_note(batch_size: int, parts: int, gain: float, step_images: int = SHORT_RUN_BATCH) -> str:
    """How often the short-run AdamW steps at this global batch, and the LR gain that follows."""
    if batch_size <= SHORT_RUN_BATCH and parts == 1:
        return f"; a step every {SHORT_RUN_BATCH} images, not {NOMINAL_BATCH}, for more updates"
    flag = f"--micro-steps {step_images}" if step_images not in (0, SHORT_RUN_BATCH) else ""
    if parts > 1:
        asked = f"{flag}: " if flag else ""
        split = f"; {parts} optimizer steps per batch of {batch_size} ({asked}a step per {batch_size / parts:g} images)"
    else:
        split = f"; a step every batch of {batch_size} images" + (f" ({flag})" if flag else "")
    if not step_images:
        split += f" (--micro-steps off; on: a step per {SHORT_RUN_BATCH} images)"
    if gain == 1.0:  # steps of SHORT_RUN_BATCH images, or fewer (--micro-steps 8) at the same lr
        return split + (", the batch-16 run's steps" if batch_size / parts >= SHORT_RUN_BATCH
                        else f", at the lr of a step of {SHORT_RUN_BATCH}")
    return split + f", the lr x {gain:g} for the fewer steps, at most {SHORT_LR_MAX:g}"


HYPS = ROOT / "hyps"
RECIPES: dict[str, Recipe] = {r.family: r for r in (
    Recipe("anchor-based", HYPS / "hyp.scratch-low.yaml", HYPS / "tune-space.yaml", autoanchor=True, auto=yolov5_sgd),
    Recipe("anchor-free", HYPS / "hyp.v8.yaml", HYPS / "tune-space.v8.yaml", autoanchor=False, auto=short_run_adamw,
           short_lr_gain=SHORT_LR_GAIN),
    Recipe("end-to-end", HYPS / "hyp.v8.yaml", HYPS / "tune-space.v8.yaml", autoanchor=False, auto=short_run_adamw,
           short_lr_gain=SHORT_LR_GAIN),
)}


def recipe_for(model: str | Path | dict) -> Recipe:
    """The recipe of a model yaml (a path, a size name such as yolov8n.yaml, or its dict): its head's family;
    a yaml whose last row is no registered head is read as YOLOv5's (anchors), as the model builder does."""
    cls = head_class(load_model_yaml(model)[0])
    return RECIPES[cls.family if cls is not None else "anchor-based"]
