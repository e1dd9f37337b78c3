"""``YOLO``: train, validate, predict and export from Python, through the CLIs' own engine.

Each method turns its keyword options into the matching CLI's flags (yolotrain/options.py), parses
them with that CLI's parser and calls the CLI's ``main`` with them: the same checks, defaults and
code path as the command line, so ``YOLO("yolov8n.yaml").train(epochs=3)`` trains the same weights
as ``python train.py --cfg models/yolov8n.yaml --epochs 3``.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from yolotrain.app import detect as detect_cli
from yolotrain.app import export as export_cli
from yolotrain.app import train as train_cli
from yolotrain.app import tune as tune_cli
from yolotrain.app import val as val_cli
from yolotrain.models.parse import MODELS_DIR, load_model_yaml
from yolotrain.models.yolo import Model
from yolotrain.utils.core.cli import tool_command
from yolotrain.utils.core import dist
from yolotrain.utils.core.callbacks import Callbacks
from yolotrain.utils.core.errors import UserError, did_you_mean
from yolotrain.utils.data.sources import resolve_sources
from yolotrain.utils.engine.state import TrainResult
from yolotrain.utils.infer.backends import EXPORT_SUFFIXES
from yolotrain.utils.infer.loop import ShardReport, VideoSinks, predict_batches, write_prediction
from yolotrain.utils.infer.results import Results, as_results, predict_batch_end
from yolotrain.utils.weights.checkpoint import load_model
from yolotrain.launch import launch_training
from yolotrain.options import ALIASES, option_flags, parse, to_argv
from yolotrain.results import ValResult


class YOLO:
    """A detector: a model yaml (to train), a checkpoint (yolotrain's, or a YOLOv5/Ultralytics .pt read by the
    safe importer) or an export.py file (.onnx, .torchscript: predict and val only)."""

    def __init__(self, source: str | Path = "yolov8n.yaml") -> None:
        self.path, self.kind = _resolve(source)
        self.callbacks = Callbacks()
        self.train_result: TrainResult | None = None  # the last train()'s

    def __repr__(self) -> str:
        return f"YOLO({str(self.path)!r}, {self.kind})"

    def add_callback(self, event: str, fn: Callable[[Any], None]) -> None:
        """Call ``fn(payload)`` at ``event`` (utils/core/callbacks.EVENTS; docs/python.md lists each payload)."""
        self.callbacks.add(event, fn)

    @property
    def model(self) -> torch.nn.Module:
        """The network on the CPU: a checkpoint's weights in eval mode, or a yaml's freshly initialised one."""
        if self.kind == "yaml":
            return Model(str(self.path))
        self._need("checkpoint", "model")
        return load_model(self.path, torch.device("cpu"))[0]

    def train(self, nproc: int | None = None, **options: Any) -> TrainResult:
        """Train with train.py's options (``epochs=3``, ``batch_size=16`` or ``batch=16``, ``device="0,1"``...).

        ``device="0,1,2,3"`` or ``nproc=N`` (CPU: gloo) starts N ranks with torch's elastic launcher, as torchrun
        would; inside a process torchrun started, the run trains on that process group. Afterwards this object
        holds best.pt (last.pt when no epoch was validated)."""
        if self.kind in ("onnx", "torchscript"):
            raise UserError(f"{self.path}: an exported model predicts and validates; train its checkpoint or a yaml")
        options = {**self._train_source(options), **options}
        parser = train_cli.build_parser()
        argv = to_argv(parser, options, "train.py")
        opt = parse(parser, argv)
        ranks = _ranks(opt.device, nproc)
        if ranks > 1:
            if self.callbacks.listened():
                raise UserError("callbacks run in the calling process: for a data-parallel run with callbacks, "
                                "start your script with torchrun (the callbacks then run on rank 0)")
            result = launch_training(argv, ranks)
        else:
            result = train_cli.main(opt, self.callbacks)
        self.train_result = result
        self.path, self.kind = result.best or result.last, "checkpoint"
        return result

    def tune(self, **options: Any) -> Path:
        """Search hyperparameters (tune.py, docs/tuning.md): tune.py's options (``trials=``, ``storage=``, ``study=``,
        ``pruner=``, ``space=``, ``project=``...) and train.py's for every trial (``data=``, ``epochs=``...). Returns
        the study's folder (best_hyp.yaml, trials.csv, pictures); added callbacks hear every trial's events."""
        if self.kind in ("onnx", "torchscript"):
            raise UserError(f"{self.path}: an exported model cannot be tuned; tune its checkpoint or a yaml")
        parser, train_parser = tune_cli.build_parser(), train_cli.build_parser()
        own, known = option_flags(parser), {**option_flags(train_parser), **option_flags(parser), **ALIASES}
        for name in options:
            if str(name).replace("-", "_") not in known:
                raise UserError(f"tune: unknown option '{name}'.{did_you_mean(str(name), known)} See "
                                f"`{tool_command('tune')} --help` and `{tool_command('train')} --help`")
        mine = {k: v for k, v in options.items() if str(k).replace("-", "_") in own}
        rest = {k: v for k, v in options.items() if k not in mine}
        opt = parse(parser, to_argv(parser, mine, "tune.py"))
        train_argv = to_argv(train_parser, {**self._train_source(rest), **rest}, "train.py")
        parse(train_parser, train_argv)  # train.py's refusals as a UserError, before the study is touched
        return tune_cli.main(opt, train_argv, self.callbacks)

    def val(self, **options: Any) -> ValResult:
        """Score on a split with val.py's options (``data=``, ``imgsz=``, ``half=True``...)."""
        self._need("weights", "val")
        parser = val_cli.build_parser()
        opt = parse(parser, to_argv(parser, {"weights": str(self.path), **options}, "val.py"))
        return ValResult.from_eval(val_cli.main(opt, self.callbacks)[0])

    def predict(self, source: str | Path | list, stream: bool | None = None,
                **options: Any) -> list[Results] | Iterator[Results]:
        """One Results per image or video frame, with detect.py's options (``conf=``, ``classes=[0]``...).

        Files are written only when asked (``save=True``, ``save_txt=True``, ``save_crop=True``). Folders,
        globs, lists and videos stream (a generator: one batch in memory); image files come back as a list
        (``stream=`` decides either way)."""
        self._need("weights", "predict")
        save = options.pop("save", None)
        options.setdefault("nosave", not save)
        sources = [str(s) for s in (source if isinstance(source, (list, tuple)) else [source])]
        parser = detect_cli.build_parser()
        opt = parse(parser, to_argv(parser, {"weights": str(self.path), "source": sources, **options}, "detect.py"))
        found = resolve_sources(opt.source)
        gen = self._predict(opt, found)
        if stream is None:
            stream = bool(found.videos) or any(not Path(s).is_file() or Path(s).suffix == ".txt" for s in sources)
        return gen if stream else list(gen)

    def export(self, format: str = "onnx", **options: Any) -> Path:  # noqa: A002 (Ultralytics' name)
        """Write and check an export (export.py's options: ``imgsz=``, ``dynamic=True``...); returns its path."""
        self._need("checkpoint", "export")
        parser = export_cli.build_parser()
        opt = parse(parser, to_argv(parser, {"weights": str(self.path), "include": [format], **options}, "export.py"))
        return Path(export_cli.main(opt, self.callbacks)[0].path)

    def _predict(self, opt, sources) -> Iterator[Results]:
        """detect.py's pipeline in this process; each batch's Results yielded, its files written when asked."""
        one = dist.DistInfo()
        run = detect_cli.build_pipeline(opt, dist.select_device(opt.device), one,
                                        writes=not opt.nosave or opt.save_txt or opt.save_crop)
        writer, names = run.writer, list(run.meta.names)
        sinks = VideoSinks(writer) if writer else None
        try:
            for k, batch in enumerate(predict_batches(sources, run.predictor, run.settings, one, True,
                                                      ShardReport(nc=run.meta.nc))):
                results = as_results(batch, names)
                for p in batch if writer else ():
                    write_prediction(p, writer, sinks)
                predict_batch_end(self.callbacks, k, results)
                yield from results
        finally:
            if sinks:
                sinks.close()

    def _train_source(self, options: dict[str, Any]) -> dict[str, Any]:
        """--cfg for a yaml, --weights for a checkpoint (fine-tuning), unless the options name their own."""
        if options.get("resume") or {"cfg", "weights"} & {k.replace("-", "_") for k in options}:
            return {}
        return {"cfg": str(self.path)} if self.kind == "yaml" else {"weights": str(self.path)}

    def _need(self, what: str, action: str) -> None:
        if self.kind == "yaml" or (what == "checkpoint" and self.kind != "checkpoint"):
            have = "a model yaml (untrained)" if self.kind == "yaml" else f"a {self.kind} export"
            raise UserError(f"{self.path}: {action} needs a checkpoint, and this is {have}; train it first or "
                            "load a .pt file")


def _resolve(source: str | Path) -> tuple[Path, str]:
    """The file and its kind: 'yaml', 'checkpoint', 'onnx' or 'torchscript'; a bare yaml name is looked up in models/."""
    path = Path(source)
    if path.suffix in (".yaml", ".yml"):
        if not path.exists() and (MODELS_DIR / path.name).exists() and path.parent == Path("."):
            path = MODELS_DIR / path.name
        load_model_yaml(path)  # a missing or malformed yaml is named now
        return path, "yaml"
    if not path.is_file():
        raise UserError(f"{path}: no such file (give a model yaml, a .pt checkpoint, or an .onnx/.torchscript export)")
    if path.suffix in EXPORT_SUFFIXES:
        return path, EXPORT_SUFFIXES[path.suffix]
    return path, "checkpoint"


def _ranks(device: str, nproc: int | None) -> int:
    """How many ranks to start: none inside torchrun (it trains on that group), else nproc or the listed GPUs."""
    if dist.dist_info().world_size > 1:
        return 1
    if nproc is not None:
        if not isinstance(nproc, int) or nproc < 1:
            raise UserError(f"nproc must be a positive integer, got {nproc!r}")
        return nproc
    return max(len(dist.listed_cuda_devices(device)), 1)
