#!/usr/bin/env python
"""A released YOLOv5 checkpoint scored on real COCO images by our val.py and by YOLOv5's own val.py.

    python bench/coco128_val.py --data COCO128/coco128.yaml --weights yolov5n.pt --yolov5-python Y/bin/python

Both tools read the same checkpoint file and the data yaml's val split at the same size and thresholds
(640 px, batch 32, conf 0.001, NMS IoU 0.6, YOLOv5's defaults; at most 300 detections per image), on a CPU.
Each prints its own mAP; both tools' saved detections (--save-json) are then scored by one pycocotools
COCOeval against one ground truth (our val.py's ground_truth.json), so a gap between the two is a gap in
what they detected, not in how they score. YOLOv5 runs offline in its own venv exactly as
bench/convert_parity.py runs it (the same shims and environment), on its own copy of the val split in the
work dir (it writes a label cache beside the labels); ours reads the split where it is. Nothing is
downloaded, and nothing is written beside the data or the weights.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from bench.convert_parity import MAX_DET, coco_map, foreign_detections, package_env, run  # noqa: E402
from bench.convert_parity_shims import OUR_VAL_SHIM, THEIR_SHIM  # noqa: E402
from yolotrain.utils.core.cli import IMGSZ, ArgumentParser, Range  # noqa: E402

IOU = 0.6  # YOLOv5's val default


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a data yaml whose val split is scored (e.g. coco128.yaml)")
    p.add_argument("--weights", required=True, help="a YOLOv5 checkpoint (e.g. the released yolov5n.pt)")
    p.add_argument("--yolov5-python", required=True, help="python of a venv with yolov5 7.0.x")
    p.add_argument("--imgsz", type=IMGSZ, default=640)
    p.add_argument("--batch-size", type=Range(int, min=1), default=32)
    p.add_argument("--work-dir", default=None, help="where the copy, runs and logs go (default: a temp dir, removed)")
    p.add_argument("--out", default=None, help="also write the figures as json here")
    return p


def val_split(data_yaml: Path) -> tuple[Path, Path, dict]:
    """(images folder, labels folder, names) of the yaml's val split (a folder, relative to ``path:``)."""
    cfg = yaml.safe_load(data_yaml.read_text())
    root = (data_yaml.parent / cfg.get("path", ".")).resolve()
    images = (root / cfg["val"]).resolve()
    labels = Path(str(images).replace(f"{os.sep}images{os.sep}", f"{os.sep}labels{os.sep}"))
    if not images.is_dir() or not labels.is_dir():
        raise SystemExit(f"{data_yaml}: val must be an image folder beside a labels folder ({images}, {labels})")
    names = cfg["names"] if isinstance(cfg["names"], dict) else dict(enumerate(cfg["names"]))
    return images, labels, names


def their_copy(images: Path, labels: Path, names: dict, dst: Path) -> Path:
    """The val split copied for YOLOv5 (its label cache goes beside the labels), and its data yaml."""
    shutil.copytree(images, dst / "images" / "val")
    shutil.copytree(labels, dst / "labels" / "val", ignore=shutil.ignore_patterns("*.cache*"))
    data = dst / "data.yaml"
    data.write_text(yaml.safe_dump({"path": str(dst), "train": "images/val", "val": "images/val", "names": names},
                                   sort_keys=False))
    return data


def main(argv: list[str] | None = None) -> int:
    opt = build_parser().parse_args(argv)
    data, weights = Path(opt.data).resolve(), Path(opt.weights).resolve()
    for path in (data, weights, Path(opt.yolov5_python)):
        if not path.is_file():
            raise SystemExit(f"{path}: not found")
    work = Path(opt.work_dir).resolve() if opt.work_dir else Path(tempfile.mkdtemp(prefix="coco128_val_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        images, labels, names = val_split(data)
        (work / "their_shim.py").write_text(THEIR_SHIM)
        (work / "our_val_shim.py").write_text(OUR_VAL_SHIM)
        theirs_out, ours_out, ours_dir = work / "their_val.json", work / "our_val.json", work / "our_val"
        args = {"data": str(their_copy(images, labels, names, work / "yolov5_data")), "weights": str(weights),
                "stem": weights.stem, "imgsz": opt.imgsz, "batch": opt.batch_size, "conf": 0.001, "iou": IOU,
                "project": str(work / "their_val"), "out": str(theirs_out)}
        run([opt.yolov5_python, str(work / "their_shim.py"), "yolov5-val", json.dumps(args)],
            package_env(work, opt.yolov5_python), work, work / "their_val.log")
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        run([sys.executable, str(work / "our_val_shim.py"), str(ROOT), str(ours_out), "--weights", str(weights),
             "--data", str(data), "--imgsz", str(opt.imgsz), "--batch-size", str(opt.batch_size),
             "--conf-thres", "0.001", "--iou-thres", str(IOU), "--max-det", str(MAX_DET), "--workers", "0",
             "--noplots", "--device", "cpu", "--save-json", "--project", str(ours_dir), "--name", "val",
             "--exist-ok"], env, ROOT, work / "our_val.log")
        theirs, ours = json.loads(theirs_out.read_text()), json.loads(ours_out.read_text())
        gt_file = ours_dir / "val" / "ground_truth.json"
        gt = json.loads(gt_file.read_text())
        their_dets = foreign_detections(json.loads(Path(theirs.pop("predictions")).read_text()), gt, "yolov5")
        our_dets = json.loads((ours_dir / "val" / "predictions.json").read_text())
        theirs["coco_map"], theirs["coco_map50"] = coco_map(gt_file, their_dets)
        ours["coco_map"], ours["coco_map50"] = coco_map(gt_file, our_dets)
        theirs["detections"], ours["detections"] = len(their_dets), len(our_dets)
    finally:
        if not opt.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    figures = {"images": len(gt["images"]), "boxes": len(gt["annotations"]), "imgsz": opt.imgsz,
               "yolov5": theirs, "yolotrain": ours}
    print(f"{weights.name} on {figures['images']} images ({figures['boxes']} boxes) of {data.name}'s val split at "
          f"{opt.imgsz} px, conf 0.001, NMS IoU {IOU}, max det {MAX_DET}, CPU")
    print(f"{'tool':<11}{'own mAP50':>10}{'mAP50-95':>10}{'COCOeval mAP50':>16}{'mAP50-95':>10}{'detections':>12}")
    for tool in ("yolov5", "yolotrain"):
        m = figures[tool]
        print(f"{tool:<11}{m['map50']:>10.4f}{m['map']:>10.4f}{m['coco_map50']:>16.4f}{m['coco_map']:>10.4f}"
              f"{m['detections']:>12}")
    if opt.out:
        Path(opt.out).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
