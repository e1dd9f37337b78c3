"""What detect.py reads: images, folders, globs, ``.txt`` lists and videos, letterboxed as val.py does.

Every image and video frame goes through ``letterbox_image``: the validation loader's own steps
(``resize_long_side`` to ``imgsz``, then ``letterbox`` to a square ``imgsz`` x ``imgsz`` input,
never scaled up), so an image's network input, and so its detections, never depend on which
images share its batch, and equal ``val.py --no-rect``'s input for the same file and size.

Sources are resolved the same way on every rank (sorted, de-duplicated), so every rank agrees on
the list, on each output's name and on who owns what: images are sharded by ``InferenceSampler``
(contiguous whole batches, like val), each video belongs whole to one rank (``assign_videos``),
so each output file has exactly one writer. A bad file is skipped, named and counted by the
caller; a source that names nothing is a ``UserError``.
"""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple, Sequence

import cv2
import numpy as np
import torch
from torch.utils.data import Dataset

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data.augment import letterbox, resize_long_side
from yolotrain.utils.data.geometry import Placement
from yolotrain.utils.data.images import IMG_SUFFIXES, read_image_bgr

VIDEO_SUFFIXES = (".asf", ".avi", ".m4v", ".mkv", ".mov", ".mp4", ".mpeg", ".mpg", ".ts", ".webm", ".wmv")
DEFAULT_FPS = 30.0  # when a container does not say its frame rate


@dataclass
class Sources:
    """The resolved inputs of one detect run, identical on every rank.

    ``stems`` gives every image and video a unique output stem (its own stem, with ``_2``, ``_3``...
    appended when another source already took it), so two ``img.jpg`` in different folders
    never write one file. ``problems`` are list entries that name nothing usable, as
    (path, reason): skipped and counted like unreadable images.
    """

    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    stems: dict[str, str] = field(default_factory=dict)
    problems: list[tuple[str, str]] = field(default_factory=list)
    duplicates: int = 0


def _kind(path: str) -> str | None:
    suffix = Path(path).suffix.lower()
    return "image" if suffix in IMG_SUFFIXES else "video" if suffix in VIDEO_SUFFIXES else None


def _is_glob(text: str) -> bool:
    return any(c in text for c in "*?[")


def _list_entries(list_file: Path) -> list[str]:
    """A .txt list's paths, relative ones taken from the list's folder (as dataset lists are)."""
    try:
        lines = list_file.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{list_file}: cannot read the list of sources ({e})") from None
    out = []
    for line in (s.strip() for s in lines):
        if line and not line.startswith("#"):
            p = Path(line).expanduser()
            out.append(str(p if p.is_absolute() else list_file.parent / p))
    if not out:
        raise UserError(f"{list_file}: the list names no files")
    return out


def _expand(source: str) -> tuple[list[str], list[tuple[str, str]]]:
    """One --source entry -> (media files, problems); UserError when it names nothing usable."""
    wanted = ", ".join(IMG_SUFFIXES + VIDEO_SUFFIXES)
    p = Path(source).expanduser()
    if p.is_dir():
        files = sorted(str(f) for f in p.iterdir() if f.is_file() and _kind(f.name))
        if not files:
            raise UserError(f"{p}: folder has no images or videos (looked for {wanted})")
        return files, []
    if p.is_file():
        if p.suffix.lower() == ".txt":
            files, problems = [], []
            for entry in _list_entries(p):
                if not os.path.isfile(entry):
                    problems.append((entry, f"listed in {p} but not found"))
                elif not _kind(entry):
                    problems.append((entry, f"listed in {p} but not an image or video ({Path(entry).suffix or 'no suffix'})"))
                else:
                    files.append(entry)
            return files, problems
        if _kind(p.name):
            return [str(p)], []
        raise UserError(f"{p}: not an image, a video, a folder or a .txt list (suffix {p.suffix or 'none'}; "
                        f"looked for {wanted})")
    if _is_glob(source):
        files = sorted(f for f in glob.glob(os.path.expanduser(source), recursive=True)
                       if os.path.isfile(f) and _kind(f))
        if not files:
            raise UserError(f"{source}: no images or videos match this pattern")
        return files, []
    raise UserError(f"{source}: does not exist")


def resolve_sources(sources: Sequence[str]) -> Sources:
    """Images and videos named by ``sources`` (files, folders, globs, .txt lists), in the order given.

    A folder is read without recursion (YOLOv5's rule; a ``**`` glob recurses). A path named
    twice is used once.
    """
    out, seen = Sources(), set()
    for source in sources:
        files, problems = _expand(str(source))
        out.problems += problems
        for f in files:
            key = os.path.realpath(f)
            if key in seen:
                out.duplicates += 1
                continue
            seen.add(key)
            (out.images if _kind(f) == "image" else out.videos).append(f)
    if not out.images and not out.videos:
        raise UserError(f"{', '.join(map(str, sources))}: no images or videos to run on")
    out.stems = unique_stems([*out.images, *out.videos])
    return out


def unique_stems(paths: Sequence[str]) -> dict[str, str]:
    """Each path's output stem: its own, or with ``_2``, ``_3``... when an earlier path took it."""
    taken, stems = set(), {}
    for path in paths:
        stem = candidate = Path(path).stem
        k = 2
        while candidate in taken:
            candidate, k = f"{stem}_{k}", k + 1
        taken.add(candidate)
        stems[path] = candidate
    return stems


