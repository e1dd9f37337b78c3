#!/usr/bin/env python
"""Side by side with the PyPI ``ultralytics`` package (8.4.190) on anchor-free models: seconds per
training epoch and per validation pass, peak memory, and final accuracy scored twice (each tool's
own validator, and one COCOeval over both tools' predictions), measured back to back in one run.

    U=/work/ultra-venv/bin/python
    python bench/compare_ultralytics.py --ultralytics-python $U
    python bench/compare_ultralytics.py --ultralytics-python $U --epochs 2 --imgsz 128 --n-train 32 --n-val 16
    python bench/compare_ultralytics.py --ultralytics-python $U --data /work/photo800/data.yaml --epochs 5 --rounds 2

How it runs offline (facts from shared/notes/running-ultralytics-offline.md):
  * ultralytics lives in its own venv, never in this repo's:
        python -m venv /work/ultra-venv
        /work/ultra-venv/bin/pip install torch torchvision ultralytics==8.4.190 faster-coco-eval
    (faster-coco-eval: its save_json would pip-install it otherwise) and pass its interpreter as
    --ultralytics-python. This repo never imports ultralytics; tests never run this.
  * Every ultralytics process gets YOLO_CONFIG_DIR and MPLCONFIGDIR inside the work dir,
    YOLO_OFFLINE=1 and YOLO_AUTOINSTALL=false; `yolo settings` turns off sync and every logger
    integration and points its datasets/weights/runs dirs into the work dir, once per work dir.
    Both tools train from scratch (ultralytics: model=<name>.yaml pretrained=False) and plots=False
    (its plots would download a font): nothing is downloaded.
  * Each tool gets its own copy of the dataset in the work dir (both write label caches next to the
    labels; --n-train/--n-val take the first N images of each split in sorted path order).

Same settings for both: images, model (``--model yolov8n`` = our models/yolov8n.yaml = Ultralytics'
yolov8n.yaml, the same architecture), image size, batch, epochs, seed, CPU, torch threads
(--threads: ours via its --threads flag; Ultralytics sizes its pool as min(8, cores - 1), one
thread on 2 cores, so the shim sets its NUM_THREADS before select_device applies it), validation
after every epoch at 2 x batch (Ultralytics' training val batch), no plots. Left at each tool's own
defaults for this family, and printed: hyperparameters (ours picks hyps/hyp.v8.yaml, Ultralytics'
default.yaml values; no --hyp), close_mosaic, NMS IoU of the final val (ours 0.6, Ultralytics 0.7),
and the optimizer (both default to auto: AdamW with an lr from the class count on short runs; Ultralytics
accumulates to 64 images per step, ours steps every 16 on such runs). Loader workers: Ultralytics forces 0 on CPU whatever it is given,
so --workers defaults to 0 and ours gets the same number, both loading in the training process
(pass --workers 2 to see ours with loader processes); the table shows what each actually used.

Method: each tool runs inside a small timing shim (written to the work dir, run with that tool's
interpreter) that calls the tool's own entry point unchanged (ours: train.cli / val.main;
Ultralytics: ultralytics.cfg.entrypoint, i.e. the `yolo` command) and records wall-clock stamps:
  ours         yolotrain.utils.engine.loop's train_one_epoch and evaluate_model are wrapped (loop.py calls both
               by those module-level names; evaluate_model is the validation pass)
  ultralytics  'on_train_epoch_start' / 'on_train_epoch_end' callbacks (added to its default
               callbacks, which every model copies) and BaseValidator.__call__ (every validation)
so "train s/epoch" is the batch loop of one epoch and "val s/epoch" the validation pass after it
(Ultralytics' final validation of best.pt is reported separately, not averaged in). With two or
more epochs the steady figure is the mean over epochs 2..E. Peak RSS is os.wait4's ru_maxrss of
each tool process: the largest resident set of the process or of any loader worker it reaped.

Accuracy: each tool's best.pt is validated standalone with its own validator and save-json (ours
val.py --save-json, Ultralytics `yolo detect val save_json=True`), giving each tool's own mAP50-95
and mAP50. Both predictions files are then scored by pycocotools' COCOeval against one ground truth
per dataset copy (utils/eval/coco.export_split, ids as in val.py's json), with maxDets 300 (both
tools' max_det), so the two figures come from the same scorer. Ultralytics' file is mapped first:
its image_id is the file stem (an int when numeric), its category_id the class index + 1.

With --rounds R both tools run R times, in alternating order, each round on a fresh dataset copy;
every time is the best of its R measurements (a busy machine only ever adds time), accuracy and
counts come from the first round and peak RSS is the largest seen.

Precision: each tool's default on the device. Ours trains under bf16 autocast where the CPU has
native bf16 (train.py's --amp default; its validation in training follows), Ultralytics in fp32 (it
turns AMP off on CPU); our standalone val.py scores in fp32 unless --half (bf16, as the
validation in training).

Timing runs must be alone on the machine; figures from a busy machine are only indicative.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.compare_yolov5 import base_env, epoch_times, steady, write_yaml  # noqa: E402
from yolotrain.utils.core.cli import IMGSZ, SEED, ArgumentParser, Range  # noqa: E402

MAX_DET = 300  # both tools' default val max_det; COCOeval scores this many per image (its default is 100)
MODEL_NAME = re.compile(r"(yolov8|yolo11|yolo26)[nsmlx]|yolov5[nsmlx]u")  # Ultralytics' anchor-free families

# Run by either interpreter: sys.argv = [shim, mode, events.json, ROOT, *rest]. Records (what, start,
# end, extra) stamps around the tool's own functions and writes them, with facts about the run, as JSON.
# Ultralytics modes take the torch thread count as the first of *rest, the tool's own arguments after it.
SHIM = r'''
import json, sys, time
mode, events_path, root, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
events, facts, t_process = [], {}, time.perf_counter()

def stamp(what, start, extra=None):
    events.append({"what": what, "start": start - t_process, "end": time.perf_counter() - t_process,
                   "extra": extra})

def wrap(module, name, what, on_result=None):
    inner = getattr(module, name)
    def timed(*a, **k):
        t, out = time.perf_counter(), None
        try:
            out = inner(*a, **k)
            return out
        finally:
            stamp(what, t)
            if on_result is not None and out is not None:
                on_result(out)
    setattr(module, name, timed)

def describe_optimizer(opt):
    # from the param groups, not opt.defaults: Ultralytics passes lr per group (defaults keep torch's)
    g = opt.param_groups[0]
    lrs = sorted({x.get("initial_lr", x["lr"]) for x in opt.param_groups})  # initial_lr: before warmup
    return {"name": type(opt).__name__, "lr": lrs, "momentum": g["betas"][0] if "betas" in g else g.get("momentum")}

def n_params(model):
    return sum(p.numel() for p in model.parameters())

def save():
    import torch
    facts["threads"] = torch.get_num_threads()
    with open(events_path, "w") as f:
        json.dump({"events": events, "facts": facts}, f)

if mode == "ours-train":
    sys.path.insert(0, root)
    sys.argv = ["train.py", *argv]
    from yolotrain.app import train
    from yolotrain.utils.engine import loop
    def setup(t):
        facts.update(optimizer=describe_optimizer(t.step.optimizer), params=n_params(t.step.model),
                     train_workers=t.train_loader.num_workers, val_workers=t.val_loader.num_workers,
                     mosaic_off_from_epoch=t.train_loader.sampler.mosaic_off_from_epoch, mosaic=float(t.hyp.mosaic))
    wrap(train, "build_training", "setup", setup)
    wrap(loop, "train_one_epoch", "train")  # called by name from loop.run_epochs
    wrap(loop, "evaluate_model", "val")  # ... and from loop.validate
    rc = train.cli(argv)
    save()
    sys.exit(rc)
elif mode == "ours-val":
    sys.path.insert(0, root)
    sys.argv = ["val.py", *argv]
    from yolotrain.app import val
    wrap(val, "get_loader", "loader", lambda loader: facts.update(val_workers=loader.num_workers))
    r = val.main(val.parse_opt(argv))[0]
    facts.update(speed_ms={"pre-process": r.speed_ms[0], "inference": r.speed_ms[1], "NMS": r.speed_ms[2]},
                 map50=r.metrics.map50, map=r.metrics.map)
    save()
elif mode in ("ultralytics-train", "ultralytics-val"):
    threads, argv = int(argv[0]), argv[1:]
    sys.argv = ["yolo", *argv]  # before the import: ultralytics.utils keeps it as ARGV, entrypoint's arguments
    import ultralytics.utils.torch_utils as tu
    tu.NUM_THREADS = threads  # select_device sets torch's threads to this (default min(8, cores - 1))
    from ultralytics.cfg import entrypoint
    from ultralytics.engine.validator import BaseValidator
    from ultralytics.utils.callbacks import base as callbacks
    inner_val = BaseValidator.__call__
    def timed_val(self, *a, **k):
        t = time.perf_counter()
        out = inner_val(self, *a, **k)
        metrics = {k: float(v) for k, v in out.items()} if isinstance(out, dict) else None
        stamp("val", t, {"speed_ms": dict(self.speed), "metrics": metrics, "save_dir": str(self.save_dir),
                         "workers": self.dataloader.num_workers if self.dataloader is not None else None})
        return out
    BaseValidator.__call__ = timed_val
    if mode == "ultralytics-train":  # every model (and so its trainer) copies the default callbacks
        starts = []
        def on_train_start(tr):
            facts.update(optimizer=describe_optimizer(tr.optimizer), params=n_params(tr.model),
                         train_workers=tr.train_loader.num_workers, val_workers=tr.test_loader.num_workers,
                         close_mosaic=int(tr.args.close_mosaic), mosaic=float(tr.args.mosaic))
        added = {"on_train_start": on_train_start,
                 "on_train_epoch_start": lambda tr: starts.append(time.perf_counter()),
                 "on_train_epoch_end": lambda tr: stamp("train", starts[-1]),
                 "on_train_end": lambda tr: facts.update(best=str(tr.best))}
        for event, fn in added.items():
            callbacks.default_callbacks[event].append(fn)
    entrypoint()
    save()
else:
    raise SystemExit(f"unknown mode {mode}")
'''

# `yolo settings` for a fresh YOLO_CONFIG_DIR: no sync, no logger integrations, folders in the work dir.
# sys.argv is set before the import: ultralytics.utils keeps it as ARGV, the arguments entrypoint reads.
SETTINGS = ("import sys\nsys.argv = ['yolo', 'settings', *sys.argv[1:]]\n"
            "from ultralytics.cfg import entrypoint\nentrypoint()\n")


def model_name(text: str) -> str:
    """--model: a sized anchor-free model name both tools know (yolov8n, yolo11s, yolov5nu, ...)."""
    if not MODEL_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: expected yolov8<size>, yolo11<size>, yolo26<size> or yolov5<size>u, "
                                         "size one of n s m l x (e.g. yolov8n, yolo11n, yolov5nu)")
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The benchmark's flags, range-checked at parse time like train.py's."""
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ultralytics-python", required=True,
                   help="python of the venv that has ultralytics 8.4.190 and faster-coco-eval")
    p.add_argument("--data", default=None,
                   help="YOLO-format dataset yaml (default: this repo's built-in shapes dataset, generated if needed)")
    p.add_argument("--model", type=model_name, default="yolov8n",
                   help="models/<name>.yaml for ours, <name>.yaml for Ultralytics")
    p.add_argument("--epochs", type=Range(int, min=1), default=2, help="training epochs for each tool")
    p.add_argument("--imgsz", type=IMGSZ, default=320)
    p.add_argument("--batch-size", type=Range(int, min=1), default=16, help="training batch (val in training: 2x)")
    p.add_argument("--val-batch-size", type=Range(int, min=1), default=32, help="standalone validation batch")
    p.add_argument("--workers", type=Range(int, min=0), default=0,
                   help="loader workers given to both (Ultralytics uses 0 on CPU whatever it is given)")
    p.add_argument("--threads", type=Range(int, min=1), default=2, help="torch threads of each tool")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--n-train", type=Range(int, min=0), default=0, help="use the first N training images (0: all)")
    p.add_argument("--n-val", type=Range(int, min=0), default=0, help="use the first N validation images (0: all)")
    p.add_argument("--rounds", type=Range(int, min=1), default=1,
                   help="run both tools this many times, alternating their order; report each time's best")
    p.add_argument("--workdir", "--work-dir", dest="workdir", default=None,
                   help="where datasets, runs and logs go (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the default temp work dir")
    p.add_argument("--half", action="store_true",
                   help="our standalone val.py with --half (bf16 on CPU, as its validation in training under --amp)")
    p.add_argument("--only", choices=("ours", "ultralytics"), default=None, help="run one tool only (debugging)")
    p.add_argument("--ours-args", type=shlex.split, default=[], metavar="FLAGS",
                   help='extra train.py flags for ours, one shell-quoted string after an "=" '
                        '(--ours-args="--cos-lr --micro-steps off"); printed in the report')
    return p


