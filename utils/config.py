"""Loading and validating the user's yaml: hyperparameters and dataset descriptions.

Every yaml goes through ``yaml.safe_load`` and nothing is evaluated. Each problem becomes a
UserError naming the file and the key, so a typo costs a second rather than a training run.
"""
from __future__ import annotations

import dataclasses
import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from models.yolo import check_anchors_spec
from utils.errors import UserError, did_you_mean
from utils.logging import LOGGER

ROOT = Path(__file__).resolve().parents[1]


def load_yaml(path: str | Path) -> dict:
    """safe_load a yaml mapping; UserError naming the file when it is missing, broken or not a mapping."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: file not found")
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" (line {where.line + 1}, column {where.column + 1})" if where else ""
        raise UserError(f"{path}: not valid yaml{at}: {getattr(e, 'problem', e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot be read: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping of keys to values, got {type(data).__name__}")
    return data


@dataclass
class Hyp:
    """Training hyperparameters (YOLOv5 hyp.scratch-low defaults). Read-only once training starts."""

    lr0: float = 0.01  # initial learning rate
    lrf: float = 0.01  # final learning rate = lr0 * lrf
    momentum: float = 0.937  # SGD momentum / Adam beta1
    weight_decay: float = 0.0005  # scaled by batch size * accumulation / 64
    warmup_epochs: float = 3.0
    warmup_momentum: float = 0.8
    warmup_bias_lr: float = 0.1
    box: float = 0.05  # box loss gain (scaled by 3 / detection layers)
    cls: float = 0.5  # class loss gain (scaled by classes / 80 and layers)
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
# VOC/Objects365): their defaults are YOLOv5's behaviour, so leaving them out is not worth a warning.
OPTIONAL_HYP = ("anchors", "label_smoothing", "close_mosaic")


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


@dataclass
class DataConfig:
    """A dataset yaml, resolved: absolute split paths and a names list."""

    file: Path
    root: Path
    train: list[str]
    val: list[str]
    test: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    generate: str | None = None
    generate_args: dict = field(default_factory=dict)
    anchors: list | None = None  # optional per-level [w, h, ...] pixel lists overriding the model's
    path_text: str | None = None  # 'path' as written, to say where YOLOv5/Ultralytics would have looked
    has_download: bool = False  # YOLOv5's 'download' (URL or code): only named in errors, never fetched or run

    @property
    def nc(self) -> int:
        return len(self.names)


def _names_list(file: Path, names: Any) -> list[str]:
    if isinstance(names, list):
        return [str(n) for n in names]
    if isinstance(names, dict):
        try:
            keys = sorted(int(k) for k in names)
        except (TypeError, ValueError):
            raise UserError(f"{file}: 'names' keys must be class indices 0..N-1, got {list(names)}") from None
        if keys != list(range(len(keys))):
            gaps = sorted(set(range(max(keys) + 1)) - set(keys)) if keys else []
            raise UserError(f"{file}: 'names' must number classes 0..{len(keys) - 1} without gaps (missing {gaps})")
        return [str(names.get(k, names.get(str(k)))) for k in keys]
    raise UserError(f"{file}: 'names' must be a list or a {{index: name}} mapping")


def _split_paths(file: Path, root: Path, key: str, value: Any) -> list[str]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in items):
        raise UserError(f"{file}: '{key}' must be a path or a list of paths")
    return [str(p if (p := Path(v).expanduser()).is_absolute() else root / p) for v in items]


def load_data_config(path: str | Path) -> DataConfig:
    """Parse a YOLO dataset yaml. Relative paths resolve against the yaml's own folder."""
    file = Path(path)
    raw = load_yaml(file)
    for key in ("train", "val", "names"):
        if key not in raw:
            raise UserError(f"{file}: missing required key '{key}'")
    path_text = None if raw.get("path") in (None, "") else str(raw["path"])
    root = Path(path_text or ".").expanduser()
    root = (root if root.is_absolute() else file.resolve().parent / root).resolve()
    names = _names_list(file, raw["names"])
    if not names:
        raise UserError(f"{file}: 'names' is empty")
    nc = raw.get("nc")  # optional, as in YOLOv5 (which counts the names); checked when given
    if nc is not None and (isinstance(nc, bool) or not isinstance(nc, (int, float))):
        raise UserError(f"{file}: 'nc' must be the number of classes, got {nc!r}")
    if nc is not None and nc != len(names):
        raise UserError(f"{file}: nc is {nc!r} but 'names' lists {len(names)} classes")
    cfg = DataConfig(
        file=file,
        root=root,
        train=_split_paths(file, root, "train", raw["train"]),
        val=_split_paths(file, root, "val", raw["val"]),
        test=_split_paths(file, root, "test", raw.get("test")),
        names=names,
        generate=raw.get("generate"),
        generate_args=dict(raw.get("generate_args") or {}),
        anchors=None if raw.get("anchors") is None else check_anchors_spec(raw["anchors"], f"{file}: 'anchors'"),
        path_text=path_text,
        has_download=bool(raw.get("download")),
    )
    if not cfg.train or not cfg.val:
        raise UserError(f"{file}: 'train' and 'val' must name at least one path each")
    return cfg


