"""Python keyword options -> the CLI's own arguments, parsed by the CLI's own parser.

``model.train(epochs=3, batch_size=8)`` becomes ``--epochs 3 --batch-size 8`` and goes through
train.py's parser, so every option is range-checked, defaulted and named exactly as on the command
line, and a run from Python is the same run as the command with those flags.
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from typing import Any

from yolotrain.utils.core.errors import UserError, did_you_mean
from yolotrain.utils.core.hyp import Hyp

# Ultralytics' names for options the CLIs spell YOLOv5's way: accepted as well, so notebooks carry over.
ALIASES = {"batch": "batch_size", "conf": "conf_thres", "iou": "iou_thres"}


def option_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """The parser's long options by Python name: --batch-size -> batch_size (every alias of a flag too)."""
    out = {}
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help":
                out[flag[2:].replace("-", "_")] = action
    return out


def to_argv(parser: argparse.ArgumentParser, options: Mapping[str, Any], tool: str) -> list[str]:
    """The command-line arguments that say what ``options`` say; an unknown name is a UserError with a suggestion."""
    flags = option_flags(parser)
    argv: list[str] = []
    for name, value in options.items():
        key = str(name).replace("-", "_")
        key = ALIASES.get(key, key) if key not in flags else key
        if key not in flags and tool == "train.py" and key in hyp_keys():
            raise UserError(f"{tool}: '{name}' is a hyperparameter, not an option: put '{key}: {options[name]}' in a "
                            f"copy of the hyp file and pass hyp='that.yaml' (docs/training.md, Hyperparameter files)")
        if key not in flags:
            raise UserError(f"{tool}: unknown option '{name}'.{did_you_mean(key, flags)} See `python {tool} --help`")
        argv += _flag_tokens(flags[key], value, name)
    return argv


def hyp_keys() -> set[str]:
    """The keys a hyp file may hold (lr0, mosaic, close_mosaic, ...)."""
    return {f.name for f in dataclasses.fields(Hyp)}


def _flag_tokens(action: argparse.Action, value: Any, name: str) -> list[str]:
    """One option as tokens: booleans switch flags, lists spread, None leaves the default."""
    flag = action.option_strings[0] if action.option_strings[0].startswith("--") else action.option_strings[-1]
    if value is None:
        return []
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if _as_bool(value, name) else "--no-" + flag[2:]]
    if action.nargs == 0:  # store_true
        return [flag] if _as_bool(value, name) else []
    if action.nargs == "?" and isinstance(value, bool):  # --resume, --cache, --mlflow: bare flag or a value
        return [flag] if value else []
    if isinstance(value, (list, tuple)):
        return [flag, *(str(v) for v in value)] if value else []
    return [flag, str(value)]


def _as_bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise UserError(f"option '{name}' is a switch: give True or False, got {value!r}")
    return value


def parse(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse with the CLI's checks; a refusal raises UserError with the CLI's message instead of exiting."""
    parser.raise_errors = True
    return parser.parse_args(argv)
