"""PLACEHOLDER (branch y26-arch): the end-to-end head's loss is written on the loss branch; this file only
gives ``models/heads/e2e.py`` the names it imports, and the merge takes the loss branch's file."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from utils.core.hyp import Hyp


@dataclass(frozen=True)
class E2ELossGains:
    """Loss gains read from the hyp file (placeholder: the loss branch defines the fields)."""

    @classmethod
    def from_hyp(cls, hyp: Hyp) -> E2ELossGains:
        raise NotImplementedError("E2ELossGains comes from the loss branch (models/heads/e2e_loss.py)")


class E2ELoss:
    """The one-to-many + one-to-one loss of ``E2EDetect`` (placeholder until the loss branch merges)."""

    loss_names: tuple[str, ...] = ()

    def __init__(self, head: nn.Module, gains: E2ELossGains) -> None:
        raise NotImplementedError("E2ELoss comes from the loss branch (models/heads/e2e_loss.py)")

    def __call__(self, preds: Any, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError
