#!/usr/bin/env python
"""Kernel launches one training step dispatches, phase by phase, for yolotrain and (--ultralytics-python)
Ultralytics 8.4.190, counted on the CPU.

    python bench/step_launches.py --models yolov8n yolo26n --batch 16 [--ultralytics-python U]

On a GPU every operator counted here is a kernel launch (or more) with its host-side dispatch; on GPU hosts with
slow cores that, not the arithmetic, sets the time of a small model's step (docs/benchmarks.md, "GPU training").
The count is a property of the code, not of the machine: a torch dispatch mode counts the aten operators of the
second of two steps (the first builds what later steps keep), leaving out views, allocations and other operators
that launch nothing. The step runs as a CUDA run would: autocast (bf16 on the CPU standing in for CUDA's fp16,
which casts the same tensors), the loss, backward, then the optimizer step as each tool's trainer takes it
(gradient clipping to 10, the AdamW step, zeroing, the EMA). The optimizer is each tool's CUDA choice: ours fused
AdamW, Ultralytics' its three parameter groups in torch's foreach AdamW (torch's default on CUDA; its CPU default
is a loop per tensor, which no GPU run takes). Images and labels are random (the counts do not depend on them,
except the loss's through the largest label count per image, kept equal for both tools).

``--tool ultralytics`` is the mode the script runs itself in under Ultralytics' interpreter; the module level
imports only the standard library.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("forward", "loss", "backward", "optimizer")
# operators that launch no kernel: views, metadata, allocations
NO_LAUNCH = {"view", "unsqueeze", "squeeze", "expand", "select", "slice", "split", "split_with_sizes", "unbind", "t",
             "transpose", "permute", "alias", "detach", "as_strided", "_unsafe_view", "chunk", "reshape", "flatten",
             "unflatten", "empty", "empty_like", "lift_fresh", "_reshape_alias", "diagonal", "narrow", "view_as",
             "expand_as", "new_empty", "empty_strided", "_record_function_enter_new", "_record_function_exit",
             "promote_types", "is_nonzero", "_local_scalar_dense", "set_", "resize_", "_to_copy_meta"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["yolov8n"], help="model names (models/<name>.yaml; Ultralytics' own)")
    p.add_argument("--batch", type=int, default=16, help="images per step")
    p.add_argument("--imgsz", type=int, default=64, help="image size (the counts do not depend on it)")
    p.add_argument("--labels", type=int, default=6, help="labels per image")
    p.add_argument("--classes", type=int, default=11)
    p.add_argument("--ultralytics-python", help="an interpreter that imports ultralytics: its step counted beside ours")
    p.add_argument("--tool", choices=("ours", "ultralytics"), default="ours", help=argparse.SUPPRESS)
    p.add_argument("--json", help="write the counts here")
    return p


def counter():
    """A dispatch mode counting launching operators by name (torch imported only when counting)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in NO_LAUNCH:
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    return Count()


def batch(args: argparse.Namespace):
    """Random images and (image, class, xc, yc, w, h) rows, the same for both tools."""
    import torch
    g = torch.Generator().manual_seed(0)
    n = args.batch * args.labels
    image = torch.arange(args.batch).repeat_interleave(args.labels).float()[:, None]
    rows = torch.cat([image, torch.randint(0, args.classes, (n, 1), generator=g).float(),
                      torch.rand(n, 2, generator=g) * 0.6 + 0.2, torch.rand(n, 2, generator=g) * 0.2 + 0.05], 1)
    return torch.rand(args.batch, 3, args.imgsz, args.imgsz, generator=g), rows


def count_steps(forward, loss, backward, step) -> dict:
    """The launches of each phase in the second of two steps."""
    import torch
    counts: dict = {}
    for _ in range(2):
        counts = {}
        state: dict = {}
        for phase in PHASES:
            c = counter()
            with c:
                if phase == "forward":
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        state["preds"] = forward()
                elif phase == "loss":
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        state["loss"] = loss(state["preds"])
                elif phase == "backward":
                    backward(state["loss"])
                else:
                    step()
            counts[phase] = {"launches": sum(c.ops.values()), "top": c.ops.most_common(6)}
    return counts


