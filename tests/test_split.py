"""A split's source is one interface (utils/data/split.py): a source written here, images held in memory, trains
an epoch through the normal loader and step with no change outside this file."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import torch

from yolotrain.models.heads.base import Ranks
from yolotrain.models.yolo import Model
from yolotrain.utils.core.dist import BatchSplit, DistInfo
from yolotrain.utils.core.hyp import Hyp
from yolotrain.utils.data.dataset import DatasetSpec
from yolotrain.utils.data.labels import COUNT_KEYS, FileColumn, LabelTable, ScanResult
from yolotrain.utils.data.loader import LoaderSpec, build_loader
from yolotrain.utils.data.split import KeyedCacheSource, Missing, Scan, SplitSource, open_split


# ---------------------------------------------------------------- a third source, in memory (under 60 lines)
class MemorySource:
    """Images (BGR uint8 arrays) and their label rows (cls, xc, yc, w, h) held in memory: a scan of nothing."""

    def __init__(self, images: list[np.ndarray], labels: list[np.ndarray], name: str = "memory") -> None:
        self.images, self.labels, self.where = images, labels, name

    def check(self) -> Missing | None:
        return None if self.images else Missing(self.where, "empty")

    def count(self) -> int:
        return len(self.images)

    def scan(self, nc: int, cache_dir: Path | None) -> Scan:
        names = [f"{self.where}/{i:06d}.jpg" for i in range(len(self.images))]  # paths for messages and pictures
        table = LabelTable.of([np.asarray(x, np.float64).reshape(-1, 5) for x in self.labels])
        counts = {**dict.fromkeys(COUNT_KEYS, 0), "found": len(names), "images": len(names),
                  "backgrounds": int((table.counts() == 0).sum()), "instances": int(table.counts().sum())}
        hw = np.array([im.shape[:2] for im in self.images], np.int32)
        return Scan(ScanResult(FileColumn(names), [n + ".txt" for n in names], table, hw, [], counts), " (in memory)")

    def read(self, row: int) -> np.ndarray:
        return self.images[row]

    def cache_source(self, rows, cache_dir, read):
        return KeyedCacheSource(read, f"{self.where} {rows.tolist()}", Path(cache_dir or "."), self.where)
# ---------------------------------------------------------------- (end of the source)


def _shapes(n: int, seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """``n`` 96 px images, each with one filled rectangle of class 0-2 and its label row."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for _ in range(n):
        img = np.full((96, 96, 3), 40, np.uint8)
        c, (x, y), (w, h) = int(rng.integers(3)), rng.integers(10, 50, 2), rng.integers(20, 40, 2)
        cv2.rectangle(img, (int(x), int(y)), (int(x + w), int(y + h)), [(0, 0, 255), (0, 255, 0), (255, 0, 0)][c], -1)
        images.append(img)
        labels.append(np.array([[c, (x + w / 2) / 96, (y + h / 2) / 96, w / 96, h / 96]]))
    return images, labels


def test_a_source_of_ones_own_trains_an_epoch_through_the_normal_loader(one_thread):
    from yolotrain.utils.engine.optim import LRSchedule, ModelEMA, Warmup, smart_optimizer
    from yolotrain.utils.engine.plan import StepPlan
    from yolotrain.utils.engine.step import StepOptions, StepParts, build_step

    source = MemorySource(*_shapes(16))
    assert isinstance(source, SplitSource) and open_split(source) is source  # given as it is, never sniffed
    data = DatasetSpec(source, nc=3, img_size=64, stride=32, augment=True, hyp=Hyp(), seed=1)
    loader = build_loader(LoaderSpec(data, BatchSplit(4, 1), training=True, workers=0))
    assert loader.dataset.counts["instances"] == 16 and len(loader) == 4
    torch.manual_seed(0)
    model = Model("yolov8n.yaml", nc=3).train()
    optimizer = smart_optimizer(model, "AdamW", lr=0.002, momentum=0.9, decay=5e-4)
    ema = ModelEMA(model)
    lr = LRSchedule(optimizer, Warmup(iters=0, bias_lr=0.0, momentum0=0.8, momentum=0.9), 1, lrf=0.01, cos=False)
    parts = StepParts(model, model.detect.build_criterion(Hyp(), 64), optimizer,
                      torch.amp.GradScaler("cpu", enabled=False), ema, lr)
    step = build_step(parts, StepPlan.of(BatchSplit(4, 1), 4, 1, 16), DistInfo(), torch.device("cpu"),  # a step a batch
                      StepOptions(amp=False, graphs=False, sync_bn=False, compile=False))
    before = [p.detach().clone() for p in model.parameters()]
    step.begin(0, 0)
    for i, batch in enumerate(loader):
        assert batch.images.shape == (4, 3, 64, 64) and batch.paths[0].startswith("memory/")
        out = step(batch.images.float() / 255, batch.targets, i, meanwhile=lambda: None, ask=lambda: (False, False))
        assert out.stepped and torch.isfinite(out.mloss).all()
    assert i == 3 and ema.updates == 4 and step.loss.ranks.alone and isinstance(step.loss.ranks, Ranks)
    assert sum(not torch.equal(a, p) for a, p in zip(before, model.parameters())) > 100  # it learned


def test_the_split_kind_is_decided_once_where_the_data_yaml_is_read(tiny_data, tmp_path):
    """The data config holds each split's source; a folder and a shard index made from it scan alike."""
    from yolotrain.utils.data.config import load_data_config, prepare_dataset
    from yolotrain.utils.data.split import ImageFiles, ShardSplit
    from yolotrain.app import shards

    data = load_data_config(tiny_data)
    prepare_dataset(data)
    assert {k: type(v) for k, v in data.sources.items()} == {"train": ImageFiles, "val": ImageFiles}
    made = shards.main(shards.build_parser().parse_args([str(tiny_data), str(tmp_path / "shards")])) / "data.yaml"
    indexed = load_data_config(made)
    assert isinstance(indexed.sources["train"], ShardSplit) and indexed.sources["train"].count() == 16
    a, b = (d.sources["train"].scan(6, None) for d in (data, indexed))
    assert b.known == " (from the shard index)" and len(a.result.labels) == len(b.result.labels) == 16
    assert all(np.array_equal(x, y) for x, y in zip(a.result.labels, b.result.labels))
    assert np.array_equal(data.sources["train"].read(3), indexed.sources["train"].read(3))
