"""Small pieces of train.py that need no training run."""
from __future__ import annotations

import pytest
import torch

import train


def test_multi_scale_sizes_vary_within_range_on_stride_multiples_and_repeat():
    imgs = torch.zeros(2, 3, 320, 256)
    sizes = [tuple(train.rescale_batch(imgs, 320, 32, seed=0, epoch=1, i=i).shape[2:]) for i in range(30)]
    assert len(set(sizes)) > 5
    assert all(h % 32 == 0 and w % 32 == 0 and 160 <= max(h, w) <= 480 for h, w in sizes)
    assert sizes == [tuple(train.rescale_batch(imgs, 320, 32, seed=0, epoch=1, i=i).shape[2:]) for i in range(30)]
    assert sizes != [tuple(train.rescale_batch(imgs, 320, 32, seed=0, epoch=2, i=i).shape[2:]) for i in range(30)]


def test_loss_gains_scale_with_layers_classes_and_image_size():
    from utils.config import Hyp
    h = train.loss_hyp(Hyp(), nl=3, nc=80, imgsz=640)
    assert (h.box, h.cls, h.obj) == pytest.approx((Hyp().box, Hyp().cls, Hyp().obj))
    h = train.loss_hyp(Hyp(), nl=3, nc=8, imgsz=320)
    assert (h.cls, h.obj) == pytest.approx((Hyp().cls * 8 / 80, Hyp().obj * 0.25))
