"""Building a training run: one place that turns arguments into everything the loop needs.

``build_training`` is used by train.py and by the bench scripts, so what they measure is what
trains. Its stages run in a fixed order (run folder, data, model, loaders, anchors, optimizer,
resume state, DDP) because each consumes the previous ones' results.
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import yaml
from torch import nn

from models.heads.base import Criterion
from models.parse import MODELS_DIR, head_has_anchors, load_model_yaml
from models.yolo import Model, ModelInfo, de_parallel, round_to_stride
from utils.core import dist
from utils.core.dist import DistInfo
from utils.core.fileio import ROOT
from utils.core.hyp import Hyp, load_hyp
from utils.core.logging import LOGGER
from utils.core.runs import increment_path
from utils.data.config import DataConfig, load_data_config, prepare_dataset
from utils.data.loader import create_dataloader
from utils.engine.autoanchor import anchors_per_level, fit_anchors
from utils.engine.checkpoint import set_rng_states
from utils.engine.optim import NOMINAL_BATCH, EarlyStopping, ModelEMA, OptimizerChoice, Warmup, accumulate_steps, \
    choose_optimizer, lr_lambda, make_scheduler, smart_optimizer
from utils.weights.checkpoint import load_checkpoint, to_plain


DEFAULT_MODEL = MODELS_DIR / "yolov8n.yaml"  # the best mAP in the quick CPU run (README)
DEFAULT_HYP = ROOT / "hyps" / "hyp.scratch-low.yaml"  # anchor-based heads (YOLOv5)
DEFAULT_HYP_ANCHOR_FREE = ROOT / "hyps" / "hyp.v8.yaml"  # anchor-free DFL heads: their gains are on another scale


@dataclass
class Start:
    """Where the loop starts: epoch 0, or a resumed checkpoint's epoch and batch."""

    epoch: int = 0
    batches_done: int = 0  # a mid-epoch checkpoint (--save-interval)
    best_fitness: float = 0.0
    mloss: torch.Tensor | None = None  # that checkpoint's running mean loss
    resumed: bool = False
    train_seconds: float = 0.0  # wall time the run had spent when it was saved (--time)
    epoch_seconds: tuple[float, ...] = ()  # whole epochs' wall times over its attempts (--time's mean, the ETA)
    lr_scale: float = 1.0  # a mid-epoch checkpoint's --nan-recover LR scale for the rest of that epoch


@dataclass
class Training:
    """Everything a run trains with, built once; the loop reads it and changes only the model,
    optimizer, scheduler, scaler, EMA and early-stop states inside it."""

    opt: argparse.Namespace
    info: DistInfo
    device: torch.device
    save_dir: Path
    hyp: Hyp
    data: DataConfig
    names: list[str]
    model: nn.Module  # DDP-wrapped when distributed
    model_info: ModelInfo
    ema: ModelEMA
    optimizer_choice: OptimizerChoice
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    lr_lambda: Callable[[float], float]
    warmup: Warmup
    scaler: torch.amp.GradScaler
    criterion: Criterion
    stopper: EarlyStopping
    train_loader: torch.utils.data.DataLoader
    val_loader: torch.utils.data.DataLoader
    batches_per_epoch: int  # per rank, a whole epoch (a resumed epoch's loader yields fewer)
    imgsz: int
    grid: int  # the largest stride (at least 32): image sizes are multiples of it
    batch: int  # images per rank per step
    accumulate: int  # batches per optimizer step after warmup
    amp: bool  # autocast in dist.amp_dtype(device): fp16 on CUDA, bf16 on CPU
    memory_format: torch.memory_format
    start: Start

    @property
    def weights_dir(self) -> Path:
        return self.save_dir / "weights"

    @property
    def val_half(self) -> bool:
        """Validation in training runs in bf16 too on CPU under --amp (mAP within a few 1e-4 of fp32's,
        half the inference time); CUDA validation stays fp32, as before (not measured here)."""
        return self.amp and self.device.type == "cpu"

    def autocast(self) -> torch.autocast:
        """The forward and loss precision of --amp (off: fp32)."""
        return torch.autocast(self.device.type, dtype=dist.amp_dtype(self.device), enabled=self.amp)


