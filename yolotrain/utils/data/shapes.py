"""Built-in synthetic detection dataset: coloured shapes on cluttered backgrounds.

``python train.py`` with no arguments trains on this, so a newcomer sees the whole loop work
on a CPU in minutes without downloading anything. Both shape and colour identify a class, the
objects vary in size, rotation and position, and the backgrounds carry low-contrast clutter,
so the task is learnable in minutes but not trivial. Every image is drawn from its own
generator seeded by ``(seed, split, index)``: the bytes never depend on order or threads.
"""
from __future__ import annotations

import fcntl
import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import cv2
import numpy as np

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.logging import LOGGER

SHAPE_NAMES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross", "ring")
CLASS_HUES = (0, 115, 60, 28, 150, 90)  # OpenCV hue (0-179): red, blue, green, yellow, magenta, cyan
HUE_JITTER = 7  # +- around each family's hue; families are 25+ apart, so colour stays informative
ROTATING = {1, 2, 3, 4}  # square, triangle, star, cross get a random rotation
GENERATOR_VERSION = 1  # bump when the drawing changes, so old datasets are regenerated
EMPTY_FRACTION = 0.08
MAX_OBJECTS = 8
MIN_SIDE_PX = 10
MAX_SIDE_FRACTION = 0.45
SPLITS = (("train", 0), ("val", 1))
MARKER = ".complete"


def _side_choices(img_size: int) -> list[int]:
    """Image sides: 320, 288, 256, 224 for img_size 320 (scaled otherwise), so letterbox matters."""
    return sorted({max(32, int(round(img_size * f / 8)) * 8) for f in (1.0, 0.9, 0.8, 0.7)})


def _hsv_to_bgr(h: float, s: float, v: float) -> tuple[int, int, int]:
    px = np.array([[[h, s, v]]], dtype=np.uint8)
    b, g, r = cv2.cvtColor(px, cv2.COLOR_HSV2BGR)[0, 0]
    return int(b), int(g), int(r)


def _dull_colour(rng: np.random.Generator, v_lo: int = 40, v_hi: int = 225) -> tuple[int, int, int]:
    """A low-saturation colour: unlike any class family."""
    return _hsv_to_bgr(rng.integers(0, 180), rng.integers(0, 60), rng.integers(v_lo, v_hi))


