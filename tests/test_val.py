"""val.py: the same results for any world size, COCO json that pycocotools scores identically,
--save-txt files, --task speed, run folders, and the ground-truth export command (python -m yolotrain coco)."""
from __future__ import annotations

import contextlib
import io
import json
import re
from argparse import Namespace
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from tests.helpers import PYTHON, TORCHRUN, run, val_here

pytestmark = pytest.mark.slow  # subprocess training runs: `pytest -m 'not slow'` skips them


NAMES = ["circle", "square", "triangle", "star", "cross", "ring"]  # conftest's tiny_data
# 8 val images, a global batch of 12: one batch of 8 on 1 rank; 6 + 2 on 2 ranks; on 3 ranks rank 0 gets no
# batch and ranks 1 and 2 four images each. Rect shapes follow the global batch, so every image has one shape.
VAL = ["--batch-size", "12", "--workers", "0"]


@pytest.fixture(scope="module")
def weights(tiny_v5n) -> Path:
    """A YOLOv5n checkpoint of one tiny epoch, its biases raised so it detects: mAP, P, R and the confusion matrix
    are non-zero and there are hundreds of detections to write and compare (conftest's tiny_v5n)."""
    return tiny_v5n


@pytest.fixture(scope="module")
def val_runs(weights, tiny_data, once) -> dict[int, tuple[str, Path]]:
    """The same val.py command on 1, 2 and 3 ranks, saving everything, all with --name exp (run once per test
    run)."""
    def build(project: Path) -> None:
        for n in (1, 2, 3):
            save_conf = ["--save-conf"] if n != 2 else []  # world size 2 writes 5-column label rows
            launcher = [PYTHON] if n == 1 else [*TORCHRUN[:-1], str(n)]
            p = run([*launcher, "val.py", "--weights", weights, "--data", tiny_data, *VAL, "--verbose", "--save-json",
                     "--save-txt", *save_conf, "--project", project / "runs"], timeout=300)
            (project / f"stdout{n}.txt").write_text(p.stdout)

    project = once("val-world-sizes", build)
    return {n: ((project / f"stdout{n}.txt").read_text(), project / "runs" / ("exp" if n == 1 else f"exp{n}"))
            for n in (1, 2, 3)}


def _metric_lines(stdout: str) -> list[str]:
    pattern = re.compile(rf"^val: +({'|'.join(['all', *NAMES])}) +\d+ +\d+ ")
    return [line for line in stdout.splitlines() if pattern.match(line) or line.startswith("Results:")]


def _read_labels(folder: Path) -> dict[str, list[list[str]]]:
    return {f.stem: [row.split() for row in f.read_text().splitlines()] for f in sorted(folder.glob("*.txt"))}


@pytest.mark.dist
def test_world_sizes_give_identical_metrics_and_files(val_runs):
    from yolotrain.utils.data.loader import InferenceSampler

    assert [len(InferenceSampler(8, 4, r, 3)) for r in range(3)] == [0, 4, 4]  # an empty rank
    project = val_runs[1][1].parent
    assert sorted(p.name for p in project.iterdir()) == ["exp", "exp2", "exp3"]  # one folder per run (rank 0)
    pictures = ["PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png", "confusion_matrix.png",
                "val_batch0_labels.jpg", "val_batch0_pred.jpg"]
    # rank 0 draws its own first batches: the one batch on 1 rank, one of its own on 2, none on 3 (empty shard)
    for n in (1, 2, 3):
        expected = pictures[:5] if n == 3 else pictures
        assert sorted(f.name for f in val_runs[n][1].glob("*_*.*g")) == sorted(expected)
        assert all((val_runs[n][1] / f).stat().st_size > 1000 for f in expected)
    ref_lines = _metric_lines(val_runs[1][0])
    assert len(ref_lines) == 2 + len(NAMES) and ref_lines[-1].startswith("Results: mAP50 ")
    ref = json.loads((val_runs[1][1] / "metrics.json").read_text())
    assert ref["metrics"]["map50"] > 0 and ref["images"] == 8
    for n in (2, 3):
        stdout, run_dir = val_runs[n]
        assert _metric_lines(stdout) == ref_lines
        got = json.loads((run_dir / "metrics.json").read_text())
        assert got["metrics"] == ref["metrics"]  # every float, bit for bit
        assert got["confusion_matrix"] == ref["confusion_matrix"]
        for name in ("predictions.json", "ground_truth.json"):
            assert (run_dir / name).read_bytes() == (val_runs[1][1] / name).read_bytes(), name
        assert sorted(f.name for f in run_dir.iterdir() if f.suffix not in (".png", ".jpg")) == ["ground_truth.json", "labels", "metrics.json",
                                                            "predictions.json"]  # no temp files left
    assert _read_labels(val_runs[3][1] / "labels") == _read_labels(val_runs[1][1] / "labels")
    with_conf, without = _read_labels(val_runs[1][1] / "labels"), _read_labels(val_runs[2][1] / "labels")
    assert {k: [r[:5] for r in v] for k, v in with_conf.items()} == without  # --save-conf only appends


