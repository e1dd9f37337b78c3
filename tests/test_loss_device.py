"""Every family's loss queues on the training device without reading it back: with the loader's host
targets and the head's outputs on the meta device (shapes, no data), forward and backward must run, as any
data-dependent step on the device's tensors (a mask index, ``nonzero``, ``.item()``) cannot. On CUDA
such a step makes the host wait for the forward before it can queue the rest of the step."""
from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_map

from yolotrain.models.yolo import Model
from yolotrain.utils.core.hyp import Hyp

MODELS = Path(__file__).resolve().parents[1] / "models"
TARGETS = torch.tensor([[0, 1, 0.3, 0.4, 0.2, 0.3], [1, 2, 0.6, 0.5, 0.5, 0.4], [1, 0, 0.2, 0.2, 0.1, 0.1]])

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", ["yolov5n", "yolov8n", "yolo26n", "yolov10n"])
def test_the_loss_never_reads_the_device(name, monkeypatch):
    torch.manual_seed(0)
    model = Model(MODELS / f"{name}.yaml", nc=3).train()
    preds = model(torch.rand(2, 3, 64, 64))
    on_meta = tree_map(lambda t: t.detach().to("meta").requires_grad_() if isinstance(t, torch.Tensor) else t, preds)
    criterion = model.detect.build_criterion(Hyp(), 64)
    monkeypatch.setattr(torch, "autocast", lambda *a, **k: contextlib.nullcontext())  # no autocast for meta
    loss, items = criterion(on_meta, TARGETS)
    loss.backward()
    assert loss.device.type == items.device.type == "meta"
    cpu_loss, _ = criterion(preds, TARGETS)  # the same loss on real outputs is a number
    assert cpu_loss.shape == loss.shape and torch.isfinite(cpu_loss).all()
