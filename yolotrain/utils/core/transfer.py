"""Host tensors onto the training device without the host waiting for it.

A copy to CUDA from pageable memory may wait for the stream (the work already queued on it) before it
starts, which stops the host from queuing anything else meanwhile; from page-locked memory it is queued
like a kernel. The step's small host-built tensors (loss matches, the device path's mixup rows) go through
``to_device`` so none of them holds the host mid-step.
"""
from __future__ import annotations

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: from the host to CUDA through page-locked memory without waiting, else ``t.to``."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
