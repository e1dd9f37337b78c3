"""One way to run a detector, whatever file it comes from: a yolotrain checkpoint, ONNX or TorchScript.

A ``Backend`` is called like a ``Model`` in eval mode: images (B, 3, H, W), float in [0, 1] (or
uint8 0-255), -> ``(decoded, raw)``, where ``decoded`` is the head's (B, N, 4 + nc) form (box
centre and size in input pixels, one score per class; models/heads/base.py), or for an
end-to-end model (``backend.end2end``, from the head or the export's metadata) its final
detections (B, max_det, 6), and ``raw`` the per-level outputs, which only a checkpoint has
(exported graphs end at the decoding). So ``evaluate_model`` (val.py) and detect.py's
``Predictor`` run every backend through the same post-processing (``yolotrain.utils.core.boxes.postprocess``)
and unletterboxing code. ``backend.meta`` says what the network needs and what it predicts.

Input shapes: a checkpoint and a ``--dynamic`` export take any batch and any stride-multiple
size. A fixed-shape export takes exactly ``meta.batch`` x 3 x ``meta.imgsz`` x ``meta.imgsz``:
callers must letterbox to that square size (no rect batches; ``input_rule`` says so), and the
backend runs a smaller or larger batch as padded chunks of ``meta.batch`` images.
"""
from __future__ import annotations

import importlib
import json
import subprocess
import warnings
from dataclasses import asdict, dataclass, fields, replace
from importlib import metadata
from pathlib import Path
from types import ModuleType

import numpy as np
import torch
from torch import nn

from yolotrain.models.yolo import Model
from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import CHECKOUT, ROOT
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.weights.checkpoint import load_model

META_KEY = "yolotrain"  # ONNX metadata_props key / TorchScript extra file holding ModelMeta as JSON
META_FILE = "yolotrain.json"
META_VERSION = 1
FORMATS = {"onnx": ".onnx", "torchscript": ".torchscript"}  # export.py --include name -> file suffix (YOLOv5's)
EXPORT_SUFFIXES = {suffix: fmt for fmt, suffix in FORMATS.items()}  # the reverse: what a file is
EXPORT_PACKAGES = "pip install -r requirements-export.txt"
ORT_ELEMENT_TYPES = {torch.float32: np.float32, torch.float16: np.float16}  # IOBinding's input element types


@dataclass(frozen=True)
class ModelMeta:
    """What a detector file says about itself; exported files carry it, detect.py and val.py read it."""

    names: tuple[str, ...]
    stride: int  # the largest stride: input sides must be multiples of it
    imgsz: int  # training size (checkpoint) or the exported input side
    family: str  # its head's family (Head.family): "anchor-based", "anchor-free" or "end-to-end"
    end2end: bool = False  # outputs final (B, max_det, 6) detections, no NMS; files written without the key: False
    max_det: int | None = None  # an end-to-end model's detections per image (its head's top-k)
    format: str = "pytorch"  # "pytorch", "onnx" or "torchscript"
    dynamic: bool = True  # any batch and size; False: exactly batch x 3 x imgsz x imgsz
    batch: int | None = None  # the fixed batch of a fixed-shape export
    half: bool = False  # FP16 inputs and weights (CUDA exports)
    data: str | None = None  # the dataset yaml it was trained on: val.py's default --data
    single_cls: bool = False
    epoch: int = -1  # last finished epoch (0-based) of the checkpoint
    val_precision: str = "fp32"  # a checkpoint's validation in training under --amp: "bf16" (CPU), "fp16" (CUDA)
    source: str = ""  # the checkpoint an export was made from
    version: str = ""  # yolotrain's commit that wrote the export
    meta_version: int = META_VERSION

    @property
    def nc(self) -> int:
        return len(self.names)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "names": list(self.names)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> ModelMeta:
        """Parse and check exported metadata; UserError naming the file when absent or incomplete."""
        try:
            d = json.loads(text)
        except (TypeError, ValueError):
            d = None
        if not isinstance(d, dict):
            raise UserError(f"{where}: its yolotrain metadata is not valid JSON")
        required = ("names", "stride", "imgsz", "family", "format", "dynamic")
        missing = [k for k in required if k not in d]
        if missing:
            raise UserError(f"{where}: its yolotrain metadata lacks {', '.join(missing)}")
        known = {f.name for f in fields(cls)}
        d = {k: v for k, v in d.items() if k in known}  # keys of a newer version are ignored
        d["family"] = OLD_FAMILY_WORDS.get((d["family"], bool(d.get("end2end"))), d["family"])
        names = d["names"]
        if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
            raise UserError(f"{where}: its yolotrain metadata has no class names")
        return cls(**{**d, "names": tuple(names)})

    def input_rule(self) -> str:
        """How inputs must be shaped, in words, for messages and logs."""
        if self.dynamic:
            return f"any batch, sides multiples of {self.stride}"
        return f"exactly {self.batch} x 3 x {self.imgsz} x {self.imgsz} (fixed-shape export: square letterbox, no rect)"


