"""Convert COCO or Pascal VOC annotations to a YOLO-format dataset ready for train.py.

    python -m yolotrain convert coco path/to/coco OUT            # annotations/instances_<split>.json
    python -m yolotrain convert coco instances_val2017.json OUT --images val2017
    python -m yolotrain convert voc VOCdevkit/VOC2012 OUT --keep-difficult
    python train.py --data OUT/data.yaml

Thin: parses, then hands off to utils/data/convert; bad input is one line and exit 1.
"""
from __future__ import annotations

import argparse
import sys

from yolotrain.utils.core.cli import ArgumentParser, tool_command
from yolotrain.utils.core.errors import UserError, run_entry_point
from yolotrain.utils.core.logging import LOGGER, setup_logging
from yolotrain.utils.data.convert import convert_coco, convert_voc, read_names_file


def build_parser() -> argparse.ArgumentParser:
    """`coco` and `voc` subcommands, each SRC OUT plus its flags (docs/datasets.md lists them all)."""
    p = ArgumentParser(prog=tool_command("convert"),
                       description="Convert COCO or Pascal VOC annotations to a YOLO dataset with its data.yaml")
    sub = p.add_subparsers(dest="format", required=True, metavar="{coco,voc}")
    coco = sub.add_parser("coco", help="COCO instances json (a file, or a folder of annotations/instances_<split>.json)")
    voc = sub.add_parser("voc", help="Pascal VOC (a VOCdevkit/VOC20xx folder, or a folder of xml files)")
    for s in (coco, voc):
        s.add_argument("src", help="the annotations: file or folder")
        s.add_argument("out", help="output dataset folder (written whole at the end, or not at all)")
        s.add_argument("--images", default=None, help="folder holding the images (default: searched, see docs)")
        s.add_argument("--train-split", default=None, help="the split data.yaml trains on (default: train*)")
        s.add_argument("--val-split", default=None, help="the split data.yaml validates on (default: val*)")
        s.add_argument("--exist-ok", action="store_true", help="replace a non-empty OUT")
        s.add_argument("--copy", action="store_true", help="copy images instead of hard-linking them")
    names = voc.add_mutually_exclusive_group()
    names.add_argument("--names", nargs="+", default=None, help="the class list, in class-index order")
    names.add_argument("--names-file", default=None, help="a text file with one class name per line")
    voc.add_argument("--keep-difficult", action="store_true", help="keep objects marked difficult (dropped by default)")
    return p


def main(opt: argparse.Namespace) -> None:
    setup_logging()
    common = dict(images=opt.images, train_split=opt.train_split, val_split=opt.val_split, exist_ok=opt.exist_ok,
                  copy=opt.copy)
    if opt.format == "coco":
        report = convert_coco(opt.src, opt.out, **common)
    elif opt.format == "voc":
        names = read_names_file(opt.names_file) if opt.names_file else opt.names
        report = convert_voc(opt.src, opt.out, names=names, keep_difficult=opt.keep_difficult, **common)
    else:
        raise UserError(f"unknown format {opt.format!r}")
    for line in report.summary():
        LOGGER.info(line)
    LOGGER.info(f"Train on it: python train.py --data {report.data_yaml}")


def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(cli())
