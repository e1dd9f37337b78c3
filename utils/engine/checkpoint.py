"""Checkpoints: atomic, safe to load, and complete enough to continue a run exactly.

A checkpoint holds only tensors, numbers, strings, lists and dicts, so
``torch.load(path, weights_only=True)`` reads it and loading never runs pickled code. The model
is rebuilt from the yaml dict stored beside its state_dict.

``load_checkpoint`` is the one place every entry point reads weights, so it also takes YOLOv5 and
Ultralytics ``.pt`` files: those are read by the allow-listed reader of utils/engine/convert (their
pickles never run) and converted in memory to the same dict.
"""
from __future__ import annotations

import random
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision

from models.yolo import Model
from utils.core.errors import UserError
from utils.core.fileio import atomic_write
from utils.core.logging import LOGGER
from utils.engine.convert.foreign import convert, sniff

FORMAT_VERSION = 1


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


def rng_states() -> dict[str, Any]:
    """Python, numpy and torch RNG states in weights_only-safe form."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [version, list(state), gauss],
        "numpy": [str(np_state[0]), torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what rng_states() saved."""
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def versions() -> dict[str, str]:
    return to_plain({"format": FORMAT_VERSION, "torch": torch.__version__, "torchvision": torchvision.__version__,
                     "numpy": np.__version__})


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def save_checkpoint(ckpt: dict[str, Any], path: str | Path) -> None:
    """Write atomically (utils.core.fileio): a kill at any moment leaves the previous file or the new one."""
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
    allow-listed reader (utils/engine/convert: nothing in the file runs, every tensor is accounted for)."""
    ckpt, fm = convert(path)
    if torch.device(map_location).type != "cpu":
        ckpt["model"] = {k: v.to(map_location) for k, v in ckpt["model"].items()}
        ckpt["ema"] = ckpt["model"]
    ckpt.update(versions=versions(), date=now_iso())
    LOGGER.info(f"{path}: {fm.title} checkpoint ({'EMA' if fm.weights == 'ema' else 'model'} weights, "
                f"{len(fm.names)} classes, {len(ckpt['model'])} tensors) converted to a yolotrain checkpoint in "
                f"memory; python -m utils.engine.convert {path} OUT.pt saves it")
    return ckpt


def strip_optimizer(path: str | Path) -> None:
    """Drop the optimizer and training-only state from a finished checkpoint (smaller, inference-ready)."""
    ckpt = load_checkpoint(path)
    for key in ("optimizer", "scaler", "rng", "ema_updates", "nan_recovery"):
        ckpt.pop(key, None)
    ckpt["stripped"] = True
    save_checkpoint(ckpt, path)


def load_model(weights: str | Path, device: torch.device) -> tuple[Model, dict[str, Any]]:
    """Rebuild the model from a checkpoint's yaml and load its EMA weights (raw ones if no EMA), in eval mode."""
    ckpt = load_checkpoint(weights)
    model = Model(ckpt["model_yaml"])
    state = ckpt.get("ema") or ckpt["model"]
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise UserError(f"{weights}: weights do not fit the model stored in it ({str(e).splitlines()[0]})") from None
    return model.to(device).float().eval(), ckpt
