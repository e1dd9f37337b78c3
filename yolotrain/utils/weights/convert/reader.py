"""Reading YOLOv5 and Ultralytics ``.pt`` files without running them.

Both packages save checkpoints with ``torch.save`` of whole model objects, so the usual
``torch.load(weights_only=False)`` imports their classes and calls whatever the pickle names: a
crafted file runs any code it likes. This reader never does that:

- the zip is opened with ``zipfile`` and ``data.pkl`` unpickled by ``RestrictedUnpickler``, whose
  ``find_class`` (the one door through which a pickle reaches a callable) answers only from the
  allow-list below and refuses everything else, naming it;
- the model classes of the two packages (and the few ``torch.nn`` ones they contain) become
  ``Recorded`` stand-ins that keep the arguments and state the pickle hands them and do nothing
  else: no package is imported, no method of theirs runs;
- tensors become ``TensorRef`` records (storage key, offset, size, stride) checked against their
  storage's length; bytes are read from ``data/<key>`` only when a tensor is materialised.

What the records mean (which tensors form the model, its yaml, names) is ``foreign.py``'s job.
"""
from __future__ import annotations

import collections
import io
import math
import pickle
import pickletools
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from yolotrain.utils.core.errors import UserError

# torch.nn classes found inside the detection models of both packages.
TORCH_NN = {
    "torch.nn.modules.conv": {"Conv2d"},
    "torch.nn.modules.batchnorm": {"BatchNorm2d"},
    "torch.nn.modules.activation": {"SiLU"},
    "torch.nn.modules.container": {"Sequential", "ModuleList"},
    "torch.nn.modules.pooling": {"MaxPool2d"},
    "torch.nn.modules.upsampling": {"Upsample"},
    "torch.nn.modules.linear": {"Identity"},
}
# YOLOv5 7.x: a git checkout pickles models.yolo / models.common, the PyPI package yolov5.models.*.
# Focus, SPP and BottleneckCSP are the layers of releases before v6.0: read, then named as unsupported.
YOLOV5_YOLO = {"DetectionModel", "Model", "Detect"}
YOLOV5_COMMON = {"Conv", "C3", "Bottleneck", "SPPF", "Concat", "Focus", "SPP", "BottleneckCSP"}
YOLOV5_PREFIXES = ("", "yolov5.")
# Ultralytics 8.x: layers live in ultralytics.nn.modules.{conv,block,head} (one flat module in early 8.0 releases).
# YOLOv10DetectionModel is the model class of YOLOv10 files written before Ultralytics 8.4 (8.4: DetectionModel).
ULTRALYTICS_TASKS = {"DetectionModel", "YOLOv10DetectionModel"}
ULTRALYTICS_LAYERS = {"Conv", "DWConv", "Concat", "Bottleneck", "C2f", "C3", "C3k", "C3k2", "C2PSA", "PSABlock",
                      "Attention", "SPPF", "DFL", "Detect", "SCDown", "RepVGGDW", "CIB", "C2fCIB", "PSA", "v10Detect"}
ULTRALYTICS_LAYER_MODULES = ("ultralytics.nn.modules", "ultralytics.nn.modules.conv", "ultralytics.nn.modules.block",
                             "ultralytics.nn.modules.head")
# Metadata beside the model (training arguments, YOLOv5's best_fitness array): recorded, never used.
METADATA = {("ultralytics.utils", "IterableSimpleNamespace"), ("ultralytics.yolo.utils", "IterableSimpleNamespace"),
            ("numpy", "ndarray"), ("numpy", "dtype"),
            *((f"numpy.{core}.multiarray", name) for core in ("core", "_core") for name in ("_reconstruct", "scalar"))}
FOREIGN_PACKAGES = ("models.", "yolov5.", "ultralytics.")

STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8, "BoolStorage": torch.bool,
    "UntypedStorage": torch.uint8,
}