# ---------------------------------------------------------------- letterboxing
def letterbox_image(img: np.ndarray, imgsz: int) -> tuple[torch.Tensor, Placement]:
    """BGR (h, w, 3) uint8 -> the network input (3, imgsz, imgsz) uint8 RGB and where the image lies in it.

    The same steps as the validation loader without rect batches (LoadImagesAndLabels.load_image
    and load_letterboxed with augment off), so detect.py and ``val.py --no-rect`` feed the
    network identical pixels.
    """
    h0, w0 = img.shape[:2]
    resized = resize_long_side(img, imgsz, augment=False)
    h, w = resized.shape[:2]
    boxed, ratio, pad = letterbox(resized, imgsz, auto=False, scaleup=False)
    placed = Placement(orig_hw=(h0, w0), gain_hw=(h * ratio[1] / h0, w * ratio[0] / w0), pad_hw=(pad[1], pad[0]))
    return torch.from_numpy(np.ascontiguousarray(boxed.transpose((2, 0, 1))[::-1])), placed


class Item(NamedTuple):
    """One image or video frame ready for the network, or why it could not be read."""

    index: int  # position in the run's image list, or the frame number (from 1) in its video
    path: str
    image: torch.Tensor | None  # (3, imgsz, imgsz) uint8 RGB
    placement: Placement | None
    original: np.ndarray | None  # BGR as read, kept only when something is drawn or cropped from it
    error: str = ""


class LetterboxedImages(Dataset):
    """Image files letterboxed to ``imgsz``; a file that cannot be decoded becomes an Item with its reason."""

    def __init__(self, files: Sequence[str], imgsz: int, keep_original: bool) -> None:
        self.files, self.imgsz, self.keep_original = list(files), int(imgsz), keep_original

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> Item:
        path = self.files[index]
        try:
            img = read_image_bgr(path)  # the training decoder: EXIF, alpha, 16-bit, truncated JPEGs
        except UserError as e:
            return Item(index, path, None, None, None, str(e).removeprefix(f"{path}: "))
        image, placed = letterbox_image(img, self.imgsz)
        return Item(index, path, image, placed, img if self.keep_original else None)


class ItemBatch(NamedTuple):
    """Collated Items: the readable ones stacked into one uint8 batch, the unreadable ones apart."""

    images: torch.Tensor | None  # (B, 3, imgsz, imgsz) uint8, None when no item of the batch was readable
    items: list[Item]  # readable, in batch order
    failed: list[Item]


def collate_items(items: Sequence[Item]) -> ItemBatch:
    good = [it for it in items if it.image is not None]
    images = torch.stack([it.image for it in good]) if good else None
    return ItemBatch(images, [it._replace(image=None) for it in good], [it for it in items if it.image is None])


# ---------------------------------------------------------------- videos
@dataclass(frozen=True)
class VideoInfo:
    """What a video's container says: frame count (0 when unknown), frame rate and frame size (h, w)."""

    frames: int
    fps: float
    hw: tuple[int, int]
    error: str = ""


def probe_video(path: str) -> VideoInfo:
    """Open a video only to read its header; ``error`` says why it cannot be read."""
    cap = cv2.VideoCapture(path)
    try:
        if not cap.isOpened():
            return VideoInfo(0, DEFAULT_FPS, (0, 0), "cannot open video (unknown format or corrupt file)")
        frames = max(int(cap.get(cv2.CAP_PROP_FRAME_COUNT) or 0), 0)
        fps = float(cap.get(cv2.CAP_PROP_FPS) or 0)
        hw = (int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT)), int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)))
        return VideoInfo(frames, fps if np.isfinite(fps) and fps > 0 else DEFAULT_FPS, hw)
    finally:
        cap.release()


class UnreadableVideo(Exception):
    """A video file that cannot be opened or has no decodable frame; the message says which."""


def read_video(path: str, imgsz: int, batch_size: int, keep_original: bool) -> Iterator[list[Item]]:
    """A video's frames in order, letterboxed, ``batch_size`` at a time (the last batch may be short).

    Frames are numbered from 1 (YOLOv5's ``<stem>_<frame>.txt``). Decoding stops at the first frame
    the decoder cannot return, as players do; the caller counts the frames it got. Raises
    UnreadableVideo with the reason when not even the first frame can be read.
    """
    cap = cv2.VideoCapture(path)
    if not cap.isOpened():
        raise UnreadableVideo("cannot open video (unknown format or corrupt file)")
    try:
        batch: list[Item] = []
        frame = 0
        while True:
            ok, img = cap.read()
            if not ok or img is None:
                break
            frame += 1
            image, placed = letterbox_image(img, imgsz)
            batch.append(Item(frame, path, image, placed, img if keep_original else None))
            if len(batch) == batch_size:
                yield batch
                batch = []
        if frame == 0:
            raise UnreadableVideo("no decodable frame (corrupt or empty video)")
        if batch:
            yield batch
    finally:
        cap.release()


def assign_videos(frames: Sequence[int], world_size: int, loads: Sequence[int] | None = None) -> list[int]:
    """The rank that owns each video: longest first, to the least loaded rank (ties: the lower rank).

    ``loads`` are the ranks' image counts already given out. A video is never split, so its
    annotated file and frame labels have one writer; the deal depends only on the frame counts,
    so every rank computes the same one.
    """
    load = list(loads) if loads is not None else [0] * world_size
    owner = [0] * len(frames)
    for v in sorted(range(len(frames)), key=lambda i: (-frames[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[v] = rank
        load[rank] += max(int(frames[v]), 1)
    return owner
