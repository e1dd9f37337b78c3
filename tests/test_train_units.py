"""Small pieces of the training engine that need no training run."""
from __future__ import annotations

import pytest
import torch

from yolotrain.utils.core.dist import BatchSplit
from yolotrain.models.heads.anchor_loss import AnchorLossGains
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.engine.loop import rescale_batch
from yolotrain.utils.engine.config import micro_step_images, resolve_resume
from yolotrain.utils.engine.recipe import RECIPES
from yolotrain.app.train import build_parser


def test_multi_scale_sizes_vary_within_range_on_stride_multiples_and_repeat():
    imgs = torch.zeros(2, 3, 320, 256)
    sizes = [tuple(rescale_batch(imgs, 320, 32, seed=0, epoch=1, i=i).shape[2:]) for i in range(30)]
    assert len(set(sizes)) > 5
    assert all(h % 32 == 0 and w % 32 == 0 and 160 <= max(h, w) <= 480 for h, w in sizes)
    assert sizes == [tuple(rescale_batch(imgs, 320, 32, seed=0, epoch=1, i=i).shape[2:]) for i in range(30)]
    assert sizes != [tuple(rescale_batch(imgs, 320, 32, seed=0, epoch=2, i=i).shape[2:]) for i in range(30)]


def test_loss_gains_scale_with_layers_classes_and_image_size():
    h = AnchorLossGains.from_hyp(Hyp(), nl=3, nc=80, imgsz=640)
    assert (h.box, h.cls, h.obj) == pytest.approx((Hyp().box, Hyp().cls, Hyp().obj))
    h = AnchorLossGains.from_hyp(Hyp(), nl=3, nc=8, imgsz=320)
    assert (h.cls, h.obj) == pytest.approx((Hyp().cls * 8 / 80, Hyp().obj * 0.25))


def test_resumed_lr_schedule_matches_the_uninterrupted_one():
    """Resuming at epoch s must give every later epoch the LR the uninterrupted run gives it."""
    from yolotrain.utils.engine.optim import LRSchedule, Warmup

    def fresh():
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01, momentum=0.9)
        return optimizer, LRSchedule(optimizer, Warmup(iters=0, bias_lr=0.0, momentum0=0.8, momentum=0.9), 10,
                                     lrf=0.01, cos=False)

    opt, lr = fresh()
    straight, saved = [], {}
    for epoch in range(10):
        straight.append(opt.param_groups[0]["lr"])  # the LR this epoch trains with
        lr.next_epoch()
        saved[epoch] = opt.state_dict()  # what the end-of-epoch checkpoint holds
    for s in (1, 4, 9):
        opt2, lr2 = fresh()
        opt2.load_state_dict(saved[s - 1])
        lr2.load_state_dict({}, s)
        resumed = []
        for _ in range(s, 10):
            resumed.append(opt2.param_groups[0]["lr"])
            lr2.next_epoch()
        assert resumed == straight[s:], f"resume at epoch {s}"


@pytest.mark.parametrize("model, family, hyp, space", [
    ("yolov5n.yaml", "anchor-based", "hyp.scratch-low.yaml", "tune-space.yaml"),
    ("yolov5nu.yaml", "anchor-free", "hyp.v8.yaml", "tune-space.v8.yaml"),
    ("yolov8n.yaml", "anchor-free", "hyp.v8.yaml", "tune-space.v8.yaml"),
    ("yolo11n.yaml", "anchor-free", "hyp.v8.yaml", "tune-space.v8.yaml"),
    ("yolo26n.yaml", "end-to-end", "hyp.v8.yaml", "tune-space.v8.yaml"),
    ("yolov10n.yaml", "end-to-end", "hyp.v8.yaml", "tune-space.v8.yaml"),
])
def test_each_model_yaml_gets_its_family_recipe(model, family, hyp, space):
    from yolotrain.models.parse import load_model_yaml
    from yolotrain.models.registry import head_class
    from yolotrain.utils.engine.recipe import recipe_for

    recipe = recipe_for(model)
    assert recipe.family == family == head_class(load_model_yaml(model)[0]).family
    assert (recipe.hyp.name, recipe.space.name, recipe.autoanchor) == (hyp, space, family == "anchor-based")


