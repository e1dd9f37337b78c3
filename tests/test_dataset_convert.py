"""COCO and Pascal VOC -> YOLO datasets (utils/data/convert, python -m yolotrain.convert).

Every test writes its own annotation files and tiny images; the converted folders are read back
with the project's own loader, and the slow test scores one with val.py --save-json and checks
that ground_truth.json gives the source's boxes and ids back.
"""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import cv2
import numpy as np
import pytest
import yaml

from tests.helpers import PYTHON, run, val_here
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data.convert import convert_coco, convert_voc

CATS = [{"id": 90, "name": "toothbrush"}, {"id": 3, "name": "car"}, {"id": 17, "name": "cat"}]


def _jpg(path: Path, w: int, h: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), np.full((h, w, 3), 90, np.uint8))


def _coco(root: Path, split: str = "val", images=None, annotations=None, categories=None, write_images=True) -> Path:
    """root/annotations/instances_<split>.json and root/<split>/*.jpg; returns the json path."""
    images = images if images is not None else [
        {"id": 7, "file_name": "a.jpg", "width": 64, "height": 48},
        {"id": 9, "file_name": "b.jpg", "width": 40, "height": 30},
        {"id": 12, "file_name": "c.jpg", "width": 32, "height": 32}]  # c: no annotations, a background
    annotations = annotations if annotations is not None else [
        {"id": 1, "image_id": 7, "category_id": 90, "bbox": [10, 5, 20, 10], "iscrowd": 0},
        {"id": 2, "image_id": 7, "category_id": 3, "bbox": [50, 40, 30, 20]},  # runs off the bottom right: clipped
        {"id": 3, "image_id": 9, "category_id": 17, "bbox": [1, 2, 3, 4], "iscrowd": 1},  # crowd: left out
        {"id": 4, "image_id": 9, "category_id": 17, "bbox": [0.5, 1.25, 10.5, 20]}]
    for im in images if write_images else []:
        _jpg(root / split / im["file_name"], im["width"], im["height"])
    file = root / "annotations" / f"instances_{split}.json"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": CATS if categories is None else categories}))
    return file


def _rows(path: Path) -> list[list[float]]:
    return [[float(v) for v in line.split()] for line in path.read_text().splitlines()]


def test_coco_remaps_ids_drops_crowd_clips_and_keeps_backgrounds(tmp_path):
    _coco(tmp_path / "coco")
    report = convert_coco(tmp_path / "coco", tmp_path / "out")
    out = tmp_path / "out"
    data = yaml.safe_load((out / "data.yaml").read_text())
    assert data["names"] == ["car", "cat", "toothbrush"] and data["category_ids"] == [3, 17, 90]  # sorted ids
    assert (data["path"], data["train"], data["val"], data["image_ids"]) == (".", "images/val", "images/val",
                                                                            "image_ids.json")
    assert json.loads((out / "image_ids.json").read_text()) == {"images/val/a.jpg": 7, "images/val/b.jpg": 9,
                                                                "images/val/c.jpg": 12}
    c = report.splits["val"]
    assert (c.images, c.labels, c.instances, c.backgrounds, c.crowd, c.clipped) == (3, 2, 3, 1, 1, 1)
    assert report.data_yaml == out / "data.yaml" and report.linked == 3 and report.copied == 0
    assert os.stat(out / "images/val/a.jpg").st_ino == os.stat(tmp_path / "coco/val/a.jpg").st_ino  # hard link
    np.testing.assert_allclose(_rows(out / "labels/val/a.txt"),
                               [[2, 20 / 64, 10 / 48, 20 / 64, 10 / 48], [0, 57 / 64, 44 / 48, 14 / 64, 8 / 48]],
                               rtol=1e-15)
    assert _rows(out / "labels/val/b.txt") == [[1, 5.75 / 40, 11.25 / 30, 10.5 / 40, 20 / 30]]
    assert (out / "labels/val/c.txt").read_text() == ""  # background: an empty label file
    assert not list(tmp_path.glob(".out*"))  # no temporary folder left