def test_confusion_matrix_accounts_for_every_label(val_runs):
    m = json.loads((val_runs[1][1] / "metrics.json").read_text())
    cm = np.array(m["confusion_matrix"])
    assert cm.shape == (len(NAMES) + 1, len(NAMES) + 1) and cm.dtype.kind == "i"
    # each label is either paired with one detection (its row) or missed (background row)
    assert cm[:, :-1].sum(0).tolist() == m["metrics"]["nt"]
    assert cm[:-1].sum() > 0 and cm[-1, -1] == 0  # detections above conf 0.25 exist; bg-bg is never counted


def _cocoeval(gt_file: Path, pred_file: Path) -> tuple[float, float]:
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(gt_file))
        ev = COCOeval(gt, gt.loadRes(str(pred_file)), "bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return float(ev.stats[1]), float(ev.stats[0])  # mAP50, mAP50-95


def test_pycocotools_scores_the_saved_json_like_val(val_runs):
    run_dir = val_runs[1][1]
    metrics = json.loads((run_dir / "metrics.json").read_text())["metrics"]
    map50, map5095 = _cocoeval(run_dir / "ground_truth.json", run_dir / "predictions.json")
    assert metrics["map50"] > 0 and metrics["map"] > 0
    assert abs(map50 - metrics["map50"]) < 1e-3 and abs(map5095 - metrics["map"]) < 1e-3
    assert abs(map50 - metrics["map50"]) < 1e-9 and abs(map5095 - metrics["map"]) < 1e-9  # in fact exact


def test_save_txt_rows_are_the_json_boxes_normalised_to_the_original_image(val_runs):
    run_dir = val_runs[1][1]
    gt = json.loads((run_dir / "ground_truth.json").read_text())
    preds = json.loads((run_dir / "predictions.json").read_text())
    labels = _read_labels(run_dir / "labels")
    assert labels and len(labels) == len({p["image_id"] for p in preds})  # a file per image with detections
    for image in gt["images"]:
        h, w = cv2.imread(image["file_name"]).shape[:2]
        assert (image["width"], image["height"]) == (w, h)
        mine = [p for p in preds if p["image_id"] == image["id"]]
        rows = np.array(labels.get(Path(image["file_name"]).stem, []), dtype=np.float64).reshape(-1, 6)
        assert len(rows) == len(mine)
        assert rows[:, 0].tolist() == [p["category_id"] for p in mine]
        assert rows[:, 1:5].min() >= 0 and rows[:, 1:5].max() <= 1
        x, y, bw, bh = np.array([p["bbox"] for p in mine]).reshape(-1, 4).T
        expected = np.stack([(x + bw / 2) / w, (y + bh / 2) / h, bw / w, bh / h], 1)
        np.testing.assert_allclose(rows[:, 1:5], expected, rtol=1e-5, atol=1e-6)  # %g: 6 significant digits
        np.testing.assert_allclose(rows[:, 5], [p["score"] for p in mine], rtol=1e-5)


def test_coco_export_cli_matches_val_ground_truth(val_runs, tiny_data, tmp_path, capsys, restore_logger):
    from yolotrain.app import coco

    out = tmp_path / "gt.json"
    assert coco.cli(["--data", str(tiny_data), "--task", "val", "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    gt = json.loads(out.read_text())
    label_rows = sum(len(f.read_text().split("\n")) - 1 for f in (tiny_data.parent / "shapes" / "labels" / "val").glob("*.txt"))
    assert (len(gt["images"]), len(gt["annotations"]), len(gt["categories"])) == (8, label_rows, len(NAMES))
    assert f"{out}: 8 images, {label_rows} annotations, 6 categories" in stdout
    assert [c["name"] for c in gt["categories"]] == NAMES and [c["id"] for c in gt["categories"]] == list(range(6))
    assert [im["id"] for im in gt["images"]] == list(range(1, 9))
    assert [im["file_name"] for im in gt["images"]] == sorted(im["file_name"] for im in gt["images"])
    assert sorted(a["id"] for a in gt["annotations"]) == list(range(1, label_rows + 1))
    assert gt == json.loads((val_runs[1][1] / "ground_truth.json").read_text())  # same ids as val.py's


def test_coco_export_broken_yaml_is_one_clear_error(tmp_path, capsys, restore_logger):
    from yolotrain.app import coco

    data = tmp_path / "bad.yaml"
    data.write_text("train: [images/train\nval: images/val\nnames: [a]\n")
    assert coco.cli(["--data", str(data), "--out", str(tmp_path / "gt.json")]) == 1
    captured = capsys.readouterr()
    out = (captured.out + captured.err).strip()
    assert "Traceback" not in out
    assert out.splitlines() == [out] and out.startswith(f"ERROR: {data}: not valid yaml"), out
    assert not (tmp_path / "gt.json").exists()


@pytest.mark.parametrize("case", ["missing", "no_split"])
def test_coco_export_bad_input_names_the_file(case, tiny_data, tmp_path, capsys, restore_logger):
    from yolotrain.app import coco

    data, task, expect = tmp_path / "nowhere.yaml", "val", f"ERROR: {tmp_path / 'nowhere.yaml'}: file not found"
    if case == "no_split":
        data, task, expect = tiny_data, "test", f"ERROR: {tiny_data}: no 'test' split"
    assert coco.cli(["--data", str(data), "--task", task, "--out", str(tmp_path / "gt.json")]) == 1
    assert capsys.readouterr().out.strip().splitlines() == [expect]
    assert not (tmp_path / "gt.json").exists()


def test_task_speed_times_at_yolov5_thresholds_and_saves_nothing(weights, tiny_data, tmp_path, capsys,
                                                                restore_logger):
    val_here("--weights", weights, "--data", tiny_data, *VAL, "--task", "speed", "--save-json", "--project",
             tmp_path / "runs")
    stdout = capsys.readouterr().out
    assert "conf 0.25, IoU 0.45" in stdout
    assert re.search(r"^Speed: [\d.]+ms pre-process, [\d.]+ms inference, [\d.]+ms NMS per image at shape \(12, 3, 64, 64\)$",
                     stdout, re.M)
    assert re.search(r"^Results: mAP50 [\d.]+  mAP50-95 [\d.]+$", stdout, re.M)
    assert re.search(r"^val: +all +8 +\d+ ", stdout, re.M)  # the val split, as YOLOv5's speed task
    assert not (tmp_path / "runs").exists()


def test_run_folder_rules(tmp_path):
    from yolotrain.app import val
    from yolotrain.utils.core.dist import DistInfo
    from yolotrain.utils.core.errors import UserError

    opt = Namespace(project=str(tmp_path / "runs"), name="exp", exist_ok=False, save_txt=False, save_json=False,
                    noplots=True)
    assert val.make_save_dir(opt, DistInfo()) is None and not (tmp_path / "runs").exists()  # nothing to save
    opt.save_json = True
    assert val.make_save_dir(opt, DistInfo()) == tmp_path / "runs" / "exp"
    assert val.make_save_dir(opt, DistInfo()) == tmp_path / "runs" / "exp2"
    opt.exist_ok = True
    assert val.make_save_dir(opt, DistInfo()) == tmp_path / "runs" / "exp"
    opt = val.parse_opt(["--weights", "a.pt", "b.pt", "--save-txt", "--exist-ok"])
    with pytest.raises(UserError, match="--exist-ok with several --weights"):
        val.check_opt(opt)


def test_pick_run_dir_creates_only_when_asked(tmp_path):
    """val.py picks its folder before it knows it will write; detect.py writes from every rank at once."""
    from yolotrain.utils.core.dist import DistInfo
    from yolotrain.utils.core.runs import pick_run_dir

    assert pick_run_dir(tmp_path / "runs", "exp", False, DistInfo()) == tmp_path / "runs" / "exp"
    assert not (tmp_path / "runs").exists()
    made = pick_run_dir(tmp_path / "runs", "exp", False, DistInfo(), create=True)
    assert made == tmp_path / "runs" / "exp" and made.is_dir()
    assert pick_run_dir(tmp_path / "runs", "exp", False, DistInfo(), create=True) == tmp_path / "runs" / "exp2"
    assert pick_run_dir(tmp_path / "runs", "exp", True, DistInfo()) == tmp_path / "runs" / "exp"


class _ReplayModel(torch.nn.Module):
    """Stands in for a detector: returns prepared decoded outputs, one per batch, in loader order."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.outputs = outputs

    def forward(self, imgs: torch.Tensor):
        out = self.outputs.pop(0)
        assert out.shape[0] == imgs.shape[0]
        return out, None


def _make_dataset(root: Path, rng: np.random.Generator, n: int = 12, nc: int = 3) -> Path:
    """Images of many aspect ratios (so rect order is not path order) with 0-5 labelled boxes each."""
    for d in ("images", "labels"):
        (root / d).mkdir(parents=True)
    for i in range(n):
        w, h = (int(v) for v in rng.integers(40, 130, 2))
        cv2.imwrite(str(root / "images" / f"im{i:02d}.jpg"), np.full((h, w, 3), 90, np.uint8))
        k = int(rng.integers(0, 6))
        wh = rng.uniform(0.1, 0.5, (k, 2))
        xy = rng.uniform(wh / 2, 1 - wh / 2)
        rows = [f"{c} {x:.6f} {y:.6f} {bw:.6f} {bh:.6f}" for c, (x, y), (bw, bh) in zip(rng.integers(0, nc, k), xy, wh)]
        (root / "labels" / f"im{i:02d}.txt").write_text("".join(r + "\n" for r in rows))
    return root / "images"


def _replay_outputs(loader, rng: np.random.Generator, nc: int = 3, per_image: int = 24) -> list[torch.Tensor]:
    """A good detector's decoded output (xywh + class scores) for each batch: jittered copies of each label, some with the
    wrong class, plus random false positives; scores on a 1/20 grid, so many tie across images."""
    outputs = []
    for batch in loader:
        bs, _, hh, ww = batch.images.shape
        out = torch.zeros(bs, per_image, 4 + nc)
        for si in range(bs):
            t = batch.targets[batch.targets[:, 0] == si, 1:].numpy()
            src = np.repeat(np.arange(len(t)), 3)
            boxes = t[src, 1:5] * (ww, hh, ww, hh) if len(t) else np.zeros((0, 4))
            boxes = boxes * (1 + rng.normal(0, 0.05, boxes.shape))
            cls = np.where(rng.random(len(src)) < 0.15, rng.integers(0, nc, len(src)), t[src, 0].astype(int))
            nfp = per_image - len(src)
            fp = np.c_[rng.uniform(0, ww, nfp), rng.uniform(0, hh, nfp), rng.uniform(5, ww / 2, nfp), rng.uniform(5, hh / 2, nfp)]
            boxes, cls = np.r_[boxes, fp], np.r_[cls, rng.integers(0, nc, nfp)]
            scores = rng.integers(1, 21, per_image) / 20
            scores[len(src):] *= 0.5  # false positives tend to score lower
            out[si, :, :4] = torch.as_tensor(boxes, dtype=torch.float32)
            out[si, np.arange(per_image), 4 + cls] = torch.as_tensor(scores, dtype=torch.float32)
        outputs.append(out)
    return outputs


def test_pycocotools_agrees_exactly_with_a_strong_detector_and_score_ties(tmp_path, one_thread):
    """A detector with mAP far from 0, score ties across images and a rect order unlike id order."""
    from yolotrain.utils.core.dist import DistInfo
    from yolotrain.utils.data.loader import create_dataloader
    from yolotrain.utils.eval.evaluate import EvalOptions, evaluate_model
    from yolotrain.utils.eval.outputs import save_json

    rng = np.random.default_rng(0)
    images = _make_dataset(tmp_path / "ds", rng)
    names = ["a", "b", "c"]
    loader = create_dataloader(str(images), 96, 4, 32, rect=True, pad=0.5, workers=0, nc=3)
    dataset = loader.dataset
    assert dataset.im_files != sorted(dataset.im_files)  # evaluation must not follow the loader's order
    model = _ReplayModel(_replay_outputs(loader, rng))
    result = evaluate_model(model, loader, torch.device("cpu"), names, DistInfo(),
                            EvalOptions(fuse=False, keep_detections=True))
    save_json(result.detections, dataset, names, tmp_path / "out")
    assert not model.outputs  # every batch consumed once
    m = result.metrics
    map50, map5095 = _cocoeval(tmp_path / "out" / "ground_truth.json", tmp_path / "out" / "predictions.json")
    assert m.map50 > 0.5 and 0.15 < m.map < 0.95 and m.n_instances > 20
    assert abs(map50 - m.map50) < 1e-9 and abs(map5095 - m.map) < 1e-9, (map50, m.map50, map5095, m.map)
    assert result.confusion is not None and result.confusion[:, :-1].sum(0).tolist() == m.nt.tolist()


def test_several_checkpoints_on_one_split_share_one_loader(weights, tiny_data, capsys, restore_logger):
    """No second label read and no workers forked from a process already holding a validation."""
    val_here("--weights", weights, weights, "--data", tiny_data, "--batch-size", "5", "--workers", "1", "--noplots")
    stdout = capsys.readouterr().out
    assert len(re.findall(r"Scanning", stdout)) == 1, stdout
    results = re.findall(r"^Results: .*$", stdout, re.M)
    assert len(results) == 2 and results[0] == results[1]
