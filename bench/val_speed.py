#!/usr/bin/env python
"""val.py speed: end-to-end images/s (load checkpoint -> results) and where the time goes.

    python bench/val_speed.py                                  # fresh yolov5n, built-in shapes val split
    python bench/val_speed.py --weights runs/train/exp/weights/best.pt --runs 3
    python bench/val_speed.py --model s --imgsz 640 --batch-size 16 --device cpu

Runs val.py's own ``main`` in this process, unchanged, and times it from outside by wrapping a
few module-level names that val.py and the evaluation library call (each is looked up when called,
so the wrapper sees every call; a name no longer there is reported as n/a instead of failing):

  end-to-end   val.main: parse -> load checkpoint -> data -> loader -> evaluate_model -> files
  set-up       end-to-end minus evaluate_model and plots: checkpoint, dataset yaml, label cache,
               loader, fuse, metrics.json (written with the plots)
  data wait    time evaluate_model spent waiting for the next batch, worker start-up included
               (val.py's loader is wrapped)
  pre-process, inference, NMS   the evaluation's own per-image figures (EvalResult.speed_ms,
               first batch left out) x the images, so "other" absorbs their difference from the
               actual seconds (negative when the machine's load changed during the run)
  matching     yolotrain.utils.eval.metrics.match_image, per image, inside the loop
  evaluate     yolotrain.utils.eval.metrics.evaluate, once at the end (COCO accumulation)
  plots        val.py's save_eval_plots: batch pictures, curves, confusion matrix (off with --noplots)
  other        the rest of evaluate_model: eval mode and layout, the first batch (left out of
               val.py's speed figures), mapping boxes back to original pixels, confusion matrix,
               gather/broadcast, progress bar

Without --weights a freshly initialised model (seeded) is saved to a temporary checkpoint: no
download, but an untrained model emits few boxes above conf 0.001, so NMS and matching are
cheaper than for a trained checkpoint; pass --weights for representative NMS/metric figures.
The first run also pays cold caches (imports, file system); each run is printed.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from yolotrain.utils.core.cli import IMGSZ, ArgumentParser, Range  # noqa: E402


class Timers:
    """Accumulated seconds per label, fed by wrapped functions and the loader proxy."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._originals: list[tuple[Any, str, Any]] = []

    def wrap(self, module: Any, name: str, label: str) -> bool:
        """Replace ``module.name`` by a timed call of the same function; False if it does not exist."""
        inner = getattr(module, name, None)
        if inner is None:
            return False

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - t
                self.calls[label] += 1

        self.replace(module, name, timed)
        return True

    def replace(self, module: Any, name: str, value: Any) -> None:
        """Set ``module.name``, remembering the original for ``restore``."""
        self._originals.append((module, name, getattr(module, name)))
        setattr(module, name, value)

    def restore(self) -> None:
        """Put every replaced name back (last replaced first)."""
        while self._originals:
            module, name, value = self._originals.pop()
            setattr(module, name, value)


class TimedLoader:
    """A DataLoader stand-in that times each wait for the next batch and passes everything else on."""

    def __init__(self, loader: Any, timers: Timers) -> None:
        self._loader, self._timers = loader, timers
        self.dataset = loader.dataset

    def __iter__(self):
        it = iter(self._loader)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                self._timers.seconds["data wait"] += time.perf_counter() - t
            yield batch

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def fresh_checkpoint(size: str, imgsz: int, data: str, seed: int, folder: Path) -> Path:
    """A seeded, untrained model saved as val.py expects a training checkpoint."""
    from yolotrain.models.parse import MODELS_DIR
    from yolotrain.models.yolo import Model
    from yolotrain.utils.data.config import load_data_config
    from yolotrain.utils.weights.checkpoint import fp32_state_dict, save_checkpoint, to_plain

    names = load_data_config(data).names
    torch.manual_seed(seed)
    model = Model(MODELS_DIR / f"yolov5{size}.yaml", nc=len(names))
    state = fp32_state_dict(model)
    path = folder / f"fresh_yolov5{size}.pt"
    save_checkpoint({"epoch": -1, "model_yaml": to_plain(model.yaml), "model": state, "ema": state,
                     "args": {"imgsz": imgsz, "data": str(data)}, "names": list(names)}, path)
    return path


