#!/usr/bin/env python
"""Build a small real-photo detection dataset (11 classes) in YOLO format, for accuracy comparisons.

    python bench/photo_dataset.py --out /work/photo800                          # 800 train + 200 val, 320 px
    python bench/photo_dataset.py --out /work/photo200 --n-train 200 --n-val 50 --imgsz 320 --seed 0
    python bench/photo_dataset.py --out /work/photob800 --object-set 2             # other objects, same recipe

Why: the built-in shapes set is learnable in minutes, which makes it a good smoke test and a poor
judge of accuracy; side-by-side runs against another trainer need real-photo content. No annotated
real-photo detection set ships in a package registry this machine reaches, but Debian ships
hundreds of real photographs of objects already cut out with an alpha mask (Tux Paint's stamps), and
real photo wallpapers. So each image here is a random crop of a real photo, with 0-8 real object
cut-outs composited onto it at random scale (16 px to 60% of the image side), position (some
touch or cross the border), flip, tilt and lighting, and some overlap. The boxes are exact: each is
the extent of the object's own alpha mask after placement, clipped to the image.

Validation measures generalisation: every class's photos are split by instance, and the background
photos too, so no val object or background photo is ever seen in training. That split is fixed
(SPLIT_SEED) so datasets built with different --seed values hold out the same instances; --seed
changes only the composition. The same seed, sizes and packages give byte-identical files.

Sources, fetched when the dataset is built (never at training or test time) with ``apt-get
download`` from Debian's archive (bookworm here) and cached under --cache, so a rebuild fetches
nothing (clear the cache to refetch):
  tuxpaint-stamps-default      GPL-2   object photos with alpha (only folders of photos; the
                                       'cartoon' subfolders of drawings are never read)
  tuxpaint-data                GPL-2+  template photos (bark, cliffs, sea, trees, ...): backgrounds
  mate-backgrounds             GPL-2+  nature photos: backgrounds
  plasma-workspace-wallpapers  GPL-2+  photo wallpapers: backgrounds
The licences allow any internal use such as benchmarking. The generated images are derived from
GPL works: keep them out of this repository (build them where they are needed).

Writes OUT/images/{train,val}/*.jpg, OUT/labels/{train,val}/*.txt (class cx cy w h, normalised),
OUT/data.yaml (absolute path:, so both ``train.py --data`` and Ultralytics read it from anywhere;
rebuild after moving OUT) and OUT/photo_dataset.json (the parameters, package versions and which
photo went to which split). An existing OUT is replaced only if this script made it.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
if __name__ == "__main__" and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from yolotrain.utils.core.cli import ArgumentParser, Range  # noqa: E402
from yolotrain.utils.core.errors import UserError, run_entry_point  # noqa: E402
from yolotrain.utils.data.shapes import write_sample  # noqa: E402

GENERATOR_VERSION = 1  # bump when the composition changes, so the manifest tells old datasets apart
SPLIT_SEED = 20240611  # fixed: which photos are held out for val does not depend on --seed
VAL_FRACTION = 0.25  # of each class's photos, and of the background photos
MIN_VAL_PER_CLASS = 2
MANIFEST = "photo_dataset.json"

MIN_SIDE_PX = 16  # an object's size: the square root of its photo's box area once scaled, before tilt
MAX_SIDE_FRACTION = 0.6  # of the image's longer side
MAX_LONG_FRACTION = 0.9  # a long thin object (a bassoon) is shrunk until its longer side fits
MAX_UPSCALE = 2.5  # never blow a small photo up further than this: it would look like a blur
MAX_OBJECTS = 8
EMPTY_FRACTION = 0.04  # background-only images, as real sets have
MIN_INSIDE = 0.6  # at least this share of an object's mask lies inside the image
MAX_COVER = 0.5  # a new object may hide at most this share of an earlier object's visible mask
MAX_TILT_DEG = 15.0
BG_LONG_SIDE = 1280  # backgrounds are kept at most this large: crops for 320 px images need no more
CUTOUT_LONG_SIDE = 512

STAMPS = "usr/share/tuxpaint/stamps"


@dataclass(frozen=True)
class ClassSpec:
    """One class: the stamp folders (read flat, never recursively) that hold its photos."""

    name: str
    folders: tuple[str, ...]
    exclude: tuple[str, ...] = ()  # file stems that are drawings or not of the class


SET1: tuple[ClassSpec, ...] = (  # animals, food, plants, tools, vehicles, instruments
    ClassSpec("bird", ("animals/birds",)),
    ClassSpec("fish", ("animals/fish",), exclude=("lobster", "shrimp")),
    ClassSpec("bug", ("animals/insects",), exclude=("bee",)),  # bee.png is a drawing; slug, woodlouse stay
    ClassSpec("bovid", ("animals/mammals/bovines",)),
    ClassSpec("rodent", ("animals/mammals/rodents",)),  # with two rabbits
    ClassSpec("fruit", ("food/fruit",)),
    ClassSpec("vegetable", ("food/vegetables",)),
    ClassSpec("flower", ("plants/flowers",)),
    ClassSpec("tool", ("household/tools",), exclude=("cementmixer", "toolbox")),
    ClassSpec("vehicle", ("vehicles", "vehicles/auto", "vehicles/construction", "vehicles/cycle",
                          "vehicles/emergency", "vehicles/flight", "vehicles/flight/planes",
                          "vehicles/masstransit", "vehicles/race", "vehicles/ship", "military/vehicles"),
              exclude=("7spoke256", "wheel_tractor", "walnutBoat")),  # two wheels and a toy
    ClassSpec("instrument", ("hobbies/music/brass", "hobbies/music/percussion", "hobbies/music/string",
                             "hobbies/music/wind")),
)
# Disjoint folders of the same package, so a second set shares no object photo with the first.
SET2: tuple[ClassSpec, ...] = (
    ClassSpec("mammal", ("animals/mammals", "animals/marsupials", "animals/mammals/apes"),
              exclude=("echidna", "hedgehog")),  # two drawings
    ClassSpec("hoofed", ("animals/mammals/equines", "animals/mammals/deer")),
    ClassSpec("carnivore", ("animals/mammals/cats", "animals/mammals/dogs")),
    ClassSpec("sea_mammal", ("animals/mammals/aquatic",)),
    ClassSpec("coin", ("symbols/money/euro/coins", "symbols/money/us/coins", "symbols/money/canadian/coins",
                       "symbols/money/japanese")),
    ClassSpec("planet", ("space/planets", "space/moon"), exclude=("0_sun",)),
    ClassSpec("ball", ("sports",), exclude=("rugby_goal_posts", "tennis_racket", "trophy_cup")),
    ClassSpec("nut_or_mushroom", ("food/nuts", "plants/mushrooms")),
    ClassSpec("household", ("household", "household/dishes")),
    ClassSpec("plant", ("plants/trees", "plants"), exclude=("holly_leaves", "rambutan")),  # a drawing, a fruit
    ClassSpec("small_tool", ("household/arttools", "medical"), exclude=("tooth",)),  # a drawing
)
OBJECT_SETS: dict[str, tuple[ClassSpec, ...]] = {"1": SET1, "2": SET2}

_PLASMA = "usr/share/wallpapers/{}/contents/images/{}.jpg"
# Real photos only, and none that shows one of the classes (sheep.jpg, the flower and insect
# close-ups and EveningGlow's boats are left out: they would be unlabelled objects).
BACKGROUNDS: tuple[tuple[str, str], ...] = (
    *(("tuxpaint-data", f"usr/share/tuxpaint/templates/{n}.jpg") for n in (
        "burnt_bark", "cliff", "corn_maze", "jellyfish", "lighthouse", "mossy_bark", "mossy_log", "mudstone",
        "ocean_splash", "ocean_waves", "redwoods_above", "rocks", "spiders_web", "sun_behind_clouds",
        "sun_behind_leaves", "trees_above", "trees_at_dusk", "wool_mill_machine")),
    *(("mate-backgrounds", f"usr/share/backgrounds/mate/nature/{n}.jpg") for n in (
        "Aqua", "Blinds", "Dune", "GreenMeadow", "RainDrops", "Storm", "Wood")),
    *(("plasma-workspace-wallpapers", _PLASMA.format(n, "2560x1600")) for n in (
        "BytheWater", "ColdRipple", "DarkestHour", "FallenLeaf", "Grey", "Kite", "OneStandsOut", "Path",
        "summer_1am")),
    ("plasma-workspace-wallpapers", _PLASMA.format("Volna", "5120x2880")),
)
PACKAGES: dict[str, str] = {  # package -> licence, for the manifest
    "tuxpaint-stamps-default": "GPL-2", "tuxpaint-data": "GPL-2+", "mate-backgrounds": "GPL-2+",
    "plasma-workspace-wallpapers": "GPL-2+",
}


@dataclass
class Cutout:
    """A photo of one object, cropped to its alpha mask: BGR uint8 and alpha float32 in [0, 1]."""

    cls: int
    source: str
    bgr: np.ndarray
    alpha: np.ndarray


@dataclass
class Pools:
    """What one split draws from: cut-outs per class, and background photos."""

    cutouts: list[list[Cutout]]
    backgrounds: list[np.ndarray]
    background_names: list[str]


@dataclass
class Sources:
    """Everything the build reads, split into train and val pools, and the package versions."""

    classes: tuple[ClassSpec, ...]
    train: Pools
    val: Pools
    versions: dict[str, str]


# ----------------------------------------------------------------------------- fetching


def _fetch_deb(package: str, cache: Path) -> Path:
    """The package's .deb from the cache, else from Debian's archive with ``apt-get download``."""
    debs = cache / "debs"
    found = sorted(debs.glob(f"{package}_*.deb"))
    if found:
        return found[-1]
    debs.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=debs) as tmp:
        try:
            run = subprocess.run(["apt-get", "download", package], cwd=tmp, capture_output=True, text=True)
        except FileNotFoundError:
            raise UserError(f"could not fetch {package} from Debian's archive: apt-get not found "
                            "(build on a Debian or Ubuntu machine, or copy a filled --cache here)") from None
        got = sorted(Path(tmp).glob(f"{package}_*.deb"))
        if run.returncode != 0 or not got:
            errors = [ln for ln in run.stderr.splitlines() if ln.startswith("E:")] or run.stderr.splitlines()
            hint = " (run 'apt-get update' first?)" if "Unable to locate" in run.stderr else ""
            raise UserError(f"could not fetch {package} from Debian's archive: "
                            f"{errors[-1] if errors else f'apt-get exit {run.returncode}'}{hint}")
        target = debs / got[0].name
        os.replace(got[0], target)
    return target


def _deb_data(deb: Path) -> bytes:
    """The data.tar.* member of a .deb (an ar archive), read without dpkg-deb."""
    with deb.open("rb") as f:
        if f.read(8) != b"!<arch>\n":
            raise UserError(f"{deb}: not a .deb archive; delete it so it is fetched again")
        while header := f.read(60):
            name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
            if name.startswith("data.tar"):
                if name.endswith(".zst"):
                    raise UserError(f"{deb}: {name} is zstd-compressed, which Python's tarfile cannot read")
                return f.read(size)
            f.seek(size + size % 2, 1)
    raise UserError(f"{deb}: has no data.tar member")


@dataclass(frozen=True)
class Selection:
    """Which files of a package to extract: every ``*.png`` directly in ``folders``, and ``files``
    (which must all be there)."""

    folders: frozenset[str] = frozenset()
    files: frozenset[str] = frozenset()

    def wants(self, name: str) -> bool:
        return name in self.files or (name.endswith(".png") and str(Path(name).parent) in self.folders)

    def key(self) -> str:
        """Short digest naming the extraction in the cache, so a changed selection extracts afresh."""
        text = json.dumps([sorted(self.folders), sorted(self.files)])
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def _extract(deb: Path, out: Path, selection: Selection) -> None:
    """Write the selected package files below ``out`` (via a temporary sibling, so never half)."""
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(_deb_data(deb)), mode="r|*") as tar:
        for member in tar:
            name = member.name.removeprefix("./")
            if member.isfile() and ".." not in Path(name).parts and selection.wants(name):
                dest = tmp / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tar.extractfile(member).read())
    if missing := sorted(p for p in selection.files if not (tmp / p).is_file()):
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{deb.name}: lacks {missing[0]} (and {len(missing) - 1} more): the package changed; "
                        "update BACKGROUNDS in bench/photo_dataset.py")
    tmp.mkdir(exist_ok=True)
    try:
        os.replace(tmp, out)
    except OSError:  # a concurrent build extracted the same selection first
        shutil.rmtree(tmp, ignore_errors=True)
        if not out.is_dir():
            raise


def fetch_package(package: str, cache: Path, selection: Selection) -> tuple[Path, str]:
    """Folder holding the selected files of the package (extracted once), and the package version."""
    deb = _fetch_deb(package, cache)
    version = urllib.parse.unquote(deb.stem.split("_")[1])  # apt writes an epoch's ':' as %3a
    out = cache / "files" / f"{deb.stem}-{selection.key()}"
    if not out.is_dir():
        _extract(deb, out, selection)
    return out, version


# ----------------------------------------------------------------------------- loading


def _group(stem: str) -> str:
    """Photos that are one photo mirrored (``dumper`` and ``dumper_mirror``) share a group and a split."""
    return stem.removesuffix("_mirror")


def _load_cutout(path: Path, cls: int, source: str) -> Cutout:
    """Read an RGBA stamp, crop it to its mask and cap its size."""
    img = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    if img is None or img.ndim != 3 or img.shape[2] != 4:
        raise UserError(f"{path}: expected an RGBA PNG")
    ys, xs = np.nonzero(img[..., 3] > 16)
    img = img[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
    scale = CUTOUT_LONG_SIDE / max(img.shape[:2])
    if scale < 1:
        img = cv2.resize(img, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA)
    return Cutout(cls, source, np.ascontiguousarray(img[..., :3]), img[..., 3].astype(np.float32) / 255)


def _train_keys(keys: list[str], rng: np.random.Generator, what: str) -> set[str]:
    """The sorted keys that go to train: ``rng`` shuffles them and about VAL_FRACTION (at least
    MIN_VAL_PER_CLASS) are held out for val."""
    order = [keys[i] for i in rng.permutation(len(keys))]
    n_val = max(MIN_VAL_PER_CLASS, math.floor(len(keys) * VAL_FRACTION + 0.5))
    if len(keys) - n_val < 1:
        raise UserError(f"only {len(keys)} photos of {what}: too few to split into train and val")
    return set(order[n_val:])


def load_cutouts(stamps: Path, classes: tuple[ClassSpec, ...]) -> tuple[list[list[Cutout]], list[list[Cutout]]]:
    """Every class's photos, split by group into (train, val) lists indexed by class."""
    rng = np.random.default_rng(SPLIT_SEED)
    train: list[list[Cutout]] = []
    val: list[list[Cutout]] = []
    for cls, spec in enumerate(classes):
        files = sorted(p for folder in spec.folders for p in (stamps / folder).glob("*.png")
                       if p.stem not in spec.exclude)
        if not files:
            raise UserError(f"no photos for class '{spec.name}' under {stamps}: the package changed")
        groups = sorted({_group(p.stem) for p in files})
        train_groups = _train_keys(groups, rng, f"class '{spec.name}'")
        cuts = [_load_cutout(p, cls, str(p.relative_to(stamps))) for p in files]
        train.append([c for c, p in zip(cuts, files) if _group(p.stem) in train_groups])
        val.append([c for c, p in zip(cuts, files) if _group(p.stem) not in train_groups])
    return train, val


