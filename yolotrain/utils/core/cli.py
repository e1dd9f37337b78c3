"""Command-line parsing shared by every CLI: range-checked numeric flags and one-line errors.

A bad number (``--epochs 0``, ``--conf-thres 1.5``, ``--save-interval nan``) is refused while the
arguments are parsed, before any device, process group or data work starts, with one line
naming the flag, the value and the allowed range, and exit status 2 (argparse's). Under torchrun
every rank parses its own argv, so every rank stops the same way.

The flag groups several CLIs share (device and threads, workers, caches, memory format, run
folder, torchrun's local rank) are written once here, so each means the same everywhere.

Leaf module: standard library only, so any CLI (and bench script) can use it.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import FrozenInstanceError
from pathlib import Path
from typing import Any, NoReturn, Union

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import CHECKOUT, ROOT

Number = Union[int, float]

SCRIPTS = ("train", "val", "detect", "export", "tune")  # the tools with a script at the checkout's top


def tool_command(tool: str) -> str:
    """A tool as a message names it, ready to paste in this form of yolotrain: ``python val.py`` (a checkout),
    ``python -m yolotrain shards`` (a checkout, no script), ``yolotrain val`` (installed)."""
    if not CHECKOUT:
        return f"yolotrain {tool}"
    return f"python {tool}.py" if tool in SCRIPTS else f"python -m yolotrain {tool}"


class Range:
    """An argparse ``type=`` that parses an int or a float and checks it against inclusive bounds.

    ``Range(int, min=1)``, ``Range(float, min=0, max=1)``; floats also refuse nan and inf.
    ``note`` says why the bound is what it is, e.g. ``"the largest model stride"``; ``also`` names
    values outside the bounds that mean something, e.g. ``{-1: "AutoBatch"}``.
    """

    def __init__(self, kind: type[int] | type[float], min: Number | None = None, max: Number | None = None,
                 note: str = "", also: dict[Number, str] | None = None) -> None:
        if kind not in (int, float):
            raise TypeError(f"Range kind must be int or float, got {kind!r}")
        if min is not None and max is not None and min > max:
            raise ValueError(f"Range min {min} > max {max}")
        self.kind, self.min, self.max, self.note, self.also = kind, min, max, note, dict(also or {})
        self.__name__ = self.describe()  # argparse names a type by __name__ in its own messages

    def describe(self) -> str:
        """The allowed values in words: 'an integer >= 1', 'a number from 0 to 1'."""
        what = "an integer" if self.kind is int else ("a number" if self.max is not None else "a finite number")
        lo, hi = (None if b is None else f"{b:g}" if isinstance(b, float) else str(b) for b in (self.min, self.max))
        if lo is not None and hi is not None:
            what += f" from {lo} to {hi}"
        elif lo is not None:
            what += f" >= {lo}"
        elif hi is not None:
            what += f" <= {hi}"
        what += f" ({self.note})" if self.note else ""
        return what + "".join(f", or {v} for {meaning}" for v, meaning in self.also.items())

    def contains(self, value: object) -> bool:
        """Whether an already-parsed value (e.g. a default) is allowed."""
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        if self.kind is int and not isinstance(value, int):
            return False
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if value in self.also:
            return True
        return (self.min is None or value >= self.min) and (self.max is None or value <= self.max)

    def __call__(self, text: str) -> Number:
        try:
            value = self.kind(str(text))
        except ValueError:
            value = None
        if value is None or not self.contains(value):
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {str(text)!r}")
        return value

    def __repr__(self) -> str:
        bounds = "".join(f", {k}={v!r}" for k, v in (("min", self.min), ("max", self.max)) if v is not None)
        return f"Range({self.kind.__name__}{bounds})"


IMGSZ = Range(int, min=32, note="the largest model stride")  # train.py rounded smaller sizes up to it
SEED = Range(int, min=0, max=2**32 - 1)  # numpy.random.seed's range; train.py seeds random, numpy and torch


class WordOrRange:
    """An argparse ``type=`` that takes one of ``words`` or a number that ``numbers`` (a Range) accepts, and
    returns it as text, so the resolved value keeps one type: ``--micro-steps auto|on|off|64``."""

    def __init__(self, words: tuple[str, ...], numbers: Range) -> None:
        self.words, self.numbers = words, numbers
        self.__name__ = self.describe()

    def describe(self) -> str:
        return f"{', '.join(self.words)} or {self.numbers.describe()}"

    def __call__(self, text: str) -> str:
        if str(text) in self.words:
            return str(text)
        try:
            return str(self.numbers(text))
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, got {str(text)!r}") from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default once: appended as ``(default: X)`` unless the help says its own
    default, and left out when there is none to show (None, False, ''); paths inside the checkout are
    shown relative to it, as a user types them from there."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, False, "", argparse.SUPPRESS) or action.nargs == 0:
            return text
        return f"{text} (default: {_shown(default)})"


def _shown(value: Any) -> str:
    """A default as --help shows it: a path in the checkout relative to it."""
    if isinstance(value, (str, Path)) and Path(value).is_absolute():
        try:
            return str(Path(value).relative_to(ROOT))
        except ValueError:
            return str(value)
    return str(value)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with a one-line error: ``ERROR: argument --epochs: must be ..., got '0'``, exit 2, and
    HelpFormatter's defaults.

    The usage dump is left out (``-h`` still prints it); the message keeps argparse's wording.
    """

    raise_errors = False  # the Python API's parsers: the same message, raised as a UserError instead of exit 2

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        text = " ".join(str(message).split())
        if self.raise_errors:
            raise UserError(text)
        self.exit(2, f"ERROR: {text}\n")


