"""Geometric augmentation, mosaic and mixup: boxes follow pixels, and every sample depends only on
(seed, epoch, index), whatever the order, worker count, world size or resume point."""
from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.data.augment import (blend, box_candidates, mixup_ratio, needs_warp, perspective_matrix, resized_hw,
                                resized_hw_all, warp_boxes, warp_image)
from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels
from yolotrain.utils.data.labels import img2label_paths
from yolotrain.utils.data.loader import create_dataloader

# Pure BGR colours: one per class, easy to find again after interpolation.
COLOURS = np.array([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0), (255, 0, 255), (0, 255, 255)], np.uint8)
FULL = Hyp(hsv_h=0.015, hsv_s=0.7, hsv_v=0.4, fliplr=0.5, flipud=0.1, mosaic=1.0, mixup=0.5,
           degrees=10.0, translate=0.1, scale=0.5, shear=2.0, perspective=0.0)
GEOMETRY_ONLY = Hyp(hsv_h=0.0, hsv_s=0.0, hsv_v=0.0, fliplr=0.0, flipud=0.0, mosaic=1.0, mixup=0.0,
                    degrees=0.0, translate=0.1, scale=0.3, shear=0.0, perspective=0.0)


def _mask(img_bgr: np.ndarray, colour: np.ndarray) -> np.ndarray:
    """Pixels close to a pure colour (edge pixels blended by interpolation are left out)."""
    return (np.abs(img_bgr.astype(np.int16) - colour.astype(np.int16)) < 60).all(-1)


def _box_mask(shape: tuple[int, int], boxes: np.ndarray) -> np.ndarray:
    """Union of xyxy pixel boxes as a boolean mask (a few boxes: one slice each)."""
    m = np.zeros(shape, bool)
    for x1, y1, x2, y2 in np.round(boxes).astype(int):
        m[max(y1, 0):y2, max(x1, 0):x2] = True
    return m


def _hwc_bgr(img_chw: torch.Tensor) -> np.ndarray:
    return np.ascontiguousarray(img_chw.numpy().transpose(1, 2, 0)[..., ::-1])


def _xyxy(labels: torch.Tensor, h: int, w: int) -> np.ndarray:
    xc, yc, bw, bh = labels[:, 2:].numpy().T
    return np.stack(((xc - bw / 2) * w, (yc - bh / 2) * h, (xc + bw / 2) * w, (yc + bh / 2) * h), 1)


@pytest.fixture(scope="module")
def colour_root(tmp_path_factory) -> Path:
    """Six images of different sizes, each black with one filled rectangle of its class's colour."""
    root = tmp_path_factory.mktemp("colours") / "images"
    specs = [((100, 200), (30, 20, 110, 80)), ((150, 90), (10, 40, 70, 140)), ((64, 64), (8, 8, 56, 40)),
             ((120, 120), (20, 30, 100, 90)), ((80, 160), (40, 10, 150, 60)), ((160, 100), (15, 20, 85, 120))]
    for k, ((h, w), (x1, y1, x2, y2)) in enumerate(specs):
        img = np.zeros((h, w, 3), np.uint8)
        img[y1:y2, x1:x2] = COLOURS[k]
        path = root / f"{k}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(path), img)
        label = Path(img2label_paths([str(path)])[0])
        label.parent.mkdir(parents=True, exist_ok=True)
        label.write_text(f"{k} {(x1 + x2) / 2 / w} {(y1 + y2) / 2 / h} {(x2 - x1) / w} {(y2 - y1) / h}\n")
    return root


@pytest.fixture(scope="module")
def shapes_train(shapes_dataset) -> Path:
    return shapes_dataset(seed=0, n_train=12, n_val=0, img_size=96) / "images" / "train"


# ---------------------------------------------------------------- random_perspective, box_candidates, mixup
def random_perspective(img: np.ndarray, labels: np.ndarray, rng: np.random.Generator, degrees: float = 10.0,
                       translate: float = 0.1, scale: float = 0.1, shear: float = 10.0,
                       perspective: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """The plan's warp of one image and its pixel xyxy boxes (plan.py draws the matrix, render.py warps)."""
    M, s, out_hw = perspective_matrix(img.shape[:2], rng, degrees, translate, scale, shear, perspective, (0, 0))
    if needs_warp(M, img.shape[:2], out_hw):
        img = warp_image(img, M, out_hw, bool(perspective))
    return img, warp_boxes(labels, M, s, out_hw, bool(perspective))


def mixup(img1, labels1, img2, labels2, rng) -> tuple[np.ndarray, np.ndarray]:
    """The plan's mixup of two images: the Beta(32, 32) ratio and the truncated blend, both label sets kept."""
    return blend(img1, img2, mixup_ratio(rng)), np.concatenate((labels1, labels2), 0)


def test_random_perspective_identity():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)
    labels = np.array([[0, 5, 6, 30, 40], [2, 50.5, 10, 79, 59]], np.float32)
    out, lb = random_perspective(img, labels, np.random.default_rng(1), degrees=0, translate=0, scale=0, shear=0,
                                 perspective=0)
    assert np.array_equal(out, img) and np.array_equal(lb, labels)
    out, lb = random_perspective(img, labels[:0], np.random.default_rng(1), degrees=0, translate=0, scale=0, shear=0)
    assert out.shape == img.shape and lb.shape == (0, 5)


