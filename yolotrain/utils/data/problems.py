"""What the user is told about a scan's problems: the console list, the report file, and the
verdict on splits without labels (with the likely reason, e.g. a misnamed label folder).

Every check here is deterministic from the scan alone, so every rank reaches the same verdict and
message without talking to the others.
"""
from __future__ import annotations

import itertools
import os
import re
from pathlib import Path
from typing import Sequence

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.core.fileio import atomic_write
from yolotrain.utils.core.logging import LOGGER
from yolotrain.utils.data.labels import ScanResult

MAX_REPORTED = 20  # console lines of problems per split; the report file lists every problem
MAX_ROWS_REPORTED = 5  # console lines per file, so one bad file does not hide the others
MISSING_WARN_MIN = 10  # a training split warns when more than this many, and over half, lack a label file
LABEL_DIR_LIKE = ("label", "annot", "ann", "anns", "anno", "annos", "gt", "yolo", "txt", "bbox", "bboxes", "boxes")


# ---------------------------------------------------------------- problem lists
def _console_lines(msgs: Sequence[str]) -> tuple[list[str], int]:
    """At most MAX_REPORTED lines, at most MAX_ROWS_REPORTED problems per file, and how many problems they show.

    A file's messages are consecutive and start with its path, so one flooded label file
    cannot hide the problems of the files after it.
    """
    lines: list[str] = []
    shown = 0
    for file, group in itertools.groupby(msgs, key=lambda m: m.split(": ", 1)[0]):
        items = list(group)
        take = items[:min(MAX_ROWS_REPORTED, MAX_REPORTED - len(lines))]
        lines += take
        shown += len(take)
        if len(lines) >= MAX_REPORTED:
            break
        if len(items) > len(take):
            lines.append(f"{file}: ... and {len(items) - len(take)} more problem(s) in this file")
    return lines, shown


def report_messages(msgs: Sequence[str], prefix: str = "", report: Path | None = None) -> None:
    """Log scan problems as warnings: a short list on the console, pointing at ``report`` (every problem)."""
    if not msgs:
        return
    shown, n_shown = _console_lines(msgs)
    where = f" (all listed in {report})" if report else ""
    if n_shown < len(msgs):
        shown.append(f"... and {len(msgs) - n_shown} more" + (f": see {report}" if report else ""))
    LOGGER.warning(f"{prefix}WARNING: {len(msgs)} dataset problem(s){where}:\n" + "\n".join(shown))


def write_problem_report(msgs: Sequence[str], report_dir: Path, split: str, source: str) -> Path | None:
    """Every problem of a split, one a line, in ``report_dir/dataset_problems_<split>.txt``; None if there are none.

    The console shows only the first few, so this file is where the rest can be read. Called by
    rank 0 only, also for a cached scan. A run without problems removes an older run's report
    from the same folder (resume, --exist-ok) so that it cannot be mistaken for this run's.
    """
    name = re.sub(r"[^\w.-]", "_", split) or "split"
    path = Path(report_dir) / f"dataset_problems_{name}.txt"
    try:
        if not msgs:
            path.unlink(missing_ok=True)
            return None
        with atomic_write(path, "w", encoding="utf-8") as f:
            f.write(f"# dataset problems, split {split}: {source}\n"
                    f"# {len(msgs)} problem(s), one per line: file[: line N]: reason; what was done\n")
            f.writelines(" ".join(m.splitlines()) + "\n" for m in msgs)
    except OSError as e:
        LOGGER.warning(f"WARNING: cannot write {path} ({e.strerror or e}); the problems are only in the log")
        return None
    return path


# ---------------------------------------------------------------- splits without labels
def _folders(files: Sequence[str], limit: int = 3) -> str:
    """Distinct parent folders of ``files`` (first ``limit``, in order), for messages."""
    parents = list(dict.fromkeys(os.path.dirname(f) + os.sep for f in files))
    more = f" (and {len(parents) - limit} more folders)" if len(parents) > limit else ""
    return ", ".join(parents[:limit]) + more


def _label_dir_like(name: str) -> bool:
    """Whether a folder name looks like one meant to hold annotations (label/, Labels/, annotations/...)."""
    low = name.lower()
    return "label" in low or "annot" in low or low in LABEL_DIR_LIKE


def _label_like_dirs(parent: Path, tail: str, skip: str | None) -> list[tuple[Path, str]]:
    """Label-like folders in ``parent`` (at most 3), each with a note when it holds the label ``tail`` names."""
    try:
        names = sorted(d for d in os.listdir(parent) if d != skip and _label_dir_like(d) and (parent / d).is_dir())
    except OSError:
        return []
    out = []
    for d in names[:3]:
        held = parent / d / (os.path.splitext(tail)[0] + ".txt") if tail else None
        out.append((parent / d, f", which holds {held}" if held is not None and held.is_file() else ""))
    return out


def _sibling_hints(img: str) -> list[str]:
    """Label-like folders where the images/ -> labels/ rule did not look, near one image."""
    sa = f"{os.sep}images{os.sep}"
    if sa in img:
        head, tail = img.rsplit(sa, 1)
        return [f"found {d}{os.sep} beside the expected {Path(head) / 'labels'}{os.sep}{held}: "
                f"the folder must be named exactly 'labels'"
                for d, held in _label_like_dirs(Path(head), tail, "labels")]
    folder = Path(img).parent
    hints = [f"the image path {folder}{os.sep} has a folder named '{p}': the rule needs exactly 'images'"
             for p in folder.parts if p.lower() == "images"][:1]
    for parent in [q for q in list(folder.parents)[:2] if q != q.parent]:
        dirs = _label_like_dirs(parent, "", None)
        if dirs:
            hints.append(f"found {', '.join(f'{d}{os.sep}' for d, _ in dirs)}, but the image path {folder}{os.sep} "
                         f"has no 'images' folder, so labels are looked for beside the images: put the images under "
                         f"an 'images' folder with the labels in the matching 'labels' folder")
            break
    return hints