class Refused(argparse.Action):
    """A flag another tool has and this one does not: using it stops the parse with one line that says what to
    type instead (``ERROR: --quad: ...``, exit 2; a UserError from the Python API). Hidden from --help and
    from the namespace (no default), so the docs' flag tables and a run's saved arguments never see it."""

    def __init__(self, option_strings: list[str], dest: str, alternative: str = "", **kwargs: Any) -> None:
        kwargs.update(nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)
        self.alternative = alternative

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is not a flag here: {self.alternative}")


def add_refused_flags(p: argparse.ArgumentParser, refused: dict[str, str]) -> None:
    """``refused``: flag -> what to type instead (see Refused)."""
    for flag, alternative in refused.items():
        p.add_argument(flag, action=Refused, alternative=alternative)


def add_device_flags(p: argparse.ArgumentParser, default: str = "", distributed: bool = True,
                     threads_note: str = "") -> None:
    """--device and --threads; ``distributed``: the CLI runs under torchrun, so threads are per rank;
    ``threads_note``: what else caps the default thread count."""
    auto = ("GPU 0, each rank its own GPU under torchrun; the CPU without CUDA" if distributed
            else "GPU 0; the CPU without CUDA")
    shown = f"(default: {default or auto})"
    if distributed:
        p.add_argument("--device", default=default, help=f"CUDA device(s), e.g. 0, 0,1,2,3, cuda:1, or cpu {shown}")
        p.add_argument("--threads", type=Range(int, min=0), default=0,
                       help=f"CPU threads per rank (0: torch's default, capped so ranks x threads <= cores{threads_note})")
    else:
        p.add_argument("--device", default=default, help=f"CUDA device, e.g. 0 or cuda:1, or cpu {shown}")
        p.add_argument("--threads", type=Range(int, min=0), default=0, help="CPU threads (0: torch's default)")


def add_workers_flag(p: argparse.ArgumentParser, reads: str = "") -> None:
    """--workers; ``reads`` names what the workers load when not everything goes through them."""
    p.add_argument("--workers", type=Range(int, min=0), default=8,
                   help=f"max dataloader workers{' for ' + reads if reads else ''} (per rank)")


def add_cache_flags(p: argparse.ArgumentParser) -> None:
    """--cache and --cache-dir: where resized images and label caches go (utils/data/imgcache, labelcache)."""
    p.add_argument("--cache", nargs="?", const="ram", choices=["ram", "disk"], default=None,
                   help="cache resized images in RAM (/dev/shm) or on disk, one copy shared by every rank and worker "
                        "of a node")
    p.add_argument("--cache-dir", default=None,
                   help="where label caches go when the dataset folder is read-only (else ~/.cache/yolotrain), and "
                        "a node's copies of a shard index and its shards (else the temp folder)")


def add_channels_last_flag(p: argparse.ArgumentParser) -> None:
    """--channels-last / --no-channels-last; unset (None) lets yolotrain.utils.core.dist pick per device."""
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory format; --no-channels-last for NCHW (default: NHWC on CPU, and on CUDA under fp16 "
                        "(--amp, --half), where each measured faster; NCHW for fp32 on CUDA). Rounding differs between "
                        "the two")


def add_run_folder_flags(p: argparse.ArgumentParser, project: str | Path) -> None:
    """--project, --name, --exist-ok: the run folder project/name, incremented (exp2, exp3...) unless --exist-ok."""
    p.add_argument("--project", default=str(project), help="save results to project/name")
    p.add_argument("--name", default="exp", help="save results to project/name")
    p.add_argument("--exist-ok", action="store_true", help="reuse project/name instead of incrementing it")


def add_hang_timeout_flag(p: argparse.ArgumentParser) -> None:
    """--hang-timeout: every rank's watchdog (utils/core/watchdog.py); a hung rank names its phase and exits 124."""
    p.add_argument("--hang-timeout", type=Range(float, min=0), default=30.0,
                   help="minutes without progress (a batch fetched or scored, a step, a collective) after which every "
                        "rank names the phase it is stuck in and exits with code 124 (0: off)")


def add_local_rank_flag(p: argparse.ArgumentParser) -> None:
    """--local-rank (hidden): older torch.distributed.launch passes it; yolotrain.utils.core.dist reads it."""
    p.add_argument("--local-rank", "--local_rank", type=Range(int, min=-1), default=-1, help=argparse.SUPPRESS)


class ResolvedArgs(argparse.Namespace):
    """A CLI's arguments once resolved (defaults that depend on the device or a checkpoint filled in):
    read-only, so every later stage sees what was decided. Setting an attribute raises FrozenInstanceError."""

    def __init__(self, **values: Any) -> None:
        for k, v in values.items():
            object.__setattr__(self, k, v)

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenInstanceError(f"the arguments are frozen once resolved; cannot set {name}")

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"the arguments are frozen once resolved; cannot delete {name}")

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def replace(self, **changes: Any) -> ResolvedArgs:
        """A copy with ``changes`` (the original stays as it was)."""
        return type(self)(**{**vars(self), **changes})
