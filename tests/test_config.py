"""Hyperparameter and dataset yaml validation: every mistake names the file and the key."""
from __future__ import annotations

import logging

import pytest

from utils.config import Hyp, load_data_config, load_hyp
from utils.errors import UserError
from tests.conftest import ROOT


def test_shipped_hyps_load_without_warnings(caplog):
    for name in ("low", "med", "high"):
        with caplog.at_level(logging.WARNING, logger="yolotrain"):
            hyp = load_hyp(ROOT / "hyps" / f"hyp.scratch-{name}.yaml")
        assert isinstance(hyp, Hyp)
    assert not caplog.records
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
    from utils.config import prepare_dataset
    f = tmp_path / "d.yaml"
    f.write_text("path: ds\ntrain: images/train\nval: images/val\nnames: [a]\n"
                 "generate: shapes\ngenerate_args: {n_trian: 4}\n")
    with pytest.raises(UserError, match=r"d\.yaml: unknown generate_args key 'n_trian'.*Did you mean 'n_train'"):
        prepare_dataset(load_data_config(f))
    assert not (tmp_path / "ds").exists()


def test_missing_split_path_is_a_user_error(tmp_path):
    from utils.config import prepare_dataset
    f = tmp_path / "d.yaml"
    f.write_text("train: images/train\nval: images/val\nnames: [a]\n")
    with pytest.raises(UserError, match=r"d\.yaml: 'train' path not found: .*images/train"):
        prepare_dataset(load_data_config(f))


@pytest.mark.parametrize("make", ["empty_dir", "empty_txt"])
def test_empty_split_names_yaml_and_key(tmp_path, make):
    from utils.config import prepare_dataset
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
