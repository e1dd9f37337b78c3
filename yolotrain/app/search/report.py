"""A study's results, written beside its trials' run folders: the best trial's hyp file (ready for
``train.py --hyp``), a CSV of every trial, and Optuna's matplotlib pictures of the search."""
from __future__ import annotations

import csv
import warnings
from pathlib import Path
from typing import Any

import yaml

from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.core.hyp import load_hyp
from yolotrain.utils.core.logging import LOGGER
from yolotrain.app.search.study import retried_from

try:  # optional (requirements-tune.txt): tune.py says what to install when it is missing
    import optuna
    from optuna.trial import TrialState
except ModuleNotFoundError:
    optuna = None

BEST_HYP = "best_hyp.yaml"
TRIALS_CSV = "trials.csv"
PICTURES = {"history.png": "plot_optimization_history", "importances.png": "plot_param_importances",
            "parallel.png": "plot_parallel_coordinate"}


def write_results(study: Any, folder: Path, base: Path) -> list[Path]:
    """Every result file this study can give now; a picture Optuna cannot draw is skipped with one line."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [write_csv(study, folder / TRIALS_CSV)]
    best = best_hyp(study, base, folder / BEST_HYP)
    written += [best] if best else []
    written += [p for name, fn in PICTURES.items() if (p := draw(study, fn, folder / name))]
    return written


def write_csv(study: Any, path: Path) -> Path:
    """One row per trial: number, state, fitness, times, each parameter, its run folder and what it retried."""
    ts = study.get_trials(deepcopy=False)
    names = sorted({k for t in ts for k in t.params})
    with atomic_write(path, "w", encoding="utf-8") as f:
        out = csv.writer(f, lineterminator="\n")
        out.writerow(["number", "state", "fitness", "start", "complete", "seconds", *names, "run_dir", "retried_from",
                      "surplus"])
        for t in ts:
            seconds = f"{t.duration.total_seconds():.1f}" if t.duration else ""
            out.writerow([t.number, t.state.name, _blank(t.value), _when(t.datetime_start), _when(t.datetime_complete),
                          seconds, *(t.params.get(k, "") for k in names), t.user_attrs.get("run_dir", ""),
                          _blank(retried_from(t)), _blank(t.user_attrs.get("surplus"))])
    return path


def _when(d: Any) -> str:
    return d.isoformat(timespec="seconds") if d else ""


def _blank(v: Any) -> Any:
    return "" if v is None else v


def best_hyp(study: Any, base: Path, path: Path) -> Path | None:
    """The best complete trial's hyp: the base hyp with its parameters written over it (so a trial trained on
    another machine gives the same file); '# comment' lines say which trial."""
    done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if not done:
        LOGGER.info(f"{path.name}: no complete trial yet")
        return None
    best = max(done, key=lambda t: t.value)
    hyp = {**load_hyp(base).as_dict(), **best.params}
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(f"# study '{study.study_name}': trial {best.number}, fitness {best.value:.5f}, base {base}\n")
        yaml.safe_dump(hyp, f, sort_keys=False)
    LOGGER.info(f"best: trial {best.number}, fitness {best.value:.5f} -> {path}")
    return path


def draw(study: Any, name: str, path: Path) -> Path | None:
    """One of optuna.visualization.matplotlib's pictures, or None (with a line saying why) when it cannot be drawn."""
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # ExperimentalWarning: the matplotlib backend
            ax = getattr(vis, name)(study)
        fig = (ax.flat[0] if hasattr(ax, "flat") else ax).get_figure()
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        return path
    except Exception as e:  # noqa: BLE001: too few trials, one parameter, a study with no complete trial...
        LOGGER.info(f"{path.name} skipped: Optuna cannot draw it yet ({type(e).__name__}: {e})")
        plt.close("all")
        return None
