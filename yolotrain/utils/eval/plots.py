"""What users look at: results.png, P/R/F1 curves, confusion matrix, label statistics, batch mosaics.

Every function takes plain data (arrays, tensors, a csv path) and an output path and writes one
image. Matplotlib is used only through its object API (``Figure`` + ``FigureCanvasAgg``) and is
imported inside the functions, so importing this module selects no global backend and costs
nothing at train.py's start. Batch mosaics are drawn with OpenCV, which is fast enough per epoch.
"""
from __future__ import annotations

import colorsys
import csv
import math
import re
from pathlib import Path
from typing import Any, Sequence

import cv2
import numpy as np

from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.labels import LabelTable
from yolotrain.utils.eval.metrics import Curves, DetectionMetrics

MAX_LEGEND_CLASSES = 21  # per-class legend entries beyond this are unreadable
MAX_ANNOTATED_CLASSES = 30  # confusion-matrix cells get numbers below this class count
LOSS_COLUMN = re.compile(r"^train/(\w+)_loss$")


def result_panels(columns: Sequence[str]) -> list[tuple[str, str]]:
    """results.csv column -> panel title, in YOLOv5's 2-row layout: train losses, P, R over val
    losses, mAP50, mAP50-95. The losses are whatever the model's head names (box/obj/cls, box/cls/dfl)."""
    losses = [m.group(1) for c in columns if (m := LOSS_COLUMN.match(c))] or ["box", "obj", "cls"]
    return ([(f"train/{n}_loss", f"train {n} loss") for n in losses]
            + [("metrics/precision", "precision"), ("metrics/recall", "recall")]
            + [(f"val/{n}_loss", f"val {n} loss") for n in losses]
            + [("metrics/mAP_0.5", "mAP50"), ("metrics/mAP_0.5:0.95", "mAP50-95")])


def class_color(i: int) -> tuple[int, int, int]:
    """RGB (0-255) colour of class i: golden-ratio hue steps, so neighbouring ids never look alike."""
    h = (int(i) * 0.618033988749895 + 0.05) % 1.0
    s, v = (0.9, 0.95) if i % 2 == 0 else (0.65, 0.8)
    return tuple(int(round(c * 255)) for c in colorsys.hsv_to_rgb(h, s, v))  # type: ignore[return-value]


def _mpl_color(i: int) -> tuple[float, float, float]:
    return tuple(c / 255 for c in class_color(i))  # type: ignore[return-value]


def _name(names: Any, c: int) -> str:
    """Class name from a list or {int: name} dict; the id itself when unknown."""
    if isinstance(names, dict):
        return str(names.get(c, c))
    return str(names[c]) if names is not None and 0 <= c < len(names) else str(c)


