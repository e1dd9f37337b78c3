"""Data pipeline: discovery, label verification, cache, letterbox geometry, samplers, loaders."""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data import labelcache
from tests.helpers import global_indices
from yolotrain.utils.data.augment import apply_hsv, flip_draws, flip_labels, hsv_gains, letterbox
from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels
from yolotrain.utils.data.labels import img2label_paths, resolve_image_files
from yolotrain.utils.data.loader import InferenceSampler, TrainSampler, create_dataloader

# No colour change and no geometry (mosaic, translate, scale off): only flips move the boxes.
NO_COLOUR = Hyp(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0, fliplr=0.5, flipud=0.5, mosaic=0.0, translate=0.0, scale=0.0)


@pytest.fixture(scope="module")
def shapes_root(shapes_dataset) -> Path:
    return shapes_dataset(seed=0, n_train=24, n_val=8, img_size=320)


@pytest.fixture
def copy_root(shapes_root, tmp_path) -> Path:
    """A private copy of the dataset, for tests that edit files."""
    dst = tmp_path / "shapes"
    shutil.copytree(shapes_root, dst)
    for f in dst.rglob("*.cache.npz"):
        f.unlink()
    return dst


@pytest.fixture
def logs():
    """Messages logged by the project logger during the test (independent of logging setup)."""
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler, old_level = Collect(), LOGGER.level
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    yield records
    LOGGER.removeHandler(handler)
    LOGGER.setLevel(old_level)


def _box_image(path: Path, hw: tuple[int, int], box: tuple[int, int, int, int]) -> None:
    """Black image with one white filled box (x1, y1, x2, y2 exclusive) and its label."""
    img = np.zeros((*hw, 3), np.uint8)
    x1, y1, x2, y2 = box
    img[y1:y2, x1:x2] = 255
    path.parent.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(path), img)
    h, w = hw
    label = Path(img2label_paths([str(path)])[0])
    label.parent.mkdir(parents=True, exist_ok=True)
    label.write_text(f"0 {(x1 + x2) / 2 / w} {(y1 + y2) / 2 / h} {(x2 - x1) / w} {(y2 - y1) / h}\n")


def _white_bbox(img_chw: torch.Tensor) -> np.ndarray:
    mask = img_chw.numpy().min(0) > 128
    ys, xs = np.nonzero(mask)
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], float)


# ---------------------------------------------------------------- discovery
def test_img2label_paths():
    assert img2label_paths(["/a/images/b/images/c/x.JPG"]) == ["/a/images/b/labels/c/x.txt"]
    assert img2label_paths(["/a/pics/x.png"]) == ["/a/pics/x.txt"]


def test_resolve_image_files(tmp_path):
    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    for name in ("b.JPG", "sub/a.png", "c.txt", "d.gif"):
        (tmp_path / "imgs" / name).write_bytes(b"x")
    found = resolve_image_files(tmp_path / "imgs")
    assert found == sorted([str(tmp_path / "imgs" / "b.JPG"), str(tmp_path / "imgs" / "sub" / "a.png")])
    lst = tmp_path / "list.txt"
    lst.write_text("imgs/b.JPG\n\n" + str(tmp_path / "imgs" / "sub" / "a.png") + "\n")
    assert resolve_image_files(lst) == found
    assert resolve_image_files([lst, tmp_path / "imgs"]) == sorted(found * 2)
    with pytest.raises(UserError, match="nope"):
        resolve_image_files(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="empty.*no images"):
        resolve_image_files(tmp_path / "empty")


# ---------------------------------------------------------------- geometry
def test_letterbox_values():
    img = np.zeros((100, 200, 3), np.uint8)
    out, ratio, pad = letterbox(img, 128)
    assert out.shape == (128, 128, 3) and ratio == (0.64, 0.64) and pad == (0.0, 32.0)
    out, ratio, pad = letterbox(img, 128, auto=True, stride=32)
    assert out.shape == (64, 128, 3) and pad == (0.0, 0.0)
    out, ratio, pad = letterbox(img, (300, 400), scaleup=False)
    assert out.shape == (300, 400, 3) and ratio == (1.0, 1.0) and pad == (100.0, 100.0)
    assert (out[:100] == 114).all() and (out[100:200, 100:300] == 0).all()


