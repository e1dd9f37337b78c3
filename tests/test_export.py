"""export.py: ONNX and TorchScript for an anchor-based and an anchor-free checkpoint, each checked
against its checkpoint; a mismatch refused; val.py and detect.py on the exported files agree with
the checkpoint."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.infer.backends import ModelMeta, load_backend
from yolotrain.utils.infer.parity import FP32, compare_detections


@pytest.fixture(scope="module")
def onnx_packages():
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")


def _export(argv: list[str]) -> list:
    """export.main in this process, leaving the project logger as it found it (module fixtures run it)."""
    from yolotrain.app import export
    from yolotrain.utils.core.logging import LOGGER

    saved = list(LOGGER.handlers), LOGGER.level, LOGGER.propagate
    try:
        return export.main(export.parse_opt(argv))
    finally:
        LOGGER.handlers[:] = saved[0]
        LOGGER.setLevel(saved[1])
        LOGGER.propagate = saved[2]


@pytest.fixture(scope="module")
def v5n_fixed(tiny_v5n, onnx_packages, one_thread) -> dict:
    """yolov5n (anchor head) exported at its fixed shape 2 x 3 x 64 x 64."""
    results = _export(["--weights", str(tiny_v5n), "--include", "onnx", "torchscript", "--batch-size", "2"])
    return {r.format: r for r in results}


@pytest.fixture(scope="module")
def v8n_dynamic(tiny_v8n, onnx_packages, one_thread) -> dict:
    """yolov8n (anchor-free DFL head) exported with a dynamic batch and size, simplified by onnxslim when
    it is installed (the parity check then covers the simplified graph)."""
    results = _export(["--weights", str(tiny_v8n), "--include", "onnx", "torchscript", "--dynamic", "--batch-size", "3",
                       "--simplify"])
    return {r.format: r for r in results}


@pytest.mark.slow
@pytest.mark.parametrize("family", ["v5n_fixed", "v8n_dynamic"])
def test_both_formats_pass_parity_and_carry_metadata(family, request):
    results = request.getfixturevalue(family)
    weights = Path(request.getfixturevalue("tiny_v5n" if family == "v5n_fixed" else "tiny_v8n"))
    dynamic = family == "v8n_dynamic"
    assert sorted(results) == ["onnx", "torchscript"]
    for fmt, r in results.items():
        assert r.path == weights.with_suffix(".onnx" if fmt == "onnx" else ".torchscript") and r.path.is_file()
        assert len(r.reports) == (2 if dynamic else 1) and all(p.passed for p in r.reports)
        assert all(p.detections > 0 and p.box_diff <= FP32.box_px and p.score_diff <= FP32.score for p in r.reports)
        if dynamic:
            assert r.reports[1].shape == (2, 3, 32, 64)  # a second batch size and a non-square input
        meta = load_backend(r.path, torch.device("cpu")).meta
        assert meta.names == ("circle", "square", "triangle", "star", "cross", "ring") and meta.format == fmt
        assert (meta.family, meta.dynamic, meta.batch, meta.imgsz) == \
            (("anchor-free", True, None, 64) if dynamic else ("anchor-based", False, 2, 64))
        assert meta.stride == 32 and meta.version and meta.source == str(weights) and meta.data
    assert sorted(p.name for p in weights.parent.iterdir() if p.name.startswith(".")) == []  # no temp files


def _scores(weights: Path, data: Path, extra: list[str]) -> tuple[tuple[float, ...], list]:
    """val.py's P, R, mAP50, mAP50-95 and confusion matrix (conf 0.25, IoU 0.45) for a checkpoint or export."""
    from yolotrain.app import val

    result = val.main(val.parse_opt(["--weights", str(weights), "--data", str(data), "--batch-size", "4",
                                     "--workers", "0", "--noplots", *extra]))[0]
    m = result.metrics
    return (m.mp, m.mr, m.map50, m.map), result.confusion.tolist()


