"""The RNG part of a training checkpoint: what a resumed run needs to draw the same numbers.

Reading and writing checkpoint files lives in utils/weights/checkpoint.py, below the engine, so
inference loads weights without the training engine.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


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