@pytest.mark.parametrize("rect,augment", [(False, False), (True, False), (False, True)])
def test_labels_land_on_pixels(tmp_path, rect, augment):
    specs = [((100, 200), (30, 20, 90, 70)), ((150, 90), (0, 40, 50, 150)), ((64, 64), (10, 10, 60, 30))]
    for k, (hw, box) in enumerate(specs):
        _box_image(tmp_path / "images" / f"{k}.png", hw, box)
    data = LoadImagesAndLabels(DatasetSpec(tmp_path / "images", nc=1, img_size=128, augment=augment, hyp=NO_COLOUR,
                                           rect=rect), batch_size=2)
    for i in range(len(data)):
        for epoch in range(3 if augment else 1):
            img, labels, path, placed, index = data[(epoch, i)]
            assert img.dtype == torch.uint8 and img.shape[0] == 3 and index == i
            h, w = img.shape[1:]
            assert (h, w) == ((128, 128) if not rect else tuple(data.batch_shapes[data.batch_index[i]]))
            xc, yc, bw, bh = labels[0, 2:].numpy()
            got = np.array([(xc - bw / 2) * w, (yc - bh / 2) * h, (xc + bw / 2) * w, (yc + bh / 2) * h])
            assert np.abs(got - _white_bbox(img)).max() <= 1.5, (path, epoch)
            (h0, w0), (gh, gw) = placed.orig_hw, placed.gain_hw
            assert cv2.imread(path).shape[:2] == (h0, w0) and gh == pytest.approx(gw, rel=0.03)


def random_flip(img: np.ndarray, labels: np.ndarray, rng: np.random.Generator, fliplr: float,
                flipud: float) -> tuple[np.ndarray, np.ndarray]:
    """The plan's flip draws and label flip applied to one image (plan.py and render.py do it per sample)."""
    lr, ud = flip_draws(rng, fliplr, flipud)
    img = np.ascontiguousarray(img[:, ::-1]) if lr else img
    img = np.ascontiguousarray(img[::-1]) if ud else img
    return img, flip_labels(labels, lr, ud)


def augment_hsv(img: np.ndarray, rng: np.random.Generator, hgain: float, sgain: float, vgain: float) -> None:
    """The plan's HSV gains applied in place (render.py's colour stage)."""
    r = hsv_gains(rng, hgain, sgain, vgain)
    if r is not None:
        apply_hsv(img, r)


def test_flip_and_hsv_use_only_given_rng():
    labels = np.array([[1, 0.2, 0.3, 0.1, 0.1]], np.float32)
    img = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    state = np.random.get_state()
    out, lb = random_flip(img, labels, np.random.default_rng(0), fliplr=1.0, flipud=1.0)
    assert (out == img[::-1, ::-1]).all() and np.allclose(lb[0, 1:3], [0.8, 0.7])
    _, lb = random_flip(img, labels, np.random.default_rng(0), fliplr=0.0, flipud=0.0)
    assert np.array_equal(lb, labels)
    a = np.random.default_rng(1).integers(0, 255, (8, 8, 3), dtype=np.uint8)
    b, c = a.copy(), a.copy()
    augment_hsv(b, np.random.default_rng(5), 0.5, 0.5, 0.5)
    augment_hsv(c, np.random.default_rng(5), 0.5, 0.5, 0.5)
    assert np.array_equal(b, c) and not np.array_equal(a, b)
    d = a.copy()
    augment_hsv(d, np.random.default_rng(5), 0.0, 0.0, 0.0)
    assert np.array_equal(a, d)
    assert all(np.array_equal(x, y) for x, y in zip(state[1:2], np.random.get_state()[1:2]))


