"""``python -m yolotrain weights yolov5s.pt [yolov5s-yolotrain.pt]``: convert a YOLOv5 or
Ultralytics checkpoint once and save it as a yolotrain checkpoint (weights_only-loadable).

train.py, val.py and detect.py also take the original file as ``--weights`` and convert it in
memory each time; the saved file skips that and never needs the reader again.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from yolotrain.models.yolo import Model
from yolotrain.utils.core.cli import ArgumentParser, tool_command
from yolotrain.utils.core.errors import UserError, run_entry_point
from yolotrain.utils.core.logging import LOGGER, setup_logging
from yolotrain.utils.weights.checkpoint import load_checkpoint, load_foreign, save_checkpoint
from yolotrain.utils.weights.convert.sniff import sniff


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """SOURCE and an optional OUTPUT; nothing else to choose."""
    p = ArgumentParser(prog=tool_command("weights"),
                       description="Convert a YOLOv5 or Ultralytics checkpoint to a yolotrain checkpoint "
                                   "(read without running anything in it; weights_only-loadable when saved).")
    p.add_argument("source", help="a YOLOv5 (v6.0+, 7.x package or checkout) or Ultralytics 8.x detection .pt file")
    p.add_argument("output", nargs="?", default=None,
                   help="where to write the yolotrain checkpoint (default: SOURCE's folder, <stem>-yolotrain.pt)")
    return p


def default_output(source: Path) -> Path:
    return source.with_name(f"{source.stem}-yolotrain.pt")


def main(opt: argparse.Namespace) -> Path:
    """Convert, write atomically, then read the written file back with weights_only=True and rebuild it."""
    source = Path(opt.source)
    output = Path(opt.output) if opt.output else default_output(source)
    if not source.is_file():
        raise UserError(f"{source}: checkpoint not found")
    if output.resolve() == source.resolve():
        raise UserError(f"{output}: the output would overwrite the source; give another name")
    if sniff(source).package is None:
        load_checkpoint(source)  # says what the file is when it is not readable at all
        raise UserError(f"{source}: already a yolotrain checkpoint; nothing to convert")
    ckpt = load_foreign(source)
    output.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(ckpt, output)
    saved = load_checkpoint(output)  # weights_only: the written file needs no reader
    Model(saved["model_yaml"]).load_state_dict(saved["model"])
    LOGGER.info(f"Saved {output} ({len(saved['model'])} tensors, {len(saved['names'])} classes, "
                f"imgsz {saved['args']['imgsz']}); use it as --weights for train.py, val.py and detect.py")
    return output


def cli(argv: list[str] | None = None) -> int:
    setup_logging()
    return run_entry_point(lambda: main(parse_opt(argv)))


if __name__ == "__main__":
    sys.exit(cli())
