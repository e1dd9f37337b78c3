"""Checkpoints: atomic, safe to load, and complete enough to continue a run exactly.

A checkpoint holds only tensors, numbers, strings, lists and dicts, so
``torch.load(path, weights_only=True)`` reads it and loading never runs pickled code. The model
is rebuilt from the yaml dict stored beside its state_dict.

``load_checkpoint`` is the one place every entry point reads weights, so it also takes YOLOv5 and
Ultralytics ``.pt`` files: those are read by the allow-listed reader of utils/weights/convert (their
pickles never run) and converted in memory to the same dict. ``load_model`` gives inference the
model and a ``CheckpointCard``, so no caller outside this module reads checkpoint keys to run it.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision

from yolotrain.models.yolo import Model
from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.weights.convert.foreign import convert, sniff

FORMAT_VERSION = 1


@dataclass(frozen=True)
class CheckpointCard:
    """What inference needs to know about a checkpoint besides its weights, read in one place."""

    names: tuple[str, ...]  # one per class of the model (indices when the file's names do not fit)
    imgsz: int  # the training image size (640 when the file does not say)
    data: str | None  # the dataset yaml it was trained on
    single_cls: bool
    epoch: int  # last finished epoch, 0-based; -1 for a converted file
    val_precision: str  # its validation in training: "bf16" (CPU) or "fp16" (CUDA) under --amp, else "fp32"
    tensors: int  # entries of the state_dict loaded
    converted_weights: str | None  # "ema" or "model" for a converted YOLOv5/Ultralytics file, else None


def to_plain(obj: Any) -> Any:
    """Turn Paths, tuples, numpy scalars/arrays and dataclass-like values into weights_only-safe types."""
    if isinstance(obj, dict):
        return {str(k): to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bool) or obj is None or isinstance(obj, torch.Tensor):
        return obj
    for kind in (str, int, float):  # subclasses (e.g. torch's TorchVersion) are refused by weights_only
        if isinstance(obj, kind):
            return kind(obj)
    return str(obj)


def fp32_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A CPU fp32 copy of a state_dict (detached), so the file does not depend on the device or AMP."""
    return {k: (v.detach().float() if v.is_floating_point() else v.detach()).cpu().clone()
            for k, v in model.state_dict().items()}


def versions() -> dict[str, str]:
    """The library versions a checkpoint was written with, for reading it back years later."""
    return to_plain({"format": FORMAT_VERSION, "torch": torch.__version__, "torchvision": torchvision.__version__,
                     "numpy": np.__version__})


def now_iso() -> str:
    """UTC time to the second: the checkpoint's date, comparable across machines."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def save_checkpoint(ckpt: dict[str, Any], path: str | Path) -> None:
    """Write atomically (yolotrain.utils.core.fileio): a kill at any moment leaves the previous file or the new one."""
    with atomic_write(path) as f:
        torch.save(ckpt, f)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load with weights_only=True, or convert a YOLOv5 / Ultralytics file in memory (``load_foreign``);
    UserError naming the file when missing, truncated, refused or of another kind."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: checkpoint not found")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, pickled classes, not a torch file at all
        kind = sniff(path)
        if kind.package is not None:
            return load_foreign(path, map_location)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{path}: not a readable yolotrain checkpoint ({kind.problem or first})") from None
    if not isinstance(ckpt, dict) or "model_yaml" not in ckpt or "model" not in ckpt:
        raise UserError(f"{path}: not a yolotrain checkpoint (no model_yaml/model entries), nor a YOLOv5 or "
                        "Ultralytics one")
    return ckpt


def load_foreign(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """A YOLOv5 / Ultralytics checkpoint as a yolotrain checkpoint dict, converted in memory by the
    allow-listed reader (utils/weights/convert: nothing in the file runs, every tensor is accounted for)."""
    ckpt, fm = convert(path)
    if torch.device(map_location).type != "cpu":
        ckpt["model"] = {k: v.to(map_location) for k, v in ckpt["model"].items()}
        ckpt["ema"] = ckpt["model"]
    ckpt.update(versions=versions(), date=now_iso())
    LOGGER.info(f"{path}: {fm.title} checkpoint ({'EMA' if fm.weights == 'ema' else 'model'} weights, "
                f"{len(fm.names)} classes, {len(ckpt['model'])} tensors) converted to a yolotrain checkpoint in "
                f"memory; {tool_command('weights')} {path} OUT.pt saves it. Its weights keep their AGPL-3.0 licence "
                "(YOLOv5's and Ultralytics'), whatever yolotrain's")
    return ckpt


def strip_optimizer(path: str | Path) -> None:
    """Drop the optimizer and training-only state from a finished checkpoint (smaller, inference-ready)."""
    ckpt = load_checkpoint(path)
    for key in ("optimizer", "scaler", "rng", "ema_updates", "nan_recovery"):
        ckpt.pop(key, None)
    ckpt["stripped"] = True
    save_checkpoint(ckpt, path)


def checkpoint_card(ckpt: dict[str, Any], nc: int, where: str | Path) -> CheckpointCard:
    """The inference view of a checkpoint dict whose model has ``nc`` classes; names that do not fit
    are replaced by the class indices, with a warning naming ``where``."""
    args = ckpt.get("args", {}) or {}
    names = list(ckpt.get("names") or [])
    if len(names) != nc:
        LOGGER.warning(f"WARNING: {where}: {len(names)} class names for {nc} classes; classes are named by their index")
        names = [str(i) for i in range(nc)]
    converted = ckpt.get("converted_from")
    return CheckpointCard(names=tuple(names), imgsz=int(args.get("imgsz", 640)), data=args.get("data"),
                          single_cls=bool(args.get("single_cls")), epoch=int(ckpt.get("epoch", -1)),
                          val_precision=str(ckpt.get("val_precision", "fp32")),
                          tensors=len(ckpt.get("ema") or ckpt["model"]),
                          converted_weights=converted.get("weights") if isinstance(converted, dict) else None)


@dataclass(frozen=True)
class WeightsSource:
    """A checkpoint a fresh run starts from (train.py --weights): the model it holds and the weights to transfer."""

    path: Path
    model_yaml: dict[str, Any]
    weights: dict[str, torch.Tensor]  # the EMA's, else the raw model's


def load_weights_source(path: str | Path) -> WeightsSource:
    ckpt = load_checkpoint(path)
    return WeightsSource(Path(path), ckpt["model_yaml"], _inference_weights(ckpt))


def _inference_weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    return ckpt.get("ema") or ckpt["model"]


def load_model(weights: str | Path, device: torch.device) -> tuple[Model, CheckpointCard]:
    """Rebuild the model from a checkpoint's yaml and load its EMA weights (raw ones if no EMA), in eval
    mode, with the checkpoint's card: what inference reads of the file besides the weights."""
    ckpt = load_checkpoint(weights)
    model = Model(ckpt["model_yaml"])
    state = _inference_weights(ckpt)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise UserError(f"{weights}: weights do not fit the model stored in it ({str(e).splitlines()[0]})") from None
    return model.to(device).float().eval(), checkpoint_card(ckpt, model.detect.nc, weights)