# ---------------------------------------------------------------- dataset
def test_dataset_contents(shapes_root):
    data = LoadImagesAndLabels(DatasetSpec(shapes_root / "images" / "train", nc=6, img_size=320))
    assert len(data) == 24 and data.image_hw.shape == (24, 2) and len(data.labels) == 24
    assert data.counts["images"] == 24 and data.counts["corrupt"] == 0
    for i in (0, 5):
        h, w = cv2.imread(data.im_files[i]).shape[:2]
        assert tuple(data.image_hw[i]) == (h, w)
        img, labels, *_ = data[i]
        assert img.shape == (3, 320, 320) and labels.shape[1] == 6
        assert (labels[:, 2:] >= 0).all() and (labels[:, 2:] <= 1).all()
    single = LoadImagesAndLabels(DatasetSpec(shapes_root / "images" / "train", nc=6, img_size=320, single_cls=True))
    assert all((x[:, 0] == 0).all() for x in single.labels)


def test_rect_batches_share_shape(shapes_root):
    loader = create_dataloader(shapes_root / "images" / "train", 320, 5, 32, rect=True, pad=0.5, nc=6, workers=0)
    data = loader.dataset
    ar = data.image_hw[:, 0] / data.image_hw[:, 1]
    assert (np.diff(ar) >= 0).all()
    seen = []
    for batch in loader:
        assert batch.images.shape[2] % 32 == 0 and batch.images.shape[3] % 32 == 0
        seen += batch.indices.tolist()
    assert seen == list(range(24))


def test_rect_training_two_ranks_stack(shapes_root):
    """Interleaved training shards with rect: every local batch shares one shape."""
    seen = []
    for rank in (0, 1):
        loader = create_dataloader(shapes_root / "images" / "train", 320, 10, 32, rect=True, augment=True,
                                   shuffle=True, info=DistInfo(rank=rank, world_size=2, local_world_size=2),
                                   nc=6, workers=0)
        seen += [i for b in loader for i in b.indices.tolist()]
    assert sorted(seen) == list(range(24))


def test_workers_do_not_change_batches(shapes_root):
    batches = {}
    for workers in (0, 2):
        loader = create_dataloader(shapes_root / "images" / "train", 160, 8, 32, augment=True, shuffle=True,
                                   hyp=Hyp(hsv_h=0.1, hsv_s=0.7, hsv_v=0.4, fliplr=0.5, flipud=0.5),
                                   nc=6, workers=workers, seed=3)
        assert loader.num_workers == min(workers, os.cpu_count() or 1)
        loader.sampler.set_epoch(1)
        batches[workers] = list(loader)
    for a, b in zip(batches[0], batches[2]):
        assert torch.equal(a.images, b.images) and torch.equal(a.targets, b.targets)
        assert torch.equal(a.indices, b.indices) and a.paths == b.paths
    assert batches[0][0].targets.dtype == torch.float32 and batches[0][0].images.dtype == torch.uint8