@pytest.mark.slow
def test_val_py_scores_exports_like_their_checkpoints(v5n_fixed, v8n_dynamic, tiny_v5n, tiny_v8n, tiny_data,
                                                      restore_logger):
    """One epoch scores an mAP near 0, so for YOLOv5n the confusion matrix (every box above conf 0.25
    matched to the labels) is compared too: the same, box for box, and not empty. The 1-epoch YOLOv8n
    scores many candidates equally (flat grey padding gives equal features), so NMS at val's
    conf 0.001 breaks exact ties by rounding and a few boxes differ: its matrix is not compared."""
    pairs = [(tiny_v8n, v8n_dynamic["onnx"].path, []),  # dynamic: rect batches, as the checkpoint
             (tiny_v5n, v5n_fixed["onnx"].path, ["--no-rect"]),  # fixed shape: square inputs on both sides
             (tiny_v5n, v5n_fixed["torchscript"].path, ["--no-rect"])]
    for ckpt, exported, extra in pairs:
        reference, matrix = _scores(ckpt, tiny_data, extra)
        got, got_matrix = _scores(exported, tiny_data, [])
        assert got == pytest.approx(reference, abs=1e-3), (exported, got, reference)
        if ckpt == tiny_v5n:
            assert got_matrix == matrix and np.array(matrix)[:-1].sum() > 0
    with pytest.raises(UserError, match="a fixed-shape export takes exactly 2 x 3 x 64 x 64"):
        _scores(v5n_fixed["onnx"].path, tiny_data, ["--rect"])


def _labels(folder: Path) -> dict[str, np.ndarray]:
    return {f.name: np.loadtxt(f, ndmin=2) for f in sorted(folder.glob("*.txt"))}


@pytest.mark.slow
def test_detect_on_exports_finds_the_checkpoints_boxes(v5n_fixed, v8n_dynamic, tiny_v5n, tiny_v8n, tiny_data,
                                                       tmp_path, restore_logger):
    from yolotrain.app import detect
    from yolotrain.utils.data.config import load_data_config

    source = load_data_config(tiny_data).val[0]
    runs = []
    for k, weights in enumerate([tiny_v5n, v5n_fixed["onnx"].path, v5n_fixed["torchscript"].path,
                                 tiny_v8n, v8n_dynamic["onnx"].path]):
        summary = detect.main(detect.parse_opt(["--weights", str(weights), "--source", source, "--save-txt",
                                                "--save-conf", "--workers", "0", "--batch-size", "3", "--nosave",
                                                "--project", str(tmp_path), "--name", str(k)]))
        runs.append(_labels(Path(summary.save_dir) / "labels"))
    for reference, exported in ((runs[0], runs[1]), (runs[0], runs[2]), (runs[3], runs[4])):
        assert reference and sorted(reference) == sorted(exported)
        for name, rows in reference.items():
            assert rows.shape == exported[name].shape and (rows[:, 0] == exported[name][:, 0]).all()
            np.testing.assert_allclose(exported[name][:, 1:], rows[:, 1:], atol=2e-5)  # %g: 6 significant digits