def _load_background(path: Path) -> np.ndarray:
    img = cv2.imread(str(path), cv2.IMREAD_COLOR)
    if img is None:
        raise UserError(f"{path}: cannot be read as an image; delete the cache to refetch")
    scale = BG_LONG_SIDE / max(img.shape[:2])
    return cv2.resize(img, None, fx=scale, fy=scale, interpolation=cv2.INTER_AREA) if scale < 1 else img


def load_sources(cache: Path, classes: tuple[ClassSpec, ...]) -> Sources:
    """Fetch (or reuse) the packages and load the train and val pools."""
    versions: dict[str, str] = {}
    folders = frozenset(f"{STAMPS}/{folder}" for spec in classes for folder in spec.folders)
    stamps_root, versions["tuxpaint-stamps-default"] = fetch_package("tuxpaint-stamps-default", cache,
                                                                     Selection(folders=folders))
    train_cuts, val_cuts = load_cutouts(stamps_root / STAMPS, classes)
    bg_files: dict[str, Path] = {}
    for package in sorted({pkg for pkg, _ in BACKGROUNDS}):
        wanted = {member for pkg, member in BACKGROUNDS if pkg == package}
        root, versions[package] = fetch_package(package, cache, Selection(files=frozenset(wanted)))
        bg_files.update({f"{package}:{m}": root / m for m in wanted})
    names = sorted(bg_files)
    train_bg = _train_keys(names, np.random.default_rng([SPLIT_SEED, 1]), "backgrounds")

    def pools(cutouts: list[list[Cutout]], chosen: list[str]) -> Pools:
        return Pools(cutouts, [_load_background(bg_files[n]) for n in chosen], chosen)

    return Sources(classes=classes, train=pools(train_cuts, [n for n in names if n in train_bg]),
                   val=pools(val_cuts, [n for n in names if n not in train_bg]), versions=versions)