# ---------------------------------------------------------------- samplers
def test_train_sampler():
    def shards(n, ws, epoch, seed=0, drop_last=False):
        out = []
        for r in range(ws):
            s = TrainSampler(n, r, ws, seed, drop_last=drop_last)
            s.set_epoch(epoch)
            items = list(s)
            assert len(items) == len(s) and all(k.epoch == epoch and k.mosaic for k in items)
            out.append([k.index for k in items])
        return out

    for n, ws in ((10, 3), (7, 1), (2, 4), (12, 4)):
        parts = shards(n, ws, epoch=0)
        assert len({len(p) for p in parts}) == 1
        perm = global_indices(TrainSampler(n, 0, ws, 0))
        assert sorted(set(perm)) == list(range(n)) and len(perm) == -(-n // ws) * ws
        assert sorted(i for p in parts for i in p) == sorted(perm)
    assert shards(50, 2, 0) == shards(50, 2, 0)
    assert shards(50, 2, 0) != shards(50, 2, 1) and shards(50, 2, 0) != shards(50, 2, 0, seed=1)
    dropped = shards(10, 3, 0, drop_last=True)
    assert [len(p) for p in dropped] == [3, 3, 3] and len(set(sum(dropped, []))) == 9


def test_train_sampler_carries_close_mosaic():
    """close_mosaic is read in the main process at each epoch's iteration, so moving it mid-run
    (--time) reaches persistent workers with the keys."""
    s = TrainSampler(8, 0, 1, seed=0)
    s.mosaic_off_from_epoch = 3
    for epoch, on in ((0, True), (2, True), (3, False), (7, False)):
        s.set_epoch(epoch)
        assert {k.mosaic for k in s} == {on}
    s.mosaic_off_from_epoch = None
    assert all(k.mosaic for k in s)


def test_train_sampler_skip_resumes_where_global_batches_end():
    """A mid-epoch resume skips k batches per rank: exactly the first k global batches, whatever the world size."""
    n, global_bs, k = 37, 4, 3
    for ws in (1, 2, 4):
        padded = TrainSampler(n, 0, ws, seed=3)
        padded.set_epoch(2)
        order = global_indices(padded)  # the same permutation, padded to a multiple of ws
        rest = []
        for r in range(ws):
            s = TrainSampler(n, r, ws, seed=3)
            s.set_epoch(2, skip=k * global_bs // ws)
            items = [k.index for k in s]
            assert len(items) == len(s) == s.num_samples - k * global_bs // ws
            rest += items
        assert sorted(rest) == sorted(order[k * global_bs:])
    with pytest.raises(ValueError):
        TrainSampler(n, 0, 1).set_epoch(0, skip=n + 1)


def test_inference_sampler():
    for size in (0, 1, 7, 16, 33):
        for bs in (1, 4, 5):
            for ws in (1, 2, 3, 8):
                parts = [list(InferenceSampler(size, bs, r, ws)) for r in range(ws)]
                assert sum(parts, []) == list(range(size))  # contiguous, in rank order, exactly once
                for p in parts:
                    assert not p or p[0] % bs == 0  # starts on a global batch boundary
                    assert p == list(range(p[0], p[0] + len(p))) if p else True
    assert [len(InferenceSampler(3, 2, r, 4)) for r in range(4)] == [0, 2, 0, 1]  # fewer batches than ranks


# ---------------------------------------------------------------- cache
def test_cache_reuse_and_invalidation(copy_root, logs):
    train = copy_root / "images" / "train"
    first = LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320))
    cache = copy_root / "labels" / "train.cache.npz"
    assert not first.cache_hit and cache.is_file()
    with np.load(cache, allow_pickle=False) as z:  # no pickle anywhere in the file
        assert all(z[k].dtype != object for k in z.files)
    second = LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320))
    assert second.cache_hit and any("(from cache)" in m for m in logs)
    assert all(np.array_equal(a, b) for a, b in zip(first.labels, second.labels))

    # same-size edit with a new mtime: stale
    label = next(p for p in sorted((copy_root / "labels" / "train").glob("*.txt")) if p.stat().st_size)
    text = label.read_text()
    new = ("1" if text[0] != "1" else "2") + text[1:]
    assert len(new) == len(text)
    st = label.stat()
    label.write_text(new)
    os.utime(label, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    third = LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320))
    assert not third.cache_hit
    k = img2label_paths(third.im_files).index(str(label))
    assert third.labels[k][0, 0] == float(new[0])
    assert LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320)).cache_hit
    assert not LoadImagesAndLabels(DatasetSpec(train, nc=7, img_size=320)).cache_hit  # class count is in the hash


def test_corrupt_cache_file_rebuilt(copy_root, logs):
    train = copy_root / "images" / "train"
    LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320))
    cache = copy_root / "labels" / "train.cache.npz"
    cache.write_bytes(b"not a zip file at all")
    data = LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320))
    assert not data.cache_hit and any("unreadable cache" in m for m in logs)
    assert LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320)).cache_hit