class Recorded:
    """An inert stand-in for a class named in the file: it keeps what the pickle hands it (constructor
    arguments, then the state of BUILD, i.e. a module's ``__dict__``) and has no other behaviour."""

    path: ClassVar[str] = ""

    def __new__(cls, *args: Any, **kwargs: Any) -> Recorded:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def attr(self, name: str, default: Any = None) -> Any:
        """An attribute of the recorded object (an entry of its pickled ``__dict__``)."""
        return self.state.get(name, default) if isinstance(self.state, dict) else default

    def __repr__(self) -> str:
        return f"<recorded {self.path}>"


class Sealed:
    """A record the reader makes itself: BUILD (``__setstate__``) may not change it after its checks."""

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"the pickle tries to modify a {type(self).__name__}")


@dataclass(frozen=True)
class StorageKind(Sealed):
    """What ``torch.HalfStorage`` and the like stand for in a storage record: the element type."""

    dtype: torch.dtype


@dataclass(frozen=True)
class StorageRef(Sealed):
    """One ``data/<key>`` record of the zip: ``numel`` elements of ``dtype``."""

    key: str
    dtype: torch.dtype
    numel: int


@dataclass(frozen=True)
class TensorRef(Sealed):
    """A tensor as the pickle describes it: a strided view of a storage, checked to lie inside it."""

    storage: StorageRef
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.size)


class ReadError(UserError):
    """The file is not a checkpoint this reader can read (not a zip, truncated, corrupt)."""

    def __init__(self, source: str, reason: str) -> None:
        super().__init__(f"{source}: {reason}")
        self.reason = reason