# ----------------------------------------------------------------------------- composing


def _image_size(rng: np.random.Generator, imgsz: int) -> tuple[int, int]:
    """(w, h): square, landscape or portrait with the short side at 3/4, so letterboxing matters."""
    short = max(32, int(round(imgsz * 0.75 / 8)) * 8)
    return [(imgsz, imgsz), (imgsz, short), (short, imgsz)][int(rng.integers(0, 3))]


def _jitter_colour(rng: np.random.Generator, bgr: np.ndarray, strength: float) -> np.ndarray:
    """Brightness, contrast, saturation and a small hue shift: lighting, not a change of object."""
    hsv = cv2.cvtColor(bgr, cv2.COLOR_BGR2HSV).astype(np.float32)
    hsv[..., 0] = (hsv[..., 0] + rng.uniform(-6, 6) * strength) % 180
    hsv[..., 1] *= 1 + rng.uniform(-0.35, 0.35) * strength
    hsv[..., 2] = (hsv[..., 2] - 128) * (1 + rng.uniform(-0.3, 0.3) * strength) + 128
    hsv[..., 2] *= 1 + rng.uniform(-0.3, 0.3) * strength
    return cv2.cvtColor(np.clip(hsv, 0, 255).astype(np.uint8), cv2.COLOR_HSV2BGR)