def test_cache_fallback_when_primary_unwritable(copy_root, tmp_path, logs, monkeypatch):
    real_save = labelcache.save_cache

    def refuse_primary(file, *args):
        if file.parent == copy_root / "labels":
            raise PermissionError(13, "Permission denied")
        return real_save(file, *args)

    monkeypatch.setattr(labelcache, "save_cache", refuse_primary)
    cache_dir = tmp_path / "fallback"
    train = copy_root / "images" / "train"
    assert not LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320), cache_dir=cache_dir).cache_hit
    assert len(list(cache_dir.glob("*.cache.npz"))) == 1
    assert sum("label cache saved to" in m for m in logs) == 1
    assert LoadImagesAndLabels(DatasetSpec(train, nc=6, img_size=320), cache_dir=cache_dir).cache_hit
    monkeypatch.setattr(labelcache, "save_cache", lambda *a: (_ for _ in ()).throw(OSError(30, "Read-only")))
    assert not LoadImagesAndLabels(DatasetSpec(train, nc=7, img_size=320), cache_dir=cache_dir).cache_hit
    assert any("continuing without a cache" in m for m in logs)


def test_cache_fallback_read_only_folder(copy_root, tmp_path, logs):
    labels = copy_root / "labels"
    labels.chmod(0o555)
    try:
        if os.access(labels, os.W_OK):
            pytest.skip("running as root: chmod does not make the folder read-only")
        data = LoadImagesAndLabels(DatasetSpec(copy_root / "images" / "train", nc=6, img_size=320),
                                   cache_dir=tmp_path / "c")
        assert not data.cache_hit and list((tmp_path / "c").glob("*.cache.npz"))
        assert sum("label cache saved to" in m for m in logs) == 1
    finally:
        labels.chmod(0o755)


# ---------------------------------------------------------------- bad input
def test_bad_label_rows_reported(copy_root, logs):
    lbl = sorted((copy_root / "labels" / "train").glob("*.txt"))
    lbl[0].write_text("0 0.5 0.5 0.2 0.2\n9 0.5 0.5 0.2 0.2\n")
    lbl[1].write_text("0 0.5 0.5 0.2\n")
    lbl[2].write_text("0 0.5 abc 0.2 0.2\n")
    lbl[3].write_text("0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n")
    lbl[4].unlink()
    (copy_root / "images" / "train" / "train_000005.jpg").write_bytes(b"garbage")
    data = LoadImagesAndLabels(DatasetSpec(copy_root / "images" / "train", nc=6, img_size=320))
    text = "\n".join(logs)
    assert f"{lbl[0]}: line 2: class outside [0, 5]" in text
    assert f"{lbl[1]}: line 1: expected 5 columns" in text and f"{lbl[2]}: line 1: non-numeric" in text
    assert f"{lbl[3]}: 1 duplicate label row(s) removed" in text and "train_000005.jpg: unreadable image" in text
    # only the bad rows are dropped (lbl[0] keeps its good row); only the unreadable image is skipped
    assert data.counts["corrupt"] == 1 and data.counts["missing"] == 1 and len(data) == 23
    assert data.counts["dropped"] == 3 and data.counts["duplicates"] == 1
    assert len(data.labels[img2label_paths(data.im_files).index(str(lbl[0]))]) == 1
    assert len(data.labels[img2label_paths(data.im_files).index(str(lbl[3]))]) == 1
    assert "1 corrupt" in text


def test_missing_and_unusable_datasets(tmp_path):
    with pytest.raises(UserError, match="does_not_exist"):
        LoadImagesAndLabels(DatasetSpec(tmp_path / "does_not_exist", nc=1))
    bad = tmp_path / "bad" / "images"
    bad.mkdir(parents=True)
    for k in range(3):
        (bad / f"{k}.jpg").write_bytes(b"not an image")
    with pytest.raises(UserError, match=r"bad/images: no usable images \(3 corrupt"):
        LoadImagesAndLabels(DatasetSpec(bad, nc=1))


