"""Write a YOLO-format split's ground truth as COCO json, with the ids val.py --save-json uses.

    python -m yolotrain coco --data data/shapes.yaml --task val --out gt.json

pycocotools then scores ``val.py --save-json``'s predictions.json against it (utils/eval/coco.py says how
the ids are chosen).
"""
from __future__ import annotations

import argparse
import sys

from yolotrain.utils.core.cli import ArgumentParser, tool_command
from yolotrain.utils.core.errors import run_entry_point
from yolotrain.utils.core.logging import LOGGER, setup_logging
from yolotrain.utils.eval.coco import export_split


def parse_opt(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    """The export CLI (utils/core/cli gives it the one-line errors of the others)."""
    p = ArgumentParser(prog=tool_command("coco"), description="Export a YOLO-format split's ground truth "
                       "as COCO json (ids match val.py --save-json)")
    p.add_argument("--data", required=True, help="dataset yaml")
    p.add_argument("--task", default="val", choices=("train", "val", "test"), help="which split")
    p.add_argument("--out", required=True, help="output json file")
    p.add_argument("--single-cls", action="store_true", help="one class 'item', as val.py --single-cls")
    p.add_argument("--cache-dir", default=None, help="where label caches go when the dataset folder is read-only")
    return p


def main(opt: argparse.Namespace) -> None:
    setup_logging()
    gt = export_split(opt.data, opt.task, opt.out, opt.single_cls, opt.cache_dir)
    LOGGER.info(f"{opt.out}: {len(gt['images'])} images, {len(gt['annotations'])} annotations, "
                f"{len(gt['categories'])} categories")


def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(parse_opt(argv)))


if __name__ == "__main__":
    sys.exit(cli())