def _figure(figsize: tuple[float, float]) -> Any:
    """A figure bound to its own Agg canvas: no pyplot, no global backend, no window."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Any, path: str | Path, dpi: float = 150, max_px: int = 3000) -> Path:
    """Write the figure, lowering dpi so its longer side stays under max_px (big confusion matrices)."""
    dpi = min(dpi, max_px / max(fig.get_size_inches()))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    return path


def _to_numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


# ---------------------------------------------------------------- results.csv -> results.png
def read_results(csv_path: str | Path) -> dict[str, np.ndarray]:
    """results.csv as {column: float array}; rows that do not parse (a torn last line) are skipped."""
    with open(csv_path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    if not rows:
        return {}
    header = [h.strip() for h in rows[0]]
    values = []
    for r in rows[1:]:
        try:
            row = [float(v) for v in r]
        except ValueError:
            continue
        if len(row) == len(header):
            values.append(row)
    data = np.asarray(values, np.float64).reshape(-1, len(header))
    return {h: data[:, j] for j, h in enumerate(header)}


def _gauss_smooth(y: np.ndarray, sigma: float = 3.0) -> np.ndarray:
    """Gaussian-weighted average with weights renormalised at the ends (no edge droop)."""
    i = np.arange(len(y))
    w = np.exp(-0.5 * ((i[:, None] - i[None, :]) / sigma) ** 2)
    return (w @ y) / w.sum(1)


def plot_results(csv_path: str | Path, path: str | Path | None = None) -> Path | None:
    """results.png beside results.csv: losses and metrics per epoch, raw points and a smoothed line.

    Returns None (with a warning) when the csv is missing, empty or unreadable: a plot must
    never stop training.
    """
    csv_path = Path(csv_path)
    try:
        cols = read_results(csv_path)
    except (OSError, ValueError, csv.Error) as e:
        LOGGER.warning(f"plot_results: cannot read {csv_path} ({e}); results.png not written")
        return None
    epochs = cols.get("epoch")
    if epochs is None or not len(epochs):
        LOGGER.warning(f"plot_results: {csv_path} has no epochs yet; results.png not written")
        return None
    panels = result_panels(list(cols))
    fig = _figure((3 * len(panels) // 2, 6))
    axes = fig.subplots(2, len(panels) // 2).ravel()
    for ax, (key, title) in zip(axes, panels):
        ax.set_title(title)
        ax.set_xlabel("epoch")
        y = cols.get(key)
        if y is None:
            ax.text(0.5, 0.5, f"no column\n{key}", ha="center", va="center", transform=ax.transAxes)
            continue
        ok = np.isfinite(y)
        ax.plot(epochs[ok], y[ok], marker=".", ms=8, lw=1.5, label="results")
        if ok.sum() > 2:
            ax.plot(epochs[ok], _gauss_smooth(y[ok]), ":", lw=2, label="smooth")
    axes[0].legend()
    fig.tight_layout()
    return _save(fig, path or csv_path.with_name("results.png"))


# ---------------------------------------------------------------- P / R / F1 curves
def _curve_axes(figsize: tuple[float, float] = (9, 6)) -> tuple[Any, Any]:
    fig = _figure(figsize)
    ax = fig.subplots()
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3)
    return fig, ax


def _class_lines(ax: Any, x: np.ndarray, ys: np.ndarray, classes: np.ndarray, names: Any, labels: list[str]) -> None:
    """Thin per-class lines, named in the legend when there are few enough classes."""
    legend = len(classes) <= MAX_LEGEND_CLASSES
    for y, c, lab in zip(ys, classes, labels):
        ax.plot(x, y, lw=1, color=_mpl_color(int(c)), label=f"{_name(names, int(c))} {lab}" if legend else None)
    if not legend:
        ax.plot([], [], lw=1, color="grey", label=f"{len(classes)} classes")


def _finish_curve(fig: Any, ax: Any, xlabel: str, ylabel: str, path: str | Path) -> Path:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel}-{xlabel} Curve")
    ax.legend(bbox_to_anchor=(1.02, 1), loc="upper left", fontsize=9)
    return _save(fig, path)


def plot_pr_curve(curves: Curves, names: Any, path: str | Path) -> Path:
    """PR_curve.png: COCO interpolated precision vs recall at IoU 0.5; the thick mean line's area is mAP50."""
    fig, ax = _curve_axes()
    ap50 = curves.precision.mean(1) if len(curves.precision) else np.zeros(0)
    _class_lines(ax, curves.recall, curves.precision, curves.classes, names, [f"{a:.3f}" for a in ap50])
    mean = curves.precision.mean(0) if len(curves.precision) else np.zeros_like(curves.recall)
    ax.plot(curves.recall, mean, lw=3, color="blue", label=f"all classes {ap50.mean() if len(ap50) else 0:.3f} mAP@0.5")
    return _finish_curve(fig, ax, "Recall", "Precision", path)


def operating_point(curves: Curves) -> int:
    """Index into curves.px of the confidence where reported P and R are read (best smoothed mean F1)."""
    return int(curves.mean_f1().argmax())


def plot_conf_curve(curves: Curves, names: Any, path: str | Path, kind: str = "F1") -> Path:
    """F1_curve.png / P_curve.png / R_curve.png: metric vs confidence per class and over all classes.

    The thick line for F1 is the smoothed mean whose peak picks the operating confidence
    (metrics.conf); for P and R it is the plain mean, which passes through the reported P and R.
    A dotted line marks that confidence.
    """
    ys = {"F1": curves.f1, "Precision": curves.p, "Recall": curves.r}[kind]
    fig, ax = _curve_axes()
    _class_lines(ax, curves.px, ys, curves.classes, names, [""] * len(ys))
    best = operating_point(curves)
    mean = curves.mean_f1() if kind == "F1" else (ys.mean(0) if len(ys) else np.zeros_like(curves.px))
    ax.plot(curves.px, mean, lw=3, color="blue", label=f"all classes {mean[best]:.2f} at {curves.px[best]:.3f}")
    ax.axvline(curves.px[best], color="grey", ls=":", lw=1.5)
    return _finish_curve(fig, ax, "Confidence", kind, path)


