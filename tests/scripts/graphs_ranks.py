"""torchrun helper for tests/test_graphs.py: --cuda-graphs' distributed step on CPU ranks (gloo), its capture
replaced by the eager forward (graphs need a GPU; what is under test is what DDP wraps and reduces).

Each rank trains MODEL (yolov8n: the loss graphed with it; yolov5n: the model alone) for three steps on its
own batches two ways: DDP around the model, the loop's path without graphs, and StepLoss(graphs=True) with DDP
around its replayable unit. Rank 1's BatchNorm statistics start perturbed (DDP broadcasts rank 0's), its second
batch crowds one image past the first capture's slots (a capture anew on rank 1 alone, where the loss is
graphed), and the third batch is smaller (eager through DDP). Rank 0 writes one json line per rank to OUT:
equal losses, gradients and BatchNorm statistics between the two ways, and the captures taken.

usage: graphs_ranks.py OUT MODEL
"""
import copy
import functools
import json
import sys

import torch

from yolotrain.models.yolo import Model
from tests.helpers import ROOT
from yolotrain.utils.core import dist
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.engine.graphs import MIN_SLOTS, StepLoss

CPU = torch.device("cpu")


def eager_capture(captured: list, module: torch.nn.Module, args: tuple) -> object:
    """What capture_graphs hands back, minus the GPU: a forward for inputs like ``args`` (here the eager one)."""
    captured.append([tuple(a.shape) for a in args])
    return type(module).forward.__get__(module)


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(10 + rank)
    out = []
    for n, crowd in ((4, 1), (4, MIN_SLOTS + 4 if rank == 1 else 1), (2, 1)):
        rows = torch.cat([torch.arange(n).repeat_interleave(2)[:, None].float(), torch.randint(0, 3, (2 * n, 1),
                          generator=g).float(), torch.rand(2 * n, 2, generator=g) * 0.6 + 0.2,
                          torch.rand(2 * n, 2, generator=g) * 0.2 + 0.1], 1)
        rows = torch.cat([rows, rows[:1].repeat(crowd - 1, 1)])  # image 0 holds crowd labels more
        out.append((torch.rand(n, 3, 64, 64, generator=g), rows))
    return out


def compare(rank: int, world: int, name: str) -> dict:
    """This rank's three steps both ways: what equals what, the captures taken, the last gradients' sum."""
    torch.manual_seed(0)
    plain = Model(ROOT / "models" / f"{name}.yaml", nc=3).train()
    if rank == 1:
        with torch.no_grad():
            for m in plain.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.add_(1.0)
    graphed = copy.deepcopy(plain)
    reference = dist.smart_DDP(plain, CPU)
    ref_loss = reference.module.detect.build_criterion(Hyp(), 64)
    captured: list = []
    step = StepLoss(graphed, graphed.detect.build_criterion(Hyp(), 64), graphs=True,
                    wrap=functools.partial(dist.smart_DDP, device=CPU), capture=functools.partial(eager_capture,
                                                                                                  captured))
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.01) for m in (plain, graphed)]
    report = {"rank": rank, "equal_losses": [], "equal_grads": [], "equal_buffers": []}
    for images, targets in batches(rank):
        losses = []
        for model, loss_of in ((reference, lambda i, t: ref_loss(reference(i), t)), (graphed, step)):
            model.zero_grad(set_to_none=True)
            loss, _ = loss_of(images, targets)
            (loss * world).backward()
            losses.append(loss.detach())
        a, b = reference.module, graphed
        report["equal_losses"].append(bool(torch.equal(*losses)))
        report["equal_grads"].append(all((p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
                                         for p, q in zip(a.parameters(), b.parameters())))
        report["equal_buffers"].append(all(torch.equal(x, y) for x, y in zip(a.buffers(), b.buffers())))
        for opt in optimizers:  # a step, so the next batch's gradients are of new weights on both
            opt.step()
    report["captures"] = captured
    report["grad_sum"] = float(sum(p.grad.double().sum() for p in graphed.parameters() if p.grad is not None))
    return report


def main(out: str, name: str) -> None:
    info = dist.dist_info()
    with dist.process_group(info, CPU):  # the trainer's group and teardown (its DDP wrappers released first)
        reports = dist.all_gather_object(compare(info.rank, info.world_size, name))
        if info.is_main:
            with open(out, "w") as f:
                f.write("\n".join(json.dumps(r) for r in reports) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