# ---------------------------------------------------------------------------------------------- set-up


def source_dataset(data: str | None) -> tuple[dict[str, list[str]], list[str]]:
    """Image files of the train and val splits of ``data`` (the shapes yaml, generated on first use,
    when None) and its class names. Both tools then read copies, never the source."""
    from yolotrain.utils.core.logging import setup_logging
    from yolotrain.utils.data.config import load_data_config, prepare_dataset
    from yolotrain.utils.data.labels import resolve_image_files

    setup_logging(verbose=False)
    cfg = load_data_config(data or ROOT / "data" / "shapes.yaml")
    prepare_dataset(cfg)
    return {"train": resolve_image_files(cfg.train), "val": resolve_image_files(cfg.val)}, cfg.names


def copy_dataset(splits: dict[str, list[str]], names: list[str], dst: Path, n: dict[str, int]) -> Path:
    """A private copy of the first ``n[split]`` images of each split (0: all) and their labels in
    ``dst/images|labels/<split>``; returns its data yaml. Names must be unique within a split:
    the copy is flat, and Ultralytics' json names images by stem."""
    from yolotrain.utils.data.labels import img2label_paths

    for split, files in splits.items():
        files = files[: n[split]] if n[split] else files
        stems = [Path(f).stem for f in files]
        if len(set(stems)) != len(stems):
            raise SystemExit(f"{split}: several images share a file stem; cannot make a flat copy")
        (dst / "images" / split).mkdir(parents=True, exist_ok=True)
        (dst / "labels" / split).mkdir(parents=True, exist_ok=True)
        for im, label in zip(files, img2label_paths(files)):
            shutil.copy2(im, dst / "images" / split / Path(im).name)
            if Path(label).exists():
                shutil.copy2(label, dst / "labels" / split / Path(label).name)
    return write_yaml(dst / "data.yaml", {"path": str(dst), "train": "images/train", "val": "images/val",
                                          "names": dict(enumerate(names))})