def build_training(opt: argparse.Namespace, info: DistInfo, device: torch.device, ckpt: dict | None) -> Training:
    """Run folder -> data -> model -> loaders -> anchors -> optimizer, EMA, schedule -> resume -> DDP."""
    source = load_checkpoint(opt.weights) if opt.weights and not ckpt else None  # read once: --weights to fine-tune
    anchored = ckpt is not None or head_has_anchors(load_model_yaml(model_cfg(opt, source))[0])
    if not ckpt and not opt.hyp:
        opt.hyp = str(DEFAULT_HYP if anchored else DEFAULT_HYP_ANCHOR_FREE)  # each family's own recipe
    hyp = Hyp(**ckpt["hyp"]) if ckpt else load_hyp(opt.hyp)
    na = anchors_per_level(hyp.anchors, opt.hyp, opt.noautoanchor) if not ckpt and anchored else None  # YOLOv5's
    save_dir = make_run_dir(opt, info, hyp, resumed=ckpt is not None)
    data, names = load_data(opt, info)
    model, model_info = build_model(opt, ckpt, source, len(names), data.anchors, na, device)
    grid = max(int(model.stride.max()), 32)
    imgsz = round_to_stride(opt.imgsz, grid)
    batch = opt.batch_size // info.world_size
    train_loader, val_loader = build_loaders(opt, info, data, hyp, imgsz, grid, batch, save_dir)
    if not ckpt and not opt.noautoanchor and model.detect.has_anchors:  # before EMA and DDP copy the model
        fit_anchors(model, train_loader.dataset, hyp, imgsz, opt.seed, info, force=na is not None)
    choice = resume_choice(ckpt) or choose_optimizer(opt.optimizer, hyp, len(names), len(train_loader.dataset),
                                                     opt.batch_size, opt.epochs, anchored)
    accumulate = accumulate_steps(opt.batch_size, choice.nominal_batch)
    decay = hyp.weight_decay * opt.batch_size * accumulate / NOMINAL_BATCH  # the same decay per image at any step size
    optimizer = smart_optimizer(model, choice.name, choice.lr, choice.momentum, decay)
    lf = lr_lambda(opt.epochs, hyp.lrf, opt.cos_lr)
    ema = ModelEMA(model)
    amp = bool(opt.amp)
    scaler = torch.amp.GradScaler("cuda", enabled=amp and device.type == "cuda")  # bf16 needs no loss scaling
    stopper = EarlyStopping(patience=opt.patience)
    start = restore_state(ckpt, optimizer, ema, scaler, stopper, device) if ckpt else Start()
    scheduler = make_scheduler(optimizer, lf, start.epoch)
    model = wrap_model(model, opt, info, device)
    criterion = de_parallel(model).detect.build_criterion(hyp, imgsz)
    nb = len(train_loader)  # before any resume skip shortens the sampler
    warmup = Warmup(iters=max(round(hyp.warmup_epochs * nb), 100), bias_lr=choice.warmup_bias_lr,
                    momentum0=hyp.warmup_momentum, momentum=choice.momentum)
    memory_format = torch.channels_last if opt.channels_last else torch.contiguous_format
    return Training(opt, info, device, save_dir, hyp, data, names, model, model_info, ema, choice, optimizer, scheduler, lf,
                    warmup, scaler, criterion, stopper, train_loader, val_loader, nb, imgsz, grid, batch,
                    accumulate, amp, memory_format, start)


def resume_choice(ckpt: dict | None) -> OptimizerChoice | None:
    """A resumed run's own optimizer choice (checkpoints from before --optimizer auto have none)."""
    return OptimizerChoice(**ckpt["optimizer_choice"]) if ckpt and "optimizer_choice" in ckpt else None


def model_cfg(opt: argparse.Namespace, source: dict | None) -> str | Path | dict:
    """The model a fresh run builds: --cfg, else the --weights checkpoint's yaml, else the default."""
    return opt.cfg or (source["model_yaml"] if source else DEFAULT_MODEL)


def make_run_dir(opt: argparse.Namespace, info: DistInfo, hyp: Hyp, resumed: bool) -> Path:
    """runs/train/exp, exp2, ... chosen on rank 0 and shared; a fresh run writes hyp.yaml and opt.yaml."""
    save_dir = Path(opt.save_dir) if resumed else increment_path(Path(opt.project) / opt.name, opt.exist_ok)
    save_dir = Path(dist.broadcast_object(str(save_dir)))
    opt.save_dir = str(save_dir)
    if info.is_main:
        (save_dir / "weights").mkdir(parents=True, exist_ok=True)
        if not resumed:
            _write_yaml(save_dir / "hyp.yaml", hyp.as_dict())
            _write_yaml(save_dir / "opt.yaml", to_plain(vars(opt)))
    return save_dir