def prepare_dataset(cfg: DataConfig) -> None:
    """Create a built-in dataset on first use (call under torch_distributed_zero_first), then
    check that every split path exists."""
    if cfg.generate:
        from data.shapes import GENERATORS  # explicit registry, never eval

        if cfg.generate not in GENERATORS:
            hint = did_you_mean(cfg.generate, GENERATORS)
            raise UserError(f"{cfg.file}: unknown generator '{cfg.generate}'.{hint}")
        generator = GENERATORS[cfg.generate]
        accepted = [p for p in inspect.signature(generator).parameters if p != "root"]
        for key in cfg.generate_args:
            if key not in accepted:
                raise UserError(f"{cfg.file}: unknown generate_args key '{key}' for generator "
                                f"'{cfg.generate}'.{did_you_mean(key, accepted)} Accepted: {', '.join(accepted)}")
        generator(cfg.root, **cfg.generate_args)
    for key in ("train", "val", "test"):
        for p in getattr(cfg, key):
            if not Path(p).exists():
                raise UserError(f"{cfg.file}: '{key}' path not found: {p}{_missing_split_hint(cfg, Path(p))}")
            if not _has_images(Path(p)):
                raise UserError(f"{cfg.file}: '{key}' has no images: {p}")


def _root_candidates(cfg: DataConfig) -> list[tuple[Path, str]]:
    """Where YOLOv5 and Ultralytics would have put this yaml's dataset root, and why."""
    text = cfg.path_text
    if text is None:  # YOLOv5 resolves the splits against its repo folder, usually the working directory
        return [(Path.cwd(), "the working directory, against which YOLOv5 resolves splits when there is no path:")]
    if Path(text).expanduser().is_absolute():
        return []
    return [(Path.cwd() / text, "relative to the working directory, as YOLOv5 resolves it from its repo folder"),
            (cfg.file.resolve().parent.parent / text,
             "relative to the yaml folder's parent, as YOLOv5 resolves it for a yaml in its data/ folder"),
            (Path.cwd() / "datasets" / text, "in ./datasets, as Ultralytics resolves it")]


def _missing_split_hint(cfg: DataConfig, split: Path) -> str:
    """'; why' for a missing split: the root YOLOv5 or Ultralytics would have used when that one has
    the split, else where the dataset belongs (a download key is never fetched or run); may be ''."""
    where = (f"path '{cfg.path_text}' resolves to {cfg.root} (against this yaml's folder)" if cfg.path_text
             else f"there is no path:, so splits resolve against this yaml's folder {cfg.root}")
    try:
        rel = split.relative_to(cfg.root)
    except ValueError:  # an absolute split outside the root: path: played no part
        rel = None
    if rel is not None:
        found = [(c.resolve(), why) for c, why in _root_candidates(cfg) if (c / rel).exists()]
        found = [(c, why) for c, why in found if c != cfg.root]
        if found:
            state = "which does not exist" if not cfg.root.exists() else f"which has no {rel}"
            return f"; {where}, {state}; {found[0][0]} has {rel} ({found[0][1]}): set path: to {found[0][0]}"
    if cfg.has_download:
        target = cfg.root if rel is not None and not cfg.root.exists() else split
        return f"; the yaml has a download key: yolotrain never downloads or runs it; put the dataset at {target}"
    return f"; {where}, which does not exist" if rel is not None and not cfg.root.exists() else ""


def _has_images(path: Path) -> bool:
    """Cheap emptiness check (stops at the first image): a folder with an image, or a non-empty list."""
    from utils.labels import IMG_SUFFIXES

    if path.is_dir():
        return any(f.suffix.lower() in IMG_SUFFIXES for f in path.rglob("*"))
    if path.suffix.lower() == ".txt":
        return any(line.strip() for line in path.read_text(errors="replace").splitlines())
    return path.suffix.lower() in IMG_SUFFIXES
