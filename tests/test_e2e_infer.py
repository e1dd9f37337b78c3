"""End-to-end (NMS-free) heads at inference: post-processing, evaluation, backends, export and the flag.

The real head (models/heads/e2e.py) trains; these tests need only its contract, so a toy head stands
in: ``end2end`` True, ``max_det``, and in eval mode fixed (B, max_det, 6) detections (its NMS form
when switched off). Fast: nothing trains.
"""
from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from yolotrain.models.heads.base import Head
from yolotrain.models.yolo import Model
from yolotrain.utils.core.boxes import postprocess
from yolotrain.utils.core.dist import DistInfo
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data.geometry import Placement
from yolotrain.utils.data.loader import create_dataloader
from yolotrain.utils.eval.evaluate import EvalOptions, evaluate_model
from yolotrain.utils.infer.backends import ModelMeta, TorchBackend, load_backend
from yolotrain.utils.infer.export import ExportOptions, export_all
from yolotrain.utils.infer.predict import PredictOptions, Predictor

MODELS = Path(__file__).resolve().parents[1] / "models"
NAMES = ("a", "b", "c")
IMGSZ = 64
# two boxes of class 1 overlapping (IoU 0.68): an end-to-end head keeps both, NMS one; then lower scores
DETS = torch.tensor([[10.0, 10.0, 40.0, 40.0, 0.9, 1.0],
                     [12.0, 12.0, 42.0, 42.0, 0.8, 1.0],
                     [30.0, 5.0, 60.0, 25.0, 0.6, 0.0],
                     [5.0, 40.0, 25.0, 60.0, 0.3, 2.0],
                     [20.0, 20.0, 30.0, 30.0, 0.1, 0.0],
                     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # padding row: score 0


class ToyE2E(Head):
    """A head keeping to the end-to-end contract: eval output (DETS for every image, raw) when ``end2end``,
    else the same boxes decoded (xywh + one score per class) for NMS. Takes the place of a built head."""

    family = "end-to-end"

    def __init__(self, built: Head, nc: int = len(NAMES)) -> None:
        super().__init__()
        self.nc, self.nl, self.max_det, self.end2end = nc, built.nl, len(DETS), True
        self.f, self.i, self.kind = built.f, built.i, "ToyE2E"
        self.register_buffer("stride", built.stride.clone())
        self.register_buffer("dets", DETS.clone())

    def forward(self, x: list[torch.Tensor]):
        if self.training:
            return x
        d = self.dets[: self.max_det].unsqueeze(0).repeat(x[0].shape[0], 1, 1) + x[0].sum() * 0  # a traced input
        if self.end2end:
            return d, x
        xywh = torch.cat(((d[..., :2] + d[..., 2:4]) / 2, d[..., 2:4] - d[..., :2]), -1)
        scores = torch.nn.functional.one_hot(d[..., 5].long(), self.nc) * d[..., 4:5]
        return torch.cat((xywh, scores), -1), x


@pytest.fixture(scope="module")
def toy_model(one_thread) -> Model:
    model = Model(MODELS / "yolov5n.yaml", nc=len(NAMES))
    model.model[-1] = ToyE2E(model.detect)
    return model.eval()


def _backend(model: Model, source: Path) -> TorchBackend:
    meta = ModelMeta(names=NAMES, stride=int(model.stride.max()), imgsz=IMGSZ, family=model.detect.family,
                     source=str(source))
    return TorchBackend(model.fuse(), meta).eval()  # as from_checkpoint: BatchNorm folded; end2end from the head


def test_postprocess_end2end_keeps_filters_and_limits_without_nms():
    out = DETS.unsqueeze(0).repeat(2, 1, 1)
    (kept,) = postprocess(out[:1], True, conf_thres=0.25)
    assert kept.tolist() == DETS[:4].tolist()  # both overlapping class-1 boxes survive, the padding row does not
    decoded = torch.cat((torch.cat(((DETS[:, :2] + DETS[:, 2:4]) / 2, DETS[:, 2:4] - DETS[:, :2]), 1),
                         torch.nn.functional.one_hot(DETS[:, 5].long(), 3) * DETS[:, 4:5]), 1)[None]
    (nms,) = postprocess(decoded, False, conf_thres=0.25, iou_thres=0.45)
    assert len(nms) == 3 and (nms[:, 5] == 1).sum() == 1  # NMS keeps one of the two
    (classes,) = postprocess(out[:1], True, conf_thres=0.001, classes=[0, 2])
    assert classes[:, 5].tolist() == [0.0, 2.0, 0.0]
    few = postprocess(out, True, conf_thres=0.001, max_det=2)
    assert len(few) == 2 and all(d.tolist() == DETS[:2].tolist() for d in few)
    shuffled = DETS[[3, 0, 2, 1]].unsqueeze(0)  # rows not sorted: the top ones still come first
    assert postprocess(shuffled, True, 0.5)[0].tolist() == DETS[:3].tolist()
    with pytest.raises(ValueError, match="max_det, 6"):
        postprocess(decoded, True)


def test_model_and_backend_read_end2end_from_the_head(toy_model, tmp_path):
    assert toy_model.end2end and not Model(MODELS / "yolov5n.yaml").end2end
    backend = _backend(toy_model, tmp_path / "toy.pt")
    assert backend.end2end and backend.meta.end2end and backend.meta.max_det == len(DETS)
    out = backend(torch.zeros(2, 3, IMGSZ, IMGSZ))[0]
    assert out.shape == (2, len(DETS), 6)


def test_predictor_uses_the_dets_and_no_end2end_falls_back_to_nms(toy_model, tmp_path):
    backend = _backend(toy_model, tmp_path / "toy.pt")
    placed = [Placement((IMGSZ, IMGSZ), (1.0, 1.0), (0.0, 0.0))]
    images = torch.zeros(1, 3, IMGSZ, IMGSZ, dtype=torch.uint8)
    opts = PredictOptions(conf_thres=0.25)
    (det,) = Predictor(backend, torch.device("cpu"), opts)(images, placed)
    np.testing.assert_allclose(det, DETS[:4].numpy())
    backend.configure(end2end=False)
    try:
        assert not backend.meta.end2end and backend.meta.max_det is None
        (nms,) = Predictor(backend, torch.device("cpu"), opts)(images, placed)
        assert len(nms) == 3
    finally:
        backend.configure(end2end=True)


def test_end2end_refused_for_a_head_without_it(tmp_path):
    model = Model(MODELS / "yolov5n.yaml", nc=len(NAMES))
    backend = _backend(model, tmp_path / "v5.pt")
    assert not backend.end2end and backend.meta.max_det is None
    backend.configure(end2end=False)  # its own mode: fine
    with pytest.raises(UserError, match=r"v5\.pt: --end2end"):
        backend.configure(end2end=True)


def test_evaluate_model_on_an_end2end_model_gives_its_dets(toy_model, tmp_path):
    images, labels = tmp_path / "images", tmp_path / "labels"
    images.mkdir()
    labels.mkdir()
    for k in range(3):
        cv2.imwrite(str(images / f"{k}.jpg"), np.full((IMGSZ, IMGSZ, 3), 80, np.uint8))
        (labels / f"{k}.txt").write_text("1 0.39 0.39 0.47 0.47\n")
    loader = create_dataloader(str(images), IMGSZ, 2, 32, rect=False, workers=0, nc=len(NAMES))
    result = evaluate_model(toy_model, loader, torch.device("cpu"), list(NAMES), DistInfo(),
                            EvalOptions(keep_detections=True, keep_batches=1))
    assert len(result.detections) == 3
    for _, det in result.detections:  # every image: the head's rows above conf 0.001, no NMS, in original pixels
        np.testing.assert_allclose(det, DETS[:5].numpy(), atol=1e-4)
    assert result.batches[0].detections[0].tolist() == DETS[:5].tolist()  # what the pictures draw
    assert result.metrics.map50 > 0


def test_torchscript_export_outputs_dets_and_says_end2end(toy_model, tmp_path, restore_logger):
    reference = _backend(toy_model, tmp_path / "toy.pt")
    reference.configure(max_det=4)  # export.py --max-det 4
    img = np.full((IMGSZ, IMGSZ, 3), 80, np.uint8)
    try:
        (result,) = export_all(reference, ["torchscript"], ExportOptions(imgsz=IMGSZ, batch=2, dynamic=True),
                               torch.device("cpu"), [img])
    finally:
        reference.configure(max_det=len(DETS))
    assert result.path == tmp_path / "toy.torchscript" and all(r.passed for r in result.reports)
    assert result.reports[0].detections == 2 * 4  # two images, their top 4 rows all above conf 0.25
    exported = load_backend(result.path, torch.device("cpu"))
    assert exported.end2end and exported.meta.end2end and exported.meta.max_det == 4
    out = exported(torch.zeros(3, 3, IMGSZ, IMGSZ))[0]
    assert out.shape == (3, 4, 6) and out[0].tolist() == DETS[:4].tolist()
    with pytest.raises(UserError, match=r"toy\.torchscript: --no-end2end"):
        load_backend(result.path, torch.device("cpu"), end2end=False)
    assert load_backend(result.path, torch.device("cpu"), end2end=True).end2end  # its own mode: fine


def test_detect_refuses_a_flag_contradicting_an_export(toy_model, tmp_path, restore_logger):
    from yolotrain.app import detect

    reference = _backend(toy_model, tmp_path / "toy.pt")
    img = np.full((IMGSZ, IMGSZ, 3), 80, np.uint8)
    (result,) = export_all(reference, ["torchscript"], ExportOptions(imgsz=IMGSZ, batch=1), torch.device("cpu"),
                           [img])
    cv2.imwrite(str(tmp_path / "im.jpg"), img)
    argv = ["--weights", str(result.path), "--source", str(tmp_path / "im.jpg"), "--project", str(tmp_path / "runs"),
            "--device", "cpu", "--workers", "0", "--save-txt", "--save-conf"]
    with pytest.raises(UserError, match=r"toy\.torchscript: --no-end2end: this file was exported end-to-end"):
        detect.main(detect.parse_opt([*argv, "--no-end2end"]))
    detect.main(detect.parse_opt(argv))
    rows = (tmp_path / "runs" / "exp" / "labels" / "im.txt").read_text().splitlines()
    assert [r.split()[0] for r in rows] == ["1", "1", "0", "2"]  # both overlapping boxes: no NMS


def test_model_meta_without_end2end_reads_as_false():
    meta = ModelMeta(names=NAMES, stride=32, imgsz=IMGSZ, family="anchor", format="onnx", dynamic=True)
    old = {k: v for k, v in json.loads(meta.to_json()).items() if k not in ("end2end", "max_det")}
    read = ModelMeta.from_json(json.dumps(old), "old.onnx")
    assert read.end2end is False and read.max_det is None
    new = ModelMeta.from_json(json.dumps({**old, "end2end": True, "max_det": 100}), "new.onnx")
    assert new.end2end and new.max_det == 100


def test_model_meta_speaks_the_heads_family_words_and_reads_the_older_ones():
    """Exports carry Head.family ("anchor-based", "anchor-free", "end-to-end"); files written with the older words
    ("anchor"; "anchor-free" for an end-to-end head too) read back in the heads' words."""
    assert {Model(f"{m}.yaml", nc=3).detect.family for m in ("yolov5n", "yolov8n", "yolo26n")} == {
        "anchor-based", "anchor-free", "end-to-end"}
    base = json.loads(ModelMeta(names=NAMES, stride=32, imgsz=IMGSZ, family="x", format="onnx").to_json())
    for written, end2end, read in (("anchor", False, "anchor-based"), ("anchor-free", False, "anchor-free"),
                                   ("anchor-free", True, "end-to-end"), ("end-to-end", True, "end-to-end")):
        meta = ModelMeta.from_json(json.dumps({**base, "family": written, "end2end": end2end}), "old.onnx")
        assert meta.family == read, (written, end2end)


def test_parity_pairs_end2end_rows_rather_than_positions():
    from yolotrain.utils.infer.parity import FP32, compare_end2end

    ref = DETS[:5].unsqueeze(0)
    tied = ref.clone()
    tied[0, :2, 4] = 0.85  # two rows tied on score may come in either order
    swapped = tied[:, [1, 0, 2, 3, 4]]
    assert not (swapped - tied).abs().amax() < 1  # by position they differ by pixels...
    report = compare_end2end(swapped, tied, (1, 3, IMGSZ, IMGSZ), FP32)
    assert report.passed and report.box_diff == 0 and report.detections == 4  # ...paired, they are the same
    moved = ref.clone()
    moved[0, 2, 0] += 1.0  # a box one pixel off
    report = compare_end2end(moved, ref, (1, 3, IMGSZ, IMGSZ), FP32)
    assert not report.passed and "class 0" in report.mismatch and report.box_diff == pytest.approx(1.0)
    relabelled = ref.clone()
    relabelled[0, 0, 5] = 2.0
    assert "only in the export" in compare_end2end(relabelled, ref, (1, 3, IMGSZ, IMGSZ), FP32).mismatch


def test_onnx_export_of_an_end2end_model(toy_model, tmp_path, restore_logger):
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    reference = _backend(toy_model, tmp_path / "toy.pt")
    img = np.full((IMGSZ, IMGSZ, 3), 80, np.uint8)
    (result,) = export_all(reference, ["onnx"], ExportOptions(imgsz=IMGSZ, batch=2, dynamic=True),
                           torch.device("cpu"), [img])
    assert all(r.passed for r in result.reports) and len(result.reports) == 2
    exported = load_backend(result.path, torch.device("cpu"))
    assert exported.meta.end2end and exported.meta.max_det == len(DETS)
    assert exported(torch.zeros(3, 3, 32, IMGSZ))[0].shape == (3, len(DETS), 6)