def plot_curves(metrics: DetectionMetrics, save_dir: str | Path) -> list[Path]:
    """PR_curve.png, F1_curve.png, P_curve.png, R_curve.png in save_dir from evaluate()'s result."""
    if metrics.curves is None:
        LOGGER.warning("plot_curves: metrics carry no curves (not from evaluate()); nothing plotted")
        return []
    save_dir, c, names = Path(save_dir), metrics.curves, metrics.names
    out = [plot_pr_curve(c, names, save_dir / "PR_curve.png")]
    for kind, file in (("F1", "F1_curve.png"), ("Precision", "P_curve.png"), ("Recall", "R_curve.png")):
        out.append(plot_conf_curve(c, names, save_dir / file, kind))
    return out


# ---------------------------------------------------------------- confusion matrix
def normalize_confusion(matrix: Any) -> np.ndarray:
    """matrix[pred, true] divided by each true column's total (empty columns stay 0)."""
    m = np.asarray(matrix, np.float64)
    total = m.sum(0, keepdims=True)
    return np.divide(m, total, out=np.zeros_like(m), where=total > 0)


def plot_confusion_matrix(matrix: Any, names: Any, path: str | Path, normalize: bool = True) -> Path:
    """confusion_matrix.png from ConfusionMatrix.matrix ([pred, true], background last)."""
    m = normalize_confusion(matrix) if normalize else np.asarray(matrix, np.float64)
    nc = m.shape[0] - 1
    labels = [_name(names, i) for i in range(nc)] + ["background"]
    side = min(max(6.0, 0.45 * (nc + 1) + 3), 24.0)
    fig = _figure((side * 1.15, side))
    ax = fig.subplots()
    vmax = 1.0 if normalize else max(float(m.max()), 1.0)
    shown = np.where(m < 0.005 * vmax, np.nan, m)  # blank, not dark blue, where nothing happened
    im = ax.imshow(shown, cmap="Blues", vmin=0.0, vmax=vmax)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    if nc < MAX_ANNOTATED_CLASSES:
        for (i, j), v in np.ndenumerate(m):
            if v >= 0.005 * vmax:
                ax.text(j, i, f"{v:.2f}" if normalize else f"{int(v)}", ha="center", va="center", fontsize=8,
                        color="white" if v > 0.5 * vmax else "black")
    if nc < 100:
        ax.set_xticks(range(nc + 1), labels, rotation=90)
        ax.set_yticks(range(nc + 1), labels)
    ax.set_xlabel("True")
    ax.set_ylabel("Predicted")
    ax.set_title("Confusion Matrix" + (" (normalised per true class)" if normalize else ""))
    return _save(fig, path)


# ---------------------------------------------------------------- dataset labels
def _stack_labels(labels: Any) -> np.ndarray:
    """(N, 5) [cls, xc, yc, w, h] from one array, a list of per-image arrays or dataset.labels (a LabelTable)."""
    if isinstance(labels, LabelTable):
        return labels.stacked()
    if isinstance(labels, (list, tuple)):
        parts = [_to_numpy(x).reshape(-1, 5) for x in labels]
        return np.concatenate(parts).astype(np.float64) if parts else np.zeros((0, 5))
    return _to_numpy(labels).reshape(-1, 5).astype(np.float64)