def ultralytics_env(work: Path) -> dict[str, str]:
    """Environment that keeps ultralytics offline and writing only inside the work dir."""
    env = base_env()
    env.update(YOLO_CONFIG_DIR=str(work / "ultralytics-config"), YOLO_OFFLINE="1", YOLO_AUTOINSTALL="false",
               MPLCONFIGDIR=str(work / "mpl"))
    return env


def ultralytics_settings(python: str, work: Path) -> None:
    """Write Ultralytics' settings for this work dir once (its defaults sync and look for loggers)."""
    args = ["sync=False", "clearml=False", "comet=False", "dvc=False", "mlflow=False", "raytune=False",
            "tensorboard=False", "wandb=False", f"datasets_dir={work / 'ultralytics' / 'datasets'}",
            f"weights_dir={work / 'ultralytics' / 'weights'}", f"runs_dir={work / 'ultralytics' / 'runs'}"]
    r = subprocess.run([python, "-c", SETTINGS, *args], env=ultralytics_env(work), capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"yolo settings failed (exit {r.returncode}):\n{r.stdout[-2000:]}{r.stderr[-2000:]}")


# ---------------------------------------------------------------------------------------------- running


def run_shim(python: str, mode: str, args: list[str], env: dict[str, str], folder: Path) -> dict:
    """Run one tool under the timing shim in ``folder``; return its stamps, facts, wall time and peak
    RSS (os.wait4: this process or the largest loader worker it reaped), or exit with its log."""
    shim = folder / "shim.py"
    if not shim.exists():
        shim.write_text(SHIM)
    events, log = folder / f"{mode}.json", folder / f"{mode}.log"
    cmd = [python, str(shim), mode, str(events), str(ROOT), *args]
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, cwd=folder, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = rc = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    wall = time.perf_counter() - t
    if rc or not events.exists():
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"{mode} failed (exit {rc}); log: {log}")
    out = json.loads(events.read_text())
    out.update(wall=wall, log=str(log), peak_rss_mib=usage.ru_maxrss / 1024)  # Linux: KiB
    return out


