"""What the Python API's val returns: ``ValResult``, a thin view over the EvalResult val.py computed
(predict returns utils/infer/results.Results; training utils/engine/state.TrainResult)."""
from __future__ import annotations

from dataclasses import dataclass, field

from yolotrain.utils.eval.evaluate import EvalResult


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