def plot_labels(labels: Any, names: Any, path: str | Path, max_boxes: int = 1000) -> Path:
    """labels.jpg: instances per class, box outlines by size, box centres and box sizes.

    labels: LoadImagesAndLabels.labels (per-image [cls, xc, yc, w, h] normalised) or one stacked array.
    """
    lb = _stack_labels(labels)
    cls = lb[:, 0].astype(np.int64)
    nc = max(len(names) if names is not None else 0, int(cls.max()) + 1 if len(cls) else 0)
    fig = _figure((10, 10))
    (a_cls, a_box), (a_xy, a_wh) = fig.subplots(2, 2)
    a_cls.bar(range(nc), np.bincount(cls, minlength=nc), color=[_mpl_color(c) for c in range(nc)])
    a_cls.set_ylabel("instances")
    a_cls.set_title(f"{len(lb)} instances, {nc} classes")
    if nc <= MAX_ANNOTATED_CLASSES:
        a_cls.set_xticks(range(nc), [_name(names, c) for c in range(nc)], rotation=90)
    canvas = np.full((1000, 1000, 3), 255, np.uint8)  # box outlines, all centred, to show sizes
    for c, w, h in lb[:max_boxes, [0, 3, 4]]:
        p1 = (int((0.5 - w / 2) * 999), int((0.5 - h / 2) * 999))
        p2 = (int((0.5 + w / 2) * 999), int((0.5 + h / 2) * 999))
        cv2.rectangle(canvas, p1, p2, class_color(int(c)), 1, cv2.LINE_AA)
    a_box.imshow(canvas, extent=(0, 1, 1, 0))
    a_box.set_title("box outlines (centred)")
    a_box.axis("off")
    for ax, (u, v), (xl, yl) in ((a_xy, (1, 2), ("x", "y")), (a_wh, (3, 4), ("width", "height"))):
        ax.hist2d(lb[:, u], lb[:, v], bins=50, range=[[0, 1], [0, 1]], cmap="Blues", cmin=1, vmin=0)
        ax.set_xlabel(xl)
        ax.set_ylabel(yl)
        ax.set_aspect("equal")
    a_xy.set_ylim(1, 0)  # image coordinates: y grows downwards
    a_xy.set_title("box centres")
    a_wh.set_title("box sizes (fraction of image)")
    fig.tight_layout()
    return _save(fig, path)


# ---------------------------------------------------------------- batch mosaics
def output_to_target(dets: Sequence[Any], max_det: int = 300) -> np.ndarray:
    """NMS output (per image (n, 6) [x1, y1, x2, y2, conf, cls]) -> plot_images rows [i, cls, x1, y1, x2, y2, conf]."""
    rows = [np.zeros((0, 7))]
    for i, d in enumerate(dets):
        d = _to_numpy(d).reshape(-1, 6)[:max_det].astype(np.float64)
        rows.append(np.concatenate([np.full((len(d), 1), i), d[:, 5:6], d[:, :4], d[:, 4:5]], 1))
    return np.concatenate(rows)


def _draw_box(img: np.ndarray, box: np.ndarray, color: tuple[int, int, int], text: str, lw: int, fs: float,
              tile: tuple[int, int, int] = (0, 0, 1 << 30)) -> None:
    """Rectangle with a filled label tab above it, kept inside its tile (x0, y0, x1) where it can be."""
    p1, p2 = (int(box[0]), int(box[1])), (int(box[2]), int(box[3]))
    cv2.rectangle(img, p1, p2, color, lw, cv2.LINE_AA)
    (tw, th), base = cv2.getTextSize(text, cv2.FONT_HERSHEY_SIMPLEX, fs, max(lw - 1, 1))
    above = p1[1] - th - base >= tile[1]
    q1 = (max(min(p1[0], tile[2] - tw), tile[0]), p1[1] - th - base if above else p1[1])
    cv2.rectangle(img, q1, (q1[0] + tw, q1[1] + th + base), color, -1, cv2.LINE_AA)
    ink = (0, 0, 0) if sum(c * k for c, k in zip(color, (0.299, 0.587, 0.114))) > 150 else (255, 255, 255)
    cv2.putText(img, text, (q1[0], q1[1] + th), cv2.FONT_HERSHEY_SIMPLEX, fs, ink, max(lw - 1, 1), cv2.LINE_AA)