# files exported before the metadata used the heads' word: "anchor" was anchor-based, "anchor-free" covered the
# end-to-end heads too (their end2end key tells them apart)
OLD_FAMILY_WORDS = {("anchor", False): "anchor-based", ("anchor-free", True): "end-to-end"}


def yolotrain_version() -> str:
    """The checkout's commit (``git describe --always --dirty``), or the installed package's version."""
    if not CHECKOUT:
        try:
            return metadata.version("yolotrain")
        except metadata.PackageNotFoundError:
            return "unknown"
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def require(package: str, purpose: str) -> ModuleType:
    """Import an optional package, or a UserError naming it and how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError:
        raise UserError(f"{purpose} needs the '{package}' package: {EXPORT_PACKAGES} "
                        f"(or pip install {package})") from None


class Backend(nn.Module):
    """A detector called like an eval-mode ``Model``: images -> ``(decoded, raw)``; see the module docstring."""

    def __init__(self, meta: ModelMeta) -> None:
        super().__init__()
        self.meta = meta

    @property
    def end2end(self) -> bool:
        """Whether the output is final detections (post-processing selects, no NMS): what evaluate_model and
        Predictor read, as they read a Model's."""
        return self.meta.end2end

    def configure(self, end2end: bool | None = None, max_det: int | None = None) -> None:
        """Apply --end2end/--no-end2end (None: the model's own mode) and, for an end-to-end checkpoint, the
        head's top-k ``max_det``; an exported graph has one fixed mode (see ExportedBackend)."""
        raise NotImplementedError

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        raise NotImplementedError


class TorchBackend(Backend):
    """A yolotrain checkpoint's model (EMA weights), BN folded, on its device."""

    def __init__(self, model: Model, meta: ModelMeta) -> None:
        super().__init__(meta)
        self.model = model
        model.detect.raw_for_loss = False  # inference computes no loss: a head skips what only the loss reads
        self.configure()  # meta's end2end and max_det are the head's

    @classmethod
    def from_checkpoint(cls, weights: str | Path, device: torch.device) -> TorchBackend:
        model, card = load_model(weights, device)
        meta = ModelMeta(names=card.names, stride=int(model.stride.max()), imgsz=card.imgsz, family=model.detect.family,
                         data=card.data, single_cls=card.single_cls, epoch=card.epoch, source=str(weights),
                         val_precision=card.val_precision)
        return cls(model.fuse(), meta)

    def configure(self, end2end: bool | None = None, max_det: int | None = None) -> None:
        """Set the head's mode (and an end-to-end head's ``max_det``) and keep ``meta`` in step with it, so
        what an export records is what its graph does. UserError naming the file for a head with no
        end-to-end output asked for one."""
        head = self.model.detect
        if end2end is not None:
            if end2end and not head.supports_end2end:
                raise UserError(f"{self.meta.source}: --end2end: its {type(head).__name__} head has no end-to-end "
                                "(NMS-free) output; drop the flag (its detections go through NMS)")
            head.set_end2end(end2end)
        if head.end2end and max_det is not None:
            head.max_det = int(max_det)
        self.meta = replace(self.meta, end2end=bool(head.end2end),
                            max_det=int(head.max_det) if head.end2end else None)

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if images.dtype == torch.uint8:  # to the weights' precision, as evaluate_model and Predictor do
            images = images.to(next(self.model.parameters()).dtype).div_(255)
        return self.model(images)