def test_a_run_reads_its_model_yaml_once(monkeypatch):
    """resolve_model reads the yaml; the recipe and the builder take what it read (with its file named in
    messages)."""
    import yolotrain.models.parse
    from yolotrain.models.yolo import Model
    from yolotrain.utils.engine.config import resolve_model
    from yolotrain.app import train

    reads = []
    real = yolotrain.models.parse.yaml.safe_load
    monkeypatch.setattr(yolotrain.models.parse.yaml, "safe_load", lambda text: reads.append(1) or real(text))
    source = resolve_model(train.build_parser().parse_args(["--cfg", "yolov8n.yaml"]))
    model = Model(source.yaml, nc=2, label=source.label)
    assert len(reads) == 1 and source.recipe.family == "anchor-free" and model.source.endswith("yolov8.yaml")
    assert model.yaml["scale"] == "n"


def test_optimizer_auto_follows_each_family_and_the_schedule_length():
    from yolotrain.utils.engine.recipe import AUTO_SGD_ITERATIONS, RECIPES, SHORT_LR_GAIN, SHORT_LR_MAX
    hyp = Hyp(lr0=0.02, momentum=0.95, warmup_bias_lr=0.2)
    yolov5 = RECIPES["anchor-based"].optimizer("auto", hyp, nc=11, n_images=800, batch=BatchSplit(16, 1), epochs=30)
    assert (yolov5.name, yolov5.lr, yolov5.momentum, yolov5.warmup_bias_lr) == ("SGD", 0.02, 0.95, 0.2)
    short = RECIPES["anchor-free"].optimizer("auto", hyp, nc=11, n_images=800, batch=BatchSplit(16, 1), epochs=30)
    assert (short.name, short.lr, short.momentum, short.warmup_bias_lr) == ("AdamW", 0.000667 * SHORT_LR_GAIN, 0.9, 0.0)
    assert "390 steps of 64 images" in short.reason  # ceil(800 / 64) * 30
    assert "lr 0.002 * 5 / (4 + 11 classes) x 4 (at most 0.004)" in short.reason
    e2e = RECIPES["end-to-end"].optimizer("auto", hyp, nc=11, n_images=800, batch=BatchSplit(16, 1), epochs=30)
    assert (e2e.name, e2e.momentum, e2e.nominal_batch) == ("AdamW", 0.9, 16)
    assert e2e.lr == short.lr  # one short-run rule for both families
    few = RECIPES["anchor-free"].optimizer("auto", hyp, nc=1, n_images=800, batch=BatchSplit(16, 1), epochs=30)
    assert few.lr == SHORT_LR_MAX  # 4 x 0.002 capped
    e2e_long = RECIPES["end-to-end"].optimizer("auto", hyp, nc=80, n_images=640_000, batch=BatchSplit(64, 1), epochs=30)
    assert (e2e_long.name, e2e_long.lr) == ("SGD", 0.01)  # long runs: the anchor-free recipe as it is
    steps_per_epoch = 1000  # 64,000 images at the nominal batch of 64
    epochs = AUTO_SGD_ITERATIONS // steps_per_epoch + 1
    long = RECIPES["anchor-free"].optimizer("auto", hyp, nc=80, n_images=64_000, batch=BatchSplit(64, 1), epochs=epochs)
    assert (long.name, long.lr, long.momentum) == ("SGD", 0.01, 0.9)
    at_limit = RECIPES["anchor-free"].optimizer("auto", hyp, nc=80, n_images=64_000, batch=BatchSplit(16, 1), epochs=epochs - 1)
    assert at_limit.name == "AdamW"
    named = RECIPES["anchor-free"].optimizer("AdamW", hyp, nc=11, n_images=800, batch=BatchSplit(16, 1), epochs=30)
    assert (named.name, named.lr, named.momentum, named.warmup_bias_lr) == ("AdamW", 0.02, 0.95, 0.2)
    # only the short-run AdamW steps every 16 images; the SGD recipes and named optimizers accumulate to 64
    assert short.nominal_batch == 16 and "a step every 16 images" in short.reason
    assert yolov5.nominal_batch == long.nominal_batch == named.nominal_batch == 64


