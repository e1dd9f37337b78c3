"""Which package wrote a ``.pt`` file that ``torch.load(weights_only=True)`` refused, from its pickle's
opcodes alone: the first question the checkpoint loader asks, before anything is unpickled."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from yolotrain.utils.weights.convert.reader import Archive, ReadError, globals_named, is_tensor_plumbing

YOLOV5 = "yolov5"
ULTRALYTICS = "ultralytics"


@dataclass(frozen=True)
class Sniffed:
    """What a file that ``torch.load(weights_only=True)`` refused is, read from its pickle's opcodes
    (nothing unpickled): a YOLOv5 / Ultralytics checkpoint, or why it is readable as neither."""

    package: str | None  # YOLOV5 or ULTRALYTICS when the pickle names their classes
    problem: str  # otherwise what is wrong with it ('' when nothing specific was found)


def sniff(path: str | Path) -> Sniffed:
    """Classify a file by the globals its pickle names; see ``Sniffed``."""
    try:
        archive = Archive(path)
        try:
            named = globals_named(archive.raw_pickle())
        finally:
            archive.close()
    except ReadError as e:
        return Sniffed(None, e.reason)
    modules = {m for m, _ in named}
    if any(m.startswith("ultralytics.") for m in modules):
        return Sniffed(ULTRALYTICS, "")
    if any(m.startswith(("models.yolo", "models.common", "yolov5.models.")) for m in modules):
        return Sniffed(YOLOV5, "")
    objects = sorted(f"{m}.{n}" for m, n in named if not is_tensor_plumbing(m, n))
    if not objects:
        return Sniffed(None, "")
    listed = ", ".join(objects[:3]) + (f" and {len(objects) - 3} more" if len(objects) > 3 else "")
    return Sniffed(None, f"its pickle names {listed}: Python objects, which are read only from YOLOv5 and "
                         "Ultralytics checkpoints")
