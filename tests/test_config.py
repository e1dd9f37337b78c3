"""Hyperparameter and dataset yaml validation: every mistake names the file and the key."""
from __future__ import annotations

import logging

import pytest

from yolotrain.utils.core.hyp import Hyp, load_hyp

from yolotrain.utils.data.config import load_data_config
from yolotrain.utils.core.errors import UserError
from tests.helpers import ROOT


def test_shipped_hyps_load_without_warnings(caplog):
    for name in ("low", "med", "high"):
        with caplog.at_level(logging.WARNING, logger="yolotrain"):
            hyp = load_hyp(ROOT / "hyps" / f"hyp.scratch-{name}.yaml")
        assert isinstance(hyp, Hyp)
    # scratch-high keeps YOLOv5's copy_paste 0.1, which box-only training ignores (and says so)
    assert [r.getMessage() for r in caplog.records if "copy_paste" not in r.getMessage()] == []
    assert all("scratch-high" in r.getMessage() for r in caplog.records)
    assert load_hyp(ROOT / "hyps" / "hyp.scratch-med.yaml").mixup == 0.1


def test_unknown_hyp_key_suggests_the_right_one(tmp_path):
    f = tmp_path / "h.yaml"
    f.write_text("lr0: 0.01\nmomentun: 0.9\n")
    with pytest.raises(UserError, match=r"h\.yaml: unknown hyperparameter 'momentun'.*Did you mean 'momentum'"):
        load_hyp(f)


def test_missing_hyp_keys_take_defaults_with_warning(tmp_path, caplog):
    f = tmp_path / "h.yaml"
    f.write_text("lr0: 0.02\n")
    with caplog.at_level(logging.WARNING, logger="yolotrain"):
        hyp = load_hyp(f)
    assert hyp.lr0 == 0.02 and hyp.momentum == Hyp().momentum
    assert "missing" in caplog.text and "momentum" in caplog.text


def test_non_numeric_hyp_value(tmp_path):
    f = tmp_path / "h.yaml"
    f.write_text("lr0: fast\n")
    with pytest.raises(UserError, match="'lr0' must be a number"):
        load_hyp(f)