def train_args(tool: str, opt: argparse.Namespace, data_yaml: Path, project: Path) -> list[str]:
    """Training arguments; everything not listed is the tool's own default (see the docstring)."""
    if tool == "ultralytics":
        return [str(opt.threads), "detect", "train", f"model={opt.model}.yaml", "pretrained=False",
                f"data={data_yaml}", f"imgsz={opt.imgsz}", f"batch={opt.batch_size}", f"epochs={opt.epochs}",
                "device=cpu", f"workers={opt.workers}", f"seed={opt.seed}", "plots=False", "exist_ok=True",
                f"project={project}", "name=train"]
    return ["--cfg", str(ROOT / "models" / f"{opt.model}.yaml"), "--data", str(data_yaml), "--imgsz", str(opt.imgsz),
            "--batch-size", str(opt.batch_size), "--val-batch-size", str(2 * opt.batch_size),
            "--epochs", str(opt.epochs), "--device", "cpu", "--workers", str(opt.workers),
            "--threads", str(opt.threads), "--seed", str(opt.seed), "--noplots", "--project", str(project),
            "--name", "train", "--exist-ok", *opt.ours_args]


def val_args(tool: str, opt: argparse.Namespace, weights: Path, data_yaml: Path, project: Path) -> list[str]:
    """Standalone validation of ``weights`` with COCO json output into project/val, no plots."""
    if tool == "ultralytics":
        return [str(opt.threads), "detect", "val", f"model={weights}", f"data={data_yaml}", f"imgsz={opt.imgsz}",
                f"batch={opt.val_batch_size}", "device=cpu", f"workers={opt.workers}", "save_json=True",
                "plots=False", "exist_ok=True", f"project={project}", "name=val"]
    return ["--weights", str(weights), "--data", str(data_yaml), "--imgsz", str(opt.imgsz),
            "--batch-size", str(opt.val_batch_size), "--device", "cpu", "--workers", str(opt.workers),
            "--threads", str(opt.threads), "--save-json", "--noplots", "--project", str(project), "--name", "val",
            "--exist-ok", *(["--half"] if opt.half else [])]