def test_a_short_run_at_a_large_batch_keeps_the_batch_16_steps():
    """A global batch above 16 is cut into micro-steps of 16 images while each rank's part keeps 8 images;
    what a step sees beyond 16 (many ranks, a small batch per rank) raises the AdamW LR in proportion, to at
    most 0.004. The choice is a function of the resolved config alone."""
    from yolotrain.utils.engine.recipe import RECIPES, SHORT_LR_MAX, steps_per_batch
    hyp = Hyp()

    def auto(batch: int, ranks: int = 1, family: str = "anchor-free", nc: int = 11):
        return RECIPES[family].optimizer("auto", hyp, nc=nc, n_images=800, batch=BatchSplit(batch, ranks), epochs=30)

    assert [steps_per_batch(BatchSplit(b, 1)) for b in (8, 16, 32, 64, 128, 256)] == [1, 1, 2, 4, 8, 16]
    assert [steps_per_batch(BatchSplit(128, r)) for r in (1, 2, 4, 8, 16)] == [8, 8, 4, 2, 1]
    assert len({auto(b).lr for b in (8, 16, 32, 64, 128, 256)}) == 1  # every step sees 16 images
    assert (auto(64).steps_per_batch, auto(16).steps_per_batch, auto(8).steps_per_batch) == (4, 1, 1)
    spread = auto(128, ranks=8, nc=80)  # 16 per rank: 2 steps of 64 images
    assert (spread.steps_per_batch, spread.lr) == (2, 0.001904)  # 0.002 * 5 / 84 = 0.000119, x 4, x 4
    assert "2 optimizer steps per batch of 128 (a step per 64 images), the lr x 4 for the fewer steps" in spread.reason
    assert auto(256, ranks=32, nc=80).lr == SHORT_LR_MAX  # 8 per rank, one step of 256 images: x 16, capped
    assert "8 optimizer steps per batch of 128 (a step per 16 images), the batch-16 run's steps" in auto(128).reason
    assert auto(64, family="end-to-end", nc=1).lr == SHORT_LR_MAX  # already at the cap
    assert auto(128, ranks=8, nc=80) == spread
    sgd = RECIPES["anchor-based"].optimizer("auto", hyp, nc=11, n_images=800, batch=BatchSplit(128, 8), epochs=30)
    assert (sgd.lr, sgd.steps_per_batch) == (hyp.lr0, 1)  # YOLOv5's SGD recipe is unchanged


def test_micro_steps_are_on_for_a_cpu_and_off_on_cuda_unless_asked():
    """--micro-steps auto resolves by the device (a CUDA step has a fixed cost, a CPU step costs its images);
    off, a short run's large batch is one AdamW step at the linear lr gain, which the reason names."""
    from yolotrain.utils.engine.config import micro_steps_default
    from yolotrain.utils.engine.recipe import RECIPES
    assert micro_steps_default("auto", torch.device("cpu")) == "on"
    assert micro_steps_default("auto", torch.device("cuda", 0)) == "off"
    assert micro_steps_default("on", torch.device("cuda", 0)) == "on"
    assert micro_steps_default("off", torch.device("cpu")) == "off"
    rule = RECIPES["anchor-free"]
    on = rule.optimizer("auto", Hyp(), nc=80, n_images=800, batch=BatchSplit(64, 1), epochs=30, step_images=16)
    off = rule.optimizer("auto", Hyp(), nc=80, n_images=800, batch=BatchSplit(64, 1), epochs=30, step_images=0)
    assert (on.steps_per_batch, off.steps_per_batch) == (4, 1)
    assert off.lr == round(on.lr * 4, 7)  # 64 images a step: the linear rule
    assert "a step every batch of 64 images (--micro-steps off; on: a step per 16 images)" in off.reason
    small = rule.optimizer("auto", Hyp(), nc=80, n_images=800, batch=BatchSplit(16, 1), epochs=30, step_images=0)
    assert small == rule.optimizer("auto", Hyp(), nc=80, n_images=800, batch=BatchSplit(16, 1), epochs=30)  # nothing to cut