def _background(rng: np.random.Generator, photos: list[np.ndarray], w: int, h: int) -> np.ndarray:
    """A random crop (25-100% of the largest one that fits) of a random photo, resized to (w, h)."""
    photo = photos[int(rng.integers(0, len(photos)))]
    ph, pw = photo.shape[:2]
    fit = min(pw / w, ph / h)
    k = fit * rng.uniform(0.25, 1.0)
    cw, ch = max(8, int(w * k)), max(8, int(h * k))
    x, y = int(rng.integers(0, pw - cw + 1)), int(rng.integers(0, ph - ch + 1))
    crop = cv2.resize(photo[y:y + ch, x:x + cw], (w, h), interpolation=cv2.INTER_AREA if k > 1 else cv2.INTER_LINEAR)
    if rng.random() < 0.5:
        crop = crop[:, ::-1]
    return _jitter_colour(rng, np.ascontiguousarray(crop), 1.0)


@dataclass
class Placed:
    """An object warped onto the canvas: colour, alpha (both canvas-sized) and its expected mask area."""

    bgr: np.ndarray
    alpha: np.ndarray
    full_area: float


def _centre_range(extent: int, side: int) -> tuple[float, float]:
    """Where an object's centre may go along one axis: up to 30% of it may stick out past the
    border (MIN_INSIDE then judges the whole mask); an object wider than the image is centred."""
    margin = min(0.2 * extent, side / 2)
    return margin, side - margin