def ultralytics_detections(preds: list[dict], gt: dict, nc: int) -> list[dict]:
    """Ultralytics' predictions.json in our ids: image_id from the file stem (Ultralytics writes
    int(stem) for numeric stems), category_id - 1 (it writes class index + 1 for non-COCO data)."""
    def key(stem: str) -> str:
        return str(int(stem)) if stem.isnumeric() else stem

    ids = {key(Path(im["file_name"]).stem): im["id"] for im in gt["images"]}
    if len(ids) != len(gt["images"]):
        raise SystemExit("val images whose stems read as the same Ultralytics image_id; cannot map its json")
    out = []
    for p in preds:
        c = int(p["category_id"])
        if not 1 <= c <= nc:
            raise SystemExit(f"Ultralytics predictions.json: category_id {c} outside 1..{nc}")
        out.append({"image_id": ids[key(str(p["image_id"]))], "category_id": c - 1, "bbox": p["bbox"],
                    "score": p["score"]})
    return out


def coco_map(gt_file: Path, dets: list[dict]) -> tuple[float, float]:
    """(mAP50-95, mAP50) by pycocotools' COCOeval at maxDets MAX_DET (bench/cocoeval.py)."""
    from bench.cocoeval import coco_map as score

    return score(gt_file, dets, MAX_DET)