def test_cuda_s_default_plan_is_the_cpu_s_micro_steps_off_and_differs_from_the_cpu_default():
    """The stated difference between devices: at global batch 64 a CPU's --micro-steps auto cuts each batch into
    four AdamW steps of 16 at lr 0.002668, CUDA's takes one step per batch at 0.004; CUDA's choice and plan are
    exactly what --micro-steps off gives a CPU run, so a GPU user's default can be trained on a CPU. At batch 16
    the two devices train the same steps."""
    from yolotrain.utils.engine.config import micro_steps_default
    from yolotrain.utils.engine.plan import StepPlan

    def plan(flag: str, device: str, batch: int = 64):
        resolved = micro_steps_default(flag, torch.device(device))
        choice = RECIPES["anchor-free"].optimizer("auto", Hyp(), nc=11, n_images=800, batch=BatchSplit(batch, 1),
                                                  epochs=30, step_images=micro_step_images(resolved))
        return choice, StepPlan.of(BatchSplit(batch, 1), choice.nominal_batch, choice.steps_per_batch, 800)

    assert plan("auto", "cuda") == plan("off", "cpu")
    (cpu, cpu_plan), (cuda, cuda_plan) = plan("auto", "cpu"), plan("auto", "cuda")
    assert (cpu.lr, cpu_plan.parts, cpu_plan.images_per_step) == (0.002668, 4, 16)
    assert (cuda.lr, cuda_plan.parts, cuda_plan.images_per_step) == (0.004, 1, 64)
    assert plan("auto", "cpu", 16) == plan("auto", "cuda", 16)


