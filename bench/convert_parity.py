#!/usr/bin/env python
"""Converted YOLOv5 / Ultralytics checkpoints against the packages that wrote them: raw outputs and val mAP.

    python bench/convert_parity.py
    python bench/convert_parity.py --models yolov5n yolov8n yolo11n --epochs 10 --n-train 128 --n-val 64
    python bench/convert_parity.py --models yolov5s yolov8s yolo11m yolov5nu
    python bench/convert_parity.py --yolov5-python Y/bin/python --ultralytics-python U/bin/python
    python bench/convert_parity.py --models yolo26n --no-val --ultralytics-python .venv/bin/python \
        --ultralytics-pythonpath /work/ultra-pkgs   # ultralytics as plain packages beside this repo's venv
    python bench/convert_parity.py --models yolov10n --epochs 1 --no-val --ultralytics-python .venv/bin/python \
        --ultralytics-pythonpath /work/ultra-pkgs   # YOLOv10: the end-to-end head with DFL

Nothing can be downloaded here, so each package first makes genuine checkpoints: it trains its own
model yaml from scratch (yolov5 train --weights '', yolo train pretrained=False) on a copy of the
built-in shapes dataset, saving the first epoch's full checkpoint (``--save-period E`` /
``save_period=E`` write ``epoch0.pt`` with EMA and optimizer) and a final, stripped ``last.pt``. Then,
for every such file:

  outputs  the package loads it its own way (in its own venv, ``ckpt.get("ema") or ckpt["model"]``,
           fp32, eval) and runs a fixed random batch; we read the same file through
           yolotrain.utils.weights.checkpoint.load_model (the allow-listed reader, converted in memory) and run
           the same batch. Compared: the decoded predictions (YOLOv5's objectness multiplied into its
           class scores, as ours report them; for YOLO26 and YOLOv10 both the end-to-end detections and,
           with end2end off, the one-to-many NMS form) and the raw head outputs (both branches), as
           the largest absolute difference and that divided by the largest absolute value of the
           package's output. Parity means at most --tol (default 1e-4): fp32 sums of a few thousand
           terms in another order differ by about 1e-6 of their size, so anything larger is a real
           difference.
  val      last.pt scored by the package's own val and by our val.py --weights <the same file>, on the
           same images with the same thresholds (conf 0.001, max 300 detections; NMS IoU 0.6 for
           YOLOv5, 0.7 for Ultralytics, each package's default). Our mAP is COCO's definition
           (pycocotools-exact), theirs their own matching and interpolation, so the two own figures
           differ on the same detections; both tools' saved detections (--save-json / save_json) are
           therefore also scored by one pycocotools COCOeval against one ground truth (val.py's
           ground_truth.json), which separates what each tool detected from how it scores.

How the packages run offline (shared/notes/running-yolov5-offline.md, running-ultralytics-offline.md):
each lives in its own venv and is never imported here; every process gets its config folder, a
TrueType font named Arial.ttf (yolov5 would download one), MPLCONFIGDIR and offline switches inside
the work dir, and TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 (their own loaders unpickle whole models, which
is safe only because these files were just made by them). Each tool gets its own dataset copy
(both write label caches next to the labels).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

from yolotrain.utils.core.cli import IMGSZ, SEED, ArgumentParser, Range  # noqa: E402
from yolotrain.utils.core.logging import setup_logging  # noqa: E402
from yolotrain.utils.weights.checkpoint import CheckpointCard, load_model  # noqa: E402

from bench.convert_parity_shims import OUR_VAL_SHIM, THEIR_SHIM  # noqa: E402

YOLOV5_MODELS = ("yolov5n", "yolov5s", "yolov5m", "yolov5l", "yolov5x")
VAL_IOU = {"yolov5": 0.6, "ultralytics": 0.7}

PYTHONPATHS: dict[str, str] = {}  # interpreter -> extra PYTHONPATH (set once by main from the options)
MAX_DET = 300  # every tool's val default; COCOeval scores this many per image (its own default is 100)


@dataclass
class Parity:
    """One checkpoint file: what was loaded and how far our outputs are from the package's."""

    model: str
    file: str
    weights: str
    tensors: int
    decoded_abs: float
    decoded_rel: float
    raw_abs: float
    raw_rel: float


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["yolov5n", "yolov8n", "yolo11n"],
                   help="yolov5{n,s,m,l,x} (yolov5 package); yolov8?, yolo11?, yolo26?, yolov10?, yolov5?u "
                        "(ultralytics package)")
    p.add_argument("--yolov5-python", default="/work/yolov5-venv/bin/python", help="python of the yolov5 venv")
    p.add_argument("--ultralytics-python", default="/work/ultra-venv/bin/python",
                   help="python of the ultralytics venv")
    p.add_argument("--ultralytics-pythonpath", default="",
                   help="folder put on PYTHONPATH for --ultralytics-python (ultralytics installed as plain packages "
                        "there, e.g. /work/ultra-pkgs with this repo's venv python)")
    p.add_argument("--no-val", action="store_true", help="compare outputs only (skip both tools' val)")
    p.add_argument("--epochs", type=Range(int, min=1), default=1, help="training epochs that make each checkpoint")
    p.add_argument("--imgsz", type=IMGSZ, default=128)
    p.add_argument("--batch-size", type=Range(int, min=1), default=16)
    p.add_argument("--n-train", type=Range(int, min=1), default=32, help="first N training images of shapes")
    p.add_argument("--n-val", type=Range(int, min=1), default=32, help="first N validation images of shapes")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--tol", type=Range(float, min=0), default=1e-4,
                   help="largest allowed output difference, relative to the largest output value")
    p.add_argument("--work-dir", default=None, help="where datasets, runs and logs go (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the default temp work dir")
    return p


