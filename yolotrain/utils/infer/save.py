"""What detect.py writes for each image or frame: the annotated picture, YOLO label txt and crops.

Layout (YOLOv5's): ``<run>/<stem><suffix>`` annotated images, ``<run>/<stem>.mp4`` annotated
videos, ``<run>/labels/<stem>.txt`` (``<stem>_<frame>.txt`` for video frames, frames from 1),
``<run>/crops/<class>/<stem>.jpg`` (``<stem>2.jpg``... for further boxes of that class in the same
image). Every name comes from the source's unique stem (utils/data/sources.py) and the box's
rank in its own image, so each file has one writer and the same name on any number of ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.eval.outputs import label_rows
from yolotrain.utils.eval.plots import draw_detections

CROP_GAIN, CROP_PAD = 1.02, 10  # YOLOv5's save_one_box margins: a little context around the box


@dataclass(frozen=True)
class SaveOptions:
    """Which files to write, and how boxes are drawn (YOLOv5 detect.py's flags)."""

    save_img: bool = True
    save_txt: bool = False
    save_conf: bool = False
    save_crop: bool = False
    line_width: int = 0  # 0: scaled with the image
    hide_labels: bool = False
    hide_conf: bool = False

    @property
    def needs_original(self) -> bool:
        """Whether the original pixels must travel with each image (drawing or cropping)."""
        return self.save_img or self.save_crop


def _imwrite(path: Path, img: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), img):
        raise UserError(f"{path}: cannot write the image (disk full, or no writer for '{path.suffix}')")


def crop_box(img: np.ndarray, xyxy: np.ndarray) -> np.ndarray:
    """The box grown by CROP_GAIN and CROP_PAD pixels, clipped to the image (YOLOv5's save_one_box)."""
    (x1, y1, x2, y2), (h, w) = xyxy, img.shape[:2]
    cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
    bw, bh = (x2 - x1) * CROP_GAIN + CROP_PAD, (y2 - y1) * CROP_GAIN + CROP_PAD
    left, top = int(np.clip(cx - bw / 2, 0, w)), int(np.clip(cy - bh / 2, 0, h))
    right, bottom = int(np.clip(cx + bw / 2, 0, w)), int(np.clip(cy + bh / 2, 0, h))
    return img[top:max(bottom, top + 1), left:max(right, left + 1)]


class Writer:
    """Writes one run's per-image files under ``save_dir``; see the module docstring for names."""

    def __init__(self, save_dir: Path, names: tuple[str, ...] | list[str], opts: SaveOptions) -> None:
        self.dir, self.names, self.opts = Path(save_dir), list(names), opts
        self.label_files = 0

    def annotate(self, original: np.ndarray, det: np.ndarray) -> np.ndarray:
        o = self.opts
        return draw_detections(original.copy(), det, self.names, o.line_width, labels=not o.hide_labels,
                               conf=not o.hide_conf)

    def detections(self, det: np.ndarray, hw: tuple[int, int], stem: str, original: np.ndarray | None) -> None:
        """Label txt and crops for one image or frame (``stem`` already carries a frame number)."""
        if self.opts.save_txt and len(det):
            path = self.dir / "labels" / f"{stem}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(label_rows(det, hw, self.opts.save_conf)) + "\n")
            self.label_files += 1
        if self.opts.save_crop and original is not None:
            seen: dict[int, int] = {}
            for row in det:
                c = int(row[5])
                seen[c] = seen.get(c, 0) + 1
                name = f"{stem}.jpg" if seen[c] == 1 else f"{stem}{seen[c]}.jpg"
                _imwrite(self.dir / "crops" / self.names[c] / name, crop_box(original, row[:4]))

    def image(self, original: np.ndarray, det: np.ndarray, name: str) -> None:
        """The annotated picture, under the source's own suffix."""
        if self.opts.save_img:
            _imwrite(self.dir / name, self.annotate(original, det))


class VideoSink:
    """An annotated video: mp4v in .mp4 (what YOLOv5 writes; OpenCV's own builds encode it), the
    source's frame rate and frame size. Frames of another size (a stream that changes resolution)
    are resized to the first one's."""

    def __init__(self, path: Path, fps: float, hw: tuple[int, int]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.hw = path, hw
        self.writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), fps, (hw[1], hw[0]))
        if not self.writer.isOpened():
            raise UserError(f"{path}: OpenCV cannot write an mp4v video here")

    def write(self, frame: np.ndarray) -> None:
        if frame.shape[:2] != self.hw:
            frame = cv2.resize(frame, (self.hw[1], self.hw[0]), interpolation=cv2.INTER_LINEAR)
        self.writer.write(frame)

    def close(self) -> None:
        self.writer.release()