class Refused(UserError):
    """The pickle names something outside the allow-list: nothing of it was run."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_tuple(v: Any) -> tuple[int, ...] | None:
    return tuple(v) if isinstance(v, tuple) and all(_is_int(x) for x in v) else None


def _rebuild_tensor(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> TensorRef:
    """Stands in for ``torch._utils._rebuild_tensor_v2``: validates, reads nothing."""
    size_t, stride_t = _int_tuple(size), _int_tuple(stride)
    if not (isinstance(storage, StorageRef) and _is_int(offset) and size_t is not None and stride_t is not None
            and len(size_t) == len(stride_t) and offset >= 0 and min(size_t + stride_t, default=0) >= 0):
        raise pickle.UnpicklingError("malformed tensor record")
    if 0 not in size_t and offset + sum((n - 1) * s for n, s in zip(size_t, stride_t)) >= storage.numel:
        raise pickle.UnpicklingError(f"tensor of size {size_t} does not fit its storage '{storage.key}'")
    return TensorRef(storage, offset, size_t, stride_t)


def _rebuild_parameter(data: Any, *rest: Any) -> TensorRef:
    """Stands in for ``torch._utils._rebuild_parameter(_with_state)``: a parameter is its tensor here."""
    if not isinstance(data, TensorRef):
        raise pickle.UnpicklingError("malformed parameter record")
    return data


def _encode(text: Any, encoding: Any = "latin1") -> bytes:
    """Stands in for ``_codecs.encode``, which protocol-2 pickles use to carry bytes as latin-1 text."""
    if not (isinstance(text, str) and encoding in ("latin1", "latin-1")):
        raise pickle.UnpicklingError("malformed bytes record")
    return text.encode("latin1")


def _size(dims: Any = ()) -> tuple[int, ...]:
    """Stands in for ``torch.Size``: a tuple of ints."""
    out = _int_tuple(tuple(dims)) if isinstance(dims, (tuple, list)) else None
    if out is None:
        raise pickle.UnpicklingError("malformed torch.Size")
    return out


SAFE_CALLABLES: dict[tuple[str, str], Any] = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("__builtin__", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("__builtin__", "frozenset"): frozenset,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch", "Size"): _size,
    ("_codecs", "encode"): _encode,
}
_STANDINS: dict[tuple[str, str], type[Recorded]] = {}


def is_allowed_class(module: str, name: str) -> bool:
    """Whether (module, name) gets a stand-in: a class of the two packages' detection models, or of the
    metadata saved beside them."""
    if name in TORCH_NN.get(module, ()):
        return True
    for prefix in YOLOV5_PREFIXES:
        if (module == f"{prefix}models.yolo" and name in YOLOV5_YOLO
                or module == f"{prefix}models.common" and name in YOLOV5_COMMON):
            return True
    if module == "ultralytics.nn.tasks" and name in ULTRALYTICS_TASKS:
        return True
    return module in ULTRALYTICS_LAYER_MODULES and name in ULTRALYTICS_LAYERS or (module, name) in METADATA


def is_tensor_plumbing(module: str, name: str) -> bool:
    """Whether (module, name) is one of the containers and tensor rebuilders any torch.save file uses."""
    return (module, name) in SAFE_CALLABLES or (module == "torch" and name in STORAGE_DTYPES)


def standin(module: str, name: str) -> type[Recorded]:
    """The stand-in class for an allowed (module, name), one per pair so the records say what they were."""
    key = (module, name)
    if key not in _STANDINS:
        _STANDINS[key] = type(name, (Recorded,), {"path": f"{module}.{name}", "__module__": __name__})
    return _STANDINS[key]


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles only from the allow-list; storages are resolved against the archive's records."""

    def __init__(self, data: bytes, records: dict[str, int], source: str) -> None:
        super().__init__(io.BytesIO(data))
        self.records, self.source = records, source
        self.storages: dict[str, StorageRef] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in SAFE_CALLABLES:
            return SAFE_CALLABLES[(module, name)]
        if module == "torch" and name in STORAGE_DTYPES:
            return StorageKind(STORAGE_DTYPES[name])
        if is_allowed_class(module, name):
            return standin(module, name)
        what = f"{module}.{name}"
        if module.startswith(FOREIGN_PACKAGES):
            raise Refused(f"{self.source}: refused: its pickle names {what}, which is not part of the detection "
                          "models yolotrain reads (YOLOv5 v6+ and Ultralytics YOLOv8, YOLO11, YOLO26, YOLOv10, "
                          "YOLOv5u); nothing in the file was run")
        raise Refused(f"{self.source}: refused: its pickle asks for {what}, which no YOLOv5 or Ultralytics "
                      "detection checkpoint contains (a tampered or unrelated file?); nothing in the file was run")

    def persistent_load(self, pid: Any) -> StorageRef:
        """A ('storage', kind, key, location, numel) record: the key must name a data record of that size."""
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], StorageKind)
                and isinstance(pid[2], str) and _is_int(pid[4]) and pid[4] >= 0):
            raise pickle.UnpicklingError(f"unexpected persistent record {pid!r:.80}")
        _, kind, key, _location, numel = pid
        nbytes = self.records.get(key)
        expected = numel * torch.empty((), dtype=kind.dtype).element_size()
        if nbytes is None or nbytes != expected:
            raise pickle.UnpicklingError(f"storage '{key}' should hold {expected} bytes, the archive has "
                                         f"{'none' if nbytes is None else nbytes}")
        ref = self.storages.setdefault(key, StorageRef(key, kind.dtype, numel))
        if ref.dtype != kind.dtype:
            raise pickle.UnpicklingError(f"storage '{key}' is read as two element types")
        return ref