@pytest.mark.parametrize("seed", range(6))
def test_random_perspective_boxes_enclose_objects(seed):
    img = np.zeros((160, 200, 3), np.uint8)
    boxes = np.array([[20, 20, 70, 60], [110, 30, 180, 70], [40, 90, 120, 150]], float)
    for k, (x1, y1, x2, y2) in enumerate(boxes.astype(int)):
        img[y1:y2, x1:x2] = COLOURS[k]
    labels = np.concatenate((np.arange(3)[:, None], boxes), 1)
    rng = np.random.default_rng(seed)
    perspective = 0.0005 if seed % 2 else 0.0
    out, lb = random_perspective(img, labels, rng, degrees=30, translate=0.05, scale=0.3, shear=5,
                                 perspective=perspective)
    assert out.shape == img.shape and len(lb) >= 1
    assert (lb[:, 1:] >= 0).all() and (lb[:, [1, 3]] <= 200).all() and (lb[:, [2, 4]] <= 160).all()
    for cls, *box in lb:
        colour = _mask(out, COLOURS[int(cls)])
        inside = _box_mask(colour.shape, np.array([box]))
        assert colour.sum() > 50
        assert (colour & inside).sum() >= 0.97 * colour.sum()  # the box holds its object...
        assert (colour & inside).sum() >= 0.45 * inside.sum()  # ...and is not much bigger (rotated hull)


def test_box_candidates():
    before = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 100, 100], [0, 0, 10, 10]], float)
    after = np.array([[0, 0, 8, 9], [0, 0, 1.5, 9], [0, 0, 10, 0], [0, 0, 20, 20], [0, 0, 300, 2.5]], float)
    # kept; too narrow; zero height; under 10% of the area it had; sliver (aspect ratio 120)
    assert box_candidates(before, after).tolist() == [True, False, False, False, False]
    assert box_candidates(before[:0], after[:0]).shape == (0,)


def test_mixup():
    a, b = np.full((8, 8, 3), 200, np.uint8), np.zeros((8, 8, 3), np.uint8)
    la, lb = np.array([[0, 1, 1, 4, 4]], np.float32), np.array([[1, 2, 2, 6, 6], [2, 0, 0, 3, 3]], np.float32)
    out, labels = mixup(a, la, b, lb, np.random.default_rng(0))
    out2, _ = mixup(a, la, b, lb, np.random.default_rng(0))
    assert np.array_equal(out, out2) and out.dtype == np.uint8 and 60 < out[0, 0, 0] < 140
    assert np.array_equal(labels, np.concatenate((la, lb)))


# ---------------------------------------------------------------- mosaic
@pytest.mark.parametrize("mosaic", [1.0, 0.0])
def test_labels_on_pixels_mosaic_and_plain(colour_root, mosaic):
    """Mosaic (4 tiles + perspective) and the plain path (letterbox + perspective) keep boxes on their objects."""
    s = 128
    hyp = dataclasses.replace(GEOMETRY_ONLY, mosaic=mosaic)
    data = LoadImagesAndLabels(DatasetSpec(colour_root, nc=6, img_size=s, augment=True, hyp=hyp), verbose=False)
    multi = 0
    for epoch in range(3):
        for i in range(len(data)):
            img, labels, _, placed, index = data[(epoch, i)]
            assert img.shape == (3, s, s) and index == i and (placed is None) == bool(mosaic)
            assert ((labels[:, 2:] >= 0) & (labels[:, 2:] <= 1)).all()
            bgr, boxes = _hwc_bgr(img), _xyxy(labels, s, s)
            assert (boxes >= -1e-3).all() and (boxes <= s + 1e-3).all()
            multi += len(set(labels[:, 1].tolist())) > 1
            for cls in range(6):
                colour = _mask(bgr, COLOURS[cls])
                mine = boxes[labels[:, 1].numpy() == cls]
                inside = _box_mask(colour.shape, mine)
                for box in mine:  # every box is filled with its class's colour
                    one = _box_mask(colour.shape, box[None])
                    assert (colour & one).sum() >= 0.7 * one.sum(), (epoch, i, cls)
                # every coloured pixel is in a box of its class, except slivers box_candidates dropped
                assert (colour & ~inside).sum() <= 0.12 * (1.3 * s) ** 2 * 0.35, (epoch, i, cls)
                if not len(mine):
                    assert colour.sum() <= 0.1 * (1.3 * s) ** 2, (epoch, i, cls)
    assert multi >= 6 if mosaic else multi == 0  # mosaics really combine several images


def test_rect_training_has_no_mosaic(shapes_train):
    data = LoadImagesAndLabels(DatasetSpec(shapes_train, nc=6, img_size=96, augment=True, hyp=FULL, rect=True),
                               batch_size=4, verbose=False)
    for i in range(len(data)):
        img, _, _, placed, _ = data[(1, i)]
        assert placed is not None and tuple(img.shape[1:]) == tuple(data.batch_shapes[data.batch_index[i]])


