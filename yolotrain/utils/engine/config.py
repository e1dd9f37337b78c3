"""The run configuration: train.py's arguments resolved once, then frozen.

Resolving merges a resumed run's saved arguments with the ones given now, then fills in what
depends on the machine and the model: the memory format and precision defaults of the device, the
family's hyperparameter file, and the run folder (chosen by rank 0). After that nothing changes
the config; what changes during a run (--time's epoch count) lives in the run state.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from yolotrain.models.parse import MODELS_DIR, load_model_yaml
from yolotrain.utils.core import dist, precision
from yolotrain.utils.core.cli import ResolvedArgs
from yolotrain.utils.core.dist import BatchSplit, DistInfo
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import shipped
from yolotrain.utils.core.hyp import Hyp, load_hyp
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.core.runs import increment_path, latest_checkpoint
from yolotrain.utils.data.config import DEMO_DATA, DataConfig, count_images, load_data_config
from yolotrain.utils.engine.autobatch import AUTO_BATCH, auto_batch_size
from yolotrain.utils.engine.optim import NOMINAL_BATCH, SHORT_RUN_BATCH, OptimizerChoice
from yolotrain.utils.engine.recipe import Recipe, recipe_for
from yolotrain.utils.engine.state import SavedRun
from yolotrain.utils.engine.plan import problems as step_problems
from yolotrain.utils.weights.checkpoint import WeightsSource, load_weights_source, to_plain

DEFAULT_MODEL = MODELS_DIR / "yolov8n.yaml"  # the best mAP in the quick CPU run (docs/benchmarks.md)

# Arguments that may differ on --resume without changing what the run computes (or, for
# epochs, only by the user's explicit wish to train longer); bookkeeping ones are never compared.
# --compile computes the same functions; like --device and --threads it can change the order of float
# operations (inductor fuses kernels), so a resume that switches it is exact in maths, not in bits.
RESUME_HARMLESS = {"device", "augment_on", "workers", "epochs", "time", "nan_recover", "hang_timeout", "patience", "cache", "cache_dir",
                   "noval", "save_period", "save_interval", "keep_optimizer", "noplots", "threads", "deterministic",
                   "compile", "cuda_graphs", "tensorboard", "mlflow"}
RESUME_BOOKKEEPING = {"resume", "allow_changes", "local_rank", "project", "name", "exist_ok", "save_dir",
                      "sized_for", "by_device"}
BY_DEVICE = ("augment_on", "micro_steps")  # flags whose 'auto' the device resolves (the summary says which did)
# --imgsz and --epochs when not given, by what is trained: the quick demo on the built-in set (minutes on a
# CPU), and on a user's data the values YOLOv5 and Ultralytics users expect.
SIZE_DEFAULTS = {"demo": {"imgsz": 256, "epochs": 8}, "your data": {"imgsz": 640, "epochs": 100}}


class RunConfig(ResolvedArgs):
    """Every train.py argument, resolved once; read-only (setting an attribute raises FrozenInstanceError)."""


@dataclass(frozen=True)
class ModelSource:
    """The model a fresh run builds, read once per run: ``cfg`` (--cfg, else the --weights checkpoint's yaml,
    else the default), the --weights checkpoint whose tensors transfer, and the family's recipe."""

    cfg: str | Path | dict
    weights: WeightsSource | None
    recipe: Recipe
    yaml: dict  # the model yaml as read (models/parse.py: load_model_yaml), which the builders take
    label: str  # where it came from, for messages


def resolve_model(args: argparse.Namespace) -> ModelSource:
    """Read --weights and the model yaml (once each) and find its family's recipe."""
    weights = load_weights_source(args.weights) if args.weights else None
    cfg = args.cfg or (weights.model_yaml if weights else DEFAULT_MODEL)
    d, label = load_model_yaml(cfg)
    return ModelSource(cfg, weights, recipe_for(d), d, label)


@dataclass(frozen=True)
class Resume:
    """The arguments after the --resume merge, and the checkpoint to continue (None: a fresh run, whose model
    source is read here once)."""

    args: ResolvedArgs
    saved: SavedRun | None = None
    model: ModelSource | None = None

    def fresh_model(self) -> ModelSource:
        """A fresh run's model source: the one read at the merge, else read now."""
        return self.model or resolve_model(self.args)


