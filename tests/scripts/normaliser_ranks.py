"""torchrun helper for tests/test_step.py: one step's gradients on two CPU ranks (gloo, DDP) against one process's
at the same global batch, for the three loss families.

Each rank takes half of a batch of 8 images whose halves hold different numbers of objects (rank 0: five per
image, rank 1: one), computes the training loss with the step's normalisers (``Ranks(2)``: every rank's counts)
and, as the control, with its own counts alone, backpropagates ``loss * world`` through DDP, and rank 0 compares
the averaged gradients with one process's on all 8 images. BatchNorm runs on its running statistics (eval), which
is what --sync-bn's exchange makes equal across ranks; the loss's normalisers are what is under test. Rank 0
writes one json line per model: the largest gradient difference over the largest gradient, for each normaliser.

usage: normaliser_ranks.py OUT
"""
import copy
import json
import sys

import torch

from yolotrain.models.heads.base import ALONE, Ranks
from yolotrain.models.yolo import Model
from tests.helpers import ROOT
from yolotrain.utils.core import dist
from yolotrain.utils.core.hyp import Hyp

MODELS = ("yolov5n", "yolov8n", "yolo26n")
CPU = torch.device("cpu")


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 images of 64 px; images 0-3 hold five objects each, images 4-7 one."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for image in range(8):
        for _ in range(5 if image < 4 else 1):
            wh = torch.rand(2, generator=g) * 0.3 + 0.1
            xy = torch.rand(2, generator=g) * (1 - wh) + wh / 2
            rows.append(torch.cat([torch.tensor([float(image), float(torch.randint(0, 3, (1,), generator=g))]), xy, wh]))
    return torch.rand(8, 3, 64, 64, generator=g), torch.stack(rows)


def half(images: torch.Tensor, targets: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    mine = targets[(targets[:, 0] >= 4 * rank) & (targets[:, 0] < 4 * rank + 4)].clone()
    mine[:, 0] -= 4 * rank
    return images[4 * rank:4 * rank + 4], mine


def gradients(model: torch.nn.Module, criterion, images: torch.Tensor, targets: torch.Tensor, ranks: Ranks,
              scale: float) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss, _ = criterion(model(images), targets, ranks)
    (loss * scale).backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def build(name: str) -> Model:
    torch.manual_seed(0)
    model = Model(ROOT / "models" / f"{name}.yaml", nc=3).train()
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.eval()  # running statistics: equal on every rank (what --sync-bn makes of the batch's)
    return model


def compare(rank: int, world: int) -> list[dict]:
    """Per model, on rank 0: each normaliser's largest gradient difference from one process's, relative."""
    images, targets = batch()
    lines = []
    for name in MODELS:
        plain = build(name)
        criterion = plain.detect.build_criterion(Hyp(), 64)
        reference = gradients(copy.deepcopy(plain), criterion, images, targets, ALONE, 1.0) if rank == 0 else None
        ddp = dist.smart_DDP(plain, CPU)
        report = {"model": name}
        for label, ranks in (("global", Ranks(world)), ("per-rank", ALONE)):
            grads = gradients(ddp, criterion, *half(images, targets, rank), ranks, float(world))
            if rank == 0:
                top = max(r.abs().max() for r in reference)
                report[label] = float(max((g - r).abs().max() for g, r in zip(grads, reference)) / top)
        lines.append(report)
    return lines


def main(out: str) -> None:
    info = dist.dist_info()
    with dist.process_group(info, CPU):  # the trainer's group and teardown (its DDP wrappers released first)
        lines = compare(info.rank, info.world_size)
        if info.is_main:
            with open(out, "w") as f:
                f.write("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main(sys.argv[1])