def test_close_mosaic(shapes_train):
    data = LoadImagesAndLabels(DatasetSpec(shapes_train, nc=6, img_size=96, augment=True, hyp=FULL, seed=4),
                               verbose=False)
    plain = LoadImagesAndLabels(DatasetSpec(shapes_train, nc=6, img_size=96, augment=True,
                                            hyp=dataclasses.replace(FULL, mosaic=0.0), seed=4), verbose=False)
    for i in range(0, len(data), 3):
        assert data[(1, i, True)][3] is None  # still mosaic before the switch
        assert not torch.equal(data[(1, i, True)][0], plain[(1, i)][0])
        for epoch in (2, 5):
            a, b = data[(epoch, i, False)], plain[(epoch, i)]
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[3] == b[3] is not None


# ---------------------------------------------------------------- determinism
def test_same_sample_whatever_the_order(shapes_train):
    items = [(e, i) for e in (0, 1, 7) for i in range(12)]
    first = LoadImagesAndLabels(DatasetSpec(shapes_train, nc=6, img_size=96, augment=True, hyp=FULL, seed=1),
                                verbose=False)
    want = {it: first[it] for it in items}
    second = LoadImagesAndLabels(DatasetSpec(shapes_train, nc=6, img_size=96, augment=True, hyp=FULL, seed=1),
                                 verbose=False)
    order = np.random.default_rng(0).permutation(len(items))
    for k in order:
        second[(3, int(k) % 12)]  # unrelated fetches in between change nothing
        got = second[items[k]]
        assert got[0].numpy().tobytes() == want[items[k]][0].numpy().tobytes()
        assert torch.equal(got[1], want[items[k]][1])
    other_seed = LoadImagesAndLabels(DatasetSpec(shapes_train, nc=6, img_size=96, augment=True, hyp=FULL, seed=2),
                                     verbose=False)
    assert not torch.equal(other_seed[(0, 0)][0], want[(0, 0)][0])


def test_global_rngs_untouched(shapes_train):
    hyp = dataclasses.replace(FULL, mixup=1.0, perspective=0.0005)
    data = LoadImagesAndLabels(DatasetSpec(shapes_train, nc=6, img_size=96, augment=True, hyp=hyp), verbose=False)
    np_state, py_state, torch_state = np.random.get_state(), random.getstate(), torch.get_rng_state()
    for i in range(4):
        data[(i, i)]
    after = np.random.get_state()
    assert np_state[0] == after[0] and np.array_equal(np_state[1], after[1]) and np_state[2:] == after[2:]
    assert random.getstate() == py_state and torch.equal(torch.get_rng_state(), torch_state)


MIX = dataclasses.replace(FULL, mixup=1.0)


def _loader(root: Path, workers: int, rank: int = 0, world_size: int = 1):
    info = DistInfo(rank=rank, world_size=world_size, local_world_size=world_size)
    return create_dataloader(root, 96, 4 * world_size, 32, hyp=MIX, augment=True, shuffle=True, info=info,
                             workers=workers, seed=5, nc=6)


def _epoch(loader, epoch: int) -> list:
    loader.sampler.set_epoch(epoch)
    return list(loader)


def _same_batches(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.images.numpy().tobytes() == y.images.numpy().tobytes()
        assert torch.equal(x.targets, y.targets) and torch.equal(x.indices, y.indices)


def test_workers_and_resume_do_not_change_batches(shapes_train):
    """Mosaic + mixup: 2 persistent workers over 4 epochs == no workers; a fresh loader at epoch 3 == epoch 3."""
    two = _loader(shapes_train, workers=2)
    run = [_epoch(two, e) for e in range(4)]
    zero = _loader(shapes_train, workers=0)
    _same_batches(run[1], _epoch(zero, 1))
    fresh = _loader(shapes_train, workers=0)  # "resumed" at epoch 3
    _same_batches(run[3], _epoch(fresh, 3))
    assert not torch.equal(run[2][0].images, run[3][0].images)


def test_world_size_does_not_change_samples(shapes_train):
    def samples(batches: list) -> dict:
        out = {}
        for b in batches:
            for k, idx in enumerate(b.indices.tolist()):
                out[idx] = (b.images[k].numpy().tobytes(), b.targets[b.targets[:, 0] == k, 1:].numpy().tobytes())
        return out

    single = samples(_epoch(_loader(shapes_train, 0), 2))
    ranks = [samples(_epoch(_loader(shapes_train, 0, r, 2), 2)) for r in (0, 1)]
    assert not set(ranks[0]) & set(ranks[1])
    assert {**ranks[0], **ranks[1]} == single and len(single) == 12


def test_resized_sizes_of_a_whole_split_match_one_image_at_a_time():
    rng = np.random.default_rng(0)
    hw = np.concatenate([rng.integers(1, 5000, (5000, 2)), [[640, 640], [640, 17], [1, 640], [641, 1]]])
    for size in (33, 320, 640):
        assert resized_hw_all(hw, size).tolist() == [list(resized_hw(int(h), int(w), size)) for h, w in hw]