class Archive:
    """A torch zip checkpoint opened for reading: ``load()`` the pickle, then ``tensor()`` what is needed.

    torch.save writes ``<name>/data.pkl``, ``<name>/data/<key>`` (raw storage bytes),
    ``<name>/byteorder`` and ``<name>/version`` (<name> is the saved file's stem, or 'archive').
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.source = str(path)
        try:
            self.zip = zipfile.ZipFile(self.path)
            names = self.zip.namelist()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise ReadError(self.source, f"not a PyTorch zip checkpoint, or truncated ({e})") from None
        pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            found = "TorchScript" if any(n.endswith("/constants.pkl") for n in names) else "no data.pkl"
            raise ReadError(self.source, f"not a torch.save checkpoint ({found})")
        self.prefix = pickles[0][: -len("data.pkl")]
        if any(info.compress_type != zipfile.ZIP_STORED for info in self.zip.infolist()):
            # torch.save stores records uncompressed; refusing others bounds every read by the file's size
            raise ReadError(self.source, "compressed zip records: not a file torch.save wrote")
        order = self._text("byteorder")
        if order not in (None, "little"):
            raise ReadError(self.source, f"written with byte order '{order}'; only little-endian files are read")
        data_dir = f"{self.prefix}data/"
        self.records = {n[len(data_dir):]: self.zip.getinfo(n).file_size for n in names
                        if n.startswith(data_dir) and "/" not in n[len(data_dir):]}
        self._cache: dict[str, torch.Tensor] = {}

    def _text(self, name: str) -> str | None:
        try:
            return self.zip.read(self.prefix + name).decode("ascii", "replace").strip()
        except KeyError:
            return None
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise ReadError(self.source, f"truncated or corrupt ({e})") from None

    def raw_pickle(self) -> bytes:
        try:
            return self.zip.read(self.prefix + "data.pkl")
        except (zipfile.BadZipFile, OSError, EOFError, zipfile.LargeZipFile) as e:
            raise ReadError(self.source, f"truncated or corrupt ({e})") from None

    def load(self) -> Any:
        """The unpickled object tree: plain containers, Recorded stand-ins and TensorRefs."""
        unpickler = RestrictedUnpickler(self.raw_pickle(), self.records, self.source)
        try:
            return unpickler.load()
        except Refused:
            raise
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
                RecursionError, MemoryError) as e:
            raise ReadError(self.source, f"corrupt checkpoint pickle ({type(e).__name__}: {e})") from None

    def tensor(self, ref: TensorRef) -> torch.Tensor:
        """The tensor a TensorRef describes, as a fresh CPU tensor; fp16/bf16 become fp32.

        The view is checked again against the storage actually read, and may not hold more
        elements than it (no expanded views: a model's weights never are one), so no record can
        make this read outside its storage or allocate more than the file holds."""
        raw = self._storage(ref.storage)
        n = math.prod(ref.size)
        end = ref.offset + sum((d - 1) * s for d, s in zip(ref.size, ref.stride))
        if n and (n > raw.numel() or end >= raw.numel() or min(ref.stride, default=0) < 0 or ref.offset < 0):
            raise ReadError(self.source, f"a tensor of size {ref.size} does not fit its storage '{ref.storage.key}'")
        t = torch.as_strided(raw, ref.size, ref.stride, ref.offset).clone()
        return t.float() if t.is_floating_point() and t.dtype != torch.float64 else t

    def _storage(self, ref: StorageRef) -> torch.Tensor:
        if ref.key not in self._cache:
            try:
                data = self.zip.read(f"{self.prefix}data/{ref.key}")
            except (zipfile.BadZipFile, OSError, EOFError, KeyError) as e:
                raise ReadError(self.source, f"storage '{ref.key}' is unreadable ({e})") from None
            buf = torch.frombuffer(bytearray(data), dtype=ref.dtype) if data else torch.empty(0, dtype=ref.dtype)
            if buf.numel() != ref.numel:
                raise ReadError(self.source, f"storage '{ref.key}' has {buf.numel()} elements, not {ref.numel}")
            self._cache[ref.key] = buf
        return self._cache[ref.key]

    def close(self) -> None:
        self.zip.close()


def globals_named(data: bytes) -> set[tuple[str, str]]:
    """The (module, name) pairs a pickle refers to, read from its opcodes without unpickling it
    (GLOBAL and the string pair before STACK_GLOBAL; memoised strings are not followed)."""
    out, strings = set(), []
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name == "GLOBAL":
                module, _, name = str(arg).partition(" ")
                out.add((module, name))
            elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE", "BINUNICODE8"):
                strings.append(arg)
            elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
                out.add((strings[-2], strings[-1]))
    except (ValueError, EOFError, pickle.UnpicklingError):
        pass  # a truncated pickle: what was seen so far
    return out
