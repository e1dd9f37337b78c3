"""Small pieces of the training engine that need no training run."""
from __future__ import annotations

import pytest
import torch

from models.heads.anchor_loss import AnchorLossGains
from utils.core.hyp import Hyp
from utils.engine.loop import rescale_batch
from utils.engine.optim import make_scheduler


def test_multi_scale_sizes_vary_within_range_on_stride_multiples_and_repeat():
    imgs = torch.zeros(2, 3, 320, 256)
    sizes = [tuple(rescale_batch(imgs, 320, 32, seed=0, epoch=1, i=i).shape[2:]) for i in range(30)]
    assert len(set(sizes)) > 5
    assert all(h % 32 == 0 and w % 32 == 0 and 160 <= max(h, w) <= 480 for h, w in sizes)
    assert sizes == [tuple(rescale_batch(imgs, 320, 32, seed=0, epoch=1, i=i).shape[2:]) for i in range(30)]
    assert sizes != [tuple(rescale_batch(imgs, 320, 32, seed=0, epoch=2, i=i).shape[2:]) for i in range(30)]


def test_loss_gains_scale_with_layers_classes_and_image_size():
    h = AnchorLossGains.from_hyp(Hyp(), nl=3, nc=80, imgsz=640)
    assert (h.box, h.cls, h.obj) == pytest.approx((Hyp().box, Hyp().cls, Hyp().obj))
    h = AnchorLossGains.from_hyp(Hyp(), nl=3, nc=8, imgsz=320)
    assert (h.cls, h.obj) == pytest.approx((Hyp().cls * 8 / 80, Hyp().obj * 0.25))


def test_resumed_lr_schedule_matches_the_uninterrupted_one():
    """Resuming at epoch s must give every later epoch the LR the uninterrupted run gives it."""
    from utils.engine.optim import lr_lambda

    def fresh_optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.01, momentum=0.9)

    lf = lr_lambda(10, 0.01)
    opt = fresh_optimizer()
    sched = make_scheduler(opt, lf, 0)
    straight, saved = [], {}
    for epoch in range(10):
        straight.append(opt.param_groups[0]["lr"])  # the LR this epoch trains with
        sched.step()
        saved[epoch] = opt.state_dict()  # what the end-of-epoch checkpoint holds
    for s in (1, 4, 9):
        opt2 = fresh_optimizer()
        opt2.load_state_dict(saved[s - 1])
        sched2 = make_scheduler(opt2, lf, s)
        resumed = []
        for _ in range(s, 10):
            resumed.append(opt2.param_groups[0]["lr"])
            sched2.step()
        assert resumed == straight[s:], f"resume at epoch {s}"