def package_of(model: str) -> str:
    return "yolov5" if model in YOLOV5_MODELS else "ultralytics"


# ---------------------------------------------------------------------------------------------- set-up


def dataset_copy(dst: Path, n_train: int, n_val: int) -> Path:
    """The first N images of each split of the built-in shapes set (generated on first use), and a data yaml."""
    from yolotrain.utils.data.config import load_data_config, prepare_dataset

    data = load_data_config(ROOT / "data" / "shapes.yaml")
    prepare_dataset(data)
    for split, n in (("train", n_train), ("val", n_val)):
        for sub in ("images", "labels"):
            (dst / sub / split).mkdir(parents=True, exist_ok=True)
        for im in sorted((data.root / "images" / split).glob("*.jpg"))[:n]:
            shutil.copy2(im, dst / "images" / split / im.name)
            label = data.root / "labels" / split / f"{im.stem}.txt"
            if label.exists():
                shutil.copy2(label, dst / "labels" / split / label.name)
    data_yaml = dst / "data.yaml"
    data_yaml.write_text(yaml.safe_dump({"path": str(dst), "train": "images/train", "val": "images/val",
                                         "names": dict(enumerate(data.names))}, sort_keys=False))
    return data_yaml


def package_env(work: Path, python: str) -> dict[str, str]:
    """Offline, everything inside the work dir (see the module docstring); the interpreter's extra
    PYTHONPATH (``--ultralytics-pythonpath``) when it has one."""
    config = work / "config"
    config.mkdir(parents=True, exist_ok=True)
    font = config / "Arial.ttf"
    if not font.exists():
        path = subprocess.run([python, "-c", "import matplotlib, os; print(os.path.join(matplotlib.get_data_path(), "
                               "'fonts', 'ttf', 'DejaVuSans.ttf'))"], capture_output=True, text=True, check=True)
        shutil.copy(path.stdout.strip(), font)
    (work / "mpl").mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "PYTHONPATH")}
    env.update(TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD="1", YOLOV5_CONFIG_DIR=str(config), YOLO_CONFIG_DIR=str(config),
               MPLCONFIGDIR=str(work / "mpl"), YOLO_OFFLINE="1", YOLO_AUTOINSTALL="false", PYTHONUNBUFFERED="1")
    if PYTHONPATHS.get(python):
        env["PYTHONPATH"] = PYTHONPATHS[python]
    return env


def quiet_ultralytics(work: Path, python: str) -> None:
    """Ultralytics' integrations off in the work dir's settings: with mlflow or tensorboard importable in
    its interpreter (this repo's venv has them) its training would try to log to them."""
    off = ", ".join(f"{k}=False" for k in ("sync", "clearml", "comet", "dvc", "mlflow", "raytune", "tensorboard",
                                             "wandb"))
    run([python, "-c", f"from ultralytics.utils import SETTINGS; SETTINGS.update({off})"],
        package_env(work, python), work, work / "settings.log")


