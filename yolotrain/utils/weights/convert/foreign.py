"""YOLOv5 and Ultralytics checkpoints -> yolotrain checkpoints, every tensor accounted for.

``reader.py`` turns the file into inert records; this module says what they mean, the way each
package's own loader would: the weights are ``ckpt.get("ema") or ckpt["model"]`` (both packages),
the model's ``yaml`` and ``names`` are attributes of the recorded model, and the state dict is the
walk ``nn.Module.state_dict`` makes (parameters, persistent buffers, then children).

The file's yaml is rewritten for our registry (Ultralytics' anchor-free ``Detect`` is our
``DFLDetect``, or ``E2EDetect`` when it holds YOLO26's one-to-one branches; YOLOv10's ``v10Detect`` is
our ``v10Detect`` row, the same name, and its blocks are models/blocks_v10.py's; YOLOv5's anchors come
from the trained ``anchors`` buffer, which autoanchor may have changed), our model is built from it, and then, module by module, the classes and the settings that
shape the output without showing in any tensor (strides, padding, groups, BatchNorm eps, residual
adds, attention heads) must agree, and tensor by tensor every name must exist on both sides with the
same shape (a missing or unexpected tensor is an error naming it; the head's ``stride``, a plain
attribute in both packages but a buffer here, is taken from the recorded head).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from yolotrain.models.parse import SIZE_IN_NAME
from yolotrain.models.yolo import Model
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.weights.convert.reader import Archive, Recorded, TensorRef
from yolotrain.utils.weights.convert.sniff import ULTRALYTICS, YOLOV5, Sniffed, sniff

__all__ = ["ULTRALYTICS", "YOLOV5", "ForeignModel", "Sniffed", "sniff", "read_foreign", "build_model", "convert"]

PACKAGE_TITLES = {YOLOV5: "YOLOv5", ULTRALYTICS: "Ultralytics"}
MODEL_CLASSES = {  # recorded class path of the top-level model -> package
    "models.yolo.DetectionModel": YOLOV5, "models.yolo.Model": YOLOV5,
    "yolov5.models.yolo.DetectionModel": YOLOV5, "yolov5.models.yolo.Model": YOLOV5,
    "ultralytics.nn.tasks.DetectionModel": ULTRALYTICS, "ultralytics.nn.tasks.YOLOv10DetectionModel": ULTRALYTICS,
}
SUPPORTED_ULTRALYTICS_MAJOR = "8"
PRE_V6_LAYERS = ("Focus", "SPP", "BottleneckCSP")
MAX_DEPTH = 32  # real models nest a few levels deep; deeper records are refused as corrupt
# Settings that change a layer's output without appearing in any tensor, compared module by module.
CHECKED_ATTRS = {
    "Conv2d": ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups"),
    "BatchNorm2d": ("num_features", "eps"),
    "MaxPool2d": ("kernel_size", "stride", "padding", "dilation"),
    "Upsample": ("scale_factor", "mode"),
    "Bottleneck": ("add",),
    "PSABlock": ("add",),
    "Attention": ("num_heads", "key_dim", "head_dim", "scale"),
    "DFLDetect": ("nc", "reg_max"),
    "E2EDetect": ("nc", "reg_max"),
    "V10Detect": ("nc", "reg_max"),
    "CIB": ("add",),
    "SPPF": ("n", "add"),
    "Detect": ("nc", "na"),
}
# What a recorded module lacking the attribute behaves as: SPPF's pool count and residual add came
# with Ultralytics 8.4 (its forward reads them with these defaults); YOLOv5's SPPF has neither.
ATTR_DEFAULTS = {("SPPF", "n"): 3, ("SPPF", "add"): False}
HEAD_CLASSES = ("Detect", "v10Detect")  # Ultralytics' detection heads the importer reads
OUR_CLASSES = {"v10Detect": "V10Detect"}  # an Ultralytics class name -> ours, where they differ


@dataclass
class ForeignModel:
    """What a YOLOv5 / Ultralytics file holds, read the way its own loader reads it."""

    source: str
    package: str  # YOLOV5 or ULTRALYTICS
    version: str  # the package version the file names, or '' when it names none
    weights: str  # 'ema' or 'model': the entry the package itself would load
    yaml: dict[str, Any]  # the file's model yaml, as the package built the model
    names: list[str]
    tensors: dict[str, TensorRef]  # state dict order
    modules: dict[str, Recorded]  # named modules ('' is the model itself)
    imgsz: int
    epoch: int
    date: str

    @property
    def title(self) -> str:
        version = f" {self.version}" if self.version else ""
        return f"{PACKAGE_TITLES[self.package]}{version}"


def read_foreign(archive: Archive) -> ForeignModel:
    """Unpickle with the allow-list and pick out the model, names, yaml and metadata."""
    source = archive.source
    root = archive.load()
    if not isinstance(root, dict):
        raise UserError(f"{source}: not a YOLOv5 or Ultralytics checkpoint (the pickle holds a "
                        f"{type(root).__name__}, not a dict)")
    weights = "ema" if root.get("ema") is not None else "model"
    model = root.get(weights)
    package = MODEL_CLASSES.get(model.path) if isinstance(model, Recorded) else None
    if package is None:
        what = model.path if isinstance(model, Recorded) else type(model).__name__
        raise UserError(f"{source}: no detection model in its '{weights}' entry (found {what})")
    version = _version(root, package, source)
    yaml_dict = model.attr("yaml")
    if not isinstance(yaml_dict, dict):
        raise UserError(f"{source}: the model has no yaml dict to rebuild it from")
    modules = named_records(model, source)
    return ForeignModel(source, package, version, weights, plain(yaml_dict, source),
                        _names(model.attr("names"), yaml_dict.get("nc"), source), state_refs(modules, source),
                        modules, _imgsz(root, package, model), _int(root.get("epoch"), -1), str(root.get("date") or ""))


def _version(root: dict, package: str, source: str) -> str:
    """The package version; Ultralytics files from another major version than 8 are refused."""
    if package == YOLOV5:
        return str(root.get("yolov5pip_version") or "")
    version = root.get("version")
    if version is None:
        return ""
    if not isinstance(version, str) or version.split(".")[0] != SUPPORTED_ULTRALYTICS_MAJOR:
        raise UserError(f"{source}: written by Ultralytics {version}; only Ultralytics "
                        f"{SUPPORTED_ULTRALYTICS_MAJOR}.x checkpoints are supported")
    return version


def _int(v: Any, default: int) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def _imgsz(root: dict, package: str, model: Recorded) -> int:
    """The training image size (YOLOv5 ``opt``, Ultralytics ``train_args``), 640 when the file has none."""
    args = root.get("opt" if package == YOLOV5 else "train_args")
    if not isinstance(args, dict):
        args = model.attr("args") if isinstance(model.attr("args"), dict) else {}
    size = args.get("imgsz", 640)
    if isinstance(size, (list, tuple)) and size:
        size = max(size)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else 640


def _names(names: Any, nc: Any, source: str) -> list[str]:
    """Class names as a list: YOLOv5 7 and Ultralytics store {index: name}, older files a list."""
    if isinstance(names, dict) and set(names) == set(range(len(names))):
        names = [names[i] for i in range(len(names))]
    if not (isinstance(names, (list, tuple)) and all(isinstance(n, (str, int)) for n in names)):
        raise UserError(f"{source}: the model's class names are not a list or {{index: name}} dict")
    if isinstance(nc, int) and len(names) != nc:
        raise UserError(f"{source}: {len(names)} class names for nc={nc}")
    return [str(n) for n in names]


def named_records(model: Recorded, source: str) -> dict[str, Recorded]:
    """Every recorded module by its dotted name, in ``nn.Module.named_modules`` order."""
    out: dict[str, Recorded] = {}

    def walk(m: Recorded, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise UserError(f"{source}: corrupt checkpoint (modules nested deeper than {MAX_DEPTH})")
        out[prefix] = m
        children = m.attr("_modules", {})
        if not isinstance(children, dict):
            raise UserError(f"{source}: corrupt checkpoint (module '{prefix}' has no module table)")
        for name, child in children.items():
            if child is None:
                continue
            if not isinstance(child, Recorded):
                raise UserError(f"{source}: corrupt checkpoint (child '{prefix}.{name}' is a {type(child).__name__})")
            walk(child, f"{prefix}.{name}" if prefix else str(name), depth + 1)

    walk(model, "", 0)
    return out


def state_refs(modules: dict[str, Recorded], source: str) -> dict[str, TensorRef]:
    """The state dict ``nn.Module.state_dict`` would return: each module's parameters, then its
    persistent buffers, under its dotted name (modules in ``named_modules`` order)."""
    out: dict[str, TensorRef] = {}
    for prefix, m in modules.items():
        skip = m.attr("_non_persistent_buffers_set") or set()
        if not isinstance(skip, (set, frozenset)):
            raise UserError(f"{source}: corrupt checkpoint ('{prefix}' has no set of non-persistent buffers)")
        for table in ("_parameters", "_buffers"):
            entries = m.attr(table, {})
            if not isinstance(entries, dict):
                raise UserError(f"{source}: corrupt checkpoint ('{prefix}' has no {table} table)")
            for name, t in entries.items():
                if t is None or (table == "_buffers" and name in skip):
                    continue
                key = f"{prefix}.{name}" if prefix else str(name)
                if not isinstance(t, TensorRef):
                    raise UserError(f"{source}: corrupt checkpoint ('{key}' is a {type(t).__name__}, not a tensor)")
                out[key] = t
    return out


# ----------------------------------------------------------------------------------------------
# the file's yaml -> ours


def our_yaml(fm: ForeignModel, archive: Archive) -> dict[str, Any]:
    """The file's model yaml in our registry's terms (models/parse.py)."""
    d = plain(fm.yaml, fm.source)
    rows = [r for key in ("backbone", "head") for r in (d.get(key) or []) if isinstance(r, list) and len(r) == 4]
    old = sorted({r[2] for r in rows if r[2] in PRE_V6_LAYERS})
    if fm.package == YOLOV5 and old:
        raise UserError(f"{fm.source}: a YOLOv5 model from before release v6.0 ({', '.join(old)} layers); "
                        "only v6.0 and later architectures are supported")
    head_name, head = _head(fm)
    if fm.package == YOLOV5:
        d["anchors"] = _anchors_px(fm, archive, head_name)
        return d
    for key in ("yaml_file", "channels"):
        value = d.pop(key, None)
        if key == "channels" and value is not None:
            d.setdefault("ch", value)
    if "scales" in d and not d.get("scale"):
        d["scale"] = _scale(fm, d["scales"])
    last = d["head"][-1] if isinstance(d.get("head"), list) and d["head"] else None
    if not (isinstance(last, list) and len(last) == 4 and last[2] in HEAD_CLASSES and isinstance(last[3], list)):
        raise UserError(f"{fm.source}: the model's last row is not a Detect head ({last!r:.80})")
    if last[2] == "v10Detect":  # always end-to-end, reg_max 16 and depthwise class branch (check_modules compares)
        last[3] = [last[3][0] if last[3] else "nc"]
        return d
    reg_max = _int(head.attr("reg_max"), 16)
    e2e = _is_end2end(head)
    if e2e:  # YOLO26: the end-to-end head; its yaml's end2end / reg_max keys are ours too
        d["end2end"], d["reg_max"] = True, reg_max
    last[2] = "E2EDetect" if e2e else "DFLDetect"
    last[3] = [last[3][0] if last[3] else "nc", reg_max, _depthwise_cls(fm, head_name)]
    return d


def _scale(fm: ForeignModel, scales: dict) -> str:
    """The size of a ``scales`` yaml that records none (or ''): the letter in its file name, else its only
    size (Ultralytics reads 'yolov10b.yaml' with no letter it knows, then takes the one scale listed)."""
    m = SIZE_IN_NAME.search(Path(str(fm.yaml.get("yaml_file", ""))).stem)
    if m is not None and m.group(1) in scales:
        return m.group(1)
    if len(scales) == 1:
        return str(next(iter(scales)))
    raise UserError(f"{fm.source}: its model yaml has scales but names no scale")


def _is_end2end(head: Recorded) -> bool:
    """An Ultralytics 8.4 end-to-end Detect: it holds the one-to-one branches (YOLO26's ``end2end``)."""
    return head.attr("_modules", {}).get("one2one_cv2") is not None


def _yaml_name(fm: ForeignModel) -> str:
    """The model yaml's file name as the package recorded it (Ultralytics in the yaml, YOLOv5 beside it)."""
    name = fm.yaml.get("yaml_file") or fm.modules[""].attr("yaml_file")
    return Path(name).name if isinstance(name, str) and name else "its model yaml"


def _head(fm: ForeignModel) -> tuple[str, Recorded]:
    """The detection head: the model's last layer, a recorded Detect."""
    layers = [k for k in fm.modules if k.count(".") == 1 and k.startswith("model.")]
    name = layers[-1] if layers else ""
    head = fm.modules.get(name)
    if head is None or head.path.rsplit(".", 1)[-1] not in HEAD_CLASSES:
        raise UserError(f"{fm.source}: the model's last layer is not a Detect head "
                        f"({head.path if head is not None else 'no layers'})")
    return name, head


def _depthwise_cls(fm: ForeignModel, head_name: str) -> bool:
    """YOLO11's class branch starts with a (DWConv, Conv) pair; YOLOv8's and YOLOv5u's with a Conv.
    Ultralytics decides it with a class attribute, which no pickle holds, so read the structure."""
    first = fm.modules.get(f"{head_name}.cv3.0.0")
    return first is not None and first.path.endswith(".Sequential")


def _anchors_px(fm: ForeignModel, archive: Archive, head_name: str) -> list[list[float]]:
    """YOLOv5's trained anchors in pixels: the head's buffer (grid units, what autoanchor left) x stride."""
    anchors, stride = fm.tensors.get(f"{head_name}.anchors"), fm.modules[head_name].attr("stride")
    if anchors is None or not isinstance(stride, TensorRef):
        raise UserError(f"{fm.source}: the Detect head has no anchors buffer or stride")
    a, s = archive.tensor(anchors), archive.tensor(stride)
    if a.dim() != 3 or a.shape[-1] != 2 or s.shape != (a.shape[0],):
        raise UserError(f"{fm.source}: anchors of shape {tuple(a.shape)} do not fit strides {tuple(s.shape)}")
    return [[float(v) for v in level] for level in (a * s.view(-1, 1, 1)).view(a.shape[0], -1)]


# ----------------------------------------------------------------------------------------------
# building ours and accounting for every tensor


def build_model(fm: ForeignModel, archive: Archive) -> tuple[Model, dict[str, torch.Tensor]]:
    """Our model built from the file's yaml, and the file's weights under our names (fp32)."""
    d = our_yaml(fm, archive)
    try:
        model = Model(d)
    except UserError as e:
        raise UserError(f"{fm.source}: {_yaml_name(fm)} is not a model yolotrain can build: {e}") from None
    check_modules(fm, model)
    head_name, head = _head(fm)
    tensors = dict(fm.tensors)
    stride = head.attr("stride")
    stride_key = f"{head_name}.stride"
    if stride_key not in tensors and isinstance(stride, TensorRef):
        tensors[stride_key] = stride
    own = model.state_dict()
    missing = [k for k in own if k not in tensors]
    unexpected = [k for k in tensors if k not in own]
    if missing or unexpected:
        parts = ([f"missing {_listed(missing)}"] if missing else []) + \
                ([f"unexpected {_listed(unexpected)}"] if unexpected else [])
        raise UserError(f"{fm.source}: its tensors do not match the model built from its yaml: " + "; ".join(parts))
    state = {}
    for key, ref in own.items():
        if tensors[key].shape != ref.shape:
            raise UserError(f"{fm.source}: tensor {key} has shape {tuple(tensors[key].shape)} in the file but "
                            f"{tuple(ref.shape)} in the model built from its yaml")
        t = archive.tensor(tensors[key])
        state[key] = t.to(ref.dtype) if t.dtype != ref.dtype else t
    if not torch.equal(state[stride_key], model.stride):
        raise UserError(f"{fm.source}: strides {state[stride_key].tolist()} in the file, {model.stride.tolist()} "
                        "measured on the model built from its yaml")
    model.load_state_dict(state, strict=True)
    return model.eval(), state


def _listed(keys: list[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f" and {len(keys) - n} more" if len(keys) > n else "")


def _our_class(fm: ForeignModel, recorded: Recorded) -> str:
    name = recorded.path.rsplit(".", 1)[-1]
    if name in ("DetectionModel", "Model", "YOLOv10DetectionModel"):
        return "Model"
    if name == "Detect" and fm.package == ULTRALYTICS:
        return "E2EDetect" if _is_end2end(recorded) else "DFLDetect"
    return OUR_CLASSES.get(name, name)


def check_modules(fm: ForeignModel, model: nn.Module) -> None:
    """Same modules, classes and output-shaping settings on both sides (see CHECKED_ATTRS)."""
    ours = dict(model.named_modules())
    missing = [k for k in ours if k not in fm.modules]
    unexpected = [k for k in fm.modules if k not in ours]
    if missing or unexpected:
        parts = ([f"only yolotrain's has {_listed(missing)}"] if missing else []) + \
                ([f"only the file's has {_listed(unexpected)}"] if unexpected else [])
        raise UserError(f"{fm.source}: the layers differ from the model built from its yaml: " + "; ".join(parts))
    for name, rec in fm.modules.items():
        mine = ours[name]
        kind = type(mine).__name__
        if kind != _our_class(fm, rec):
            raise UserError(f"{fm.source}: layer '{name}' is {rec.path} in the file but {kind} in the model "
                            "built from its yaml")
        for attr in CHECKED_ATTRS.get(kind, ()):
            theirs = _plain_attr(rec.attr(attr, ATTR_DEFAULTS.get((kind, attr))))
            own = _plain_attr(getattr(mine, attr, None))
            if not _same(theirs, own):
                raise UserError(f"{fm.source}: layer '{name}' ({kind}) has {attr}={theirs!r} in the file but "
                                f"{own!r} in the model built from its yaml")


def _plain_attr(v: Any) -> Any:
    return tuple(v) if isinstance(v, (list, tuple)) else v


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return a == b


def plain(value: Any, where: str) -> Any:
    """A copy of a yaml dict in plain types (tuples become lists): what our parser reads and
    weights_only saves; anything else in it (a recorded object, a tensor) is refused."""
    if isinstance(value, dict):
        return {str(k): plain(v, where) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, where) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise UserError(f"{where}: the model yaml holds a {type(value).__name__}, which no model yaml has")


def convert(path: str | Path) -> tuple[dict[str, Any], ForeignModel]:
    """A yolotrain checkpoint dict (model_yaml, model, ema, names, args, converted_from) from a
    YOLOv5 / Ultralytics file; ``model`` and ``ema`` are the same tensors: the weights the
    file's own loader would use."""
    archive = Archive(path)
    try:
        fm = read_foreign(archive)
        model, state = build_model(fm, archive)
    finally:
        archive.close()
    ckpt = {
        "epoch": -1,
        "model_yaml": plain(model.yaml, fm.source),
        "model": state,
        "ema": state,
        "names": fm.names,
        "args": {"imgsz": fm.imgsz},
        "converted_from": {"file": str(Path(path).resolve()), "package": fm.package, "version": fm.version,
                           "weights": fm.weights, "epoch": fm.epoch, "date": fm.date},
    }
    return ckpt, fm
