"""Building a training run: one place that turns the resolved config into everything the loop needs.

``build_training`` is used by train.py and by the bench scripts, so what they measure is what
trains. Its stages run in a fixed order (run folder, data, model, loaders, anchors, the step plan, the step and
its parts, the run state, both resumed) because each consumes the previous ones' results.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from yolotrain.models.yolo import Model, ModelInfo, round_to_stride
from yolotrain.utils.core import dist
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.hyp import Hyp, load_hyp
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.config import DataConfig, load_data_config, prepare_dataset
from yolotrain.utils.data.dataset import DatasetSpec
from yolotrain.utils.data.loader import LoaderSpec, build_loader
from yolotrain.utils.engine.autoanchor import anchors_per_level, fit_anchors
from yolotrain.utils.engine.budget import TimeBudget
from yolotrain.utils.engine.config import ModelSource, RunConfig, choose_optimizer, resolve_model
from yolotrain.utils.engine.optim import NOMINAL_BATCH, EarlyStopping, LRSchedule, ModelEMA, OptimizerChoice, Warmup, \
    smart_optimizer, warmup_iters
from yolotrain.utils.engine.recipe import RECIPES
from yolotrain.utils.engine.state import RunRecord, RunState, SavedRun, make_checkpoint, mosaic_off_from
from yolotrain.utils.engine.plan import StepPlan
from yolotrain.utils.engine.step import Step, StepExtra, StepOptions, StepParts, build_step
from yolotrain.utils.weights.checkpoint import to_plain


@dataclass
class Training:
    """The run's fixed context, built once: what it trains on, where it writes, its step and its state. What
    changes as it trains lives in ``step`` (model, EMA, optimizer, GradScaler, LR schedule, running loss) and in
    ``state`` (the cursor and the loop's components), one owner each."""

    cfg: RunConfig
    info: DistInfo
    device: torch.device
    save_dir: Path
    hyp: Hyp
    data: DataConfig
    names: list[str]
    model_info: ModelInfo
    optimizer_choice: OptimizerChoice
    step: Step  # how a batch becomes optimizer steps, and what they change (utils/engine/step.py)
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    imgsz: int
    grid: int  # the largest stride (at least 32): image sizes are multiples of it
    memory_format: torch.memory_format
    state: RunState  # where the run stands, and the loop's components

    @property
    def plan(self) -> StepPlan:
        return self.step.plan

    @property
    def batches_per_epoch(self) -> int:
        """Per rank, a whole epoch (a resumed epoch's loader yields fewer)."""
        return self.plan.batches_per_epoch

    @property
    def weights_dir(self) -> Path:
        return self.save_dir / "weights"

    @property
    def amp(self) -> bool:
        """Autocast in precision.amp_dtype(device): fp16 on CUDA, bf16 on CPU."""
        return bool(self.cfg.amp)

    @property
    def val_half(self) -> bool:
        """Validation in training runs in the run's precision: bf16 autocast on CPU, fp16 weights on CUDA
        under --amp (recorded in checkpoints, so val.py --half repeats the logged metrics)."""
        return self.amp

    def checkpoint(self) -> dict:
        """The run state, the step's and the run's record, as a checkpoint file holds them (utils/engine/state.py)."""
        record = RunRecord(model_yaml=self.step.model.yaml, optimizer_choice=self.optimizer_choice,
                           step=self.plan.record(), seed=self.cfg.seed, world_size=self.info.world_size,
                           hyp=self.hyp.as_dict(), args={**self.cfg.as_dict(), "epochs": self.state.epochs,
                                                         "imgsz": self.imgsz},
                           names=list(self.names),
                           val_precision=("fp16" if self.device.type == "cuda" else "bf16") if self.val_half else "fp32")
        return make_checkpoint(self.state, self.step, record)


STEP_EXTRAS: list[Callable[[nn.Module], StepExtra]] = []  # further stateful step parts: a builder each, from the model


def build_training(cfg: RunConfig, info: DistInfo, device: torch.device, saved: SavedRun | None = None,
                   started: float | None = None, source: ModelSource | None = None) -> Training:
    """Run folder -> data -> model -> loaders -> anchors -> plan -> the step and its parts -> run state (resumed).
    ``source``: a fresh run's model yaml and --weights as read by resolve_resume (read here when not given)."""
    source = None if saved else source or resolve_model(cfg)
    # the family's defaults (utils/engine/recipe.py); runs saved before the optimizer choice was recorded trained
    # with YOLOv5's SGD, the one rule there was
    recipe = RECIPES["anchor-based"] if saved else source.recipe
    hyp = Hyp(**saved.hyp) if saved else load_hyp(cfg.hyp)
    na = anchors_per_level(hyp.anchors, cfg.hyp, cfg.noautoanchor) if not saved and recipe.autoanchor else None
    save_dir = make_run_dir(cfg, info, hyp, resumed=saved is not None)
    data, names = load_data(cfg, info)
    model = build_model(cfg, saved, source, len(names), data.anchors, na, device)
    imgsz = round_to_stride(cfg.imgsz, model.grid)
    model_info = model.info(imgsz)  # GFLOPs at the size trained
    batch = dist.batch_split(cfg.batch_size, info)
    train_loader, val_loader = build_loaders(cfg, info, data, hyp, imgsz, model.grid, batch, save_dir, device)
    if not saved and not cfg.noautoanchor and recipe.autoanchor:  # before EMA and DDP copy the model
        fit_anchors(model, train_loader.dataset, hyp, imgsz, cfg.seed, info, force=na is not None)
    choice = (saved and saved.optimizer_choice) or choose_optimizer(cfg, recipe, hyp, len(names), data, batch)
    plan = StepPlan.of(batch, choice.nominal_batch, choice.steps_per_batch, train_loader.sampler.num_samples)
    step = build_step(build_parts(cfg, hyp, model, choice, plan, imgsz, device), plan, info, device,
                      StepOptions(amp=bool(cfg.amp), graphs=cfg.cuda_graphs, sync_bn=cfg.sync_bn, compile=cfg.compile),
                      nan_recover=cfg.nan_recover, extras=[build(model) for build in STEP_EXTRAS])
    state = RunState(epochs=cfg.epochs, device=device, sampler=train_loader.sampler,
                     stopper=EarlyStopping(patience=cfg.patience), clock=TimeBudget(cfg.time, started))
    if saved:
        state.load_state_dict(saved.ckpt, restore_mosaic=bool(cfg.time))  # --time had moved close_mosaic
        step.load_state_dict(saved.ckpt, state.epoch, state.batches_done)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    return Training(cfg=cfg, info=info, device=device, save_dir=save_dir, hyp=hyp, data=data, names=names,
                    model_info=model_info, optimizer_choice=choice, step=step, train_loader=train_loader,
                    val_loader=val_loader, imgsz=imgsz, grid=model.grid, memory_format=memory_format, state=state)


def build_parts(cfg: RunConfig, hyp: Hyp, model: nn.Module, choice: OptimizerChoice, plan: StepPlan, imgsz: int,
                device: torch.device) -> StepParts:
    """What the step changes: the criterion, the optimizer with its decay per image, the EMA, the GradScaler,
    the warmup and LR schedule."""
    decay = hyp.weight_decay * plan.images_per_step / NOMINAL_BATCH  # the same decay per image at any step size
    optimizer = smart_optimizer(model, choice.name, choice.lr, choice.momentum, decay,
                                model.detect.class_branches(), choice.class_lr_gain)
    scaler = torch.amp.GradScaler("cuda", enabled=bool(cfg.amp) and device.type == "cuda")  # bf16 needs no loss scaling
    warmup = Warmup(iters=warmup_iters(hyp.warmup_epochs, plan.ticks_per_epoch, None if cfg.time else cfg.epochs,
                                       round(plan.images_per_tick)),
                    bias_lr=choice.warmup_bias_lr, momentum0=hyp.warmup_momentum, momentum=choice.momentum)
    return StepParts(model=model, criterion=model.detect.build_criterion(hyp, imgsz), optimizer=optimizer,
                     scaler=scaler, ema=ModelEMA(model), lr=LRSchedule(optimizer, warmup, cfg.epochs, hyp.lrf, cfg.cos_lr))


def make_run_dir(cfg: RunConfig, info: DistInfo, hyp: Hyp, resumed: bool) -> Path:
    """The run folder the config names; a fresh run writes hyp.yaml and opt.yaml in it (rank 0)."""
    save_dir = Path(cfg.save_dir)
    if info.is_main:
        (save_dir / "weights").mkdir(parents=True, exist_ok=True)
        if not resumed:
            _write_yaml(save_dir / "hyp.yaml", hyp.as_dict())
            _write_yaml(save_dir / "opt.yaml", to_plain(cfg.as_dict()))
    return save_dir


def load_data(opt: RunConfig, info: DistInfo) -> tuple[DataConfig, list[str]]:
    """The dataset yaml, with a built-in dataset generated once per node; and the class names trained."""
    with dist.torch_distributed_zero_first(info.local_rank):
        data = load_data_config(opt.data)
        prepare_dataset(data)
    return data, (["item"] if opt.single_cls else data.names)


def build_model(opt: RunConfig, saved: SavedRun | None, source: ModelSource | None, nc: int, anchors: list | None,
                na: int | None, device: torch.device) -> Model:
    """The model to train, identical on every rank: a resumed run's own, or one built from --cfg
    (or --weights' yaml) with the seed, and the tensors of --weights that fit transferred."""
    init_seeds(opt.seed)
    if saved:  # resume: exactly the saved model
        model = Model(saved.model_yaml)
        model.load_state_dict(saved.model_weights)
    else:
        model = Model(source.yaml, nc=nc, anchors=anchors, na=na, label=source.label)
        if source.weights:
            transfer_weights(model, source.weights.weights, opt.weights)
    model = model.to(device)
    freeze_layers(model, opt.freeze)
    model.to(memory_format=torch.channels_last if opt.channels_last else torch.contiguous_format)
    return model


def transfer_weights(model: nn.Module, state: dict[str, torch.Tensor], source: str) -> None:
    """Load the tensors whose name and shape fit; say how many, and which did not."""
    own = model.state_dict()
    fits = {k: v for k, v in state.items() if k in own and v.shape == own[k].shape}
    model.load_state_dict(fits, strict=False)
    skipped = sorted(k for k in own if k not in fits)
    shown = ", ".join(skipped[:12]) + (f" and {len(skipped) - 12} more" if len(skipped) > 12 else "")
    LOGGER.info(f"Transferred {len(fits)}/{len(own)} items from {source}"
                + (f"; not transferred (new shape or name): {shown}" if skipped else ""))


def freeze_layers(model: nn.Module, freeze: list[int]) -> None:
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


def build_loaders(opt: RunConfig, info: DistInfo, data: DataConfig, hyp: Hyp, imgsz: int, grid: int,
                  batch: dist.BatchSplit, save_dir: Path, device: torch.device):
    """Train loader (augmented, reshuffled each epoch from the seed) and val loader (rect, sharded), each from its
    split's source (utils/data/split.py, decided when the data yaml was read); ``batch``: the training batch's split."""
    what = dict(img_size=imgsz, stride=grid, nc=len(data.names), single_cls=opt.single_cls, seed=opt.seed)
    how = dict(info=info, workers=opt.workers, cache=opt.cache, cache_dir=opt.cache_dir, report_dir=save_dir,
               pin_memory=device.type == "cuda",  # a CPU run on a GPU host opens no CUDA context
               reuse_memory=True)  # the loop and evaluation let go of each batch before the next but one
    train = DatasetSpec(data.sources["train"], hyp=hyp, augment=True, rect=opt.rect, **what)
    train_loader = build_loader(LoaderSpec(train, batch, training=True, prefix="train: ",
                                           render_on_device=opt.augment_on == "device", **how))
    val = DatasetSpec(data.sources["val"], rect=True, pad=0.5, **what)
    val_batch = dist.batch_split(opt.val_batch_size, info, "--val-batch-size")
    val_loader = build_loader(LoaderSpec(val, val_batch, prefix="val: ", **how))
    if hyp.close_mosaic > 0 and not opt.time:  # --time moves it once the epochs that fit are known
        train_loader.sampler.close_mosaic_from(mosaic_off_from(hyp.close_mosaic, opt.epochs))
    return train_loader, val_loader


def init_seeds(seed: int) -> None:
    """Seed Python, numpy and torch: every rank builds identical initial weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _write_yaml(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