def ours(name: str, args: argparse.Namespace) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch
    from yolotrain.models.yolo import Model
    from yolotrain.utils.core.hyp import Hyp
    from yolotrain.utils.engine.step import optimizer_step
    from yolotrain.utils.engine.optim import ModelEMA
    torch.manual_seed(0)
    model = Model(ROOT / "models" / f"{name}.yaml", nc=args.classes).train()
    criterion = model.detect.build_criterion(Hyp(), args.imgsz)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler, ema = torch.amp.GradScaler("cpu", enabled=False), ModelEMA(model)
    imgs, rows = batch(args)
    return count_steps(lambda: model(imgs), lambda preds: criterion(preds, rows)[0], lambda loss: loss.backward(),
                       lambda: optimizer_step(model, optimizer, scaler, ema))


def ultralytics(name: str, args: argparse.Namespace) -> dict:
    import torch
    from torch import nn
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel
    from ultralytics.utils.torch_utils import ModelEMA
    torch.manual_seed(0)
    model = DetectionModel(f"{name}.yaml", nc=args.classes, verbose=False).train()
    model.args = get_cfg()
    criterion = model.init_criterion()
    groups: list[list] = [[], [], []]  # its build_optimizer's: decayed weights, norm weights, biases
    for module in model.modules():
        for pname, p in module.named_parameters(recurse=False):
            groups[2 if "bias" in pname else 1 if isinstance(module, nn.BatchNorm2d) else 0].append(p)
    optimizer = torch.optim.AdamW([{"params": g} for g in groups], lr=1e-3, betas=(0.9, 0.999), foreach=True)
    scaler, ema = torch.amp.GradScaler("cpu", enabled=False), ModelEMA(model)
    imgs, rows = batch(args)
    labels = {"batch_idx": rows[:, 0], "cls": rows[:, 1:2], "bboxes": rows[:, 2:6], "img": imgs}

    def step() -> None:  # its trainer's optimizer_step
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=10.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        ema.update(model)

    return count_steps(lambda: model(imgs), lambda preds: criterion(preds, labels)[0].sum(),
                       lambda loss: loss.backward(), step)


def measure(args: argparse.Namespace) -> dict:
    """This interpreter's tool, every model."""
    import torch
    torch.set_num_threads(1)
    run = ours if args.tool == "ours" else ultralytics
    return {name: run(name, args) for name in args.models}


def peer(args: argparse.Namespace) -> dict:
    """Ultralytics' counts from its own interpreter (this script in --tool ultralytics mode)."""
    env = {**os.environ, "YOLO_OFFLINE": "1", "YOLO_AUTOINSTALL": "false",
           "YOLO_CONFIG_DIR": os.environ.get("YOLO_CONFIG_DIR", "/tmp/yolo_cfg"),
           "MPLCONFIGDIR": os.environ.get("MPLCONFIGDIR", "/tmp/mpl")}
    argv = [args.ultralytics_python, __file__, "--tool", "ultralytics", "--models", *args.models, "--batch",
            str(args.batch), "--imgsz", str(args.imgsz), "--labels", str(args.labels), "--classes", str(args.classes)]
    p = subprocess.run(argv, capture_output=True, text=True, env=env, cwd="/tmp", timeout=600)
    if p.returncode != 0:
        sys.exit(f"Ultralytics' count failed ({args.ultralytics_python}):\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.tool == "ultralytics":
        print(json.dumps(measure(args)))
        return
    results = {"ours": measure(args)}
    if args.ultralytics_python:
        results["ultralytics"] = peer(args)
    print(f"kernel launches per training step, batch {args.batch}, {args.labels} labels per image, autocast, "
          "the second of two steps")
    tools = list(results)
    print(f"{'model':10s} {'phase':10s}" + "".join(f"{t:>13s}" for t in tools) + ("   ours/ultralytics" if len(tools) > 1 else ""))
    for name in args.models:
        for phase in (*PHASES, "total"):
            row = [sum(results[t][name][p]["launches"] for p in PHASES) if phase == "total"
                   else results[t][name][phase]["launches"] for t in tools]
            ratio = f"   {row[0] / row[1]:.2f}x" if len(row) > 1 and row[1] else ""
            print(f"{name:10s} {phase:10s}" + "".join(f"{v:13d}" for v in row) + ratio)
    for t in tools:
        for name in args.models:
            print(f"{t} {name} most launched: " + "; ".join(
                f"{p} " + ", ".join(f"{op} {n}" for op, n in results[t][name][p]["top"][:4]) for p in PHASES))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
