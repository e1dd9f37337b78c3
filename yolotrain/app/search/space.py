"""The search space of a hyperparameter study: which hyperparameters a trial draws, between which bounds
and on which scale, read from a yaml validated like a hyp file (hyps/tune-space*.yaml are the defaults).

One row per hyperparameter, ``name: {low: L, high: H, log: true|false}``; a name is one of ``Hyp``'s fields
(utils/core/hyp.py). A trial's hyp is the base hyp file with the drawn values written over it.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yolotrain.utils.core.errors import UserError, did_you_mean
from yolotrain.utils.core.fileio import load_yaml
from yolotrain.utils.core.hyp import Hyp

BOUND_KEYS = ("low", "high", "log")
INTEGRAL = ("anchors",)  # YOLOv5 rounds it; a search would draw fractions it never uses


@dataclass(frozen=True)
class Bounds:
    """One hyperparameter's range: uniform on [low, high], or log-uniform when ``log``."""

    low: float
    high: float
    log: bool = False


def load_space(path: str | Path) -> dict[str, Bounds]:
    """The space in ``path``: every problem is a UserError naming the file and the key."""
    raw = load_yaml(path)
    known = [f.name for f in dataclasses.fields(Hyp)]
    space = {}
    for key, row in raw.items():
        if key not in known or key in INTEGRAL:
            why = " (an integer count: set it in the hyp file)" if key in INTEGRAL else ""
            raise UserError(f"{path}: unknown hyperparameter '{key}'{why}.{did_you_mean(str(key), known)}")
        space[key] = _bounds(path, key, row)
    if not space:
        raise UserError(f"{path}: the search space is empty: give at least one 'name: {{low: L, high: H}}' row")
    return space


def _bounds(path: str | Path, key: str, row: Any) -> Bounds:
    if not isinstance(row, dict):
        raise UserError(f"{path}: '{key}' must be a mapping like {{low: 0.0, high: 1.0, log: false}}, got {row!r}")
    for sub in row:
        if sub not in BOUND_KEYS:
            raise UserError(f"{path}: '{key}' has an unknown field '{sub}'.{did_you_mean(str(sub), BOUND_KEYS)}")
    missing = [s for s in ("low", "high") if s not in row]
    if missing:
        raise UserError(f"{path}: '{key}' needs {' and '.join(missing)}")
    low, high, log = row["low"], row["high"], row.get("log", False)
    for name, v in (("low", low), ("high", high)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise UserError(f"{path}: '{key}' {name} must be a finite number, got {v!r}")
    if not isinstance(log, bool):
        raise UserError(f"{path}: '{key}' log must be true or false, got {log!r}")
    if not low < high:
        raise UserError(f"{path}: '{key}' needs low < high, got low {low:g}, high {high:g}")
    if log and low <= 0:
        raise UserError(f"{path}: '{key}' is log-scaled, so low must be > 0, got {low:g}")
    if low < 0:
        raise UserError(f"{path}: '{key}' low must be >= 0 (hyperparameters are gains, rates and probabilities), "
                        f"got {low:g}")
    return Bounds(float(low), float(high), log)


def suggest(trial: Any, space: dict[str, Bounds]) -> dict[str, float]:
    """The trial's values, drawn by its sampler (or the fixed ones of an enqueued or retried trial)."""
    return {key: trial.suggest_float(key, b.low, b.high, log=b.log) for key, b in space.items()}
