#!/usr/bin/env python
"""What each --micro-steps rule costs a GPU run: its optimizer steps and its images, counted by the plan the
trainer builds, and the seconds they take at a GPU's measured cost per step and per image.

    python bench/step_cost.py                                     # 800 images, 30 epochs, batch 64 and 128
    python bench/step_cost.py --images 800 --epochs 30 --batch-size 64 --rules on off 32

Why: on a GPU each optimizer step has a fixed cost (launches, the loss's assignment, the optimizer, the EMA, the
host's Python) beside the cost of its images, so rules that train the same images in more steps cost more; on a
CPU a step costs its images and every rule costs the same. The steps are counted by the code a run uses
(``recipe.short_run_adamw`` with ``StepPlan``, one rank, yolov8n's family at 11 classes), not by a formula
here. The default costs are H100 host 3's (docs/benchmarks.md, "GPU training": yolov8n at 640 px, batch 64,
one step per batch at 922.2 images/s and micro-steps of 16 at 271.8): a batch of 64 took 69.4 ms in one step
and 235.5 ms in four, so each step costs (235.5 - 69.4) / 3 = 55.4 ms beside (69.4 - 55.4) / 64 = 0.219 ms per
image. Pass --step-ms and --image-ms for another GPU's figures (gpu_checks.sh's micro_steps stage measures
them). The seconds are those two figures applied to the counts, not a timing.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from yolotrain.utils.core.cli import ArgumentParser, Range, WordOrRange  # noqa: E402
from yolotrain.utils.core.dist import BatchSplit  # noqa: E402
from yolotrain.utils.core.hyp import Hyp  # noqa: E402
from yolotrain.utils.engine.config import micro_step_images  # noqa: E402
from yolotrain.utils.engine.plan import BN_BATCH_FLOOR, StepPlan  # noqa: E402
from yolotrain.utils.engine.recipe import RECIPES  # noqa: E402

STEP_MS, IMAGE_MS = 55.4, 0.219  # H100 host 3, yolov8n, 640 px (the docstring's derivation)
RULES = ("on", "off")


def steps_and_images(rule: str, images: int, epochs: int, batch: int, nc: int = 11) -> tuple[int, int, str]:
    """One rank's optimizer steps and images over the run under --micro-steps ``rule``, and its lr."""
    split = BatchSplit(batch, 1)
    choice = RECIPES["anchor-free"].optimizer("auto", Hyp(), nc, images, split, epochs,
                                              step_images=micro_step_images(rule))
    plan = StepPlan.of(split, choice.nominal_batch, choice.steps_per_batch, images)
    # a cut batch takes a step per part (its warmup ticks), a whole one a step per batch (no accumulation above 16)
    per_epoch = plan.ticks_per_epoch if plan.parts > 1 else math.ceil(plan.batches_per_epoch / plan.accumulate)
    return per_epoch * epochs, images * epochs, f"{choice.lr:g}"


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=Range(int, min=1), default=800, help="training images per epoch")
    p.add_argument("--epochs", type=Range(int, min=1), default=30)
    p.add_argument("--batch-size", type=Range(int, min=1), nargs="+", default=[64, 128], help="global batch(es)")
    p.add_argument("--rules", type=WordOrRange(RULES, Range(int, min=BN_BATCH_FLOOR)), nargs="+", default=list(RULES),
                   help="--micro-steps values to count (on, off, or N images a step)")
    p.add_argument("--step-ms", type=Range(float, min=0), default=STEP_MS, help="a GPU's fixed cost per step, ms")
    p.add_argument("--image-ms", type=Range(float, min=0), default=IMAGE_MS, help="its cost per image, ms")
    opt = p.parse_args(argv)
    print(f"{opt.images} images, {opt.epochs} epochs, one rank; GPU cost {opt.step_ms:g} ms per step + "
          f"{opt.image_ms:g} ms per image")
    print(f"{'batch':>5}  {'rule':<6} {'steps':>6} {'images':>8} {'GPU s':>7} {'x off':>6}  lr")
    for batch in opt.batch_size:
        asked = dict.fromkeys(opt.rules)  # in order, once each; "off" is counted too, the ratio's base
        rows = {rule: steps_and_images(rule, opt.images, opt.epochs, batch) for rule in {**asked, "off": None}}
        seconds = {rule: (steps * opt.step_ms + images * opt.image_ms) / 1000
                   for rule, (steps, images, _) in rows.items()}
        for rule in asked:
            (steps, images, lr), s = rows[rule], seconds[rule]
            ratio = f"{s / seconds['off']:.2f}" if seconds["off"] else "-"
            print(f"{batch:>5}  {rule:<6} {steps:>6} {images:>8} {s:>7.1f} {ratio:>6}  {lr}")


if __name__ == "__main__":
    main()
