"""The built-in shapes generator: deterministic, valid labels, atomic and idempotent."""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest

from yolotrain.utils.data import shapes
from yolotrain.utils.data.shapes import GENERATORS, SHAPE_NAMES, generate_shapes, render_image
from yolotrain.utils.core.errors import UserError


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("gen") / "shapes"
    generate_shapes(root, seed=0, n_train=24, n_val=8)
    return root


def test_layout_and_marker(small):
    assert len(list((small / "images" / "train").glob("*.jpg"))) == 24
    assert len(list((small / "labels" / "train").glob("*.txt"))) == 24
    assert len(list((small / "images" / "val").glob("*.jpg"))) == 8
    assert (small / ".complete").is_file()
    assert not list(small.parent.glob(".shapes.tmp-*"))  # temp folder renamed away
    assert GENERATORS["shapes"] is generate_shapes and len(SHAPE_NAMES) == 6


def test_deterministic_bytes(small, tmp_path):
    again = tmp_path / "again"
    generate_shapes(again, seed=0, n_train=24, n_val=8)
    assert _digest(again) == _digest(small)
    other = tmp_path / "other"
    generate_shapes(other, seed=1, n_train=24, n_val=8)
    a, b = _digest(small), _digest(other)
    assert sum(a[k] != b.get(k) for k in a if k.endswith(".jpg")) >= 30


def test_image_independent_of_order(small):
    """Image i comes from its own generator: rendering it alone gives the same labels."""
    _, labels = render_image(np.random.default_rng([0, 0, 5]), 320)
    rows = (small / "labels" / "train" / "train_000005.txt").read_text().split("\n")
    expect = [f"{int(c)} {x:.6f} {y:.6f} {w:.6f} {h:.6f}" for c, x, y, w, h in labels]
    assert [r for r in rows if r] == expect


def test_labels_valid_and_inside_image(small):
    sides = {320, 288, 256, 224}
    for lb in (small / "labels").rglob("*.txt"):
        img = cv2.imread(str(lb).replace("/labels/", "/images/").replace(".txt", ".jpg"))
        h, w = img.shape[:2]
        assert h in sides and w in sides
        for row in lb.read_text().splitlines():
            parts = row.split()
            assert len(parts) == 5 and all(len(p.split(".")[1]) == 6 for p in parts[1:])
            c, x, y, bw, bh = map(float, parts)
            assert c == int(c) and 0 <= c < 6
            assert bw > 0 and bh > 0 and bw * w >= 4 and bh * h >= 4
            assert x - bw / 2 >= -1e-6 and x + bw / 2 <= 1 + 1e-6
            assert y - bh / 2 >= -1e-6 and y + bh / 2 <= 1 + 1e-6
            assert max(bw, bh) <= 0.5 + 1e-6


def test_statistics():
    """Every class appears, some images are empty, sizes span small to large, at most 8 objects."""
    labels = [render_image(np.random.default_rng([3, 0, i]), 320)[1] for i in range(150)]
    counts = [len(x) for x in labels]
    assert max(counts) <= 8 and 0.02 <= np.mean([c == 0 for c in counts]) <= 0.2
    allb = np.concatenate(labels)
    assert set(allb[:, 0].astype(int)) == set(range(6))
    side = np.maximum(allb[:, 3], allb[:, 4]) * 320
    assert side.min() < 16 and side.max() > 100


def test_idempotent_and_regenerates(small, tmp_path):
    root = tmp_path / "ds"
    generate_shapes(root, seed=0, n_train=4, n_val=2)
    marker = (root / ".complete").stat().st_mtime_ns
    generate_shapes(root, seed=0, n_train=4, n_val=2)  # same parameters: untouched
    assert (root / ".complete").stat().st_mtime_ns == marker
    generate_shapes(root, seed=0, n_train=6, n_val=2)  # different: replaced
    assert len(list((root / "images" / "train").glob("*.jpg"))) == 6
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [".ds.lock"]  # no temp folder left


def test_refuses_foreign_folder_and_bad_args(tmp_path):
    root = tmp_path / "mine"
    root.mkdir()
    (root / "precious.txt").write_text("user data")
    with pytest.raises(UserError, match="mine"):
        generate_shapes(root, n_train=2, n_val=1)
    assert (root / "precious.txt").read_text() == "user data"
    with pytest.raises(UserError, match="n_train"):
        generate_shapes(tmp_path / "x", n_train=0)


def test_a_second_generator_of_one_folder_waits_and_keeps_the_first_ones_set(tmp_path, monkeypatch):
    """Two nodes generating into one shared folder at once: the second waits for the first (the lock beside the
    folder), then finds the finished set and leaves it in place; it never writes a set of its own, which would
    move the first one's aside while that node's ranks list it."""
    entered, release, writes = threading.Event(), threading.Event(), []
    real_write = shapes._write_one

    def held_write(*args):  # the first generator stays mid-set until the test lets it go
        writes.append(args[3:5])
        entered.set()
        assert release.wait(30)
        real_write(*args)

    monkeypatch.setattr(shapes, "_write_one", held_write)
    root, size = tmp_path / "shapes", dict(seed=3, n_train=3, n_val=2, img_size=64)
    first = threading.Thread(target=generate_shapes, args=(root,), kwargs=size)
    first.start()
    assert entered.wait(30)
    second = threading.Thread(target=generate_shapes, args=(root,), kwargs=size)
    second.start()
    second.join(1.0)
    assert second.is_alive() and not root.exists()  # waiting on the lock; the first set is not in place yet
    release.set()
    first.join(30), second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert len(writes) == 5  # one set's images: the second generator wrote none
    assert len(list((root / "images" / "train").glob("*.jpg"))) == 3
    assert len(list((root / "images" / "val").glob("*.jpg"))) == 2
