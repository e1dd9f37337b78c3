"""Turn a YOLO dataset into tar shards (WebDataset layout) and one index per split, for training from them.

    python -m yolotrain shards data/my.yaml datasets/my-shards              # every split of the yaml
    python -m yolotrain shards images/train datasets/extra --nc 80 --split train --shard-size 512
    python train.py --data datasets/my-shards/data.yaml                     # the same training as the folder
    python -m yolotrain shards data/my.yaml s3://my-bucket/my-shards        # made here, uploaded to a bucket

Every image is verified and every label read as training's scan does, and each problem is reported the
same way (file and reason; bad files are left out, nothing good is lost). OUT is written whole or not at
all: everything goes to a hidden sibling folder that is renamed at the end. A bucket prefix gets the
folder uploaded, each split's index.json last, so a reader finds an index whole or not at all.
utils/data/shards.py says what the shards and the index hold.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import yaml

from yolotrain.utils.core.cli import ArgumentParser, Range, tool_command
from yolotrain.utils.core.errors import UserError, run_entry_point
from yolotrain.utils.core.logging import LOGGER, setup_logging
from yolotrain.utils.data import remote
from yolotrain.utils.data.config import load_data_config, prepare_dataset
from yolotrain.utils.data.labels import describe_source, img2label_paths, require_usable, resolve_image_files, scan_labels
from yolotrain.utils.data.problems import report_messages
from yolotrain.utils.data.shards import INDEX_JSON, INDEX_SUFFIX, discard, replace_folder, write_split

SPLITS = ("train", "val", "test")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=tool_command("shards"), description=__doc__.splitlines()[0])
    p.add_argument("src", help="a dataset yaml (each split it names), or an image folder or .txt list (with --nc)")
    p.add_argument("out", help="the folder to write: <split>-NNNNNN.tar shards, <split>.index, and data.yaml for a "
                               "yaml source (must not exist, or be empty); or a bucket prefix (s3://bucket/prefix, "
                               "empty), uploaded")
    p.add_argument("--shard-size", type=Range(int, min=1), default=1024,
                   help="start a new shard once one holds this many MiB")
    p.add_argument("--nc", type=Range(int, min=1), default=None,
                   help="class count, for a folder or list source (a yaml's names give it)")
    p.add_argument("--split", default="train", choices=SPLITS, help="the split a folder or list source becomes")
    return p


def sources(opt: argparse.Namespace) -> tuple[dict[str, list], int, dict | None]:
    """(split -> its source paths, class count, the yaml's names to write beside the shards or None)."""
    src = Path(opt.src)
    if src.suffix in (".yaml", ".yml"):
        data = load_data_config(src)
        prepare_dataset(data)  # the built-in set is made on first use
        splits = {s: list(getattr(data, s)) for s in SPLITS if getattr(data, s)}
        return splits, len(data.names), dict(enumerate(data.names))
    if opt.nc is None:
        raise UserError(f"{src}: a folder or list source needs --nc (the class count), which a dataset yaml gives")
    return {opt.split: [str(src)]}, opt.nc, None


def main(opt: argparse.Namespace) -> Path | str:
    """Scan each split as training would, write its shards and index into OUT (a folder, renamed into place
    whole; or a bucket prefix, uploaded shards first and each index's json last)."""
    setup_logging()
    if remote.is_url(opt.out):
        url = opt.out.rstrip("/")
        if not remote.is_empty(url):
            raise UserError(f"{url}: holds objects already; choose a new prefix")
        with tempfile.TemporaryDirectory() as tmp:
            made = write(opt, Path(tmp) / "shards", url)
            remote.upload(made, url, first=lambda name: not name.endswith((INDEX_JSON, "data.yaml")))
            has_yaml = (made / "data.yaml").is_file()
        LOGGER.info(f"Uploaded to {url}" + (f"; train on it: {tool_command('train')} --data {url}/data.yaml"
                                            if has_yaml else ""))
        return url
    out = write(opt, Path(opt.out))
    yaml_file = out / "data.yaml"
    LOGGER.info(f"Train on it: {tool_command('train')} --data {yaml_file}" if yaml_file.is_file() else f"Wrote {out}")
    return out


def write(opt: argparse.Namespace, out: Path, url: str | None = None) -> Path:
    """The shards, indexes and (for a yaml source) data.yaml in the new folder ``out``, written whole or not at
    all; ``url``: where they will be uploaded (data.yaml's ``path``)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out}: exists and is not empty; choose a new folder")
    splits, nc, names = sources(opt)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        for split, paths in splits.items():
            img_files = resolve_image_files(paths)
            result = scan_labels(img_files, img2label_paths(img_files), nc)
            report_messages(result.msgs, f"{split}: ")
            require_usable(result, describe_source(paths))
            index = write_split(result, tmp, split, nc, opt.shard_size * 2**20)
            shards = sorted(tmp.glob(f"{split}-*.tar"))
            LOGGER.info(f"{split}: {len(result.img_files)} images, {result.counts['instances']} boxes, "
                        f"{result.counts['corrupt']} corrupt left out -> {len(shards)} shard(s), "
                        f"{sum(s.stat().st_size for s in shards) / 2**20:.1f} MiB, index {url or out}/{index.name}")
        if names is not None:
            body = {**({"path": url} if url else {}), **{s: f"{s}{INDEX_SUFFIX}" for s in splits}, "names": names}
            (tmp / "data.yaml").write_text(f"# made by {tool_command('shards')} from " + str(opt.src) + "\n"
                                           + yaml.safe_dump(body, sort_keys=False))
        replace_folder(tmp, out)
    finally:
        discard(tmp)
    return out


def cli(argv: list[str] | None = None) -> int:
    return run_entry_point(lambda: main(build_parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(cli())