def resolve_resume(opt: argparse.Namespace, defaults: dict[str, Any]) -> Resume:
    """Find the checkpoint to continue and merge the run's saved arguments with the ones given.

    Arguments given that differ from the saved run are listed; harmless ones apply, ones that would
    change the training math need --allow-changes. ``--resume auto`` starts the run (in its fixed
    folder) when it has no last.pt yet, so a restarted job picks up its own. ``defaults`` are the
    parser's, to tell a flag given from one left alone.
    """
    given = vars(opt)
    if not opt.resume:
        return Resume(ResolvedArgs(**given), model=resolve_model(opt))
    if opt.resume == "auto":
        path = Path(opt.project) / opt.name / "weights" / "last.pt"
        if not path.is_file():
            LOGGER.info(f"--resume auto: no {path} yet; starting the run")
            return Resume(ResolvedArgs(**{**given, "resume": False, "exist_ok": True}), model=resolve_model(opt))
    else:
        path = latest_checkpoint(opt.project) if opt.resume is True else Path(opt.resume)
    if path is None:
        raise UserError(f"--resume: no last.pt found under {opt.project}")
    saved = SavedRun.load(path)
    changed = {k: v for k, v in given.items()
               if k not in RESUME_BOOKKEEPING and k in saved.args and v != defaults.get(k)
               and not _same_arg(v, saved.args[k])}
    math = sorted(k for k in changed if k not in RESUME_HARMLESS)
    if math and not opt.allow_changes:
        listed = ", ".join(f"--{k.replace('_', '-')} {changed[k]} (run has {saved.args[k]})" for k in math)
        raise UserError(f"{path}: resuming with {listed} would change the training math; "
                        "drop them, or pass --allow-changes to continue with them")
    if "epochs" in changed and (opt.time or saved.args.get("time")):  # --epochs only planned a --time run's first epoch
        LOGGER.info(f"--time: --epochs {changed.pop('epochs')} ignored; the run's refitted count, "
                    f"{saved.args['epochs']}, stands")
    if changed.get("epochs") is not None and changed["epochs"] <= saved.epochs_done:
        raise UserError(f"{path}: --epochs {changed['epochs']} but {saved.epochs_done} epochs are already done")
    if changed:
        LOGGER.info("Resuming with changed arguments: " + ", ".join(
            f"{k}: {saved.args[k]} -> {v}" for k, v in sorted(changed.items())))
    # the given arguments first: a flag newer than the saved run keeps its given (or default) value
    args = ResolvedArgs(**{**given, **saved.args, **changed, "local_rank": opt.local_rank, "resume": str(path),
                           "save_dir": str(path.parent.parent)})
    part = f", batch {saved.batches_done + 1}" if saved.batches_done else ""
    LOGGER.info(f"Resuming {path} from epoch {saved.epochs_done + 1}{part} of {args.epochs}")
    return Resume(args, saved)


def size_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with --imgsz and --epochs filled in where not given (a resumed run has both from its
    checkpoint): the built-in demo's on the built-in set, 640 px and 100 epochs on any other data.
    ``sized_for`` records which set of defaults filled them in, for the start summary (None: none did)."""
    missing = [k for k in ("imgsz", "epochs") if values.get(k) is None]
    if not missing:
        return {**values, "sized_for": values.get("sized_for")}
    purpose = "demo" if is_demo_data(values.get("data")) else "your data"
    return {**values, **{k: SIZE_DEFAULTS[purpose][k] for k in missing}, "sized_for": purpose}


def size_default_help(key: str) -> str:
    """--help's default for --imgsz or --epochs, from SIZE_DEFAULTS."""
    return f"{SIZE_DEFAULTS['your data'][key]} on your --data, {SIZE_DEFAULTS['demo'][key]} for the built-in demo"


def is_demo_data(data: Any) -> bool:
    """Whether --data names the built-in shapes set (train.py's default)."""
    try:
        return data is not None and Path(str(data)).resolve() == DEMO_DATA.resolve()
    except OSError:
        return False


def _same_arg(given, saved) -> bool:
    """Compare a CLI value with its saved form (paths resolved, tuples as lists)."""
    given = to_plain(given)
    if isinstance(given, str) and isinstance(saved, str) and (Path(given).exists() or Path(saved).exists()):
        return Path(given).resolve() == Path(saved).resolve()
    return given == saved


