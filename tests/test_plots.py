"""utils/eval/plots.py: every plot decodes, boxes land where the labels are, curves match the metrics."""
from __future__ import annotations

import logging
import subprocess
import sys

import cv2
import numpy as np
import pytest
import torch

from tests.helpers import ROOT, run_env
from yolotrain.utils.eval import plots
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.eval.metrics import ConfusionMatrix, evaluate, match_image
from yolotrain.utils.core.runs import ResultsCSV

NAMES = ["circle", "square", "triangle"]


@pytest.fixture
def warnings_logged():
    """Warnings sent to the project logger (works whether or not it propagates to the root)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    LOGGER.addHandler(handler)
    yield records
    LOGGER.removeHandler(handler)


def _read(path) -> np.ndarray:
    img = cv2.imread(str(path))
    assert img is not None, f"{path} does not decode"
    return img


def _bgr(c: int) -> np.ndarray:
    return np.array(plots.class_color(c)[::-1], float)


def test_class_colors_are_distinct_rgb():
    colors = [plots.class_color(i) for i in range(40)]
    assert len(set(colors)) == 40
    assert all(len(c) == 3 and all(isinstance(v, int) and 0 <= v <= 255 for v in c) for c in colors)
    assert plots.class_color(3) == plots.class_color(3)


# ------------------------------------------------------------------ plot_images
def _blank_batch(n: int = 4, size: int = 256) -> torch.Tensor:
    return torch.zeros((n, 3, size, size), dtype=torch.uint8)


def test_plot_images_draws_label_boxes_where_the_labels_are(tmp_path):
    # 4 black 256 px images -> 2 x 2 grid of 256 px tiles; image 3 (bottom right) has one label
    # spanning x 96..160, y 64..192 of its tile.
    targets = torch.tensor([[3, 1, 0.5, 0.5, 0.25, 0.5]])
    out = plots.plot_images(_blank_batch(), targets, None, NAMES, tmp_path / "b.jpg")
    img = _read(out).astype(float)
    assert img.shape == (512, 512, 3)
    x0, y0 = 256, 256
    for x, y in ((x0 + 96, y0 + 128), (x0 + 160, y0 + 128), (x0 + 128, y0 + 192)):  # left, right, bottom edge
        assert np.abs(img[y, x] - _bgr(1)).max() < 60, (x, y, img[y, x])
    assert img[y0 + 110:y0 + 180, x0 + 105:x0 + 150].max() < 40  # inside the box: untouched
    assert img[y0 + 210:y0 + 245, x0 + 10:x0 + 80].max() < 40  # far from the box
    assert img[10:246, 10:246].max() < 40  # the other images have no labels
    assert img[10:246, 266:502].max() < 40


def test_plot_images_predictions_show_only_confident_boxes(tmp_path):
    # predictions in pixels: image 0 one confident box, one below the 0.25 threshold
    targets = np.array([[0, 2, 40, 60, 120, 200, 0.9], [0, 0, 150, 60, 230, 200, 0.1]])
    img = _read(plots.plot_images(_blank_batch(1), targets, ["a/img0.jpg"], NAMES, tmp_path / "p.jpg")).astype(float)
    assert img.shape == (256, 256, 3)
    assert np.abs(img[130, 40] - _bgr(2)).max() < 60  # left edge of the confident box
    assert img[70:190, 160:220].max() < 40  # the low-confidence box is not drawn
    assert img[70:190, 50:110].max() < 40  # box interior untouched


def test_output_to_target_feeds_plot_images():
    dets = [torch.tensor([[1.0, 2, 3, 4, 0.9, 2]]), torch.zeros((0, 6)), torch.tensor([[5.0, 6, 7, 8, 0.5, 1]])]
    t = plots.output_to_target(dets)
    assert t.shape == (2, 7)
    np.testing.assert_allclose(t, [[0, 2, 1, 2, 3, 4, 0.9], [2, 1, 5, 6, 7, 8, 0.5]])
    assert plots.output_to_target([]).shape == (0, 7)


def test_plot_images_and_labels_on_a_real_batch(tiny_data, tmp_path):
    from yolotrain.utils.data.config import load_data_config, prepare_dataset
    from yolotrain.utils.data.loader import create_dataloader

    data = load_data_config(tiny_data)
    prepare_dataset(data)
    loader = create_dataloader(data.train, 96, 6, 32, augment=True, workers=0, shuffle=True, nc=6)
    dataset = loader.dataset
    batch = next(iter(loader))
    img = _read(plots.plot_images(batch.images, batch.targets, batch.paths, data.names, tmp_path / "train_batch0.jpg"))
    assert min(img.shape[:2]) >= 256 * 2  # 6 images -> 3 x 2 tiles, small images enlarged to 256 px
    lab = _read(plots.plot_labels(dataset.labels, data.names, tmp_path / "labels.jpg"))
    assert min(lab.shape[:2]) > 500


# ------------------------------------------------------------------ confusion matrix
def test_normalize_confusion_divides_by_true_column():
    m = np.array([[2, 0, 1], [1, 0, 0], [1, 0, 3]])
    n = plots.normalize_confusion(m)
    np.testing.assert_allclose(n[:, 0], [0.5, 0.25, 0.25])
    np.testing.assert_array_equal(n[:, 1], 0)  # a class never seen: zeros, not NaN
    np.testing.assert_allclose(n[:, 2], [0.25, 0, 0.75])
    np.testing.assert_allclose(n.sum(0), [1, 0, 1])


@pytest.mark.parametrize("nc, normalize", [(3, True), (3, False), (31, True)])
def test_plot_confusion_matrix_writes_an_image(tmp_path, nc, normalize):
    cm = ConfusionMatrix(nc)
    gt = np.array([[0, 0, 10, 10], [20, 20, 30, 30]], float)
    cm.process_image(np.array([[0, 0, 10, 10, 0.9, 0], [50, 50, 60, 60, 0.8, 1]]), gt, [0, 2])
    names = [f"class{i}" for i in range(nc)]
    img = _read(plots.plot_confusion_matrix(cm.matrix, names, tmp_path / "cm.png", normalize=normalize))
    assert min(img.shape[:2]) > 400


# ------------------------------------------------------------------ curves
def _stats(nc: int, n_images: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_images):
        m = int(rng.integers(1, 5))
        xy = rng.uniform(0, 200, (m, 2))
        gt = np.concatenate([xy, xy + rng.uniform(10, 60, (m, 2))], 1)
        gcls = rng.integers(0, nc, m)
        det = gt + rng.normal(0, 4, gt.shape)
        dcls = np.where(rng.random(m) < 0.2, rng.integers(0, nc, m), gcls)
        out.append(match_image(det, rng.uniform(0, 1, m), dcls, gt, gcls))
    return out


def test_evaluate_keeps_curves_consistent_with_the_reported_numbers():
    m = evaluate(_stats(4), 4, NAMES + ["star"])
    c = m.curves
    k = len(m.ap_class)
    assert c is not None and c.p.shape == c.r.shape == c.f1.shape == (k, 1000)
    assert c.precision.shape == (k, 101) and c.recall.shape == (101,)
    np.testing.assert_array_equal(c.classes, m.ap_class)
    best = plots.operating_point(c)
    assert c.px[best] == m.conf  # the mean-F1 peak is the confidence P and R are read at
    assert c.p[:, best].mean() == pytest.approx(m.mp) and c.r[:, best].mean() == pytest.approx(m.mr)
    np.testing.assert_allclose(c.precision.mean(1), m.ap50[m.ap_class])
    assert c.precision.mean() == pytest.approx(m.map50)
    assert "curves" not in m.as_dict()  # never into checkpoints


def test_plot_curves_writes_all_four(tmp_path):
    m = evaluate(_stats(3), 3, NAMES)
    files = plots.plot_curves(m, tmp_path)
    assert [f.name for f in files] == ["PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png"]
    for f in files:
        assert min(_read(f).shape[:2]) > 400


@pytest.mark.parametrize("nc, n_images", [(30, 60), (3, 0)])
def test_plot_curves_many_classes_or_no_labels(tmp_path, nc, n_images):
    m = evaluate(_stats(nc, n_images), nc, None)  # > 21 classes: legend collapsed; 0 images: empty curves
    assert all(_read(f) is not None for f in plots.plot_curves(m, tmp_path))


def test_plot_curves_without_curves_warns(tmp_path, warnings_logged):
    from yolotrain.utils.eval.metrics import DetectionMetrics

    assert plots.plot_curves(DetectionMetrics(), tmp_path) == []
    assert warnings_logged


# ------------------------------------------------------------------ results.png
def _row(e: int) -> dict[str, float]:
    values = [1 / (e + 1)] * 3 + [0.5, 0.4, 0.3, 0.2] + [1 / (e + 2)] * 3 + [0.01] * 3
    return dict(zip(ResultsCSV("unused").keys, values))


@pytest.mark.parametrize("n_rows", [1, 12])
def test_plot_results(tmp_path, n_rows):
    csv = ResultsCSV(tmp_path / "results.csv")
    for e in range(n_rows):
        csv.append(e, _row(e))
    out = plots.plot_results(csv.path)
    assert out == tmp_path / "results.png"
    assert _read(out).shape[1] > 1500


def test_plot_results_skips_a_torn_last_line(tmp_path):
    csv = ResultsCSV(tmp_path / "results.csv")
    for e in range(3):
        csv.append(e, _row(e))
    with open(csv.path, "a") as f:
        f.write("3,0.1,0.")  # killed mid-write
    assert len(plots.read_results(csv.path)["epoch"]) == 3
    assert plots.plot_results(csv.path) is not None


@pytest.mark.parametrize("content", [None, "", "epoch,train/box_loss\n"])
def test_plot_results_without_data_warns_and_returns_none(tmp_path, warnings_logged, content):
    path = tmp_path / "results.csv"
    if content is not None:
        path.write_text(content)
    assert plots.plot_results(path) is None
    assert warnings_logged and "results.png not written" in warnings_logged[0].getMessage()
    assert not (tmp_path / "results.png").exists()


# ------------------------------------------------------------------ labels.jpg
def test_plot_labels_accepts_empty_images_and_no_labels(tmp_path):
    labels = [np.array([[0, 0.5, 0.5, 0.2, 0.3], [2, 0.1, 0.9, 0.05, 0.05]], np.float32), np.zeros((0, 5), np.float32)]
    assert _read(plots.plot_labels(labels, NAMES, tmp_path / "a.jpg")) is not None
    assert _read(plots.plot_labels([], NAMES, tmp_path / "b.jpg")) is not None


# ------------------------------------------------------------------ no global side effects
@pytest.mark.slow  # a subprocess
def test_import_and_use_leave_matplotlib_backend_alone(tmp_path):
    code = f"""
import sys
import numpy as np
import yolotrain.utils.eval.plots as plots
assert "matplotlib" not in sys.modules, "yolotrain.utils.eval.plots imported matplotlib at import time"
import matplotlib
matplotlib.use("svg")
plots.plot_confusion_matrix(np.eye(3, dtype=int), ["a", "b"], {str(tmp_path / 'cm.png')!r})
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
assert "matplotlib.pyplot" not in sys.modules
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "cm.png").stat().st_size > 0
