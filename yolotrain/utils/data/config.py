"""Dataset yaml files: loading, validating, resolving paths, generating the built-in dataset.

Every yaml goes through ``yaml.safe_load`` and nothing is evaluated. Each problem becomes a
UserError naming the file and the key, so a typo costs a second rather than a training run.
"""
from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yolotrain.utils.data.shapes import GENERATORS  # explicit registry, never eval
from yolotrain.models.heads.anchor import check_anchors_spec
from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core.errors import UserError, did_you_mean
from yolotrain.utils.core.fileio import CHECKOUT, ROOT, TOP, load_yaml, parse_yaml
from yolotrain.utils.data import remote
from yolotrain.utils.data.split import SplitSource, open_split


DEMO_DATA = ROOT / "data" / "shapes.yaml"  # the built-in set: train.py's and val.py's --data default


@dataclass
class DataConfig:
    """A dataset yaml, resolved: absolute split paths and a names list."""

    file: Path | str  # the yaml: a local path, or a URL string for one in object storage
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
    category_ids: list[int] | None = None  # a converted dataset's source category id per class (yolotrain.convert)
    image_ids: Path | None = None  # its json {image path relative to root: source image id}
    sources: dict[str, SplitSource] = field(default_factory=dict)  # each split's kind, decided here (open_split)

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


def _split_paths(file: Path, root: Path | str, key: str, value: Any) -> list[str]:
    """A split's paths, each absolute: a URL as written, a relative one joined to the root (a folder or URL)."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) for v in items):
        raise UserError(f"{file}: '{key}' must be a path or a list of paths")
    if remote.is_url(root):
        return [v if remote.is_url(v) else remote.join(str(root), v) for v in items]
    return [v if remote.is_url(v) else str(p if (p := Path(v).expanduser()).is_absolute() else root / p)
            for v in items]


def _category_ids(file: Path, ids: Any, nc: int) -> list[int] | None:
    """'category_ids': one distinct integer per class, the source's COCO category id (optional)."""
    if ids is None:
        return None
    if (not isinstance(ids, list) or len(ids) != nc or len(set(map(str, ids))) != nc
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise UserError(f"{file}: 'category_ids' must list {nc} distinct integers, one per class in 'names'")
    return ids


def _image_ids_file(file: Path, root: Path, value: Any) -> Path | None:
    """'image_ids': a json file (relative to the root) mapping image paths to source image ids (optional)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise UserError(f"{file}: 'image_ids' must be the path of a json file")
    return p if (p := Path(value).expanduser()).is_absolute() else root / p


def load_image_ids(cfg: DataConfig) -> dict[str, int]:
    """The 'image_ids' map keyed by each image's real path (links resolved), so any path to it matches."""
    path = cfg.image_ids
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{cfg.file}: 'image_ids' file {path} cannot be read: {e}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, int) and not isinstance(v, bool) for v in raw.values()):
        raise UserError(f"{path}: expected a mapping of image paths to integer image ids")
    return {os.path.realpath(cfg.root / k): v for k, v in raw.items()}


def yaml_folder(file: Path) -> Path:
    """The folder a data yaml's relative paths resolve against: its own, except for the package's data/, which
    resolves as a data/ at the top of the checkout (or of the working directory, installed), so the built-in set is
    generated in <top>/datasets and never inside the package."""
    folder = file.resolve().parent
    if folder != (ROOT / "data").resolve():
        return folder
    return (TOP if CHECKOUT else Path.cwd()) / "data"


def load_data_config(path: str | Path) -> DataConfig:
    """Parse a YOLO dataset yaml, a local file or a URL (s3://bucket/prefix/data.yaml: any fsspec store).
    Relative paths resolve against the yaml's own folder, a URL's folder for a yaml in a store."""
    in_store = remote.is_url(str(path))
    file: Path | str = str(path) if in_store else Path(path)
    raw = parse_yaml(remote.read(file), file) if in_store else load_yaml(file)
    for key in ("train", "val", "names"):
        if key not in raw:
            raise UserError(f"{file}: missing required key '{key}'")
    path_text = None if raw.get("path") in (None, "") else str(raw["path"])
    if in_store and not remote.is_url(path_text) and not Path(path_text or ".").expanduser().is_absolute():
        path_text = remote.join(remote.parent(file), path_text or ".")  # the store's folder, as a local yaml's
    url_root = remote.is_url(path_text)  # path: s3://bucket/dataset: the splits are under that URL
    root = Path(path_text if path_text and not url_root else ".").expanduser()
    folder = Path.cwd() if in_store else yaml_folder(file)  # a yaml in a store has no local folder
    root = (root if root.is_absolute() else Path(os.path.normpath(folder / root))).resolve()  # data/.. lexically
    base: Path | str = path_text if url_root else root
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
        train=_split_paths(file, base, "train", raw["train"]),
        val=_split_paths(file, base, "val", raw["val"]),
        test=_split_paths(file, base, "test", raw.get("test")),
        names=names,
        generate=raw.get("generate"),
        generate_args=dict(raw.get("generate_args") or {}),
        anchors=None if raw.get("anchors") is None else check_anchors_spec(raw["anchors"], f"{file}: 'anchors'"),
        path_text=path_text,
        has_download=bool(raw.get("download")),
        category_ids=_category_ids(file, raw.get("category_ids"), len(names)),
        image_ids=_image_ids_file(file, root, raw.get("image_ids")),
    )
    if not cfg.train or not cfg.val:
        raise UserError(f"{file}: 'train' and 'val' must name at least one path each")
    cfg.sources.update({k: open_split(getattr(cfg, k)) for k in ("train", "val", "test") if getattr(cfg, k)})
    return cfg


def prepare_dataset(cfg: DataConfig) -> None:
    """Create a built-in dataset on first use (call under torch_distributed_zero_first), then
    check that every split path exists."""
    if cfg.generate:
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
    for key, source in cfg.sources.items():
        missing = source.check()
        if missing is None:
            continue
        p = missing.path
        if missing.reason == "url":  # object storage holds shard indexes only
            raise UserError(f"{cfg.file}: '{key}' is {p}: only shard indexes (<split>.index) are read from object "
                            f"storage, not image folders or lists; {tool_command('shards')} DATA.yaml s3://BUCKET/PREFIX "
                            "makes them from a local copy and uploads them with a data.yaml to train from")
        if missing.reason == "missing":
            raise UserError(f"{cfg.file}: '{key}' path not found: {p}{_missing_split_hint(cfg, Path(p))}")
        raise UserError(f"{cfg.file}: '{key}' has no images: {p}")


def count_images(cfg: DataConfig, split: str = "train") -> int:
    """How many images a split lists, without reading a label or an image (or generating a built-in set): what a
    refusal that depends on the schedule's length needs before the run starts. A shard index says it in its
    json; a built-in set not made yet, in its generate_args (or its generator's default)."""
    if cfg.generate in GENERATORS and not all(Path(p).exists() for p in getattr(cfg, split)):
        default = inspect.signature(GENERATORS[cfg.generate]).parameters.get(f"n_{split}")
        return int(cfg.generate_args.get(f"n_{split}", default.default if default else 0))
    return cfg.sources[split].count()


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