# ---------------------------------------------------------------- splits without labels, problem reports
def _tiny_split(root: Path, n: int, labelled: int, labels: str = "labels", split: str = "train") -> Path:
    """n tiny images in root/images/<split>; the first ``labelled`` get a one-box label in root/<labels>/<split>."""
    imgs, lbls = root / "images" / split, root / labels / split
    imgs.mkdir(parents=True, exist_ok=True)
    lbls.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        cv2.imwrite(str(imgs / f"{k:03d}.jpg"), np.full((24, 32, 3), 40 + k, np.uint8))
        if k < labelled:
            (lbls / f"{k:03d}.txt").write_text("0 0.5 0.5 0.4 0.4\n")
    return imgs


def _warnings(logs: list[str], text: str) -> list[str]:
    return [m for m in logs if "WARNING" in m and text in m]


def test_val_split_without_labels_warns_once_at_scan(tmp_path, logs):
    imgs = _tiny_split(tmp_path / "ds", 3, labelled=3, labels="Labels", split="val")
    loader = create_dataloader(imgs, 64, 2, 32, nc=1, workers=0)  # evaluation loader: a warning
    assert len(loader.dataset) == 3
    hits = _warnings(logs, "no label file found for any of its 3 images")
    assert len(hits) == 1, logs
    assert f"Looked for label files in {tmp_path / 'ds' / 'labels' / 'val'}/" in hits[0]
    assert f"found {tmp_path / 'ds' / 'Labels'}/" in hits[0] and "Every metric will be zero" in hits[0]
    with pytest.raises(UserError, match="no label file found for any of its 3 images"):  # training loader: fatal
        create_dataloader(imgs, 64, 2, 32, nc=1, workers=0, shuffle=True)


def test_training_split_mostly_without_labels_warns(tmp_path, logs):
    imgs = _tiny_split(tmp_path / "ds", 14, labelled=2)
    create_dataloader(imgs, 64, 2, 32, nc=1, workers=0, shuffle=True)
    hits = _warnings(logs, "12 of 14 images have no label file")
    assert len(hits) == 1 and f"Looked for their label files in {tmp_path / 'ds' / 'labels' / 'train'}/" in hits[0]
    logs.clear()
    few = _tiny_split(tmp_path / "few", 12, labelled=2)  # 10 missing: not more than 10, no warning
    create_dataloader(few, 64, 2, 32, nc=1, workers=0, shuffle=True)
    half = _tiny_split(tmp_path / "half", 24, labelled=12)  # 12 of 24: not over half
    create_dataloader(half, 64, 2, 32, nc=1, workers=0, shuffle=True)
    create_dataloader(imgs, 64, 2, 32, nc=1, workers=0)  # validation: backgrounds are its business
    assert not _warnings(logs, "have no label file"), logs


def test_every_problem_goes_to_the_report_file_also_from_the_cache(tmp_path, logs):
    imgs = _tiny_split(tmp_path / "ds", 26, labelled=26)
    lbls = tmp_path / "ds" / "labels" / "train"
    (lbls / "000.txt").write_text("".join(f"{5 + k} 0.5 0.5 0.1 0.1\n" for k in range(30)))  # 30 bad rows
    for k in range(1, 26):  # 25 more files with one bad row each
        (lbls / f"{k:03d}.txt").write_text("0 0.5 0.5 0.4 0.4\n0 0.5 0.5 0.4\n")
    expected = [f"{lbls / '000.txt'}: line {k + 1}: class outside [0, 0]" for k in range(30)]
    expected += [f"{lbls / f'{k:03d}.txt'}: line 2: expected 5 columns" for k in range(1, 26)]
    reports = []
    for run in ("exp", "exp2"):
        logs.clear()
        data = LoadImagesAndLabels(DatasetSpec(imgs, nc=1), prefix="train: ", report_dir=tmp_path / "runs" / run)
        assert data.cache_hit == (run == "exp2")
        report = tmp_path / "runs" / run / "dataset_problems_train.txt"
        lines = report.read_text().splitlines()
        assert lines[0] == f"# dataset problems, split train: {imgs}" and lines[1].startswith("# 55 problem(s)")
        assert len(lines) == 57 and all(got.startswith(want) for got, want in zip(lines[2:], expected))
        assert all(line.endswith("; row dropped") for line in lines[2:])
        reports.append(report.read_text())
        console = next(m for m in logs if "dataset problem(s)" in m).splitlines()
        assert console[0] == f"train: WARNING: 55 dataset problem(s) (all listed in {report}):"
        # 20 lines: 5 of the first file, its "... more in this file" line, 14 others; 55 - 19 not shown
        assert len(console) == 1 + 20 + 1 and console[-1] == f"... and 36 more: see {report}"
        assert console[6] == f"{lbls / '000.txt'}: ... and 25 more problem(s) in this file"  # 5 per file
        assert console[7].startswith(f"{lbls / '001.txt'}: line 2:")
    assert reports[0] == reports[1]


