"""Evaluation on CUDA: timed sections end with a device synchronisation (else inference time is booked
as NMS time), detections come to the host in one copy per batch, and NMS and mAP agree with the CPU."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from yolotrain.models.yolo import Model
from tests.helpers import write_val_split
from yolotrain.utils.core.boxes import non_max_suppression
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.data.config import load_data_config, prepare_dataset
from yolotrain.utils.data.loader import create_dataloader
from yolotrain.utils.eval import evaluate
from yolotrain.utils.eval.evaluate import EvalOptions, detections_to_host, evaluate_model
from yolotrain.utils.infer.backends import TorchBackend
from yolotrain.utils.weights.checkpoint import fp32_state_dict, now_iso, save_checkpoint, to_plain, versions


@pytest.fixture
def split(tmp_path) -> Path:
    return write_val_split(tmp_path, 5, (48, 64), lambda k: 40 * k)


def _tiny_val(data: Path):
    """tiny_data's val split as the tests here score it (imgsz 64, batches of 4, rectangular) and its names."""
    config = load_data_config(str(data))
    prepare_dataset(config)
    return create_dataloader(config.val, 64, 4, 32, rect=True, pad=0.5, workers=0, nc=len(config.names)), config.names


def _ridge(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Least squares of y on [x, 1] with a small ridge, in float64: (features + 1, outputs), bias row last."""
    x = torch.cat((x.double(), torch.ones(len(x), 1, dtype=torch.float64)), 1)
    return torch.linalg.solve(x.T @ x + 1e-2 * torch.eye(x.shape[1], dtype=torch.float64), x.T @ y.double())


@pytest.fixture(scope="module")
def fitted_v8n(tiny_data, tmp_path_factory) -> Path:
    """A YOLOv8n tiny_data checkpoint made in about a second, without a training run, that finds the val
    split's objects (mAP50 about 0.2), so the CPU/CUDA comparison has real scores to compare.

    The weights are seed 0's; BN running statistics are the split's own (one pass in train mode, a cumulative
    average), and each level's last two 1x1 convs are solved by ridge least squares on their input features
    over the split: class logits +6 at the anchor points inside an object of that class (the smallest one),
    -6 elsewhere; box sides mu (grid units) at those points, as DFL logits k * mu - k^2 / 2 over the bins k:
    a softmax that is a discretised Gaussian around mu (linear in the features), whose mean, the box side
    the head decodes, is about mu. Every score and box still comes from the image's convolutions.
    (tests/conftest.py's tiny_v8n trains a 1-epoch run in a subprocess, over a minute on a GPU host; trained
    on a CPU, its model scored mAP50 0.0 there.)
    """
    loader, names = _tiny_val(tiny_data)
    batches = [(b.images.float() / 255, b.targets) for b in loader]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Model("models/yolov8n.yaml", nc=len(names))
    bns = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average
    model.train()
    with torch.no_grad():
        for images, _ in batches:
            model(images)
    for m in bns:
        m.momentum = 0.03
    model.eval()
    head, feats = model.detect, {}

    def keep_input(key):
        return lambda mod, args, out: feats.setdefault(key, []).append(args[0])

    hooks = [conv[-1].register_forward_hook(keep_input((kind, i)))
             for kind, branch in enumerate((head.cv2, head.cv3)) for i, conv in enumerate(branch)]
    with torch.no_grad():
        for images, _ in batches:
            model(images)
    for h in hooks:
        h.remove()
    bins = torch.arange(head.reg_max, dtype=torch.float64)
    for i, stride in enumerate(head.stride.tolist()):
        box_x, sides, cls_x, cls_y = [], [], [], []
        for (images, targets), box_f, cls_f in zip(batches, feats[(0, i)], feats[(1, i)]):
            h, w = box_f.shape[2:]
            size = torch.tensor(images.shape[2:][::-1] * 2)  # W, H, W, H
            ys, xs = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
            points = torch.stack((xs.flatten(), ys.flatten()), 1) * stride
            for j in range(len(images)):
                gt = targets[targets[:, 0] == j]
                xyxy = torch.cat((gt[:, 2:4] - gt[:, 4:6] / 2, gt[:, 2:4] + gt[:, 4:6] / 2), 1) * size
                ltrb = torch.cat((points[:, None] - xyxy[None, :, :2], xyxy[None, :, 2:] - points[:, None]), 2)
                inside = ltrb.amin(2) > 0  # (points, objects)
                area = (gt[:, 4] * gt[:, 5]).expand_as(inside).masked_fill(~inside, float("inf"))
                hit = inside.any(1)
                obj = area.argmin(1)[hit] if len(gt) else torch.zeros(0, dtype=torch.long)
                box_x.append(box_f[j].flatten(1).T[hit])
                sides.append(ltrb[hit, obj] / stride)
                logits = torch.full((h * w, len(names)), -6.0)
                logits[hit, gt[obj, 1].long()] = 6.0
                cls_x.append(cls_f[j].flatten(1).T)
                cls_y.append(logits)
        wc = _ridge(torch.cat(cls_x), torch.cat(cls_y))  # (c + 1, nc)
        wb = _ridge(torch.cat(box_x), torch.cat(sides))  # (c + 1, 4)
        dfl = bins[None, :, None] * wb.T[:, None, :]  # (4, reg_max, c + 1), side-major as the head reads
        dfl[..., -1] -= bins ** 2 / 2
        with torch.no_grad():
            for conv, wt in ((head.cv3[i][-1], wc.T), (head.cv2[i][-1], dfl.flatten(0, 1))):
                conv.weight.copy_(wt[:, :-1, None, None])
                conv.bias.copy_(wt[:, -1])
    ckpt = {"model_yaml": to_plain(model.yaml), "model": fp32_state_dict(model), "names": list(names),
            "args": to_plain({"imgsz": 64, "data": tiny_data}), "epoch": 0, "versions": versions(), "date": now_iso()}
    path = tmp_path_factory.mktemp("fitted") / "fitted_v8n.pt"
    save_checkpoint(ckpt, path)
    return path


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
@pytest.mark.parametrize("levels", [0, 32], ids=["continuous", "ties"])
def test_nms_on_cuda_equals_the_cpu(levels):
    """The same detections, bit for bit and in the same order: from 300 to 30000 candidates an image (one NMS
    call for all classes up to 1000 on the CPU and 25000 on CUDA, one per class above), scores with and
    without ties, class-aware and agnostic, with max_nms cutting among equal scores."""
    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(4, 3000, 2, generator=gen) * 600
    wh = torch.rand(4, 3000, 2, generator=gen) * 120 + 4
    scores = torch.rand(4, 3000, 5, generator=gen)
    if levels:
        scores = (scores * levels).floor() / levels
    pred = torch.cat((xy, wh, scores), -1)
    cases = [dict(multi_label=False), dict(multi_label=True), dict(multi_label=True, max_nms=5000),
             dict(multi_label=False, agnostic=True), dict(multi_label=True, max_nms=1000)]
    runs = [(pred[:, :n], 0.25, kw) for kw in cases for n in (3000, 300)]
    runs.append((pred[:2].reshape(1, 6000, 9), 0.001, dict(multi_label=True)))  # ~30000: CUDA also per class
    for p, conf, kw in runs:
        cpu = non_max_suppression(p, conf, 0.45, max_det=10 ** 6, **kw)
        gpu = non_max_suppression(p.cuda(), conf, 0.45, max_det=10 ** 6, **kw)
        assert all(g.is_cuda for g in gpu)
        assert [len(c) for c in cpu] == [len(g) for g in gpu], (kw, p.shape)
        for c, g in zip(cpu, gpu):
            assert torch.equal(c, g.cpu()), (kw, p.shape)


def test_the_fitted_checkpoint_scores_on_the_cpu(fitted_v8n, tiny_data, one_thread):
    """The CUDA comparison below compares real scores: the fixture's checkpoint finds objects."""
    loader, names = _tiny_val(tiny_data)
    model = TorchBackend.from_checkpoint(fitted_v8n, torch.device("cpu")).model
    result = evaluate_model(model, loader, torch.device("cpu"), names, DistInfo(), EvalOptions(fuse=False))
    assert result.metrics.map50 > 0.05 and result.metrics.map > 0


@pytest.mark.cuda
def test_cuda_and_cpu_score_a_checkpoint_alike(fitted_v8n, tiny_data, monkeypatch):
    """The evaluation (pre-processing, inference, NMS, matching, metrics) gives the same scores on both devices.
    Convolutions run in full fp32 on CUDA here: with cuDNN's TF32 (PyTorch's default) their outputs move by
    about 1e-3, enough to move a box across one of the ten IoU thresholds or reorder two scores, and 26 objects
    in 8 images turn one such change into more than 1e-3 of mAP."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    loader, names = _tiny_val(tiny_data)
    scores = []
    for device in (torch.device("cpu"), torch.device("cuda", 0)):
        model = TorchBackend.from_checkpoint(fitted_v8n, device).model
        result = evaluate_model(model, loader, device, names, DistInfo(), EvalOptions(fuse=False))
        scores.append(np.array([result.metrics.map50, result.metrics.map, result.metrics.mp, result.metrics.mr]))
    assert scores[0][0] > 0.05 and np.abs(scores[0] - scores[1]).max() < 1e-3, scores
