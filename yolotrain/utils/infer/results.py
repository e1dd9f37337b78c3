"""What a prediction hands its caller: ``Results`` per image or video frame (the Python API's predict and
detect's on_predict_batch_end listeners get them). Thin views over the engine's predictions: the pictures
and label rows come from the same functions detect.py writes with."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.eval.outputs import label_rows
from yolotrain.utils.eval.plots import draw_detections
from yolotrain.utils.infer.loop import Prediction


class Boxes:
    """Detections (n, 6) [x1, y1, x2, y2, conf, cls] in original-image pixels, as torch (default) or numpy."""

    def __init__(self, data: torch.Tensor | np.ndarray) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __repr__(self) -> str:
        return f"Boxes({len(self)} boxes, {type(self.data).__module__.split('.')[0]})"

    @property
    def xyxy(self) -> torch.Tensor | np.ndarray:
        return self.data[:, :4]

    @property
    def xywh(self) -> torch.Tensor | np.ndarray:
        """Centre x, centre y, width, height in pixels."""
        xy, wh = (self.data[:, :2] + self.data[:, 2:4]) / 2, self.data[:, 2:4] - self.data[:, :2]
        return torch.cat([xy, wh], 1) if isinstance(self.data, torch.Tensor) else np.concatenate([xy, wh], 1)

    @property
    def conf(self) -> torch.Tensor | np.ndarray:
        return self.data[:, 4]

    @property
    def cls(self) -> torch.Tensor | np.ndarray:
        return self.data[:, 5]

    def numpy(self) -> Boxes:
        return Boxes(self.data.cpu().numpy() if isinstance(self.data, torch.Tensor) else np.asarray(self.data))

    def torch(self) -> Boxes:
        return Boxes(torch.as_tensor(np.asarray(self.data)) if not isinstance(self.data, torch.Tensor) else self.data)


@dataclass
class Results:
    """One image's or video frame's detections, with the image they were found in."""

    path: str  # the source file (the video, for a frame)
    orig_img: np.ndarray  # BGR, as read
    boxes: Boxes
    names: list[str]
    frame: int | None = None  # a video's frame number, from 1

    def __len__(self) -> int:
        return len(self.boxes)

    def _det(self) -> np.ndarray:
        return np.asarray(self.boxes.numpy().data, dtype=np.float32).reshape(-1, 6)

    def plot(self, line_width: int = 0, labels: bool = True, conf: bool = True) -> np.ndarray:
        """The image with its boxes drawn (BGR), as detect.py saves it."""
        return draw_detections(self.orig_img.copy(), self._det(), self.names, line_width, labels=labels, conf=conf)

    def save(self, path: str | Path, **plot_options: Any) -> Path:
        """Write plot() to ``path`` (any OpenCV image suffix)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        if not cv2.imwrite(str(path), self.plot(**plot_options)):
            raise OSError(f"{path}: OpenCV could not write an image here")
        return path

    def save_txt(self, path: str | Path, save_conf: bool = False) -> Path:
        """YOLO label rows (class xc yc w h, normalised; + conf), detect.py --save-txt's format."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = label_rows(self._det(), self.orig_img.shape[:2], save_conf)
        path.write_text("".join(r + "\n" for r in rows))
        return path

    def to_json(self) -> str:
        """A list of {name, class, confidence, box: {x1, y1, x2, y2}} in pixels."""
        return json.dumps([{"name": self.names[int(c)], "class": int(c), "confidence": round(float(s), 5),
                            "box": {k: round(float(v), 3) for k, v in zip(("x1", "y1", "x2", "y2"), box)}}
                           for *box, s, c in self._det().tolist()])


@dataclass(frozen=True)
class PredictEvent:
    """on_predict_batch_end: a batch of images or frames was predicted (``batch``: its index, from 0)."""

    event: str
    batch: int
    results: list[Results]


def as_results(batch: list[Prediction], names: list[str]) -> list[Results]:
    """The engine's predictions (utils/infer/loop.Prediction) as Results, boxes as torch tensors."""
    return [Results(p.path, p.original, Boxes(torch.from_numpy(np.ascontiguousarray(p.det))), names, p.frame)
            for p in batch]


def predict_batch_end(callbacks: Callbacks | None, index: int, results: list[Results]) -> None:
    """on_predict_batch_end for batch ``index`` of this process's predictions, when anyone listens."""
    if callbacks is not None and callbacks.wants("on_predict_batch_end"):
        callbacks.run("on_predict_batch_end", PredictEvent("on_predict_batch_end", index, results))


def batch_listener(callbacks: Callbacks | None, names: list[str]) -> Callable[[int, list[Prediction]], None] | None:
    """run_shard's per-batch hook for on_predict_batch_end listeners; None (no Results built) without any."""
    if callbacks is None or not callbacks.wants("on_predict_batch_end"):
        return None
    return lambda index, batch: predict_batch_end(callbacks, index, as_results(batch, names))