def test_report_only_when_there_are_problems(tmp_path, logs):
    imgs = _tiny_split(tmp_path / "ds", 3, labelled=3)
    run = tmp_path / "runs" / "exp"
    LoadImagesAndLabels(DatasetSpec(imgs, nc=1), prefix="val: ", report_dir=run)
    assert not run.exists()  # nothing to report: no folder either
    (tmp_path / "ds" / "labels" / "train" / "000.txt").write_text("0 0.5 0.5\n")
    LoadImagesAndLabels(DatasetSpec(imgs, nc=1), prefix="val: ", report_dir=run, verbose=False)
    assert not run.exists()  # only the verbose rank (rank 0) writes
    LoadImagesAndLabels(DatasetSpec(imgs, nc=1), prefix="val: ", report_dir=run)
    assert (run / "dataset_problems_val.txt").read_text().count("000.txt: line 1: expected 5 columns") == 1
    assert any(f"(all listed in {run / 'dataset_problems_val.txt'})" in m for m in logs)
    (tmp_path / "ds" / "labels" / "train" / "000.txt").write_text("0 0.5 0.5 0.1 0.1\n")
    LoadImagesAndLabels(DatasetSpec(imgs, nc=1), prefix="val: ", report_dir=run)  # fixed: the old report goes
    assert not (run / "dataset_problems_val.txt").exists()
    logs.clear()
    (tmp_path / "ds" / "labels" / "train" / "000.txt").write_text("0 0.5 0.5\n")
    LoadImagesAndLabels(DatasetSpec(imgs, nc=1), prefix="val: ")  # no report folder: console as before, no path
    assert any("1 dataset problem(s):" in m for m in logs) and not any("listed in" in m for m in logs)


@pytest.mark.slow
def test_val_py_writes_the_report_into_its_run_folder(tmp_path):
    import subprocess
    import sys

    from yolotrain.models.yolo import Model
    from tests.helpers import ROOT, run_env
    from yolotrain.utils.weights.checkpoint import fp32_state_dict, save_checkpoint

    _tiny_split(tmp_path / "ds", 4, labelled=4, split="val")
    (tmp_path / "ds" / "labels" / "val" / "001.txt").write_text("0 0.5 0.5 0.4 0.4\n3 0.5 0.5 0.4 0.4\n")
    data = tmp_path / "d.yaml"
    data.write_text(f"path: {tmp_path / 'ds'}\ntrain: images/val\nval: images/val\nnames: [a]\n")
    model = Model(ROOT / "models" / "yolov5n.yaml", nc=1)
    save_checkpoint({"model_yaml": model.yaml, "model": fp32_state_dict(model), "args": {"imgsz": 64}},
                    tmp_path / "w.pt")
    project = tmp_path / "runs"
    p = subprocess.run([sys.executable, "val.py", "--weights", str(tmp_path / "w.pt"), "--data", str(data),
                        "--noplots", "--batch-size", "4", "--workers", "0", "--project", str(project)],
                       cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = project / "exp" / "dataset_problems_val.txt"
    assert f"(all listed in {report})" in p.stdout
    assert "001.txt: line 2: class outside [0, 0]" in report.read_text()
    assert [f.name for f in (project / "exp").iterdir()] == ["dataset_problems_val.txt"]  # --noplots: nothing else