def test_micro_steps_of_n_images_cut_a_large_batch_into_steps_of_n():
    """--micro-steps N: a short run's batch above N takes one AdamW step per N images (each rank's part keeping
    8), the lr x N / 16 as a batch of N stepping once; the reason names the flag. Below 8, or a word it does
    not know, the flag is refused with the allowed values."""
    parser = build_parser()
    assert [micro_step_images(parser.parse_args(["--micro-steps", v]).micro_steps)
            for v in ("on", "off", "64")] == [16, 0, 64]
    for bad in ("4", "sometimes"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--micro-steps", bad])
    rule = RECIPES["anchor-free"]

    def auto(batch: int, step_images: int, ranks: int = 1):
        return rule.optimizer("auto", Hyp(), nc=80, n_images=800, batch=BatchSplit(batch, ranks), epochs=30,
                              step_images=step_images)

    one = auto(64, 0)
    assert [auto(b, 64).steps_per_batch for b in (32, 64, 128, 256)] == [1, 1, 2, 4]
    assert auto(128, 64).lr == auto(256, 64).lr == one.lr  # every step sees 64 images, as batch 64's one step
    assert auto(128, 64, ranks=8).steps_per_batch == 2  # 16 per rank: parts of 8
    assert auto(128, 64, ranks=16).steps_per_batch == 1  # 8 per rank: one part
    assert "2 optimizer steps per batch of 128 (--micro-steps 64: a step per 64 images)" in auto(128, 64).reason
    eights = auto(16, 8)  # smaller steps than the rule's 16 keep its lr
    assert (eights.steps_per_batch, eights.lr) == (2, auto(16, 16).lr)
    assert "2 optimizer steps per batch of 16 (--micro-steps 8: a step per 8 images), at the lr of a step of 16" \
        in eights.reason


def test_a_step_plan_cuts_batches_into_the_batch_16_runs_steps():
    """Micro-steps of 16 at batch 64: 800 images take 50 steps an epoch, the short last batch of 32 two of 16,
    and the warmup ticks run through them one for one as the batch-16 run's batches; without micro-steps a
    tick is a batch."""
    from yolotrain.utils.engine.plan import StepPlan
    plan = StepPlan.of(BatchSplit(64, 1), 16, 4, 800)
    assert (plan.parts, plan.part, plan.ticks_per_epoch, plan.batches_per_epoch) == (4, 16, 50, 13)
    assert (plan.accumulate, plan.images_per_step, plan.images_per_tick) == (1, 16, 16)
    assert plan.slices(64) == [slice(0, 16), slice(16, 32), slice(32, 48), slice(48, 64)]
    assert plan.slices(32) == [slice(0, 16), slice(16, 32)]  # the epoch's last batch, as two of batch 16's
    assert [s.stop - s.start for s in plan.slices(20)] == [10, 10] and plan.slices(3) == [slice(0, 3)]
    assert [plan.tick(1, i, j) for i, j in ((0, 0), (0, 3), (1, 0), (12, 1))] == [50, 53, 54, 99]
    assert sorted(s.stop - s.start for s in StepPlan.of(BatchSplit(100, 1), 16, 6, 100).slices(100)) == [16, 16, 17, 17, 17, 17]
    whole = StepPlan.of(BatchSplit(16, 1), 16, 1, 800)
    assert (whole.parts, whole.ticks_per_epoch, whole.slices(16), whole.tick(2, 5)) == (1, 50, [slice(0, 16)], 105)
    assert StepPlan.of(BatchSplit(16, 1), 16, 1, 801).ticks_per_epoch == 51  # a last batch of one image is a tick too
    two = StepPlan.of(BatchSplit(128, 2), 16, 4, 400)  # two ranks: each cuts its 64 into four parts
    assert (two.per_rank_batch, two.parts, two.part, two.batches_per_epoch, two.images_per_step) == (64, 4, 16, 7, 32)


def test_accumulation_follows_the_chosen_step_size():
    """SGD gathers 64 images a step, the short run's AdamW 16; the plan and the summary read images per step from
    one place."""
    from yolotrain.utils.engine.plan import StepPlan, accumulate_steps
    assert [accumulate_steps(b, 64) for b in (1, 8, 16, 32, 64, 128)] == [64, 8, 4, 2, 1, 1]
    assert [accumulate_steps(b, 16) for b in (1, 4, 8, 16, 64)] == [16, 4, 2, 1, 1]
    sgd = StepPlan.of(BatchSplit(16, 1), 64, 1, 800)
    assert (sgd.accumulate, sgd.images_per_step, sgd.images_per_tick) == (4, 64, 16)
    assert sgd.describe() == "accumulate 4 (a step per 64 images)"
    assert StepPlan.of(BatchSplit(64, 1), 16, 4, 800).describe() == "4 optimizer steps per batch (a step per 16 images)"
    assert {k: sgd.record()[k] for k in ("global_batch", "per_rank_batch", "images_per_step")} == {
        "global_batch": 16, "per_rank_batch": 16, "images_per_step": 64}


def test_a_resume_keeps_the_runs_optimizer_choice():
    """More --epochs on resume could flip the auto rule; the checkpoint's choice wins."""
    from dataclasses import asdict

    from pathlib import Path

    from yolotrain.utils.engine.recipe import RECIPES
    from yolotrain.utils.engine.state import SavedRun
    choice = RECIPES["anchor-free"].optimizer("auto", Hyp(), nc=3, n_images=100, batch=BatchSplit(16, 1), epochs=10)
    assert SavedRun(Path("last.pt"), {"optimizer_choice": asdict(choice)}).optimizer_choice == choice
    saved_before = {k: v for k, v in asdict(choice).items() if k != "nominal_batch"}  # runs before the short-run step
    assert SavedRun(Path("last.pt"), {"optimizer_choice": saved_before}).optimizer_choice.nominal_batch == 64
    assert SavedRun(Path("last.pt"), {"epoch": 3}).optimizer_choice is None  # runs before --optimizer auto


def test_resume_of_a_converted_foreign_checkpoint_points_to_weights(tmp_path):
    from yolotrain.app import train
    from yolotrain.utils.core.errors import UserError

    path = tmp_path / "yolov5s.pt"
    torch.save({"model_yaml": {}, "model": {}, "converted_from": {"package": "yolov5"}}, path)
    opt = train.parse_opt(["--resume", str(path)])
    with pytest.raises(UserError, match="no training state to resume; fine-tune from it with --weights"):
        resolve_resume(opt, vars(train.build_parser().parse_args([])))


def test_amp_default_follows_the_device_and_a_flag_wins(monkeypatch):
    """--amp unset: on for CUDA, and on CPU only where bf16 is native hardware (else emulated and
    slower); a run resumed from before the flag existed keeps its fp32 CPU math."""
    from yolotrain.utils.core import precision
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for native in (True, False):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda native=native: native)
        assert precision.amp_default(None, cpu) is native
        assert precision.amp_default(None, cpu, legacy=True) is False
        assert precision.amp_default(None, cuda) is True and precision.amp_default(None, cuda, legacy=True) is True
        assert precision.amp_default(False, cuda) is False and precision.amp_default(True, cpu, legacy=True) is True
    assert precision.amp_dtype(cpu) == torch.bfloat16 and precision.amp_dtype(cuda) == torch.float16