def _warp(rng: np.random.Generator, cut: Cutout, w: int, h: int) -> Placed:
    """Scale (size log-uniform), squash, flip, tilt and place a cut-out; it may cross the border.

    Resized first (INTER_AREA when shrinking, so a 500 px photo shown at 20 px is not aliased),
    then only rotated and moved by the affine warp."""
    ch, cw = cut.alpha.shape
    side = math.exp(rng.uniform(math.log(MIN_SIDE_PX), math.log(MAX_SIDE_FRACTION * max(w, h))))
    scale = min(side / math.sqrt(cw * ch), MAX_LONG_FRACTION * max(w, h) / max(cw, ch), MAX_UPSCALE)
    squash = math.exp(rng.uniform(-0.12, 0.12))
    size = (max(2, round(cw * scale * squash)), max(2, round(ch * scale / squash)))
    interp = cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR
    bgr = _jitter_colour(rng, cv2.resize(cut.bgr, size, interpolation=interp), 0.6)
    alpha = cv2.resize(cut.alpha, size, interpolation=interp)
    if rng.random() < 0.5:
        bgr, alpha = bgr[:, ::-1], alpha[:, ::-1]
    if rng.random() < 0.2:  # slightly out of focus, as objects in photos often are
        bgr = cv2.GaussianBlur(bgr, (0, 0), rng.uniform(0.5, 1.2))
    angle = rng.uniform(-MAX_TILT_DEG, MAX_TILT_DEG) if rng.random() < 0.5 else 0.0
    cx, cy = rng.uniform(*_centre_range(size[0], w)), rng.uniform(*_centre_range(size[1], h))
    m = cv2.getRotationMatrix2D(((size[0] - 1) / 2, (size[1] - 1) / 2), angle, 1.0)
    m[:, 2] += [cx - (size[0] - 1) / 2, cy - (size[1] - 1) / 2]
    warped = cv2.warpAffine(np.ascontiguousarray(bgr), m, (w, h), flags=cv2.INTER_LINEAR,
                            borderMode=cv2.BORDER_REPLICATE)
    on_canvas = cv2.warpAffine(np.ascontiguousarray(alpha), m, (w, h), flags=cv2.INTER_LINEAR, borderValue=0.0)
    return Placed(warped, on_canvas, float(alpha.sum()))