def load_data(opt: argparse.Namespace, info: DistInfo) -> tuple[DataConfig, list[str]]:
    """The dataset yaml, with a built-in dataset generated once per node; and the class names trained."""
    with dist.torch_distributed_zero_first(info.local_rank):
        data = load_data_config(opt.data)
        prepare_dataset(data)
    return data, (["item"] if opt.single_cls else data.names)


def build_model(opt: argparse.Namespace, ckpt: dict | None, source: dict | None, nc: int, anchors: list | None,
                na: int | None, device: torch.device) -> tuple[Model, ModelInfo]:
    """The model to train, identical on every rank: a resumed run's own, or one built from --cfg
    (or --weights' yaml) with the seed, and the tensors of --weights that fit transferred."""
    init_seeds(opt.seed)
    if ckpt:  # resume: exactly the saved model
        model = Model(ckpt["model_yaml"])
        model.load_state_dict(ckpt["model"])
    else:
        model = Model(model_cfg(opt, source), nc=nc, anchors=anchors, na=na)
        if source:
            transfer_weights(model, source.get("ema") or source["model"], opt.weights)
    model = model.to(device)
    freeze_layers(model, opt.freeze)
    model.to(memory_format=torch.channels_last if opt.channels_last else torch.contiguous_format)
    return model, model.info(opt.imgsz)


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


def build_loaders(opt: argparse.Namespace, info: DistInfo, data: DataConfig, hyp: Hyp, imgsz: int, grid: int,
                  batch: int, save_dir: Path):
    """Train loader (augmented, reshuffled each epoch from the seed) and val loader (rect, sharded)."""
    common = dict(stride=grid, single_cls=opt.single_cls, info=info, workers=opt.workers, seed=opt.seed,
                  nc=len(data.names), cache=opt.cache, cache_dir=opt.cache_dir, report_dir=save_dir)
    train_loader = create_dataloader(data.train, imgsz, batch, hyp=hyp, augment=True, rect=opt.rect,
                                     shuffle=True, prefix="train: ", **common)
    val_loader = create_dataloader(data.val, imgsz, opt.val_batch_size, rect=True, pad=0.5, prefix="val: ",
                                   **common)
    if hyp.close_mosaic > 0 and not opt.time:  # --time moves it once the epochs that fit are known
        train_loader.sampler.mosaic_off_from_epoch = max(opt.epochs - int(hyp.close_mosaic), 0)
    return train_loader, val_loader


def restore_state(ckpt: dict, optimizer, ema: ModelEMA, scaler, stopper: EarlyStopping, device) -> Start:
    """Optimizer, EMA, scaler, early-stop and RNG states of a resumed run, and where it continues."""
    optimizer.load_state_dict(ckpt["optimizer"])
    ema.ema.load_state_dict(ckpt["ema"])
    ema.updates = ckpt["ema_updates"]
    if ckpt.get("scaler"):
        scaler.load_state_dict(ckpt["scaler"])
    stopper.best_fitness = ckpt["early_stop"]["best_fitness"]
    stopper.best_epoch = ckpt["early_stop"]["best_epoch"]
    set_rng_states(ckpt["rng"])
    batches = int(ckpt.get("batches_done", 0))
    mloss = torch.tensor(ckpt["mloss"], device=device) if batches else None
    return Start(ckpt["epoch"] + 1, batches, ckpt["best_fitness"], mloss, resumed=True,
                 train_seconds=float(ckpt.get("train_seconds", 0.0)),
                 epoch_seconds=tuple(float(s) for s in ckpt.get("epoch_seconds", ())),
                 lr_scale=float(ckpt.get("lr_scale", 1.0)) if batches else 1.0)


def wrap_model(model: nn.Module, opt: argparse.Namespace, info: DistInfo, device: torch.device) -> nn.Module:
    """SyncBatchNorm when asked (CUDA DDP only), then DDP when distributed."""
    if opt.sync_bn and info.distributed and device.type == "cuda":
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
        LOGGER.info("Using SyncBatchNorm")
    elif opt.sync_bn:
        LOGGER.warning("WARNING: --sync-bn needs CUDA and more than one rank; using plain BatchNorm")
    return dist.smart_DDP(model, device)


def init_seeds(seed: int) -> None:
    """Seed Python, numpy and torch: every rank builds identical initial weights."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _write_yaml(path: Path, data: dict) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(data, f, sort_keys=False)