def resolve_config(resume: Resume, device: torch.device, info: DistInfo = DistInfo()) -> RunConfig:
    """The frozen config: the image size and epochs by purpose (size_defaults), the device's layout and
    precision defaults, the family's hyp file, the run folder (rank 0's choice, shared: call it on every
    rank once the process group is up), --batch-size -1's profiled batch (every rank's GPU,
    utils/engine/autobatch.py) and the global validation batch; then every refusal of the step's settings
    (utils/engine/step.problems), before anything is written."""
    args, saved = ResolvedArgs(**size_defaults(resume.args.as_dict())), resume.saved  # --imgsz, --epochs by purpose
    model = None if saved else resume.fresh_model()
    hyp = args.hyp if saved or args.hyp else str(model.recipe.hyp)  # the family's loss-gain scale
    hyp = hyp if saved else str(shipped(hyp, "hyps"))  # hyps/hyp.scratch-low.yaml: the shipped file, from anywhere
    save_dir = Path(args.save_dir) if saved else increment_path(Path(args.project) / args.name, args.exist_ok)
    amp = precision.amp_default(args.amp, device, legacy=saved is not None and "amp" not in saved.args)
    channels_last = precision.channels_last_default(args.channels_last, device, half=amp)
    batch = args.batch_size
    if batch == AUTO_BATCH:
        batch = auto_batch_size(saved.model_yaml if saved else model.yaml, _classes(args), load_hyp(hyp), args,
                                device, info.world_size, amp, channels_last)
    val_batch = args.val_batch_size or 2 * batch  # YOLOv5's in-training rule: twice the training batch
    dist.batch_split(batch, info)  # both global batches split over the ranks: the one check, before any work
    dist.batch_split(val_batch, info, "--val-batch-size")
    given = args.as_dict()
    by_device = [k for k in BY_DEVICE if given[k] == "auto"] + [  # on a resume, what was auto then and stands
        k for k in (saved.args.get("by_device") or [] if saved else []) if given[k] == saved.args.get(k)]
    cfg = RunConfig(**{**given, "hyp": hyp, "save_dir": str(dist.broadcast_object(str(save_dir))),
                       "channels_last": channels_last, "amp": amp, "batch_size": batch, "val_batch_size": val_batch,
                       "augment_on": augment_default(args.augment_on, device),
                       "micro_steps": micro_steps_default(args.micro_steps, device), "by_device": by_device})
    found = step_problems(cfg, device, info.world_size, lambda: _nominal_batch(cfg, saved, model, info.world_size))
    if found:  # before the run folder, the data scan and the model build: a refused command leaves nothing
        raise UserError("; ".join(found))
    return cfg


def _nominal_batch(cfg: RunConfig, saved: SavedRun | None, model: ModelSource | None, world_size: int) -> int:
    """The images per optimizer step the run's optimizer gathers to, before any data is scanned: a resumed run's
    own; a fresh run's by its family's rule (``choose_optimizer``, as the run itself resolves it)."""
    if saved:
        return saved.optimizer_choice.nominal_batch if saved.optimizer_choice else NOMINAL_BATCH
    data = load_data_config(cfg.data)
    return choose_optimizer(cfg, model.recipe, load_hyp(cfg.hyp), 1 if cfg.single_cls else data.nc, data,
                            BatchSplit(cfg.batch_size, world_size)).nominal_batch


def choose_optimizer(cfg: RunConfig, recipe: Recipe, hyp: Hyp, nc: int, data: DataConfig,
                     batch: BatchSplit) -> OptimizerChoice:
    """A fresh run's --optimizer, by its family's rule on the train split's listed images (``count_images``, no
    label read): one count, so the start's refusals and the run judge the same choice, which checkpoints record."""
    return recipe.optimizer(cfg.optimizer, hyp, nc, count_images(data), batch, cfg.epochs,
                            step_images=micro_step_images(cfg.micro_steps))


def augment_default(flag: str, device: torch.device) -> str:
    """--augment-on auto: the GPU draws the augmented pixels of a CUDA run, whose loader workers then only
    read and pack (faster on the GPU hosts measured, docs/benchmarks.md); on a CPU run the workers draw
    them, since the device path would share the workers' cores."""
    if flag != "auto":
        return flag
    return "device" if device.type == "cuda" else "workers"


def micro_steps_default(flag: str, device: torch.device) -> str:
    """--micro-steps auto: on for a CPU run, where a step's cost is its images; off for a CUDA run, where each
    step has a fixed cost that micro-steps multiply (measured: docs/benchmarks.md, "GPU training")."""
    if flag != "auto":
        return flag
    return "off" if device.type == "cuda" else "on"


def micro_step_images(resolved: str) -> int:
    """The images per optimizer step a resolved --micro-steps asks of a short run's large batch: on, the
    batch-16 run's SHORT_RUN_BATCH; a number, that many; off, 0 (one step per batch)."""
    words = {"on": SHORT_RUN_BATCH, "off": 0}
    return words[resolved] if resolved in words else int(resolved)


def _classes(args: argparse.Namespace) -> int:
    """The class count a fresh run trains: the dataset yaml's names, or 1 with --single-cls."""
    return 1 if args.single_cls else len(load_data_config(args.data).names)