def run_tool(tool: str, opt: argparse.Namespace, work: Path, source: tuple[dict, list[str]], round_: int) -> dict:
    """Train, validate best.pt standalone with save-json, and score its json, with one tool on a fresh
    dataset copy and run folder; return its figures."""
    from yolotrain.utils.eval.coco import export_split

    base = work / tool / f"round{round_}"
    splits, names = source
    data_yaml = copy_dataset(splits, names, base / "data", {"train": opt.n_train, "val": opt.n_val})
    python, env = (opt.ultralytics_python, ultralytics_env(work)) if tool == "ultralytics" else (sys.executable,
                                                                                                 base_env())
    tr = run_shim(python, f"{tool}-train", train_args(tool, opt, data_yaml, base / "runs"), env, base)
    train_s, val_s, after = epoch_times(tr)
    if len(train_s) != opt.epochs or len(val_s) != opt.epochs:
        raise SystemExit(f"{tool}: expected {opt.epochs} timed epochs and validations, got {len(train_s)} and "
                         f"{len(val_s)}; log: {tr['log']}")
    weights = Path(tr["facts"]["best"]) if tool == "ultralytics" else base / "runs" / "train" / "weights" / "best.pt"
    va = run_shim(python, f"{tool}-val", val_args(tool, opt, weights, data_yaml, base / "runs"), env, base)

    gt_file = base / "ground_truth.json"  # the ids of val.py's json, for this copy; cache kept out of the copy
    gt = export_split(data_yaml, "val", gt_file, cache_dir=base / "gt-cache")
    if tool == "ultralytics":
        (valpy,) = [e for e in va["events"] if e["what"] == "val"]
        preds = json.loads((Path(valpy["extra"]["save_dir"]) / "predictions.json").read_text())
        own = valpy["extra"]["metrics"]
        own_map, own_map50 = own["metrics/mAP50-95(B)"], own["metrics/mAP50(B)"]
        speed = {"pre-process": valpy["extra"]["speed_ms"]["preprocess"],
                 "inference": valpy["extra"]["speed_ms"]["inference"],
                 "NMS": valpy["extra"]["speed_ms"]["postprocess"]}
        preds, val_workers = ultralytics_detections(preds, gt, len(names)), valpy["extra"]["workers"]
        mosaic_epochs = max(opt.epochs - tr["facts"]["close_mosaic"], 0) if tr["facts"]["close_mosaic"] else opt.epochs
    else:
        preds = json.loads((base / "runs" / "val" / "predictions.json").read_text())
        own_map, own_map50, speed = va["facts"]["map"], va["facts"]["map50"], va["facts"]["speed_ms"]
        val_workers = va["facts"]["val_workers"]
        off = tr["facts"]["mosaic_off_from_epoch"]
        mosaic_epochs = opt.epochs if off is None else min(off, opt.epochs)
    coco, coco50 = coco_map(gt_file, preds)
    first_epoch = min(e["start"] for e in tr["events"] if e["what"] == "train")
    return {"train_s": train_s, "val_s": val_s, "after_s": after, "setup_s": first_epoch, "total_s": tr["wall"],
            "train_rss": tr["peak_rss_mib"], "val_rss": va["peak_rss_mib"], "speed_ms": speed,
            "own_map": own_map, "own_map50": own_map50, "coco_map": coco, "coco_map50": coco50, "dets": len(preds),
            "n_train": len(list((base / "data" / "images" / "train").iterdir())), "n_val": len(gt["images"]),
            "optimizer": tr["facts"]["optimizer"], "params": tr["facts"]["params"],
            "workers": f"{tr['facts']['train_workers']}, {tr['facts']['val_workers']}, {val_workers}",
            "mosaic_epochs": mosaic_epochs if tr["facts"]["mosaic"] > 0 else 0,
            "threads": f"{tr['facts']['threads']}, {va['facts']['threads']}"}


