"""A dataset as tar shards plus an index (python -m yolotrain shards, utils/data/shards.py): what the shards hold,
how bad input is reported, that the folder is written whole, and that training from shards is training from the
folder."""
from __future__ import annotations

import re
import shutil
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from tests.helpers import train_here
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data.config import load_data_config
from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels
from yolotrain.utils.data.labels import LabelTable, img2label_paths, resolve_image_files, scan_labels
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.data.imgcache import release_ram_caches
from yolotrain.utils.data.loader import create_dataloader
from yolotrain.utils.data.shardcache import BUDGET_ENV, ShardCache
from yolotrain.utils.data.shards import ShardIndex
from yolotrain.app import shards


def _make(src: Path, out: Path, *flags: str) -> Path:
    shards.main(shards.build_parser().parse_args([str(src), str(out), *flags]))
    return out


def _folder(root: Path, n: int, corrupt: tuple[int, ...] = ()) -> Path:
    """``root``/images/train with ``n`` small pictures (one box each) and labels; ``corrupt`` ones are not images."""
    imgs, lbls = root / "images" / "train", root / "labels" / "train"
    imgs.mkdir(parents=True)
    lbls.mkdir(parents=True)
    for k in range(n):
        if k in corrupt:
            (imgs / f"{k}.jpg").write_bytes(b"not a picture")
        else:
            cv2.imwrite(str(imgs / f"{k}.png"), np.full((40 + k, 48, 3), 20 * k, np.uint8))
        (lbls / f"{k}.txt").write_text(f"0 0.5 0.5 0.{k + 1} 0.25\n")
    return imgs


def test_the_shards_hold_what_a_scan_of_the_folder_finds(tiny_data, tmp_path, restore_logger):
    out = _make(tiny_data, tmp_path / "out", "--shard-size", "1")
    data = load_data_config(tiny_data)
    made = load_data_config(out / "data.yaml")
    assert made.names == data.names and [Path(p).name for p in made.train + made.val] == ["train.index", "val.index"]
    for split in ("train", "val"):
        files = resolve_image_files(getattr(data, split))
        scan = scan_labels(files, img2label_paths(files), len(data.names))
        index = ShardIndex.open(out / f"{split}.index", nc=len(data.names))
        back = index.scan_result()
        assert list(back.img_files) == scan.img_files and list(back.label_files) == scan.label_files
        assert np.array_equal(back.image_hw, scan.image_hw) and back.counts == scan.counts
        assert len(back.labels) == len(scan.labels)
        assert all(np.array_equal(a, b) for a, b in zip(back.labels, scan.labels))
        tars = sorted(out.glob(f"{split}-*.tar"))
        members = {}
        for t in tars:  # plain tar reads them: <key>.<suffix> and <key>.txt per sample
            with tarfile.open(t) as tar:
                members.update({m.name: tar.extractfile(m).read() for m in tar.getmembers()})
        assert len(members) == 2 * len(scan.img_files)
        for i, (f, labels) in enumerate(zip(scan.img_files, scan.labels)):
            key = f"{i:09d}"
            assert index.read(i) == members[f"{key}{Path(f).suffix}"] == Path(f).read_bytes()
            rows = np.array([r.split() for r in members[f"{key}.txt"].decode().splitlines()], float).reshape(-1, 5)
            assert np.array_equal(rows, labels)


def test_a_bad_image_is_reported_as_the_folder_scan_reports_it_and_left_out(tmp_path, capsys, restore_logger):
    imgs = _folder(tmp_path / "src", 4, corrupt=(2,))
    files = resolve_image_files(imgs)
    expected = scan_labels(files, img2label_paths(files), 1).msgs
    out = _make(imgs, tmp_path / "out", "--nc", "1")
    assert expected and all(m in capsys.readouterr().out for m in expected)
    index = ShardIndex.open(out / "train.index")
    assert len(index) == 3 and index.meta["msgs"] == expected and index.meta["counts"]["corrupt"] == 1
    assert not (out / "data.yaml").exists()  # a folder source has no names to write