def run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path) -> None:
    print(f"$ {' '.join(cmd)}  > {log}", flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc:
        sys.stdout.write(log.read_text()[-4000:])
        raise SystemExit(f"failed (exit {rc}): {' '.join(cmd)}; log: {log}")


def train_package(model: str, opt: argparse.Namespace, work: Path, python: str) -> list[Path]:
    """Genuine checkpoints from the package: its epoch file(s) (EMA, optimizer) and the stripped last.pt."""
    folder = work / model
    data = dataset_copy(folder / "shapes", opt.n_train, opt.n_val)
    env = package_env(work, python)
    project = folder / "runs"
    if package_of(model) == "yolov5":
        cmd = [python, "-m", "yolov5.train", "--cfg", f"{model}.yaml", "--weights", "", "--data", str(data),
               "--imgsz", str(opt.imgsz), "--batch-size", str(opt.batch_size), "--epochs", str(opt.epochs),
               "--device", "cpu", "--workers", "0", "--noplots", "--seed", str(opt.seed), "--project", str(project),
               "--name", "train", "--exist-ok", "--save-period", str(opt.epochs)]
    else:
        quiet_ultralytics(work, python)
        args = (f"detect train model={model}.yaml pretrained=False data={data} imgsz={opt.imgsz} "
                f"batch={opt.batch_size} epochs={opt.epochs} device=cpu workers=0 seed={opt.seed} plots=False "
                f"exist_ok=True project={project} name=train save_period={opt.epochs}")
        cmd = [python, "-c", f"from ultralytics.cfg import entrypoint; entrypoint({args!r})"]
    run(cmd, env, folder, folder / "train.log")
    weights = project / "train" / "weights"
    return sorted(weights.glob("epoch*.pt")) + [weights / "last.pt"]


# ---------------------------------------------------------------------------------------------- comparing


def fixed_input(opt: argparse.Namespace, path: Path) -> np.ndarray:
    """Two random images, wider than tall (both grid axes are exercised), the same for every model."""
    h = opt.imgsz
    w = (h * 5 // 4 + 31) // 32 * 32
    x = np.random.default_rng(opt.seed).random((2, 3, h, w), dtype=np.float32)
    np.save(path, x)
    return x


def their_outputs(files: list[Path], x_path: Path, work: Path, python: str) -> list[dict[str, np.ndarray]]:
    shim = work / "their_shim.py"
    shim.write_text(THEIR_SHIM)
    outs = [f.with_suffix(".outputs.npz") for f in files]
    args = {"weights": [str(f) for f in files], "input": str(x_path), "outs": [str(o) for o in outs]}
    run([python, str(shim), "outputs", json.dumps(args)], package_env(work, python), work,
        files[0].parent / "outputs.log")
    return [dict(np.load(o)) for o in outs]


def our_outputs(file: Path, x: np.ndarray) -> tuple[dict[str, np.ndarray], CheckpointCard]:
    """Our model from the package's file (converted in memory), in the package's output layout."""
    model, card = load_model(file, torch.device("cpu"))
    with torch.no_grad():
        decoded, raw = model(torch.from_numpy(x))
    if model.detect.has_anchors:  # YOLOv5: (B, N, 4 + nc), objectness already multiplied in
        return {"decoded": decoded.numpy(), **{f"raw{i}": r.numpy() for i, r in enumerate(raw)}}, card
    nbox = 4 * model.detect.reg_max
    if isinstance(raw, dict):  # YOLO26, YOLOv10: end-to-end dets, then the one-to-many branch's NMS form
        out = {"decoded": decoded.numpy()}
        for branch, key in (("one2many", "o2m"), ("one2one", "o2o")):
            flat = torch.cat([r.flatten(2) for r in raw[branch]], 2)
            out.update({f"{key}_boxes": flat[:, :nbox].numpy(), f"{key}_scores": flat[:, nbox:].numpy()})
        model.detect.end2end = False
        with torch.no_grad():
            out["decoded_o2m"] = model(torch.from_numpy(x))[0].transpose(1, 2).numpy()
        return out, card
    flat = torch.cat([r.flatten(2) for r in raw], 2)
    return {"decoded": decoded.transpose(1, 2).numpy(), "boxes": flat[:, :nbox].numpy(),
            "scores": flat[:, nbox:].numpy()}, card


def comparable(theirs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """YOLOv5's decoded rows are (xywh, obj, cls...): multiply obj into cls, as ours report scores."""
    out = dict(theirs)
    d = theirs["decoded"]
    if "boxes" not in theirs and "o2o_boxes" not in theirs:
        out["decoded"] = np.concatenate([d[..., :4], d[..., 5:] * d[..., 4:5]], -1)
    return out


def difference(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray], keys: list[str]) -> tuple[float, float]:
    """Largest |ours - theirs| over the arrays, and that over the largest |theirs|."""
    worst_abs, worst_rel = 0.0, 0.0
    for k in keys:
        if ours[k].shape != theirs[k].shape:
            raise SystemExit(f"{k}: our shape {ours[k].shape} differs from the package's {theirs[k].shape}")
        diff = float(np.abs(ours[k].astype(np.float64) - theirs[k]).max())
        worst_abs = max(worst_abs, diff)
        worst_rel = max(worst_rel, diff / max(float(np.abs(theirs[k]).max()), 1e-12))
    return worst_abs, worst_rel


def compare_outputs(model: str, files: list[Path], x: np.ndarray, x_path: Path, work: Path,
                    python: str) -> list[Parity]:
    rows = []
    for f, theirs in zip(files, their_outputs(files, x_path, work, python)):
        theirs = comparable(theirs)
        ours, card = our_outputs(f, x)
        decoded = [k for k in theirs if k.startswith("decoded")]  # YOLO26: its dets and its NMS form
        raw_keys = [k for k in theirs if k not in decoded]
        rows.append(Parity(model, f.name, card.converted_weights, card.tensors,
                           *difference(ours, theirs, decoded), *difference(ours, theirs, raw_keys)))
    return rows


def compare_val(model: str, last: Path, opt: argparse.Namespace, work: Path, python: str) -> dict[str, dict]:
    """mAP of last.pt by the package's val and by our val.py, same images and thresholds: each tool's
    own figure, and both tools' saved detections scored by one COCOeval against one ground truth."""
    package, folder = package_of(model), work / model
    iou = VAL_IOU[package]
    theirs_out = folder / "their_val.json"
    args = {"data": str(folder / "shapes" / "data.yaml"), "weights": str(last), "stem": last.stem,
            "imgsz": opt.imgsz, "batch": 32, "conf": 0.001, "iou": iou, "project": str(folder / "their_val"),
            "out": str(theirs_out)}
    run([python, str(work / "their_shim.py"), f"{package}-val", json.dumps(args)], package_env(work, python),
        folder, folder / "their_val.log")
    ours_data = dataset_copy(folder / "shapes_ours", opt.n_train, opt.n_val)  # our own label cache
    ours_out, our_shim, ours_dir = folder / "our_val.json", work / "our_val_shim.py", folder / "our_val"
    our_shim.write_text(OUR_VAL_SHIM)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    run([sys.executable, str(our_shim), str(ROOT), str(ours_out), "--weights", str(last), "--data", str(ours_data),
         "--imgsz", str(opt.imgsz), "--batch-size", "32", "--conf-thres", "0.001", "--iou-thres", str(iou),
         "--max-det", str(MAX_DET), "--workers", "0", "--noplots", "--device", "cpu", "--save-json",
         "--project", str(ours_dir), "--name", "val", "--exist-ok"], env, ROOT, folder / "our_val.log")
    theirs, ours = json.loads(theirs_out.read_text()), json.loads(ours_out.read_text())
    gt_file = ours_dir / "val" / "ground_truth.json"
    gt = json.loads(gt_file.read_text())
    their_dets = foreign_detections(json.loads(Path(theirs.pop("predictions")).read_text()), gt, package)
    theirs["coco_map"], theirs["coco_map50"] = coco_map(gt_file, their_dets)
    ours["coco_map"], ours["coco_map50"] = coco_map(gt_file, json.loads((ours_dir / "val" / "predictions.json")
                                                                        .read_text()))
    return {package: theirs, "yolotrain": ours}


def foreign_detections(preds: list[dict], gt: dict, package: str) -> list[dict]:
    """A package's predictions json in our ids: image_id from the file stem (an int when numeric),
    category_id 0-based (YOLOv5 writes the class index, Ultralytics index + 1 for non-COCO data)."""
    def key(stem: str) -> str:
        return str(int(stem)) if stem.isnumeric() else stem

    ids = {key(Path(im["file_name"]).stem): im["id"] for im in gt["images"]}
    shift = 1 if package == "ultralytics" else 0
    return [{"image_id": ids[key(str(p["image_id"]))], "category_id": int(p["category_id"]) - shift,
             "bbox": p["bbox"], "score": p["score"]} for p in preds]


def coco_map(gt_file: Path, dets: list[dict]) -> tuple[float, float]:
    """(mAP50-95, mAP50) by pycocotools' COCOeval at maxDets MAX_DET (bench/cocoeval.py)."""
    from bench.cocoeval import coco_map as score

    return score(gt_file, dets, MAX_DET)


# ---------------------------------------------------------------------------------------------- report


def report(rows: list[Parity], vals: dict[str, dict[str, dict]], opt: argparse.Namespace) -> str:
    lines = [f"{len(rows)} checkpoint files, trained {opt.epochs} epoch(s) from scratch on {opt.n_train} shapes "
             f"images at {opt.imgsz} px (seed {opt.seed}); fixed input 2 x 3 x {opt.imgsz} x "
             f"{(opt.imgsz * 5 // 4 + 31) // 32 * 32}, fp32, CPU",
             f"{'model':<9}{'file':<12}{'weights':<9}{'tensors':>8}{'decoded max|d|':>16}{'rel':>10}"
             f"{'raw max|d|':>12}{'rel':>10}  parity (rel <= {opt.tol:g})", "-" * 100]
    for r in rows:
        ok = "ok" if max(r.decoded_rel, r.raw_rel) <= opt.tol else "DIFFERENT"
        lines.append(f"{r.model:<9}{r.file:<12}{r.weights:<9}{r.tensors:>8}{r.decoded_abs:>16.3g}"
                     f"{r.decoded_rel:>10.3g}{r.raw_abs:>12.3g}{r.raw_rel:>10.3g}  {ok}")
    if not vals:  # --no-val
        return "\n".join(lines)
    lines += ["", f"val of last.pt on the {opt.n_val} val images at {opt.imgsz} px (conf 0.001, max det {MAX_DET}, "
              "each package's NMS IoU): each tool's own figure, and both tools' detections scored by one COCOeval",
              f"{'model':<9}{'tool':<13}{'mAP50':>9}{'mAP50-95':>10}{'COCOeval mAP50':>16}{'mAP50-95':>10}", "-" * 67]
    for model, by_tool in vals.items():
        for tool, m in by_tool.items():
            lines.append(f"{model:<9}{tool:<13}{m['map50']:>9.4f}{m['map']:>10.4f}{m['coco_map50']:>16.4f}"
                         f"{m['coco_map']:>10.4f}")
        (_, a), (_, b) = by_tool.items()
        lines.append(f"{'':<9}{'difference':<13}{b['map50'] - a['map50']:>+9.4f}{b['map'] - a['map']:>+10.4f}"
                     f"{b['coco_map50'] - a['coco_map50']:>+16.4f}{b['coco_map'] - a['coco_map']:>+10.4f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    opt = build_parser().parse_args(argv)
    setup_logging(verbose=False)
    pythons = {"yolov5": opt.yolov5_python, "ultralytics": opt.ultralytics_python}
    if opt.ultralytics_pythonpath:
        PYTHONPATHS[opt.ultralytics_python] = str(Path(opt.ultralytics_pythonpath).resolve())
    for model in opt.models:
        if not Path(pythons[package_of(model)]).is_file():
            raise SystemExit(f"--{package_of(model)}-python {pythons[package_of(model)]}: not found")
    work = Path(opt.work_dir) if opt.work_dir else Path(tempfile.mkdtemp(prefix="convert_parity_"))
    work.mkdir(parents=True, exist_ok=True)
    x_path = work / "input.npy"
    x = fixed_input(opt, x_path)
    rows, vals = [], {}
    try:
        for model in opt.models:
            python = pythons[package_of(model)]
            files = train_package(model, opt, work, python)
            rows += compare_outputs(model, files, x, x_path, work, python)
            if not opt.no_val:
                vals[model] = compare_val(model, files[-1], opt, work, python)
    finally:
        if not opt.work_dir and not opt.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(report(rows, vals, opt))
    return 0 if all(max(r.decoded_rel, r.raw_rel) <= opt.tol for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