def instrument(timers: Timers) -> list[str]:
    """Wrap the names val.py and the evaluation call; returns the labels that could not be wrapped."""
    import yolotrain.utils.eval.evaluate as evaluation
    from yolotrain.app import val

    missing = []
    build = getattr(val, "build_loader", None)
    if build is not None:
        timers.replace(val, "build_loader", lambda *args, **kwargs: TimedLoader(build(*args, **kwargs), timers))
    else:
        missing.append("data wait")
    for module, name, label in ((val, "evaluate_model", "evaluation"), (evaluation, "match_image", "matching"),
                                (evaluation, "evaluate", "evaluate"), (val, "save_eval_plots", "plots")):
        if not timers.wrap(module, name, label):
            missing.append(label)
    if "evaluation" in missing:  # both are differences with the evaluation's time
        missing += ["set-up", "other"]
    return missing


def one_run(argv: list[str]) -> dict[str, Any]:
    """val.main once, with fresh timers; returns its figures in seconds."""
    from yolotrain.app import val

    timers = Timers()
    try:
        missing = instrument(timers)
        t = time.perf_counter()
        result = val.main(val.parse_opt(argv))[0]
        total = time.perf_counter() - t
    finally:
        timers.restore()
    n = result.images
    pre, inf, nms = (v * n / 1e3 for v in result.speed_ms)
    s = timers.seconds
    known = s["data wait"] + pre + inf + nms + s["matching"] + s["evaluate"]
    return {"images": n, "total": total, "evaluation": s["evaluation"],
            "set-up": total - s["evaluation"] - s["plots"], "data wait": s["data wait"], "pre-process": pre,
            "inference": inf, "NMS": nms, "matching": s["matching"], "evaluate": s["evaluate"], "plots": s["plots"],
            "other": s["evaluation"] - known, "missing": missing, "map": result.metrics.map,
            "map50": result.metrics.map50}


def format_run(k: int, r: dict[str, Any]) -> str:
    parts = ("set-up", "data wait", "pre-process", "inference", "NMS", "matching", "evaluate", "other", "plots")
    n = max(r["images"], 1)
    lines = [f"run {k}: {r['images']} images, end-to-end {r['total']:.2f}s = {n / r['total']:.1f} img/s "
             f"(evaluate_model alone {n / max(r['evaluation'], 1e-9):.1f} img/s); "
             f"mAP50 {r['map50']:.4f} mAP50-95 {r['map']:.4f}"]
    for p in parts:
        v, total = r[p], r["total"]
        if p in r["missing"]:
            lines.append(f"  {p:<12}{'n/a':>10}")
        else:
            lines.append(f"  {p:<12}{v:9.2f}s{1e3 * v / n:9.2f} ms/img{100 * v / total:7.1f}%")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like val.py's."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", default=None, help="checkpoint to score (default: a fresh model, see above)")
    p.add_argument("--model", default="n", help="size of the fresh model when no --weights")
    p.add_argument("--data", default=str(ROOT / "data" / "shapes.yaml"), help="dataset yaml")
    p.add_argument("--imgsz", type=IMGSZ, default=320)
    p.add_argument("--batch-size", type=Range(int, min=1), default=32, help="val.py's default")
    p.add_argument("--workers", type=Range(int, min=0), default=8, help="val.py's default (capped at the cores)")
    p.add_argument("--device", default="", help="'' (auto), cpu, 0 ...")
    p.add_argument("--seed", type=Range(int, min=0), default=0, help="seed of the fresh model")
    p.add_argument("--runs", type=Range(int, min=1), default=2, help="end-to-end runs (the first one is cold)")
    p.add_argument("--noplots", action="store_true", help="pass --noplots to val.py (plots are timed otherwise)")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="pass --channels-last or --no-channels-last to val.py (default: val.py's for the device)")
    return p


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="val_speed_") as tmp:
        weights = a.weights or str(fresh_checkpoint(a.model, a.imgsz, a.data, a.seed, Path(tmp)))
        val_argv = ["--weights", weights, "--data", a.data, "--imgsz", str(a.imgsz), "--batch-size",
                    str(a.batch_size), "--workers", str(a.workers), "--device", a.device]
        val_argv += ["--project", str(Path(tmp) / "runs"), "--exist-ok"]  # val.py's result files go to the temp dir
        val_argv += ["--noplots"] if a.noplots else []
        val_argv += [] if a.channels_last is None else ["--channels-last" if a.channels_last else "--no-channels-last"]
        print(f"val.py {' '.join(val_argv)}  ({torch.get_num_threads()} threads)", flush=True)
        runs = [one_run(val_argv) for _ in range(a.runs)]
    print()
    for k, r in enumerate(runs, 1):
        print(format_run(k, r))


if __name__ == "__main__":
    main()