def best_of(rounds: list[dict]) -> dict:
    """One tool's figures over several rounds: the smallest of each time (per epoch where listed),
    the largest peak RSS; accuracy, counts and settings from the first round."""
    out = dict(rounds[0])
    for key in ("train_s", "val_s"):
        out[key] = [min(vals) for vals in zip(*(r[key] for r in rounds))]
    for key in ("after_s", "setup_s", "total_s"):
        out[key] = min(r[key] for r in rounds)
    out["speed_ms"] = {k: min(r["speed_ms"][k] for r in rounds) for k in out["speed_ms"]}
    for key in ("train_rss", "val_rss"):
        out[key] = max(r[key] for r in rounds)
    out["rounds"] = len(rounds)
    return out


# ---------------------------------------------------------------------------------------------- report

TIME, RATIO, NONE = "time", "ratio", None  # ratio column: theirs / ours (speed-up), ours / theirs, none


def _rows() -> list[tuple[str, str, Callable[[dict], Any], str | None]]:
    """(label, format, value of one tool's figures, ratio kind) for every table row."""
    return [
        ("train s/epoch (steady)", "{:.2f}", lambda r: steady(r["train_s"]), TIME),
        ("train img/s (steady)", "{:.1f}", lambda r: r["n_train"] / steady(r["train_s"]), RATIO),
        ("val s/epoch (steady)", "{:.2f}", lambda r: steady(r["val_s"]), TIME),
        ("set-up s (start -> epoch 1)", "{:.1f}", lambda r: r["setup_s"], TIME),
        ("whole training run s", "{:.1f}", lambda r: r["total_s"], TIME),
        ("val.py ms/img pre-process", "{:.2f}", lambda r: r["speed_ms"]["pre-process"], TIME),
        ("val.py ms/img inference", "{:.2f}", lambda r: r["speed_ms"]["inference"], TIME),
        ("val.py ms/img NMS", "{:.2f}", lambda r: r["speed_ms"]["NMS"], TIME),
        ("peak RSS train MiB", "{:.0f}", lambda r: r["train_rss"], RATIO),
        ("peak RSS val MiB", "{:.0f}", lambda r: r["val_rss"], RATIO),
        ("mAP50-95 (own validator)", "{:.4f}", lambda r: r["own_map"], RATIO),
        ("mAP50 (own validator)", "{:.4f}", lambda r: r["own_map50"], RATIO),
        ("mAP50-95 (COCOeval, both)", "{:.4f}", lambda r: r["coco_map"], RATIO),
        ("mAP50 (COCOeval, both)", "{:.4f}", lambda r: r["coco_map50"], RATIO),
        ("detections scored", "{}", lambda r: r["dets"], NONE),
        ("parameters", "{:,}", lambda r: r["params"], NONE),
        ("epochs with mosaic", "{}", lambda r: r["mosaic_epochs"], NONE),
        ("workers (train, val, val.py)", "{}", lambda r: r["workers"], NONE),
        ("torch threads (train, val.py)", "{}", lambda r: r["threads"], NONE),
    ]