def _box(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    """(x, y, w, h) of the mask in pixels, or None when it is a sliver."""
    x, y, bw, bh = cv2.boundingRect(mask.astype(np.uint8))
    return (x, y, bw, bh) if min(bw, bh) >= 4 else None


def render_image(rng: np.random.Generator, pools: Pools, imgsz: int) -> tuple[np.ndarray, np.ndarray]:
    """One BGR image and its labels (n, 5) [cls, xc, yc, w, h] normalised, from ``rng`` alone."""
    w, h = _image_size(rng, imgsz)
    img = _background(rng, pools.backgrounds, w, h).astype(np.float32)
    n = 0 if rng.random() < EMPTY_FRACTION else int(rng.integers(1, MAX_OBJECTS + 1))
    owner = np.full((h, w), -1, np.int16)  # which object shows at each pixel
    visible0: list[int] = []  # each object's visible pixel count when it was placed
    labels: list[list[float]] = []
    for _ in range(n):
        cls = int(rng.integers(0, len(pools.cutouts)))
        cut = pools.cutouts[cls][int(rng.integers(0, len(pools.cutouts[cls])))]
        for _attempt in range(10):
            obj = _warp(rng, cut, w, h)
            mask = obj.alpha > 0.5
            box = _box(mask)
            if box is None or obj.alpha.sum() < MIN_INSIDE * obj.full_area:
                continue  # mostly outside the image, or too thin to label
            if visible0:  # never hide more than MAX_COVER of an earlier object
                ids = owner.astype(np.int64) + 1
                covered = np.bincount(ids[mask], minlength=len(visible0) + 1)[1:]
                shown = np.bincount(ids.ravel(), minlength=len(visible0) + 1)[1:]
                if np.any(shown - covered < (1 - MAX_COVER) * np.array(visible0)):
                    continue
            owner[mask] = len(visible0)
            visible0.append(int(mask.sum()))
            a = obj.alpha[..., None]
            img = img * (1 - a) + obj.bgr.astype(np.float32) * a
            x, y, bw, bh = box
            labels.append([cls, (x + bw / 2) / w, (y + bh / 2) / h, bw / w, bh / h])
            break
    img = _jitter_colour(rng, np.clip(img, 0, 255).astype(np.uint8), 0.4)  # one light for the scene
    noise = rng.standard_normal((h, w, 3), dtype=np.float32) * rng.uniform(0.0, 6.0)
    img = np.clip(img.astype(np.float32) + noise, 0, 255).astype(np.uint8)
    return img, np.array(labels, dtype=np.float64).reshape(-1, 5)


# ----------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class BuildConfig:
    """What the dataset is a function of (with the package versions)."""

    out: Path
    n_train: int
    n_val: int
    imgsz: int
    seed: int
    cache: Path
    object_set: str = "1"


def _write_split(folder: Path, split: str, split_id: int, n: int, pools: Pools, cfg: BuildConfig) -> None:
    (folder / "images" / split).mkdir(parents=True)
    (folder / "labels" / split).mkdir(parents=True)
    for i in range(n):
        img, labels = render_image(np.random.default_rng([cfg.seed, split_id, i]), pools, cfg.imgsz)
        write_sample(folder, split, i, img, labels, quality=92)


def _manifest(cfg: BuildConfig, sources: Sources) -> dict:
    def instances(pools: Pools) -> dict[str, list[str]]:
        return {spec.name: [c.source for c in cuts] for spec, cuts in zip(sources.classes, pools.cutouts)}

    return {"generator": "bench/photo_dataset.py", "version": GENERATOR_VERSION, "seed": cfg.seed,
            "n_train": cfg.n_train, "n_val": cfg.n_val, "imgsz": cfg.imgsz, "split_seed": SPLIT_SEED,
            "object_set": cfg.object_set, "names": [c.name for c in sources.classes],
            "packages": {p: {"version": v, "licence": PACKAGES[p]} for p, v in sorted(sources.versions.items())},
            "train": {"instances": instances(sources.train), "backgrounds": sources.train.background_names},
            "val": {"instances": instances(sources.val), "backgrounds": sources.val.background_names}}


def _data_yaml(out: Path, classes: tuple[ClassSpec, ...]) -> str:
    body = {"path": str(out), "train": "images/train", "val": "images/val",
            "names": {i: c.name for i, c in enumerate(classes)}}
    head = ("# Real-photo detection set made by bench/photo_dataset.py (photo_dataset.json says from what).\n"
            "# path: is absolute so train.py and Ultralytics both find it; rebuild after moving the folder.\n")
    return head + yaml.safe_dump(body, sort_keys=False)


def build(cfg: BuildConfig) -> Sources:
    """Write the dataset into a hidden sibling folder, then swap it in (an interrupted build never
    leaves a folder that looks complete)."""
    out = cfg.out
    if out.exists() and not (out / MANIFEST).is_file() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and was not made by bench/photo_dataset.py; remove it or choose another --out")
    sources = load_sources(cfg.cache, OBJECT_SETS[cfg.object_set])
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write_split(tmp, "train", 0, cfg.n_train, sources.train, cfg)
        _write_split(tmp, "val", 1, cfg.n_val, sources.val, cfg)
        (tmp / "data.yaml").write_text(_data_yaml(out, sources.classes))
        (tmp / MANIFEST).write_text(json.dumps(_manifest(cfg, sources), indent=1) + "\n")
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.replace(out, old)
            shutil.rmtree(old)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return sources


# ----------------------------------------------------------------------------- reporting


def _read_split(out: Path, split: str) -> tuple[list[np.ndarray], list[tuple[int, int]]]:
    """Labels (n, 5) and image (w, h) for every image of a split, read back from the files."""
    labels, sizes = [], []
    for img_path in sorted((out / "images" / split).glob("*.jpg")):
        h, w = cv2.imread(str(img_path), cv2.IMREAD_REDUCED_GRAYSCALE_2).shape[:2]
        sizes.append((w * 2, h * 2))
        text = (out / "labels" / split / f"{img_path.stem}.txt").read_text()
        labels.append(np.array([row.split() for row in text.splitlines()], dtype=np.float64).reshape(-1, 5))
    return labels, sizes


def split_report(out: Path, split: str, classes: tuple[ClassSpec, ...]) -> list[str]:
    """Boxes per image, per-class counts and box sizes in pixels (COCO small/medium/large areas)."""
    labels, sizes = _read_split(out, split)
    counts = np.array([len(lb) for lb in labels])
    boxes = np.concatenate(labels) if labels else np.zeros((0, 5))
    wh = np.concatenate([lb[:, 3:5] * np.array(sz) for lb, sz in zip(labels, sizes)]) if labels else np.zeros((0, 2))
    side = np.sqrt(wh.prod(1))
    area = wh.prod(1)
    per_class = np.bincount(boxes[:, 0].astype(int), minlength=len(classes))
    q = np.percentile(side, [5, 25, 50, 75, 95]).round(1) if len(side) else []
    return [
        f"{split}: {len(labels)} images, {len(boxes)} boxes; boxes/image mean {counts.mean():.2f}, "
        f"median {np.median(counts):.0f}, min {counts.min()}, max {counts.max()}, empty images {(counts == 0).sum()}",
        f"  per class: " + ", ".join(f"{c.name} {n}" for c, n in zip(classes, per_class)),
        f"  box side sqrt(w*h) px: p5/p25/p50/p75/p95 = {' / '.join(str(v) for v in q)}; "
        f"min {side.min():.1f}, max {side.max():.1f}",
        f"  box area: small (<32^2) {(area < 32**2).mean():.0%}, medium {((area >= 32**2) & (area < 96**2)).mean():.0%}, "
        f"large (>=96^2) {(area >= 96**2).mean():.0%}; touching the border "
        f"{_border_share(labels):.0%}",
    ]


def _border_share(labels: list[np.ndarray]) -> float:
    boxes = np.concatenate(labels) if labels else np.zeros((0, 5))
    if not len(boxes):
        return 0.0
    lo = boxes[:, 1:3] - boxes[:, 3:5] / 2
    hi = boxes[:, 1:3] + boxes[:, 3:5] / 2
    return float(((lo < 0.002) | (hi > 0.998)).any(1).mean())


def source_report(sources: Sources) -> list[str]:
    lines = ["photos per class (train / val instances, disjoint):"]
    lines += [f"  {spec.name:<10} {len(t):>3} / {len(v)}"
              for spec, t, v in zip(sources.classes, sources.train.cutouts, sources.val.cutouts)]
    lines.append(f"background photos: {len(sources.train.backgrounds)} train / {len(sources.val.backgrounds)} val")
    lines.append("packages: " + ", ".join(f"{p} {v} ({PACKAGES[p]})" for p, v in sorted(sources.versions.items())))
    return lines


# ----------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    """The builder's flags, range-checked at parse time like train.py's."""
    ap = ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="dataset folder to write (replaced if this script made it)")
    ap.add_argument("--n-train", type=Range(int, min=1), default=800, help="training images")
    ap.add_argument("--n-val", type=Range(int, min=1), default=200, help="validation images")
    ap.add_argument("--imgsz", type=Range(int, min=64), default=320, help="longer image side in pixels")
    ap.add_argument("--seed", type=Range(int, min=0), default=0, help="composition seed (the val photos are fixed)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "photo_dataset_cache",
                    help="where fetched packages are kept")
    ap.add_argument("--object-set", choices=sorted(OBJECT_SETS), default="1",
                    help="which objects: 1 = animals, food, plants, tools, vehicles, instruments; 2 = other "
                         "folders of the same package (mammals, coins, planets, balls, household things, ...), "
                         "sharing no photo with set 1, for a second accuracy check")
    return ap


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    cfg = BuildConfig(args.out.expanduser().resolve(), args.n_train, args.n_val, args.imgsz, args.seed,
                      args.cache.expanduser().resolve(), args.object_set)
    t0 = time.perf_counter()
    sources = build(cfg)
    seconds = time.perf_counter() - t0
    print(f"wrote {cfg.out} in {seconds:.1f} s ({cfg.n_train} train + {cfg.n_val} val images, imgsz {cfg.imgsz}, "
          f"seed {cfg.seed})")
    print(f"object set {cfg.object_set}, classes: " + ", ".join(f"{i}:{c.name}" for i, c in enumerate(sources.classes)))
    reports = [split_report(cfg.out, split, sources.classes) for split in ("train", "val")]
    for line in source_report(sources) + reports[0] + reports[1]:
        print(line)
    print(f"data yaml: {cfg.out / 'data.yaml'}")


if __name__ == "__main__":
    sys.exit(run_entry_point(main))