class ExportedBackend(Backend):
    """An exported graph: fixed precision and layout (``.to``/``.half`` leave it as written), fixed or
    dynamic input shape; outputs come back as float tensors on the images' device."""

    def __init__(self, meta: ModelMeta, path: str | Path) -> None:
        super().__init__(meta)
        self.path = str(path)

    def _apply(self, fn, recurse: bool = True) -> ExportedBackend:
        return self

    def configure(self, end2end: bool | None = None, max_det: int | None = None) -> None:
        """A graph ends where it was exported: a flag asking for the other mode is a UserError naming the file
        (re-export instead). ``max_det`` is left to post-processing, which caps the graph's rows."""
        m = self.meta
        if end2end is not None and end2end != m.end2end:
            mode = f"end-to-end (NMS-free, {m.max_det} detections per image)" if m.end2end else \
                "with decoded outputs for NMS"
            raise UserError(f"{self.path}: --{'' if end2end else 'no-'}end2end: this file was exported {mode} and "
                            "runs only that way; drop the flag, or export the checkpoint again with "
                            f"{tool_command('export')} --{'' if end2end else 'no-'}end2end")

    def run(self, images: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, images: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = images.to(torch.float16 if self.meta.half else torch.float32).contiguous()
        if images.dtype == torch.uint8:  # a copy was made above: dividing in place is safe
            x = x.div_(255)
        m = self.meta
        if m.dynamic:
            return self.run(x).float(), []
        if tuple(x.shape[1:]) != (3, m.imgsz, m.imgsz):
            raise UserError(f"{self.path} takes {m.input_rule()}; got input {tuple(x.shape)}")
        outs = []
        for chunk in x.split(m.batch):  # a fixed batch: run padded chunks, keep the real rows
            n = chunk.shape[0]
            if n < m.batch:
                chunk = torch.cat([chunk, chunk.new_zeros((m.batch - n, *chunk.shape[1:]))])
            outs.append(self.run(chunk)[:n])
        return torch.cat(outs).float(), []


class OnnxBackend(ExportedBackend):
    """An ONNX file run by ONNX Runtime (CUDA provider when asked for and installed, else CPU). On the CUDA
    provider a CUDA input is run through IOBinding (``run_bound``): input and output stay on the GPU."""

    def __init__(self, path: str | Path, device: torch.device) -> None:
        ort = require("onnxruntime", f"running {path}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # the rank's share of the cores (utils/core/cores.set_cpu_threads)
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        # its idle threads sleep: spinning between runs takes the cores from torch's pre- and post-processing
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        providers = ["CPUExecutionProvider"]
        if device.type == "cuda":
            if "CUDAExecutionProvider" in ort.get_available_providers():
                providers.insert(0, ("CUDAExecutionProvider", {"device_id": device.index or 0}))
            else:
                LOGGER.warning(f"WARNING: {path}: onnxruntime has no CUDA provider here (pip install "
                               "onnxruntime-gpu); running on CPU")
        try:
            session = ort.InferenceSession(str(path), sess_options=options, providers=providers)
        except Exception as e:  # onnxruntime raises its own types for a broken or foreign file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{path}: not a readable ONNX model ({first})") from None
        text = session.get_modelmeta().custom_metadata_map.get(META_KEY)
        if text is None:
            raise UserError(f"{path}: no yolotrain metadata (class names, stride, image size); export it "
                            f"with: {tool_command('export')} --weights best.pt --include onnx")
        super().__init__(ModelMeta.from_json(text, str(path)), path)
        self.session, self.input_name = session, session.get_inputs()[0].name
        self.output_name = session.get_outputs()[0].name

    def binds_on_device(self, device: torch.device) -> bool:
        """IOBinding only when both the session runs on ONNX Runtime's CUDA provider and the input is a CUDA
        tensor: then the graph reads and writes device memory directly, with no host round trip per batch.
        Anything else (CPU provider, CPU input, a CUDA run that fell back to the CPU) keeps the plain path."""
        return device.type == "cuda" and "CUDAExecutionProvider" in self.session.get_providers()

    def run(self, images: torch.Tensor) -> torch.Tensor:
        if self.binds_on_device(images.device):
            return self.run_bound(images)
        out = self.session.run(None, {self.input_name: images.detach().cpu().numpy()})[0]
        return torch.from_numpy(out).to(images.device)

    def run_bound(self, images: torch.Tensor) -> torch.Tensor:
        """Run on the CUDA input in place (``io_binding``): the input is bound by its data pointer, the output
        is allocated by ONNX Runtime on the same GPU and handed to torch through DLPack, without a copy."""
        x = images.detach().contiguous()
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        binding = self.session.io_binding()
        binding.bind_input(name=self.input_name, device_type="cuda", device_id=index,
                           element_type=ORT_ELEMENT_TYPES[x.dtype], shape=tuple(x.shape), buffer_ptr=x.data_ptr())
        binding.bind_output(self.output_name, device_type="cuda", device_id=index)
        torch.cuda.current_stream(x.device).synchronize()  # ONNX Runtime reads x on its own stream
        self.session.run_with_iobinding(binding)  # returns once its stream is done (the default run options)
        out = binding.get_outputs()[0]
        if hasattr(out, "__dlpack__"):
            return torch.from_dlpack(out)
        return torch.from_numpy(out.numpy()).to(x.device)  # an onnxruntime without DLPack on OrtValue


class TorchScriptBackend(ExportedBackend):
    """A traced TorchScript file run by torch.jit on the requested device."""

    def __init__(self, path: str | Path, device: torch.device) -> None:
        extra = {META_FILE: ""}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.jit's deprecation notice
                module = torch.jit.load(str(path), map_location=device, _extra_files=extra)
        except Exception as e:  # RuntimeError for a file that is not a TorchScript archive
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"{path}: not a readable TorchScript model ({first})") from None
        text = extra[META_FILE]
        if not text:
            raise UserError(f"{path}: no yolotrain metadata (class names, stride, image size); export it "
                            f"with: {tool_command('export')} --weights best.pt --include torchscript")
        super().__init__(ModelMeta.from_json(text.decode() if isinstance(text, bytes) else text, str(path)), path)
        self.module = module.eval()

    def run(self, images: torch.Tensor) -> torch.Tensor:
        return self.module(images)


def load_backend(weights: str | Path, device: torch.device, end2end: bool | None = None,
                 max_det: int | None = None) -> Backend:
    """The backend for a file: ``.onnx``, ``.torchscript``, else a yolotrain checkpoint. In eval mode,
    configured by ``Backend.configure(end2end, max_det)`` (the --end2end/--no-end2end and --max-det flags).

    UserError (one line) for a missing file, a file that is not a yolotrain checkpoint, an
    exported file without its metadata, and an end2end mode the file cannot run.
    """
    path = Path(weights)
    if not path.is_file():
        raise UserError(f"{path}: weights file not found")
    kind = EXPORT_SUFFIXES.get(path.suffix.lower())
    if kind == "onnx":
        backend: Backend = OnnxBackend(path, device)
    elif kind == "torchscript":
        backend = TorchScriptBackend(path, device)
    else:
        backend = TorchBackend.from_checkpoint(path, device)
    backend.configure(end2end, max_det)
    return backend.eval()