def _beside_hints(imgs: Sequence[str], label_files: Sequence[str]) -> list[str]:
    """Annotation files with the images' names lying beside the images (where the rule does not look)."""
    hints = []
    for ext, what in ((".txt", "move them to {folder} (the images/ -> labels/ rule)"),
                      (".xml", "Pascal VOC annotations: convert them to YOLO .txt rows in {folder}"),
                      (".json", "json annotations (LabelMe, COCO...): convert them to YOLO .txt rows in {folder}")):
        hits = [(os.path.splitext(i)[0] + ext, lf) for i, lf in zip(imgs, label_files)
                if os.path.splitext(i)[0] + ext != lf and os.path.isfile(os.path.splitext(i)[0] + ext)]
        if hits:
            hints.append(f"{len(hits)} {ext} file(s) lie beside the images (e.g. {hits[0][0]}): "
                         + what.format(folder=_folders([lf for _, lf in hits], limit=1)))
    return hints


def label_hints(imgs: Sequence[str], label_files: Sequence[str], sample: int = 200) -> list[str]:
    """Likely reasons why these images' label files were not found (misnamed folder, files beside the images)."""
    imgs, label_files = list(imgs)[:sample], list(label_files)[:sample]
    hints: list[str] = []
    for parent_img in dict.fromkeys(os.path.dirname(i) for i in imgs[:50]):
        first = next(i for i in imgs if os.path.dirname(i) == parent_img)
        hints += [h for h in _sibling_hints(first) if h not in hints]
        if len(hints) >= 3:
            break
    return hints[:3] + _beside_hints(imgs, label_files)


LABEL_RULE = ("the last 'images' folder of an image path becomes 'labels' and the suffix .txt ({img} -> {lbl}); "
              "an image path without an 'images' folder has its labels beside the image")
NO_LABELS_POLICY = ("There is no option to train without labels: a detector trained on zero boxes learns nothing. "
                    "Images without a label file are fine as background images mixed with labelled ones.")


def _no_labels_detail(result: ScanResult) -> str | None:
    """Why no usable image has a box, naming where labels were looked for; None when some image has one."""
    if any(len(x) for x in result.labels):
        return None
    c, n = result.counts, len(result.img_files)
    pairs = [(i, lf) for i, lf in zip(result.img_files, result.label_files) if not os.path.isfile(lf)]
    if len(pairs) == n:
        text = f"no label file found for any of its {n} images"
    else:
        text = (f"no usable label in any of its {n} images: {c.get('empty', 0)} label file(s) empty, "
                f"{c.get('found', 0)} with only bad rows ({c.get('dropped', 0)} rows dropped, see the dataset "
                f"problems)" + (f", {len(pairs)} image(s) without a label file" if pairs else ""))
    imgs, label_files = zip(*pairs) if pairs else (result.img_files, result.label_files)
    text += f". Looked for label files in {_folders(label_files)}: {LABEL_RULE.format(img=imgs[0], lbl=label_files[0])}"
    hints = label_hints(imgs, label_files) if pairs else []
    return text + (". Likely cause: " + "; ".join(hints) if hints else "")


def check_label_presence(result: ScanResult, where: str, role: str | None, prefix: str = "",
                         verbose: bool = True) -> None:
    """A training split without any box is a UserError; a validation split without any box, or a training
    split where most images lack a label file, is one loud warning (on the ``verbose`` rank).

    Deterministic from the scan alone, like require_usable, so every rank reaches the same verdict.
    ``role`` is "train", "val" (any evaluation split) or None (no check, for direct use).
    """
    if role not in (None, "train", "val"):
        raise ValueError(f"role must be 'train', 'val' or None, not {role!r}")
    if role is None or (role == "val" and not verbose):
        return
    detail = _no_labels_detail(result)
    if detail is not None and role == "train":
        raise UserError(f"{where}: {detail}. Training cannot start. {NO_LABELS_POLICY}")
    if detail is not None and verbose:
        LOGGER.warning(f"{prefix}WARNING: {where}: {detail}. Every metric will be zero.")
    if detail is None and role == "train" and verbose:
        warn_missing_labels(result, where, prefix)


def warn_missing_labels(result: ScanResult, where: str, prefix: str = "") -> None:
    """One warning when over half of a training split's images (and more than MISSING_WARN_MIN) lack a label file."""
    n, n_missing = len(result.img_files), int(result.counts.get("missing", 0))
    if n_missing <= MISSING_WARN_MIN or 2 * n_missing <= n:
        return
    pairs = [(i, lf) for i, lf, lb in zip(result.img_files, result.label_files, result.labels)
             if not len(lb) and not os.path.isfile(lf)]
    if not pairs:
        return
    imgs, missing = zip(*pairs)
    hints = label_hints(imgs, missing)
    LOGGER.warning(f"{prefix}WARNING: {where}: {len(missing)} of {n} images have no label file and train as "
                   f"background images. Looked for their label files in {_folders(missing)}: "
                   f"{LABEL_RULE.format(img=imgs[0], lbl=missing[0])}"
                   + (". Likely cause: " + "; ".join(hints) if hints else "")
                   + ". If they are meant as backgrounds, all is well.")
