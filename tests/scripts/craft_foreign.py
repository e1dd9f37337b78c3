"""Test helper: writes checkpoints shaped like YOLOv5's and Ultralytics' from plain specs.

Runs in its own process with only the stand-in packages on sys.path (tests/test_convert.py writes
them to a temp folder: models/, yolov5/, ultralytics/ and evil_mod with classes at the real module
and class paths), never this repo, whose models/ package would shadow YOLOv5's. torch.save then
pickles the stand-ins by those paths, exactly as the real packages pickle their classes.

usage: craft_foreign.py JOBS.pt
JOBS.pt (weights_only-safe) is a list of {"spec": {...}, "out": path, "payload": str}; a spec is
{"modules": [{"path", "cls", "params", "buffers", "attrs"}...] in named_modules order,
 "ckpt": top-level entries, "weights": "model" or "ema", "ema_offset": float added to the EMA copy's
 float parameters}. payload: "" | "system:<file>" | "exec:<file>" | "import" | "in-model:<file>".
"""
import importlib
import os
import sys

import torch
from torch import nn


class SystemCall:
    """Unpickling it with pickle's defaults runs ``touch <file>`` through os.system."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class ExecCall(SystemCall):
    """Unpickling it with pickle's defaults runs Python code through builtins.exec."""

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def build(entries: list[dict], offset: float = 0.0) -> nn.Module:
    """The module tree of the spec, each module an instance of its named class holding the spec's tensors."""
    built: dict[str, nn.Module] = {}
    for e in entries:
        module, _, name = e["cls"].rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        m = cls.__new__(cls)
        nn.Module.__init__(m)
        for k, v in e["params"].items():
            if v is not None and v.is_floating_point():
                v = v + offset
            m.register_parameter(k, None if v is None else nn.Parameter(v, requires_grad=v.is_floating_point()))
        for k, v in e["buffers"].items():
            m.register_buffer(k, v)
        for k, v in e["attrs"].items():
            setattr(m, k, v)
        m.training = False
        if e["path"]:
            parent, _, child = e["path"].rpartition(".")
            built[parent].add_module(child, m)
        built[e["path"]] = m
    return built[""]


def craft(spec: dict, out: str, payload: str) -> None:
    ckpt = dict(spec["ckpt"])
    model = build(spec["modules"])
    ckpt["model"], ckpt["ema"] = model, None
    if spec.get("weights") == "ema":
        ckpt["ema"] = build(spec["modules"], spec.get("ema_offset", 0.0))
    kind, _, arg = payload.partition(":")
    if kind == "system":
        ckpt["git"] = SystemCall(arg)
    elif kind == "exec":
        ckpt["git"] = ExecCall(arg)
    elif kind == "import":
        ckpt["git"] = importlib.import_module("evil_mod").Payload()
    elif kind == "in-model":
        first = next(iter(model.model.children()))
        first.hook = SystemCall(arg)
    torch.save(ckpt, out)


if __name__ == "__main__":
    for job in torch.load(sys.argv[1], weights_only=True):
        craft(job["spec"], job["out"], job["payload"])
