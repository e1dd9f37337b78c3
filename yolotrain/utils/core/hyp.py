"""Training hyperparameters: one dataclass holding every default, read from a YOLOv5-style hyp yaml.

Every yaml goes through ``yaml.safe_load`` (utils/core/fileio.py) and nothing is evaluated. Each
problem is a UserError naming the file and the key, so a typo costs a second rather than a run.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from yolotrain.utils.core.errors import UserError, did_you_mean
from yolotrain.utils.core.fileio import load_yaml
from yolotrain.utils.core.logging import LOGGER


@dataclass(frozen=True)
class Hyp:
    """Training hyperparameters (YOLOv5 hyp.scratch-low defaults); frozen: a run reads them, never changes them."""

    lr0: float = 0.01  # initial learning rate
    lrf: float = 0.01  # final learning rate = lr0 * lrf
    momentum: float = 0.937  # SGD momentum / Adam beta1
    weight_decay: float = 0.0005  # scaled by batch size * accumulation / 64
    warmup_epochs: float = 3.0
    warmup_momentum: float = 0.8
    warmup_bias_lr: float = 0.1
    # box and cls are read by both families on their own scales: the anchor head (YOLOv5) scales them by
    # 3 / layers (cls also by classes / 80) and wants ~0.05 / 0.5; anchor-free heads (YOLOv8/11) use them
    # as written and want ~7.5 / 0.5 (hyps/hyp.v8.yaml).
    box: float = 0.05  # box loss gain (CIoU)
    cls: float = 0.5  # class loss gain (BCE)
    dfl: float = 1.5  # DFL loss gain, anchor-free heads (unused by the anchor head)
    # From here to label_smoothing: the anchor head's loss only; anchor-free heads ignore them.
    cls_pw: float = 1.0  # class BCE positive weight
    obj: float = 1.0  # objectness loss gain (scaled by image size and layers)
    obj_pw: float = 1.0  # objectness BCE positive weight
    iou_t: float = 0.20  # unused, as in YOLOv5 7.0 (targets match anchors by anchor_t); accepted so its files load
    anchor_t: float = 4.0  # anchor-multiple threshold for target matching
    anchors: float = 0.0  # YOLOv5: anchors per level, rounded, fitted by autoanchor (0 = the model yaml's)
    fl_gamma: float = 0.0  # focal loss gamma (0 = plain BCE)
    label_smoothing: float = 0.0
    hsv_h: float = 0.015  # HSV augmentation gains (fractions)
    hsv_s: float = 0.7
    hsv_v: float = 0.4
    degrees: float = 0.0  # geometric augmentation (random perspective)
    translate: float = 0.1
    scale: float = 0.5
    shear: float = 0.0
    perspective: float = 0.0
    flipud: float = 0.0  # probabilities
    fliplr: float = 0.5
    mosaic: float = 1.0
    mixup: float = 0.0
    copy_paste: float = 0.0  # YOLOv5's needs segment labels; boxes only here, so > 0 is ignored with a warning
    close_mosaic: float = 0.0  # final epochs trained without mosaic (YOLOv8 style; 0 = YOLOv5 behaviour)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


# Keys YOLOv5's hyp files do not carry (label_smoothing is its --label-smoothing flag; anchors only in
# VOC/Objects365; dfl only matters to anchor-free heads): their defaults are YOLOv5's behaviour (or
# unused by it), so leaving them out is not worth a warning.
OPTIONAL_HYP = ("anchors", "label_smoothing", "close_mosaic", "dfl")


def load_hyp(path: str | Path) -> Hyp:
    """Hyp from yaml: unknown keys are errors with a suggestion; missing keys take defaults with a warning."""
    raw = load_yaml(path)
    known = {f.name for f in dataclasses.fields(Hyp)}
    for key in raw:
        if key not in known:
            hint = did_you_mean(str(key), known)
            raise UserError(f"{path}: unknown hyperparameter '{key}'.{hint}")
    values: dict[str, float] = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{path}: hyperparameter '{key}' must be a number, got {value!r}")
        values[key] = float(value)
    missing = sorted(known - set(values) - set(OPTIONAL_HYP))
    if missing:
        LOGGER.warning(f"{path}: missing {', '.join(missing)}; using the defaults")
    hyp = Hyp(**values)
    _check_yolov5_extras(path, hyp)
    return hyp


def _check_yolov5_extras(path: str | Path, hyp: Hyp) -> None:
    """YOLOv5 keys with no box-only equivalent: refuse values that cannot work, warn about ignored ones."""
    if hyp.anchors != 0 and not (0.5 <= hyp.anchors < math.inf):  # YOLOv5 rounds it: under 0.5 is none
        raise UserError(f"{path}: 'anchors' is the number of anchors per detection level, fitted by autoanchor "
                        f"(0 keeps the model yaml's); got {hyp.anchors:g}")
    if hyp.copy_paste > 0:
        LOGGER.warning(f"{path}: copy_paste {hyp.copy_paste:g} is ignored: YOLOv5's copy-paste needs segment "
                       "(polygon) labels, and yolotrain trains on boxes only (polygon rows are read as their box)")