@pytest.mark.slow
def test_a_mismatching_export_is_refused_and_not_kept(tiny_v5n, tmp_path, capsys, monkeypatch, onnx_packages,
                                                      restore_logger):
    from yolotrain.app import export
    from yolotrain.utils.infer.export import DecodedOnly

    weights = tmp_path / "best.pt"
    weights.write_bytes(Path(tiny_v5n).read_bytes())
    original = DecodedOnly.forward

    def shifted(self, images):  # what a wrong export does: scores off by a hundredth
        out = original(self, images)
        return torch.cat([out[..., :4], out[..., 4:] + 0.01], -1)

    monkeypatch.setattr(DecodedOnly, "forward", shifted)
    assert export.cli(["--weights", str(weights), "--include", "onnx", "torchscript"]) == 1
    out = capsys.readouterr().out
    errors = [line for line in out.splitlines() if line.startswith("ERROR")]
    assert len(errors) == 1 and "Traceback" not in out
    assert errors[0].startswith(f"ERROR: {tmp_path / 'best.onnx'}: the exported model does not match {weights}")
    assert "max |score diff| 0.01" in errors[0] and "the file was not kept" in errors[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.pt"]


def test_export_refuses_what_cannot_work(tmp_path, capsys, monkeypatch, restore_logger):
    from yolotrain.app import export
    from tests.helpers import check_defaults, check_numeric_flags

    parser = export.build_parser()
    assert check_numeric_flags(parser) == [] and check_defaults(parser) == []
    fake = tmp_path / "fake.pt"
    fake.write_text("not a checkpoint")
    assert export.cli(["--weights", str(fake)]) == 1
    assert f"ERROR: {fake}: not a readable yolotrain checkpoint" in capsys.readouterr().out
    assert export.cli(["--weights", str(fake), "--half"]) == 1
    assert "ERROR: --half exports FP16 for CUDA and needs a CUDA --device" in capsys.readouterr().out
    import importlib

    real = importlib.import_module

    def no_onnx(name, *args):
        if name == "onnx":
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", no_onnx)
    assert export.cli(["--weights", str(fake), "--include", "onnx"]) == 1
    assert "ERROR: exporting to ONNX needs the 'onnx' package: pip install -r requirements-export.txt" in \
        capsys.readouterr().out


def test_metadata_round_trip_and_refusals():
    meta = ModelMeta(names=("a", "b"), stride=32, imgsz=320, family="anchor-free", format="onnx", dynamic=False,
                     batch=4, data="x.yaml", epoch=9, version="abc123")
    assert ModelMeta.from_json(meta.to_json(), "m.onnx") == meta and meta.nc == 2
    newer = json.loads(meta.to_json()) | {"added_later": 1}
    assert ModelMeta.from_json(json.dumps(newer), "m.onnx") == meta
    with pytest.raises(UserError, match="m.onnx: its yolotrain metadata lacks names, stride"):
        ModelMeta.from_json(json.dumps({"imgsz": 64}), "m.onnx")
    with pytest.raises(UserError, match="not valid JSON"):
        ModelMeta.from_json("{", "m.onnx")
    assert "exactly 4 x 3 x 320 x 320" in meta.input_rule()


def test_detections_compare_within_tolerance_and_excuse_only_near_ties():
    def dets(*rows):
        return torch.tensor(rows, dtype=torch.float32).reshape(-1, 6)

    def decoded(*rows):  # xywh + 2 class scores
        return torch.tensor(rows, dtype=torch.float32).reshape(-1, 6)

    a = dets([10, 10, 30, 30, 0.9, 0], [40, 40, 60, 60, 0.6, 1])
    raw = decoded([20, 20, 20, 20, 0.9, 0], [50, 50, 20, 20, 0, 0.6])
    assert compare_detections(a, a.clone(), raw, raw, FP32) == ("", 0)
    moved = a.clone()
    moved[1, :4] += 0.5
    assert "class 1 at [40.0, 40.0, 60.0, 60.0] score 0.600 only in the export" in compare_detections(a, moved, raw, raw, FP32)[0]
    # two overlapping boxes of one class scoring the same: NMS may keep either one
    twins = decoded([20, 20, 20, 20, 0.7, 0], [21, 20, 20, 20, 0.7, 0])
    kept_a, kept_b = dets([10, 10, 30, 30, 0.7, 0]), dets([11, 10, 31, 30, 0.7, 0])
    assert compare_detections(kept_a, kept_b, twins, twins, FP32) == ("", 2)
    lone = decoded([20, 20, 20, 20, 0.7, 0], [80, 80, 20, 20, 0.7, 0])
    assert compare_detections(kept_a, dets(), lone, lone, FP32)[0].endswith("only in the export")