def test_the_folder_is_written_whole_or_not_at_all(tmp_path, restore_logger):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("x")
    imgs = _folder(tmp_path / "src", 2)
    with pytest.raises(UserError, match="exists and is not empty"):
        _make(imgs, taken, "--nc", "1")
    with pytest.raises(UserError, match="needs --nc"):
        _make(imgs, tmp_path / "out")
    bad = _folder(tmp_path / "bad", 2, corrupt=(0, 1))  # nothing usable: the split is refused
    with pytest.raises(UserError):
        _make(bad, tmp_path / "out", "--nc", "1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "src", "taken"]  # no half folder, no temp left


def test_a_split_reads_its_index_and_refuses_what_it_cannot_do(tmp_path, restore_logger):
    imgs = _folder(tmp_path / "src", 3)
    out = _make(imgs, tmp_path / "out", "--nc", "1")
    ds = LoadImagesAndLabels(DatasetSpec([str(out / "train.index")], nc=1, img_size=64), verbose=False)
    img, hw = ds.load_image(1)
    assert hw == (41, 48) and img.shape[:2] == (55, 64) and int(img[0, 0, 0]) == 20
    with pytest.raises(UserError, match="made for 1 classes, the dataset yaml has 2"):
        LoadImagesAndLabels(DatasetSpec(out / "train.index", nc=2, img_size=64), verbose=False)
    tar, cut = out / "train-000000.tar", int(ShardIndex.open(out / "train.index").arrays["offset"][2]) + 10
    tar.write_bytes(tar.read_bytes()[:cut])  # the last image's bytes cut short
    last = LoadImagesAndLabels(DatasetSpec(out / "train.index", nc=1, img_size=64), verbose=False)
    with pytest.raises(UserError, match=r"train-000000.tar/000000002.png: the shard ends \d+ bytes early"):
        last.load_image(2)


@pytest.mark.slow
def test_training_from_shards_is_training_from_the_folder(tiny_data, tmp_path, capsys, restore_logger):
    out = _make(tiny_data, tmp_path / "shards")
    flags = ["--cfg", "models/yolov8n.yaml", "--epochs", "1", "--imgsz", "64", "--batch-size", "4", "--val-batch-size",
             "4", "--workers", "1", "--seed", "3", "--noplots", "--project", str(tmp_path / "runs")]
    for name, data in (("folder", tiny_data), ("shards", out / "data.yaml")):
        capsys.readouterr()
        train_here("--data", data, *flags, "--name", name)
    assert "(from the shard index)" in capsys.readouterr().out
    a, b = (torch.load(tmp_path / "runs" / n / "weights" / "last.pt", weights_only=True) for n in ("folder", "shards"))
    for part in ("model", "ema"):  # the optimizer is stripped from a finished run
        assert a[part].keys() == b[part].keys() and all(torch.equal(a[part][k], b[part][k]) for k in a[part])
    assert a["metrics"] == b["metrics"]
    assert (tmp_path / "runs" / "folder" / "results.csv").read_text() == (tmp_path / "runs" / "shards" /
                                                                         "results.csv").read_text()


def test_a_bad_shard_read_by_a_loader_worker_is_still_one_line(tmp_path, restore_logger):
    """torch rebuilds a worker's exception around its traceback; the UserError still reads as its own message."""
    out = _make(_folder(tmp_path / "src", 3), tmp_path / "out", "--nc", "1")
    tar, cut = out / "train-000000.tar", int(ShardIndex.open(out / "train.index").arrays["offset"][1]) + 10
    tar.write_bytes(tar.read_bytes()[:cut])
    loader = create_dataloader(out / "train.index", 64, 3, 32, nc=1, workers=1)
    with pytest.raises(UserError) as e:
        next(iter(loader))
    assert re.fullmatch(rf"{re.escape(str(tar))}/000000001.png: the shard ends \d+ bytes early \(truncated\)",
                        str(e.value)), str(e.value)


def test_a_label_table_is_the_per_image_arrays_in_one(restore_logger):
    per_image = [np.array([[0, .5, .5, .2, .2], [1, .3, .3, .1, .1]]), np.zeros((0, 5)), np.array([[2, .6, .6, .3, .3]])]
    table = LabelTable.of(per_image)
    assert len(table) == 3 and all(np.array_equal(a, b) for a, b in zip(table, per_image))
    assert table.counts().tolist() == [2, 0, 1] and LabelTable.of(table) is table
    back = table.take(np.array([2, 1, 0]))
    assert np.array_equal(back.stacked(), np.concatenate(per_image[::-1])) and back.rows is table.rows
    one = back.with_class(0)
    assert (one.stacked()[:, 0] == 0).all() and table[0][1, 0] == 1  # on a copy: the source keeps its classes


def test_a_shard_split_keeps_its_index_mapped_and_reorders_as_the_folder_does(tmp_path, restore_logger):
    """Rectangular batches reorder the split: from the index, the same files, labels and shapes as from the folder,
    with the labels still the index's mapped array (one copy per node, whatever the ranks)."""
    imgs = _folder(tmp_path / "src", 6)
    out = _make(imgs, tmp_path / "out", "--nc", "1")
    kw = dict(nc=1, img_size=64, rect=True)
    folder = LoadImagesAndLabels(DatasetSpec(imgs, **kw), batch_size=2, verbose=False)
    index = LoadImagesAndLabels(DatasetSpec(out / "train.index", **kw), batch_size=2, verbose=False)
    assert list(index.im_files) == folder.im_files and np.array_equal(index.batch_shapes, folder.batch_shapes)
    assert all(np.array_equal(a, b) for a, b in zip(index.labels, folder.labels))
    assert np.array_equal(index.image_hw, folder.image_hw) and np.array_equal(index.loaded_hw, folder.loaded_hw)
    assert isinstance(index.labels.rows, np.memmap) and Path(index.labels.rows.filename) == (
        (out / "train.index" / "labels.npy").resolve())


@pytest.mark.parametrize("mode", ["ram", "disk"])
def test_cache_ram_and_disk_hold_a_shard_index_s_images(tmp_path, mode, restore_logger):
    """--cache reads a shard index's images from their byte ranges once; a batch is the uncached one, pixel for
    pixel, and a shard cut short afterwards no longer matters."""
    imgs = _folder(tmp_path / "src", 6)
    out = _make(imgs, tmp_path / "out", "--nc", "1")
    kw = dict(nc=1, workers=0, augment=True, hyp=Hyp(), shuffle=True, cache_dir=tmp_path / "node")
    plain = create_dataloader(out / "train.index", 64, 3, 32, **kw)
    cached = create_dataloader(out / "train.index", 64, 3, 32, cache=mode, **kw)
    try:
        assert cached.dataset.imgcache.meta["uncached"] == 0
        if mode == "disk":
            assert cached.dataset.imgcache.file.parent == tmp_path / "node" / "yolotrain-images"
        expected = [(a.images.clone(), a.targets.clone()) for a in plain]
        (out / "train-000000.tar").write_bytes(b"")  # the images live in the cache now
        got = [(b.images, b.targets) for b in cached]
        assert len(got) == len(expected) == 2
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(expected, got))
    finally:
        release_ram_caches(0, cached.dataset.imgcache, wait=False)


