"""torchrun helper for tests/test_imgcache.py: every rank opens the node's image cache.

usage: imgcache_ranks.py IMAGE_LIST OUT_DIR   (writes OUT_DIR/rank<R>: file, built?, digest)
"""
import contextlib
import hashlib
import sys
from pathlib import Path

import torch

from yolotrain.utils.core import dist
from yolotrain.utils.data.imgcache import build_or_open
from yolotrain.utils.data.split import FileCacheSource
from yolotrain.utils.core.logging import setup_logging

files, out = Path(sys.argv[1]).read_text().split(), Path(sys.argv[2])
info = dist.dist_info()
setup_logging(info.rank, info.world_size)
group = contextlib.ExitStack()
group.enter_context(dist.process_group(info, torch.device("cpu")))
try:
    cache = build_or_open(files, 64, False, "disk", FileCacheSource(files, cache_dir=out / "cache"),
                          local_rank=info.local_rank)
    digest = hashlib.sha256(b"".join(cache.get(i)[0].tobytes() for i in range(len(files)))).hexdigest()
    (out / f"rank{info.rank}").write_text(f"{cache.file} {cache.built} {digest}")
finally:
    group.close()