def test_converted_dataset_loads_with_the_project_loader(tmp_path):
    from yolotrain.utils.data.config import load_data_config, prepare_dataset
    from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels

    _coco(tmp_path / "coco")
    convert_coco(tmp_path / "coco", tmp_path / "out")
    cfg = load_data_config(tmp_path / "out" / "data.yaml")
    prepare_dataset(cfg)
    assert cfg.names == ["car", "cat", "toothbrush"] and cfg.category_ids == [3, 17, 90]
    ds = LoadImagesAndLabels(DatasetSpec(cfg.val, nc=cfg.nc, img_size=64), verbose=False)
    assert ds.counts["images"] == 3 and ds.counts["backgrounds"] == 1 and ds.counts["instances"] == 3
    assert ds.counts["clipped"] == 0 and ds.counts["dropped"] == 0  # nothing for the scan to fix
    assert ds.image_hw.tolist() == [[48, 64], [30, 40], [32, 32]]


def test_ground_truth_gives_a_small_box_far_from_the_origin_back_exactly(tmp_path):
    """float32 would lose ~1e-5 of w = x2 - x1 here; the ground truth keeps the source box to 1e-9."""
    from yolotrain.utils.data.config import load_data_config
    from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels
    from yolotrain.utils.eval.coco import SourceIds, dataset_ground_truth

    boxes = [[4093.37, 3070.11, 1.93, 2.07], [0.13, 0.27, 4000.5, 3.3], [2.2, 1.1, 0.71, 0.35]]
    _coco(tmp_path / "coco", images=[{"id": 5, "file_name": "big.jpg", "width": 4096, "height": 3073}],
          annotations=[{"id": k + 1, "image_id": 5, "category_id": 3, "bbox": b} for k, b in enumerate(boxes)])
    convert_coco(tmp_path / "coco", tmp_path / "out")
    cfg = load_data_config(tmp_path / "out" / "data.yaml")
    ds = LoadImagesAndLabels(DatasetSpec(cfg.val, nc=cfg.nc, img_size=64), verbose=False)
    gt = dataset_ground_truth(ds, cfg.names, SourceIds.from_data(cfg, cfg.names))
    assert [im["id"] for im in gt["images"]] == [5] and [c["id"] for c in gt["categories"]] == [3, 17, 90]
    got = sorted(a["bbox"] for a in gt["annotations"])
    np.testing.assert_allclose(got, sorted(boxes), rtol=1e-9, atol=0)


def test_coco_folder_with_two_splits_and_the_split_flags(tmp_path):
    _coco(tmp_path / "coco", "train2017")
    _coco(tmp_path / "coco", "val2017", images=[{"id": 1, "file_name": "v.jpg", "width": 20, "height": 20}],
          annotations=[])
    report = convert_coco(tmp_path / "coco", tmp_path / "out")
    assert (report.train, report.val) == ("train2017", "val2017") and set(report.splits) == {"train2017", "val2017"}
    data = yaml.safe_load((tmp_path / "out" / "data.yaml").read_text())
    assert (data["train"], data["val"]) == ("images/train2017", "images/val2017")
    report = convert_coco(tmp_path / "coco", tmp_path / "out", val_split="train2017", exist_ok=True)
    assert report.val == "train2017"
    with pytest.raises(UserError, match="split 'test' not found; the input has train2017, val2017"):
        convert_coco(tmp_path / "coco", tmp_path / "out2", val_split="test")


