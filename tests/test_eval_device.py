"""Evaluation on CUDA: timed sections end with a device synchronisation (else inference time is booked
as NMS time), detections come to the host in one copy per batch, and NMS and mAP agree with the CPU."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from models.yolo import Model
from tests.conftest import write_val_split
from utils.core.boxes import non_max_suppression
from utils.core.dist import DistInfo
from utils.data.config import load_data_config, prepare_dataset
from utils.data.loader import create_dataloader
from utils.eval import evaluate
from utils.eval.evaluate import EvalOptions, detections_to_host, evaluate_model
from utils.infer.backends import TorchBackend


@pytest.fixture
def split(tmp_path) -> Path:
    return write_val_split(tmp_path, 5, (48, 64), lambda k: 40 * k)


def test_synchronize_waits_for_cuda_only(monkeypatch):
    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", waited.append)
    evaluate.synchronize(torch.device("cpu"))
    assert waited == []
    evaluate.synchronize(torch.device("cuda", 1))
    assert waited == [torch.device("cuda", 1)]


def test_every_timed_section_ends_with_a_synchronisation(split, monkeypatch, one_thread):
    """Three boundaries per batch (pre-process, inference, NMS), each on the evaluation device."""
    waited = []
    monkeypatch.setattr(evaluate, "synchronize", waited.append)
    loader = create_dataloader(split, 64, 2, 32, nc=1, workers=0)
    torch.manual_seed(0)
    result = evaluate_model(Model("models/yolov5n.yaml", nc=1), loader, torch.device("cpu"), ["a"], DistInfo())
    assert result.images == 5 and waited == [torch.device("cpu")] * 3 * len(loader)


def test_host_detections_are_returned_as_they_are():
    dets = [torch.rand(3, 6), torch.zeros(0, 6), torch.rand(1, 6)]
    assert all(a is b for a, b in zip(detections_to_host(dets), dets)) and detections_to_host([]) == []


def test_device_detections_come_to_the_host_in_one_copy_per_batch(monkeypatch):
    """meta stands in for a GPU: the copy is counted (and faked, as meta tensors hold no values)."""
    copies = []

    def fake_cpu(self: torch.Tensor) -> torch.Tensor:
        copies.append(tuple(self.shape))
        return torch.arange(self.numel(), dtype=self.dtype).view(self.shape)

    monkeypatch.setattr(torch.Tensor, "cpu", fake_cpu)
    dets = [torch.empty(n, 6, device="meta") for n in (3, 0, 2)]
    host = detections_to_host(dets)
    assert copies == [(5, 6)]
    assert [h.shape[0] for h in host] == [3, 0, 2] and all(h.device.type == "cpu" for h in host)
    assert host[2][0, 0] == 18  # image 2's first row is row 3 of the batch: the split keeps the order


@pytest.mark.cuda
def test_nms_on_cuda_equals_the_cpu():
    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(4, 3000, 2, generator=gen) * 600
    wh = torch.rand(4, 3000, 2, generator=gen) * 120 + 4
    scores = torch.rand(4, 3000, 5, generator=gen)
    pred = torch.cat((xy, wh, scores), -1)
    for multi_label in (False, True):
        cpu = non_max_suppression(pred, 0.25, 0.45, multi_label=multi_label)
        gpu = non_max_suppression(pred.cuda(), 0.25, 0.45, multi_label=multi_label)
        assert [len(c) for c in cpu] == [len(g) for g in gpu]
        for c, g in zip(cpu, gpu):
            assert torch.allclose(c, g.cpu(), atol=1e-4, rtol=1e-5)


@pytest.mark.cuda
def test_cuda_and_cpu_score_a_checkpoint_alike(tiny_v8n, tiny_data):
    config = load_data_config(str(tiny_data))
    prepare_dataset(config)
    loader = create_dataloader(config.val, 64, 4, 32, rect=True, pad=0.5, workers=0, nc=len(config.names))
    scores = []
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        model = TorchBackend.from_checkpoint(tiny_v8n, device).model
        result = evaluate_model(model, loader, device, config.names, DistInfo(), EvalOptions(fuse=False))
        scores.append(np.array([result.metrics.map50, result.metrics.map, result.metrics.mp, result.metrics.mr]))
    assert scores[0][0] > 0 and np.abs(scores[0] - scores[1]).max() < 1e-3