def test_broken_yaml_names_file_and_line(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("train: a\nval: [b\n")
    with pytest.raises(UserError, match=r"d\.yaml: not valid yaml \(line"):
        load_data_config(f)


def test_yaml_is_never_evaluated(tmp_path):
    f = tmp_path / "evil.yaml"
    f.write_text("lr0: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(UserError, match="not valid yaml"):
        load_hyp(f)


def test_data_yaml_resolves_relative_to_its_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    f = tmp_path / "sub" / "d.yaml"
    f.write_text("path: ../ds\ntrain: images/train\nval: [images/val, extra.txt]\nnames: [a, b]\n")
    cfg = load_data_config(f)
    assert cfg.root == (tmp_path / "ds").resolve()
    assert cfg.train == [str(cfg.root / "images/train")]
    assert cfg.val[1] == str(cfg.root / "extra.txt")
    assert cfg.names == ["a", "b"] and cfg.nc == 2 and cfg.test == []


@pytest.mark.parametrize("text, match", [
    ("val: v\nnames: [a]\n", "missing required key 'train'"),
    ("train: t\nval: v\nnames: {0: a, 2: c}\n", r"without gaps \(missing \[1\]\)"),
    ("train: t\nval: v\nnames: [a, b]\nnc: 3\n", "nc is 3 but 'names' lists 2"),
    ("train: t\nval: v\nnames: []\n", "'names' is empty"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_data_yaml_errors(tmp_path, text, match):
    f = tmp_path / "d.yaml"
    f.write_text(text)
    with pytest.raises(UserError, match=match) as e:
        load_data_config(f)
    assert str(f) in str(e.value)


def test_names_dict_becomes_list(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("train: t\nval: v\nnames: {1: dog, 0: cat}\n")
    assert load_data_config(f).names == ["cat", "dog"]


def test_unknown_generate_arg_is_a_user_error(tmp_path):
    from yolotrain.utils.data.config import prepare_dataset
    f = tmp_path / "d.yaml"
    f.write_text("path: ds\ntrain: images/train\nval: images/val\nnames: [a]\n"
                 "generate: shapes\ngenerate_args: {n_trian: 4}\n")
    with pytest.raises(UserError, match=r"d\.yaml: unknown generate_args key 'n_trian'.*Did you mean 'n_train'"):
        prepare_dataset(load_data_config(f))
    assert not (tmp_path / "ds").exists()


def test_missing_split_path_is_a_user_error(tmp_path):
    from yolotrain.utils.data.config import prepare_dataset
    f = tmp_path / "d.yaml"
    f.write_text("train: images/train\nval: images/val\nnames: [a]\n")
    with pytest.raises(UserError, match=r"d\.yaml: 'train' path not found: .*images/train"):
        prepare_dataset(load_data_config(f))


@pytest.mark.parametrize("make", ["empty_dir", "empty_txt"])
def test_empty_split_names_yaml_and_key(tmp_path, make):
    from yolotrain.utils.data.config import prepare_dataset
    (tmp_path / "images" / "train").mkdir(parents=True)
    (tmp_path / "images" / "train" / "a.jpg").write_bytes(b"x")
    if make == "empty_dir":
        (tmp_path / "images" / "val").mkdir()
        (tmp_path / "images" / "val" / "notes.md").write_text("no images here")
        val = "images/val"
    else:
        (tmp_path / "val.txt").write_text("\n\n")
        val = "val.txt"
    f = tmp_path / "d.yaml"
    f.write_text(f"train: images/train\nval: {val}\nnames: [a]\n")
    with pytest.raises(UserError, match=r"d\.yaml: 'val' has no images"):
        prepare_dataset(load_data_config(f))


def test_bad_anchors_in_data_yaml_name_the_file(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("train: t\nval: v\nnames: [a]\nanchors: [[10, 13, 16], [30, 61]]\n")
    with pytest.raises(UserError, match=r"d\.yaml: 'anchors': anchors must be a list of per-level lists"):
        load_data_config(f)
    f.write_text("train: t\nval: v\nnames: [a]\nanchors: [[10, 13, 16, 30], [30, 61, 62, 45]]\n")
    assert load_data_config(f).anchors == [[10, 13, 16, 30], [30, 61, 62, 45]]


# ----------------------------------------------------------------------------------------------
# YOLOv5 7.0's own hyp and data yamls load unchanged

# data/hyps/hyp.VOC.yaml and hyp.Objects365.yaml from YOLOv5 7.0 (values verbatim, header comments dropped)
YOLOV5_HYP_VOC = """\
lr0: 0.00334
lrf: 0.15135
momentum: 0.74832
weight_decay: 0.00025
warmup_epochs: 3.3835
warmup_momentum: 0.59462
warmup_bias_lr: 0.18657
box: 0.02
cls: 0.21638
cls_pw: 0.5
obj: 0.51728
obj_pw: 0.67198
iou_t: 0.2
anchor_t: 3.3744
fl_gamma: 0.0
hsv_h: 0.01041
hsv_s: 0.54703
hsv_v: 0.27739
degrees: 0.0
translate: 0.04591
scale: 0.75544
shear: 0.0
perspective: 0.0
flipud: 0.0
fliplr: 0.5
mosaic: 0.85834
mixup: 0.04266
copy_paste: 0.0
anchors: 3.412
"""
YOLOV5_HYP_OBJECTS365 = """\
lr0: 0.00258
lrf: 0.17
momentum: 0.779
weight_decay: 0.00058
warmup_epochs: 1.33
warmup_momentum: 0.86
warmup_bias_lr: 0.0711
box: 0.0539
cls: 0.299
cls_pw: 0.825
obj: 0.632
obj_pw: 1.0
iou_t: 0.2
anchor_t: 3.44
anchors: 3.2
fl_gamma: 0.0
hsv_h: 0.0188
hsv_s: 0.704
hsv_v: 0.36
degrees: 0.0
translate: 0.0902
scale: 0.491
shear: 0.0
perspective: 0.0
flipud: 0.0
fliplr: 0.5
mosaic: 1.0
mixup: 0.0
copy_paste: 0.0
"""


def _yolov5_scratch(name: str) -> str:
    """YOLOv5 7.0's hyp.scratch-{name}.yaml: ours without the two keys yolotrain adds."""
    lines = (ROOT / "hyps" / f"hyp.scratch-{name}.yaml").read_text().splitlines()
    return "\n".join(ln for ln in lines if not ln.startswith(("label_smoothing:", "close_mosaic:"))) + "\n"


def _yolov5_no_augmentation() -> str:
    """YOLOv5 7.0's hyp.no-augmentation.yaml: scratch-high's key set with every augmentation off
    (its 'hsv_s: 00' is copied as written)."""
    text = _yolov5_scratch("high")
    off = {"hsv_h": "0", "hsv_s": "00", "hsv_v": "0", "translate": "0", "scale": "0", "shear": "0",
           "fliplr": "0.0", "mosaic": "0.0", "mixup": "0.0", "copy_paste": "0.0", "cls": "0.3", "obj": "0.7"}
    return "\n".join(f"{ln.split(':')[0]}: {off[ln.split(':')[0]]}" if ln.split(":")[0] in off else ln
                     for ln in text.splitlines()) + "\n"


@pytest.mark.parametrize("name", ["VOC", "Objects365", "scratch-low", "scratch-med", "scratch-high",
                                  "no-augmentation"])
def test_yolov5_hyp_files_load(tmp_path, caplog, name):
    text = {"VOC": YOLOV5_HYP_VOC, "Objects365": YOLOV5_HYP_OBJECTS365, "no-augmentation": None}.get(name)
    text = _yolov5_no_augmentation() if name == "no-augmentation" else text or _yolov5_scratch(name[8:])
    assert "label_smoothing" not in text and "close_mosaic" not in text
    f = tmp_path / f"hyp.{name}.yaml"
    f.write_text(text)
    with caplog.at_level(logging.WARNING, logger="yolotrain"):
        hyp = load_hyp(f)
    assert hyp.anchors == {"VOC": 3.412, "Objects365": 3.2}.get(name, 0.0)
    assert hyp.label_smoothing == 0.0 and hyp.close_mosaic == 0.0  # YOLOv5's behaviour, without a warning
    warnings = [r.getMessage() for r in caplog.records]
    if name == "scratch-high":  # YOLOv5's copy_paste: 0.1
        assert len(warnings) == 1 and "copy_paste 0.1 is ignored" in warnings[0] and "segment" in warnings[0]
    else:
        assert warnings == []
    if name == "no-augmentation":
        assert hyp.hsv_s == 0.0 and hyp.mosaic == 0.0


@pytest.mark.parametrize("value", ["0.3", "-1", ".nan", ".inf"])
def test_hyp_anchors_must_be_a_count(tmp_path, value):
    f = tmp_path / "h.yaml"
    f.write_text(f"anchors: {value}\n")
    with pytest.raises(UserError, match=r"h\.yaml: 'anchors' is the number of anchors per detection level"):
        load_hyp(f)


def test_copy_paste_warns_that_it_is_ignored(tmp_path, caplog):
    f = tmp_path / "h.yaml"
    f.write_text(_yolov5_scratch("low").replace("copy_paste: 0.0", "copy_paste: 0.5"))
    with caplog.at_level(logging.WARNING, logger="yolotrain"):
        assert load_hyp(f).copy_paste == 0.5
    assert len(caplog.records) == 1 and "h.yaml: copy_paste 0.5 is ignored" in caplog.text


# data/coco128.yaml and data/VOC.yaml from YOLOv5 7.0: every top-level key, names shortened, and the
# VOC download block replaced by code that would leave a file behind if it were ever run.
YOLOV5_COCO128 = """\
path: ../datasets/coco128  # dataset root dir
train: images/train2017  # train images (relative to 'path') 128 images
val: images/train2017  # val images (relative to 'path') 128 images
test:  # test images (optional)

# Classes
names:
  0: person
  1: bicycle
  2: car

# Download script/URL (optional)
download: https://ultralytics.com/assets/coco128.zip
"""
YOLOV5_VOC = """\
path: ../datasets/VOC
train: # train images (relative to 'path')  16551 images
  - images/train2012
  - images/train2007
val: # val images (relative to 'path')  4952 images
  - images/test2007
test: # test images (optional)
  - images/test2007
names:
  0: aeroplane
  1: bicycle
download: |
  from pathlib import Path
  Path(yaml['path'], 'RAN').write_text('the download code ran')
"""


def test_yolov5_data_yamls_load_and_download_is_never_run(tmp_path, monkeypatch):
    from yolotrain.utils.data.config import prepare_dataset
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name, text in (("coco128", YOLOV5_COCO128), ("VOC", YOLOV5_VOC)):
        f = tmp_path / "data" / f"{name}.yaml"
        f.write_text(text)
        cfg = load_data_config(f)
        root = (tmp_path / "datasets" / name).resolve()  # data/../datasets/NAME: against the yaml's folder
        assert cfg.root == root and cfg.has_download
        assert cfg.test == ([] if name == "coco128" else [str(root / "images/test2007")])  # empty test: none
        with pytest.raises(UserError) as e:
            prepare_dataset(cfg)
        msg = str(e.value)
        assert msg.startswith(f"{f}: 'train' path not found: {root / 'images'}") and "\n" not in msg
        assert msg.endswith(f"the yaml has a download key: yolotrain never downloads or runs it; "
                            f"put the dataset at {root}")
    assert not any(tmp_path.rglob("RAN")) and not any(tmp_path.rglob("*.zip"))


def test_download_hint_names_the_missing_split_when_the_root_exists(tmp_path):
    from yolotrain.utils.data.config import prepare_dataset
    (tmp_path / "ds" / "images" / "val").mkdir(parents=True)
    (tmp_path / "ds" / "images" / "val" / "a.jpg").write_bytes(b"x")
    f = tmp_path / "d.yaml"
    f.write_text("path: ds\ntrain: images/train\nval: images/val\nnames: [a]\ndownload: https://x/y.zip\n")
    with pytest.raises(UserError, match=r"put the dataset at .*ds/images/train$"):
        prepare_dataset(load_data_config(f))


@pytest.mark.parametrize("layout", ["yolov5_cwd", "yolov5_yaml_in_data", "ultralytics"])
def test_path_hint_names_where_yolov5_or_ultralytics_would_look(tmp_path, monkeypatch, layout):
    from yolotrain.utils.data.config import prepare_dataset
    if layout == "yolov5_cwd":  # run from a YOLOv5 checkout: ../datasets is beside it
        cwd, yaml_dir, text, found = tmp_path / "yolov5", tmp_path / "yolov5" / "mydata", "../datasets/coco128", \
            tmp_path / "datasets" / "coco128"
        why = "relative to the working directory, as YOLOv5 resolves it"
    elif layout == "yolov5_yaml_in_data":  # --data pointing into a YOLOv5 checkout from elsewhere
        cwd, yaml_dir, text, found = tmp_path / "a" / "b", tmp_path / "yolov5" / "data", "../datasets/coco128", \
            tmp_path / "datasets" / "coco128"
        why = "relative to the yaml folder's parent, as YOLOv5 resolves it for a yaml in its data/ folder"
    else:  # Ultralytics: relative paths live under <cwd>/datasets
        cwd, yaml_dir, text, found = tmp_path / "proj", tmp_path / "proj" / "cfg" / "sets", "coco8", \
            tmp_path / "proj" / "datasets" / "coco8"
        why = "in ./datasets, as Ultralytics resolves it"
    for d in (cwd, yaml_dir, found / "images" / "train2017"):
        d.mkdir(parents=True, exist_ok=True)
    (found / "images" / "train2017" / "a.jpg").write_bytes(b"x")
    monkeypatch.chdir(cwd)
    f = yaml_dir / "d.yaml"
    f.write_text(f"path: {text}\ntrain: images/train2017\nval: images/train2017\nnames: [a]\n"
                 "download: https://ultralytics.com/assets/coco128.zip\n")
    cfg = load_data_config(f)
    with pytest.raises(UserError) as e:
        prepare_dataset(cfg)
    assert str(e.value) == (f"{f}: 'train' path not found: {cfg.root / 'images/train2017'}; path '{text}' resolves to "
                            f"{cfg.root} (against this yaml's folder), which does not exist; {found.resolve()} has "
                            f"images/train2017 ({why}"
                            + ("" if layout != "yolov5_cwd" else " from its repo folder")
                            + f"): set path: to {found.resolve()}")
    f.write_text(f"path: {found}\ntrain: images/train2017\nval: images/train2017\nnames: [a]\n")
    prepare_dataset(load_data_config(f))  # the hint's path works


def test_absolute_splits_work_whatever_path_says(tmp_path):
    from yolotrain.utils.data.config import prepare_dataset
    images = tmp_path / "elsewhere" / "images"
    images.mkdir(parents=True)
    (images / "a.jpg").write_bytes(b"x")
    f = tmp_path / "d.yaml"
    f.write_text(f"path: ../no/such/root\ntrain: {images}\nval: [{images}]\ntest:\nnames: [a]\ndownload: |\n  x = 1\n")
    prepare_dataset(load_data_config(f))


def test_data_yaml_nc_must_be_a_number(tmp_path):
    f = tmp_path / "d.yaml"
    f.write_text("train: t\nval: v\nnames: [a, b]\nnc: two\n")
    with pytest.raises(UserError, match=r"d\.yaml: 'nc' must be the number of classes, got 'two'"):
        load_data_config(f)
    f.write_text("train: t\nval: v\nnames: [a, b]\nnc: 2\nyaml_file: x.yaml\n")  # unknown keys: accepted
    assert load_data_config(f).nc == 2