def report(res: dict[str, dict], opt: argparse.Namespace) -> str:
    """Both tools' figures side by side, with ratios read as "> 1: ours is better"."""
    o, u = res.get("ours"), res.get("ultralytics")
    any_ = o or u
    data = opt.data or "built-in shapes"
    lines = [f"{opt.model}, {data}: {any_['n_train']} train / {any_['n_val']} val images, {opt.imgsz}px, batch "
             f"{opt.batch_size}, {opt.epochs} epoch(s), seed {opt.seed}, {opt.threads} threads, CPU; "
             f"best of {any_['rounds']} round(s)"
             + (f"; ours with {shlex.join(opt.ours_args)}" if opt.ours_args else ""),
             f"{'':<31}{'ours':>12}{'ultralytics':>13}{'ratio':>9}", "-" * 65]
    for label, fmt, value, kind in _rows():
        a, b = (value(r) if r is not None else None for r in (o, u))
        ratio = ""
        if a is not None and b is not None and kind is not None and min(a, b) > 0:
            ratio = f"{(b / a) if kind == TIME else (a / b):.2f}x"
        cells = [fmt.format(v) if v is not None else "-" for v in (a, b)]
        lines.append(f"{label:<31}{cells[0]:>12}{cells[1]:>13}{ratio:>9}")
    for name, r in res.items():
        op = r["optimizer"]
        lr = ", ".join(f"{x:g}" for x in op["lr"])
        lines.append(f"{name}: optimizer {op['name']} lr {lr} momentum/beta1 {op['momentum']:g}; train s "
                     f"{[round(x, 2) for x in r['train_s']]}, val s {[round(x, 2) for x in r['val_s']]}"
                     + (f", validation of best.pt after training {r['after_s']:.2f}s" if r["after_s"] else ""))
    lines += ["ratio: time rows Ultralytics time / our time (speed-up, > 1: ours faster); other rows ours / "
              "Ultralytics (img/s and mAP: > 1 ours better; RSS: < 1 ours smaller).",
              "val.py: standalone validation of each best.pt (Ultralytics: yolo detect val), each tool's own "
              "per-image split. Own validator: ours NMS IoU 0.6, Ultralytics 0.7, both conf 0.001.",
              f"COCOeval: pycocotools on both predictions.json, same ground truth, maxDets {MAX_DET}. "
              "Workers: Ultralytics forces 0 on CPU."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    opt = parse_args(argv)
    if not Path(opt.ultralytics_python).is_file():
        raise SystemExit(f"--ultralytics-python {opt.ultralytics_python}: not found (see this script's docstring)")
    work = Path(opt.workdir) if opt.workdir else Path(tempfile.mkdtemp(prefix="compare_ultralytics_"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"work dir: {work}", flush=True)
    try:
        tools = [t for t in ("ours", "ultralytics") if opt.only in (None, t)]
        if "ultralytics" in tools:
            ultralytics_settings(opt.ultralytics_python, work)
        source = source_dataset(opt.data)
        runs: dict[str, list[dict]] = {t: [] for t in tools}
        for r in range(opt.rounds):  # alternate the order, so neither tool always runs first
            for tool in (tools if r % 2 == 0 else tools[::-1]):
                runs[tool].append(run_tool(tool, opt, work, source, r))
        res = {t: best_of(rs) for t, rs in runs.items()}
        print()
        print(report(res, opt))
        (work / "results.json").write_text(json.dumps(runs, indent=1))
    finally:
        if opt.workdir is None and not opt.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