def test_a_file_url_goes_through_the_object_storage_layer(tmp_path, restore_logger, monkeypatch):
    pytest.importorskip("fsspec", reason="pip install -r requirements-s3.txt")
    monkeypatch.setenv(BUDGET_ENV, "1")  # a budget, so the copy does not hang on this disk's free space
    out = _make(_folder(tmp_path / "src", 3), tmp_path / "out", "--nc", "1")
    local = ShardIndex.open(out / "train.index")
    there = ShardIndex.open(f"file://{out}/train.index", cache_dir=tmp_path / "node")
    assert there.cache is not None and all(there.read(i) == local.read(i) for i in range(len(local)))
    there.cache.wait()  # the node's copy of the shard, as from a bucket
    assert (tmp_path / "node" / "yolotrain-shards" / local.meta["id"] / "train-000000.tar").read_bytes() == (
        out / "train-000000.tar").read_bytes()


def test_without_a_budget_the_copies_keep_the_disk_s_reserve_free(tmp_path, monkeypatch, request, restore_logger):
    pytest.importorskip("fsspec", reason="pip install -r requirements-s3.txt")
    out = _make(_folder(tmp_path / "src", 3), tmp_path / "out", "--nc", "1")
    project_log = request.getfixturevalue("project_log")  # after the CLI run, which resets the logger's handlers
    monkeypatch.delenv(BUDGET_ENV, raising=False)
    shard = f"file://{out}/train-000000.tar"
    total = 100 * 2**30  # a 100 GiB disk: the reserve is 10 GiB
    for free, copied in [(9 * 2**30, False), (11 * 2**30, True)]:
        monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(total, total - free, free))
        cache = ShardCache(tmp_path / f"node-{free}" / "id", budget=None)
        assert cache.local(shard, None) is None  # the first read queues the copy
        cache.wait()
        assert (cache.local(shard, None) is not None) == copied
        assert sum("no room for more shard copies" in m for m in project_log) == (0 if copied else 1)
        project_log.clear()
