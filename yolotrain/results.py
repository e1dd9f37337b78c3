"""What the Python API returns: ``Results`` per predicted image or frame, ``ValResult`` per validation
(training returns utils/engine/state.TrainResult). Thin views over what the engine computed: the
pictures and label rows come from the same functions detect.py and val.py write with."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch

from utils.eval.evaluate import EvalResult
from utils.eval.outputs import label_rows
from utils.eval.plots import draw_detections
from utils.infer.loop import Prediction


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
class ValResult:
    """A validation's figures (val.py's), with the full EvalResult for everything else."""

    map50: float
    map: float  # mAP50-95
    mp: float  # mean precision at the best-F1 confidence
    mr: float  # mean recall there
    per_class: dict[str, dict[str, float]]  # class name -> p, r, ap50, ap, instances (classes with labels)
    speed_ms: dict[str, float]  # per image: preprocess, inference, nms
    result: EvalResult = field(repr=False)

    @classmethod
    def from_eval(cls, result: EvalResult) -> ValResult:
        m = result.metrics
        per_class = {m.names[c]: {"p": float(m.p[c]), "r": float(m.r[c]), "ap50": float(m.ap50[c]),
                                  "ap": float(m.ap[c]), "instances": int(m.nt[c])} for c in m.ap_class}
        speed = dict(zip(("preprocess", "inference", "nms"), map(float, result.speed_ms)))
        return cls(map50=m.map50, map=m.map, mp=m.mp, mr=m.mr, per_class=per_class, speed_ms=speed, result=result)


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