def _background(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """Dull gradient plus thin lines and faint blobs: clutter that is never a class colour."""
    c1 = np.array(_dull_colour(rng), np.float32)
    c2 = np.array(_dull_colour(rng), np.float32)
    angle = rng.uniform(0, 2 * math.pi)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    t = xx * math.cos(angle) + yy * math.sin(angle)
    t = (t - t.min()) / max(float(np.ptp(t)), 1.0)
    img = (c1 * (1 - t[..., None]) + c2 * t[..., None]).astype(np.uint8)
    for _ in range(rng.integers(0, 6)):  # thin lines
        p1 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        p2 = (int(rng.integers(0, w)), int(rng.integers(0, h)))
        cv2.line(img, p1, p2, _dull_colour(rng), int(rng.integers(1, 3)), cv2.LINE_AA)
    for _ in range(rng.integers(0, 7)):  # faint blobs, near the local background colour
        cx, cy = int(rng.integers(0, w)), int(rng.integers(0, h))
        base = img[cy, cx].astype(np.int32) + rng.integers(-35, 36)
        colour = tuple(int(c) for c in np.clip(base, 0, 255))
        axes = (int(rng.integers(3, 16)), int(rng.integers(3, 16)))
        cv2.ellipse(img, (cx, cy), axes, float(rng.uniform(0, 180)), 0, 360, colour, -1, cv2.LINE_AA)
    return img


def _polygon(cls: int, radius: float, angle: float, rng: np.random.Generator) -> np.ndarray:
    """Vertices (k, 2) around the origin for the polygon classes, circumscribed radius ``radius``."""
    if cls == 1:  # square
        a = np.deg2rad(45 + np.arange(4) * 90)
        pts = np.stack([np.cos(a), np.sin(a)], 1) * radius
    elif cls == 2:  # triangle
        a = np.deg2rad(-90 + np.arange(3) * 120)
        pts = np.stack([np.cos(a), np.sin(a)], 1) * radius
    elif cls == 3:  # five-pointed star
        a = np.deg2rad(-90 + np.arange(10) * 36)
        r = np.where(np.arange(10) % 2 == 0, radius, radius * rng.uniform(0.4, 0.5))
        pts = np.stack([np.cos(a) * r, np.sin(a) * r], 1)
    else:  # cross (plus): arms of half-width t reaching radius along the axes
        t = radius * rng.uniform(0.18, 0.26)
        arm = math.sqrt(max(radius**2 - t**2, 1.0))
        pts = np.array([[t, -arm], [t, -t], [arm, -t], [arm, t], [t, t], [t, arm],
                        [-t, arm], [-t, t], [-arm, t], [-arm, -t], [-t, -t], [-t, -arm]])
    c, s = math.cos(angle), math.sin(angle)
    return pts @ np.array([[c, s], [-s, c]])


def _draw(canvas: np.ndarray, spec: dict, colour, line_type: int) -> None:
    """Draw one object onto ``canvas`` (an image, or a mask with colour 1)."""
    cx, cy, radius = spec["cx"], spec["cy"], spec["radius"]
    if spec["cls"] == 0:
        cv2.circle(canvas, (round(cx * 16), round(cy * 16)), round(radius * 16), colour, -1, line_type, 4)
    elif spec["cls"] == 5:
        inner = spec["inner"]
        mid, thick = (radius + inner) / 2, max(int(round(radius - inner)), 2)
        cv2.circle(canvas, (round(cx * 16), round(cy * 16)), round(mid * 16), colour, thick, line_type, 4)
    else:
        pts = np.round((spec["pts"] + [cx, cy]) * 16).astype(np.int32)
        cv2.fillPoly(canvas, [pts], colour, line_type, 4)


def _area(spec: dict) -> float:
    """Analytic area of an object, to tell how much of it lies inside the image."""
    if spec["cls"] == 0:
        return math.pi * spec["radius"] ** 2
    if spec["cls"] == 5:
        thick = max(round(spec["radius"] - spec["inner"]), 2)
        mid = (spec["radius"] + spec["inner"]) / 2
        return math.pi * ((mid + thick / 2) ** 2 - (mid - thick / 2) ** 2)
    return float(cv2.contourArea(spec["pts"].astype(np.float32)))


def _propose(rng: np.random.Generator, w: int, h: int) -> dict:
    """A random object: class, size (log-uniform), position (may cross the border), rotation."""
    cls = int(rng.integers(0, len(SHAPE_NAMES)))
    side = math.exp(rng.uniform(math.log(MIN_SIDE_PX), math.log(MAX_SIDE_FRACTION * min(w, h))))
    radius = side / 2
    margin = 0.3 * radius
    spec = {"cls": cls, "radius": radius,
            "cx": rng.uniform(-margin, w + margin), "cy": rng.uniform(-margin, h + margin)}
    if cls == 5:
        spec["inner"] = radius * rng.uniform(0.45, 0.7)
    elif cls != 0:
        angle = rng.uniform(0, 2 * math.pi) if cls in ROTATING else 0.0
        spec["pts"] = _polygon(cls, radius, angle, rng)
    return spec


def _object_colour(rng: np.random.Generator, cls: int) -> tuple[int, int, int]:
    hue = (CLASS_HUES[cls] + int(rng.integers(-HUE_JITTER, HUE_JITTER + 1))) % 180
    return _hsv_to_bgr(hue, rng.integers(140, 256), rng.integers(135, 256))


def render_image(rng: np.random.Generator, img_size: int = 320) -> tuple[np.ndarray, np.ndarray]:
    """One BGR image and its labels (n, 5) [cls, xc, yc, w, h] normalised, from ``rng`` alone."""
    sides = _side_choices(img_size)
    w, h = int(rng.choice(sides)), int(rng.choice(sides))
    img = _background(rng, w, h)
    n = 0 if rng.random() < EMPTY_FRACTION else int(rng.integers(1, MAX_OBJECTS + 1))
    owner = np.full((h, w), -1, np.int16)  # which object shows at each pixel
    visible0: list[int] = []  # each object's pixel count when it was placed
    labels: list[list[float]] = []
    for _ in range(n):
        for _attempt in range(12):
            spec = _propose(rng, w, h)
            mask = np.zeros((h, w), np.uint8)
            _draw(mask, spec, 1, cv2.LINE_8)
            count = cv2.countNonZero(mask)
            x, y, bw, bh = cv2.boundingRect(mask)
            if count < 0.6 * _area(spec) or bw < 4 or bh < 4:
                continue  # mostly outside the image, or a sliver
            on = mask.astype(bool)
            if visible0:  # reject if it would cover more than half of an earlier object
                covered = np.bincount(owner[on].astype(np.int64) + 1, minlength=len(visible0) + 1)[1:]
                shown = np.bincount(owner.ravel().astype(np.int64) + 1, minlength=len(visible0) + 1)[1:]
                if np.any(shown - covered < 0.5 * np.array(visible0)):
                    continue
            owner[on] = len(visible0)
            visible0.append(count)
            colour = _object_colour(rng, spec["cls"])
            _draw(img, spec, colour, cv2.LINE_AA)
            labels.append([spec["cls"], (x + bw / 2) / w, (y + bh / 2) / h, bw / w, bh / h])
            break
    if rng.random() < 0.3:
        img = cv2.GaussianBlur(img, (3, 3), 0)
    noise = rng.standard_normal((h, w, 3), dtype=np.float32) * rng.uniform(2.0, 9.0)
    img = np.clip(img.astype(np.float32) + noise, 0, 255).astype(np.uint8)
    return img, np.array(labels, dtype=np.float64).reshape(-1, 5)


def _write_one(folder: Path, split: str, split_id: int, seed: int, i: int, img_size: int) -> None:
    img, labels = render_image(np.random.default_rng([seed, split_id, i]), img_size)
    write_sample(folder, split, i, img, labels, quality=95)


def write_sample(folder: Path, split: str, i: int, img: np.ndarray, labels: np.ndarray, quality: int) -> None:
    """A generated image as ``images/<split>/<split>_NNNNNN.jpg`` and its label rows beside it in ``labels/``
    (six decimals), the YOLO layout every generator here writes."""
    ok, buf = cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, quality])
    if not ok:
        raise RuntimeError(f"JPEG encoding failed for {split} image {i}")
    stem = f"{split}_{i:06d}"
    (folder / "images" / split / f"{stem}.jpg").write_bytes(buf.tobytes())
    rows = "".join(f"{int(c)} {x:.6f} {y:.6f} {bw:.6f} {bh:.6f}\n" for c, x, y, bw, bh in labels)
    (folder / "labels" / split / f"{stem}.txt").write_text(rows)