def test_coco_images_flag_and_single_split_warning(tmp_path, caplog):
    file = _coco(tmp_path / "coco", write_images=False)
    for name, (w, h) in {"a.jpg": (64, 48), "b.jpg": (40, 30), "c.jpg": (32, 32)}.items():
        _jpg(tmp_path / "pics" / name, w, h)
    with pytest.raises(UserError, match=r"image 'a.jpg' not found in any of: .*coco/annotations, .*coco/val, "
                                         r".*coco/images/val; point --images at its folder"):
        convert_coco(file, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    report = convert_coco(file, tmp_path / "out", images=tmp_path / "pics", copy=True)
    assert (report.train, report.val, report.copied) == ("val", "val", 3)


@pytest.mark.parametrize("case, message", [
    ("missing", r"1 image\(s\) missing on disk: .*/val/b.jpg"),
    ("json", r"instances_val.json: not valid JSON \(line 1, column \d+\)"),
    ("category", r"instances_val.json: annotation id 4: unknown category_id 5 \(categories: 3, 17, 90\)"),
    ("duplicate", r"same file name stem 'a' as .*a.jpg in split 'val'; both would write labels/val/a.txt"),
    ("outside", r"annotation id 4 \(image b.jpg\): box \(50, 1.25, 60.5, 21.25\) lies entirely outside the 40x30"),
    ("flat", r"annotation id 4: box has no positive width and height \(10.5 x 0\)"),
    ("image_id", r"annotation id 4: image_id 99 is not in 'images'"),
])
def test_coco_bad_input_is_named_and_nothing_is_written(tmp_path, case, message):
    file = _coco(tmp_path / "coco")
    doc = json.loads(file.read_text())
    if case == "missing":
        (tmp_path / "coco" / "val" / "b.jpg").unlink()
    elif case == "json":
        file.write_text(file.read_text()[:-20])
    elif case == "duplicate":
        doc["images"][1]["file_name"] = "a.png"
        _jpg(tmp_path / "coco" / "val" / "a.png", 40, 30)
    else:
        key, value = {"category": ("category_id", 5), "outside": ("bbox", [50, 1.25, 10.5, 20]),
                      "flat": ("bbox", [1, 1, 10.5, 0]), "image_id": ("image_id", 99)}[case]
        doc["annotations"][3][key] = value
    if case != "json":
        file.write_text(json.dumps(doc))
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(UserError, match=message):
        convert_coco(tmp_path / "coco", tmp_path / "out", exist_ok=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coco", "out"]  # no temporary folder left
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]  # OUT unchanged


def test_non_empty_out_is_refused_unless_exist_ok(tmp_path):
    _coco(tmp_path / "coco")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("x")
    with pytest.raises(UserError, match="exists and is not empty; pass --exist-ok"):
        convert_coco(tmp_path / "coco", tmp_path / "out")
    convert_coco(tmp_path / "coco", tmp_path / "out", exist_ok=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["data.yaml", "image_ids.json", "images", "labels"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["coco", "out"]


def _voc_xml(path: Path, filename: str, objects: list[tuple], size: tuple[int, int] | None = (50, 40)) -> None:
    objs = "".join(f"<object><name>{n}</name><difficult>{d}</difficult><bndbox><xmin>{b[0]}</xmin><ymin>{b[1]}"
                   f"</ymin><xmax>{b[2]}</xmax><ymax>{b[3]}</ymax></bndbox></object>" for n, d, b in objects)
    sz = f"<size><width>{size[0]}</width><height>{size[1]}</height><depth>3</depth></size>" if size else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"<annotation><folder>VOC2012</folder><filename>{filename}</filename>{sz}{objs}</annotation>")


def _voc(root: Path) -> Path:
    """A VOC2012-style folder: train (img1, img2) and val (img3) lists, one difficult object."""
    _voc_xml(root / "Annotations/img1.xml", "img1.jpg", [("dog", 0, (1, 1, 50, 40)), ("person", 1, (5, 6, 7, 8))])
    _voc_xml(root / "Annotations/img2.xml", "img2.jpg", [("person", 0, (11, 21, 30, 39))], size=None)
    _voc_xml(root / "Annotations/img3.xml", "img3.jpg", [("cat", 0, (2, 3, 60, 45))])  # past the edge: clipped
    for k in (1, 2, 3):
        _jpg(root / f"JPEGImages/img{k}.jpg", 50, 40)
    (root / "ImageSets/Main").mkdir(parents=True)
    (root / "ImageSets/Main/train.txt").write_text("img1\nimg2\n")
    (root / "ImageSets/Main/val.txt").write_text("img3\n")
    (root / "ImageSets/Main/dog_train.txt").write_text("img1  1\nimg2 -1\n")  # a per-class list: ignored
    return root


def test_voc_splits_one_based_boxes_and_difficult_dropped(tmp_path):
    report = convert_voc(_voc(tmp_path / "VOC2012"), tmp_path / "out")
    out = tmp_path / "out"
    data = yaml.safe_load((out / "data.yaml").read_text())
    assert data["names"] == ["cat", "dog", "person"] and "category_ids" not in data  # sorted names found
    assert (data["train"], data["val"]) == ("images/train", "images/val")
    assert (report.splits["train"].difficult, report.splits["train"].instances, report.splits["val"].clipped) == (1, 2, 1)
    # xmin 1..xmax 50 of a 50-wide image is the whole width: continuous x1 = xmin - 1 = 0, x2 = xmax = 50
    assert _rows(out / "labels/train/img1.txt") == [[1, 0.5, 0.5, 1.0, 1.0]]
    np.testing.assert_allclose(_rows(out / "labels/train/img2.txt"), [[2, 20 / 50, 29.5 / 40, 20 / 50, 19 / 40]])
    np.testing.assert_allclose(_rows(out / "labels/val/img3.txt"), [[0, 25.5 / 50, 21 / 40, 49 / 50, 38 / 40]])


def test_voc_keep_difficult_and_a_given_class_list(tmp_path):
    src = _voc(tmp_path / "VOC2012")
    report = convert_voc(src, tmp_path / "out", names=["person", "dog", "cat", "bird"], keep_difficult=True)
    assert report.names == ["person", "dog", "cat", "bird"] and report.splits["train"].difficult == 0
    assert _rows(tmp_path / "out/labels/train/img1.txt") == [[1, 0.5, 0.5, 1.0, 1.0],
                                                            [0, 5.5 / 50, 6.5 / 40, 3 / 50, 3 / 40]]
    with pytest.raises(UserError, match=r"img1.xml: object 1: class 'dog' is not in the class list "
                                        r"\(person, dgo, cat\). Did you mean 'dgo'\?"):
        convert_voc(src, tmp_path / "out2", names=["person", "dgo", "cat"])
    assert not (tmp_path / "out2").exists()


def test_voc_folder_of_xml_and_bad_xml(tmp_path):
    _voc_xml(tmp_path / "xml/p.xml", "p.jpg", [("dog", 0, (1, 1, 10, 10))])
    _jpg(tmp_path / "xml/p.jpg", 50, 40)
    report = convert_voc(tmp_path / "xml", tmp_path / "out")
    assert (report.train, report.val, report.splits["all"].images) == ("all", "all", 1)
    (tmp_path / "xml/q.xml").write_text("<annotation>\n  <object><name>dog</name>\n</annotation>\n")
    with pytest.raises(UserError, match=r"q.xml: not valid XML \(line 3, column 3\): mismatched tag"):
        convert_voc(tmp_path / "xml", tmp_path / "out2")
    _voc_xml(tmp_path / "xml/q.xml", "q.jpg", [("dog", 0, (1, 1, 10, 10))])
    with pytest.raises(UserError, match=r"q.xml: image 'q.jpg' missing on disk"):
        convert_voc(tmp_path / "xml", tmp_path / "out2")
    assert not (tmp_path / "out2").exists()


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m yolotrain.convert``, the module path older commands use."""
    return run([PYTHON, "-m", "yolotrain.convert", *args], ok=None, timeout=120)


def test_cli_converts_and_bad_input_is_one_line_and_exit_1(tmp_path):
    src = _voc(tmp_path / "VOC2012")
    names = tmp_path / "names.txt"
    names.write_text("cat\ndog\n\nperson\n")
    p = _cli("voc", str(src), str(tmp_path / "out"), "--names-file", str(names), "--keep-difficult")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "train: 2 images (0 backgrounds), 3 boxes" in p.stdout and f"--data {tmp_path / 'out' / 'data.yaml'}" in p.stdout
    file = _coco(tmp_path / "coco")
    file.write_text('{"images": [}')
    p = _cli("coco", str(tmp_path / "coco"), str(tmp_path / "out2"))
    out = (p.stdout + p.stderr).strip()
    assert p.returncode == 1 and out.splitlines() == [out] and "Traceback" not in out
    assert out.startswith(f"ERROR: {file}: not valid JSON (line 1, column 13)"), out
    assert not (tmp_path / "out2").exists()


@pytest.mark.slow
def test_coco_round_trip_through_val_save_json(tmp_path, tiny_v5n, restore_logger):
    """COCO json -> convert -> val.py --save-json: ground_truth.json is the source (ids, boxes to 1e-6), and
    predictions.json carries the source's ids, so pycocotools scores it against the source json directly."""
    from pycocotools.coco import COCO

    cats = [{"id": i, "name": n} for i, n in zip((2, 5, 11, 40, 77, 90), ("a", "b", "c", "d", "e", "f"))]  # 6: tiny_v5n's nc
    rng = np.random.default_rng(0)
    images, annotations = [], []
    for k, (w, h) in enumerate([(640, 480), (1001, 701), (333, 517), (96, 96)]):
        images.append({"id": 1000 + 7 * k, "file_name": f"{k:012d}.jpg", "width": w, "height": h})
        for _ in range(4 if k < 3 else 0):  # the last image is a background
            bw, bh = rng.uniform(0.7, w / 3), rng.uniform(0.7, h / 3)
            annotations.append({"id": len(annotations) + 1, "image_id": 1000 + 7 * k, "category_id": int(rng.choice([2, 5, 11, 40, 77, 90])),
                                "bbox": [float(rng.uniform(0, w - bw)), float(rng.uniform(0, h - bh)), bw, bh],
                                "area": bw * bh, "iscrowd": 0})
    annotations[0]["bbox"] = [637.123456789, 477.987654321, 1.23456789, 0.98765432]  # small, far from the origin
    file = _coco(tmp_path / "coco", "val2017", images, annotations, cats)
    convert_coco(file, tmp_path / "out")
    val_here("--weights", tiny_v5n, "--data", tmp_path / "out/data.yaml", "--imgsz", "64", "--batch-size", "4",
             "--workers", "0", "--save-json", "--noplots", "--project", tmp_path / "runs", "--name", "r")
    gt = json.loads((tmp_path / "runs/r/ground_truth.json").read_text())
    assert sorted(c["id"] for c in gt["categories"]) == [2, 5, 11, 40, 77, 90]
    assert {c["id"]: c["name"] for c in gt["categories"]} == {c["id"]: c["name"] for c in cats}
    assert sorted(im["id"] for im in gt["images"]) == [im["id"] for im in images]
    assert {im["id"]: Path(im["file_name"]).name for im in gt["images"]} == {im["id"]: im["file_name"] for im in images}

    def boxes(anns):  # per (image, category): the sorted boxes
        out = {}
        for a in anns:
            out.setdefault((a["image_id"], a["category_id"]), []).append(a["bbox"])
        return {k: sorted(v) for k, v in out.items()}

    want, got = boxes(annotations), boxes(gt["annotations"])
    assert want.keys() == got.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=0, err_msg=str(key))
    preds = json.loads((tmp_path / "runs/r/predictions.json").read_text())
    assert preds and {d["category_id"] for d in preds} <= {2, 5, 11, 40, 77, 90}
    assert {d["image_id"] for d in preds} <= {im["id"] for im in images}
    source = COCO(str(file))
    assert len(source.loadRes(str(tmp_path / "runs/r/predictions.json")).anns) == len(preds)  # scores as is