def test_warmup_is_yolov5s_but_at_most_a_tenth_of_a_run_above_its_floor():
    from yolotrain.utils.engine.optim import warmup_iters

    assert warmup_iters(3.0, 63, 30) == 189  # 30 epochs or more: YOLOv5's 3 epochs
    assert warmup_iters(3.0, 63, 100) == 189
    assert warmup_iters(3.0, 20, 100) == 100  # its 100-batch floor
    assert warmup_iters(3.0, 250, 8) == 200  # an 8-epoch run: a tenth, not three eighths of it
    assert warmup_iters(3.0, 63, 8) == 100  # a tenth would be 50: the floor holds
    assert warmup_iters(3.0, 2, 1) == 100  # a tiny run warms up throughout, as in YOLOv5
    assert warmup_iters(3.0, 63, None) == 189  # --time: the run's length is unknown
    # the floor counts images: 100 batches of 16, so 25 batches of 64 and 7 of 256
    assert warmup_iters(3.0, 13, 30, batch_size=64) == 39  # 3 epochs of 800 images, not 8 epochs
    assert warmup_iters(3.0, 4, 30, batch_size=256) == 12 and warmup_iters(3.0, 2, 3, batch_size=256) == 7
    assert warmup_iters(3.0, 2, 1, batch_size=8) == 100


def test_the_summary_says_how_a_batch_becomes_steps_and_why_and_names_an_unused_flag():
    """One line per run on how a batch becomes optimizer steps on this device and why; a --micro-steps the run's
    optimizer does not use is said at start, never silently ignored (an auto one, resolved by the device, is not)."""
    from yolotrain.utils.engine.plan import StepPlan, explain
    hyp, rule = Hyp(), RECIPES["anchor-free"]
    short = rule.optimizer("auto", hyp, nc=80, n_images=800, batch=BatchSplit(64, 1), epochs=30, step_images=16)
    line, unused = explain(StepPlan.of(BatchSplit(64, 1), 16, short.steps_per_batch, 800), short, "on", by_device=True)
    assert line.startswith("4 optimizer steps per batch (a step per 16 images) at global batch 64: the short run's "
                           "AdamW takes the batch-16 run's steps") and "on for a CPU" in line and unused is None
    off = rule.optimizer("auto", hyp, nc=80, n_images=800, batch=BatchSplit(64, 1), epochs=30, step_images=0)
    line, _ = explain(StepPlan.of(BatchSplit(64, 1), 16, off.steps_per_batch, 800), off, "off", by_device=True)
    assert line.endswith("one AdamW step per batch (--micro-steps auto: off on CUDA, where each step has a fixed "
                         "cost; on takes the batch-16 run's steps)")
    sgd = rule.optimizer("SGD", hyp, nc=80, n_images=800, batch=BatchSplit(64, 1), epochs=30)
    line, unused = explain(StepPlan.of(BatchSplit(64, 1), 64, 1, 800), sgd, "on", by_device=False)
    assert line.endswith("SGD gathers 64 images a step")
    assert unused.startswith("WARNING: --micro-steps on has no effect") and "this run trains SGD" in unused
    assert explain(StepPlan.of(BatchSplit(64, 1), 64, 1, 800), sgd, "on", by_device=True)[1] is None  # auto: nobody asked


def test_a_rank_batch_too_small_for_batchnorm_is_said_at_start_with_what_to_do():
    """The default global --batch-size 16 on 8 GPUs is 2 images per rank: said, with the batch or --sync-bn to
    use; one process, 8 images a rank, or SyncBatchNorm in use say nothing."""
    from yolotrain.utils.engine.plan import StepPlan
    from yolotrain.utils.engine.summary import small_batch_warning
    warning = small_batch_warning(StepPlan.of(BatchSplit(16, 8), 64, 1, 100), sync_bn=False)
    assert warning == ("WARNING: each rank's batch is 2 images (global --batch-size 16 over 8 ranks): BatchNorm's "
                       "statistics from so few images are noisy and can cost accuracy. Give at least 8 per rank "
                       "(--batch-size 64), or --sync-bn on CUDA to normalise over every rank's images")
    assert small_batch_warning(StepPlan.of(BatchSplit(16, 8), 64, 1, 100), sync_bn=True) is None
    assert small_batch_warning(StepPlan.of(BatchSplit(64, 8), 64, 1, 100), sync_bn=False) is None
    assert small_batch_warning(StepPlan.of(BatchSplit(4, 1), 64, 1, 100), sync_bn=False) is None