def _read_marker(root: Path) -> dict | None:
    try:
        return json.loads((root / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _check_args(seed: int, n_train: int, n_val: int, img_size: int) -> None:
    for key, value, low in (("seed", seed, 0), ("n_train", n_train, 1), ("n_val", n_val, 0), ("img_size", img_size, 64)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UserError(f"shapes generator: generate_args.{key} must be an integer >= {low}, got {value!r}")


def _swap_in(tmp: Path, root: Path, params: dict) -> None:
    """Move the finished dataset into place; an older generated one is replaced, user data never."""
    if _read_marker(root) == params:  # another process finished the same dataset meanwhile
        return
    if root.exists():
        if _read_marker(root) is None and any(root.iterdir()):
            raise UserError(f"{root}: exists and was not made by the shapes generator; "
                            "remove it or point the data yaml's 'path' elsewhere")
        old = root.parent / f".{root.name}.old-{os.getpid()}"
        os.replace(root, old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        os.replace(tmp, root)
    except OSError:
        if _read_marker(root) != params:  # another process finished first: fine if same params
            raise


def generate_shapes(root: Path, seed: int = 0, n_train: int = 1000, n_val: int = 200, img_size: int = 320) -> None:
    """Write the shapes dataset in YOLO format under ``root`` unless an identical one is there.

    Generated into a hidden sibling folder and renamed into place with a ``.complete`` marker,
    so a crash never leaves a half-written dataset that looks usable.
    """
    _check_args(seed, n_train, n_val, img_size)
    root = Path(root)
    params = {"generator": "shapes", "version": GENERATOR_VERSION, "seed": seed, "n_train": n_train,
              "n_val": n_val, "img_size": img_size, "names": list(SHAPE_NAMES)}
    if _read_marker(root) == params:
        return
    if root.exists() and _read_marker(root) is None and any(root.iterdir()):
        raise UserError(f"{root}: exists and was not made by the shapes generator; "
                        "remove it or point the data yaml's 'path' elsewhere")
    root.parent.mkdir(parents=True, exist_ok=True)
    with open(root.parent / f".{root.name}.lock", "w") as lock:  # nodes sharing the folder generate one at a time
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _read_marker(root) != params:  # a process that held the lock first may have made it meanwhile
            _generate(root, params, seed, n_train, n_val, img_size)


def _generate(root: Path, params: dict, seed: int, n_train: int, n_val: int, img_size: int) -> None:
    """Write the set into a hidden sibling folder and swap it in; the caller holds the lock."""
    LOGGER.info(f"Generating the synthetic shapes dataset in {root} ({n_train} train + {n_val} val images)...")
    tmp = root.parent / f".{root.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for split, _ in SPLITS:
            (tmp / "images" / split).mkdir(parents=True)
            (tmp / "labels" / split).mkdir(parents=True)
        jobs = [(split, sid, i) for split, sid in SPLITS for i in range(n_train if sid == 0 else n_val)]
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            list(pool.map(lambda job: _write_one(tmp, job[0], job[1], seed, job[2], img_size), jobs))
        (tmp / MARKER).write_text(json.dumps(params, indent=1) + "\n")
        _swap_in(tmp, root, params)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    LOGGER.info(f"Shapes dataset ready: {root}")


GENERATORS: dict[str, Callable[..., None]] = {"shapes": generate_shapes}
