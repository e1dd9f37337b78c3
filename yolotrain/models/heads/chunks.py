"""Evaluating a tensor function slice by slice along one dimension, to bound its temporaries' memory."""
from __future__ import annotations

from typing import Callable

import torch


def cat_in_chunks(fn: Callable[[slice], torch.Tensor], n: int, step: int, dim: int = 1) -> torch.Tensor:
    """``fn(slice(0, n))`` computed as ``fn`` of consecutive slices of ``step`` along ``dim``, written into one
    output: elementwise work gives the same values, while each call's temporaries shrink by n / step.
    A single slice (the usual case) returns ``fn``'s own result, with no copy."""
    step = max(1, step)
    if n <= step:
        return fn(slice(0, n))
    first = fn(slice(0, step))
    shape = list(first.shape)
    shape[dim] = n
    out = first.new_empty(shape)
    out.narrow(dim, 0, step).copy_(first)
    del first
    for start in range(step, n, step):
        out.narrow(dim, start, min(step, n - start)).copy_(fn(slice(start, start + step)))
    return out
