"""The RNG part of a training checkpoint: what a resumed run needs to draw the same numbers.

Python's, numpy's and torch's CPU generators, and the CUDA generator of the device the run trains
on (only that one: a resume may see fewer GPUs, e.g. a SLURM requeue with one GPU visible per task).
Reading and writing checkpoint files lives in utils/weights/checkpoint.py.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_states(device: torch.device | None = None) -> dict[str, Any]:
    """Python, numpy and torch RNG states in weights_only-safe form; on CUDA also ``device``'s generator."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [version, list(state), gauss],
        "numpy": [str(np_state[0]), torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
        "torch": torch.get_rng_state(),
    }
    if device is not None and device.type == "cuda":
        out["cuda"] = torch.cuda.get_rng_state(device)
    return out


def set_rng_states(states: dict[str, Any], device: torch.device | None = None) -> None:
    """Restore what rng_states() saved; the CUDA generator only on a CUDA ``device``. A file that holds one
    state per visible GPU gives ``device`` its own index's, or none when that index is not in it."""
    version, state, gauss = states["python"]
    random.setstate((version, tuple(state), gauss))
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(states["torch"])
    cuda = states.get("cuda")
    if cuda is None or device is None or device.type != "cuda":
        return
    if isinstance(cuda, (list, tuple)):  # every visible GPU's state
        index = device.index or 0
        cuda = cuda[index] if index < len(cuda) else None
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