def draw_detections(img: np.ndarray, det: Any, names: Any, line_width: int = 0, labels: bool = True,
                    conf: bool = True) -> np.ndarray:
    """Draw (n, 6) [x1, y1, x2, y2, conf, cls] original-pixel detections on a BGR image, in place.

    Colours are the class colours of every other picture (class_color, given here in BGR order).
    ``line_width`` 0 scales with the image (YOLOv5's Annotator rule, 2 px at least), so boxes stay
    visible on a 4K frame and do not swamp a thumbnail. Returns ``img``.
    """
    d = _to_numpy(det).reshape(-1, 6)
    lw = line_width or max(round(sum(img.shape[:2]) / 2 * 0.003), 2)
    fs = lw / 3
    for x1, y1, x2, y2, score, c in d[::-1].tolist():  # the most confident last, on top (as YOLOv5 draws)
        text = (_name(names, int(c)) + (f" {score:.2f}" if conf else "")) if labels else ""
        color = class_color(int(c))[::-1]
        if text:
            _draw_box(img, np.array([x1, y1, x2, y2]), color, text, lw, fs, tile=(0, 0, img.shape[1]))
        else:
            cv2.rectangle(img, (int(x1), int(y1)), (int(x2), int(y2)), color, lw, cv2.LINE_AA)
    return img


def plot_images(images: Any, targets: Any, paths: Sequence[str] | None, names: Any, path: str | Path,
                max_subplots: int = 16, conf_thres: float = 0.25) -> Path:
    """A grid of batch images with their boxes: train_batch*.jpg, val_batch*_labels.jpg / _pred.jpg.

    images: uint8 (B, 3, H, W) RGB (Batch.images). targets: labels [i, cls, xc, yc, w, h] normalised
    (Batch.targets) or predictions [i, cls, x1, y1, x2, y2, conf] in letterboxed pixels
    (output_to_target); predictions show their confidence and only those above conf_thres.
    """
    imgs = _to_numpy(images)
    if imgs.dtype != np.uint8:
        imgs = np.clip(imgs * (255 if imgs.max() <= 1 else 1), 0, 255).astype(np.uint8)
    t = _to_numpy(targets).astype(np.float64)
    t = t.reshape(-1, t.shape[-1] if t.ndim == 2 and t.shape[-1] in (6, 7) else 6)
    bs = min(len(imgs), max_subplots)
    ns = max(math.ceil(math.sqrt(bs)), 1)
    h, w = imgs.shape[2:] if bs else (64, 64)
    scale = min(max(h, w, 256), 1920 // ns) / max(h, w)  # small images are enlarged so text stays readable
    th, tw = round(h * scale), round(w * scale)
    mosaic = np.full((math.ceil(bs / ns) * th if bs else th, ns * tw, 3), 255, np.uint8)
    lw = max(round(max(th, tw) / 160), 1)
    fs = max(th, tw) / 640
    for i in range(bs):
        x0, y0 = (i % ns) * tw, (i // ns) * th
        mosaic[y0:y0 + th, x0:x0 + tw] = cv2.resize(np.ascontiguousarray(imgs[i].transpose(1, 2, 0)), (tw, th),
                                                    interpolation=cv2.INTER_LINEAR)
        rows = t[t[:, 0] == i]
        if t.shape[1] == 7:  # predictions: pixel xyxy + conf
            rows = rows[rows[:, 6] > conf_thres]
            boxes, confs = rows[:, 2:6] * scale, rows[:, 6]
        else:  # labels: normalised xywh
            xy, wh = rows[:, 2:4], rows[:, 4:6]
            boxes, confs = np.concatenate([xy - wh / 2, xy + wh / 2], 1) * (tw, th, tw, th), None
        boxes = np.clip(boxes, 0, (tw - 1, th - 1, tw - 1, th - 1)) + (x0, y0, x0, y0)
        for k, (c, box) in enumerate(zip(rows[:, 1].astype(np.int64), boxes)):
            text = _name(names, int(c)) + (f" {confs[k]:.2f}" if confs is not None else "")
            _draw_box(mosaic, box, class_color(int(c)), text, lw, fs, tile=(x0, y0, x0 + tw))
        if paths is not None and i < len(paths):
            cv2.putText(mosaic, Path(paths[i]).name[:40], (x0 + 5, y0 + th - 6), cv2.FONT_HERSHEY_SIMPLEX, fs,
                        (220, 220, 220), max(lw - 1, 1), cv2.LINE_AA)
        cv2.rectangle(mosaic, (x0, y0), (x0 + tw - 1, y0 + th - 1), (255, 255, 255), max(lw, 2))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not cv2.imwrite(str(path), cv2.cvtColor(mosaic, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 90]):
        raise OSError(f"cannot write {path}")
    return path
