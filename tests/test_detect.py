"""detect.py: images, folders, globs, .txt lists and videos; corrupt files skipped and named; the same
files on 1 and 2 ranks; val.py's boxes at val.py's settings; one-line errors for bad input."""
from __future__ import annotations

import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from tests.helpers import PYTHON, TORCHRUN, out, run
from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data.sources import assign_videos, letterbox_image, resolve_sources, unique_stems

VIDEO_FRAMES, VIDEO_FPS = 10, 12.5
COMMON = ["--save-txt", "--save-conf", "--batch-size", "6"]  # 3 per rank on two ranks


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under a run folder but summary.json (its timings differ run to run), by relative path."""
    return {str(f.relative_to(folder)): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file() and f.name != "summary.json"}


@pytest.fixture(scope="module")
def val_images(tiny_data) -> Path:
    from yolotrain.utils.data.config import load_data_config, prepare_dataset

    data = load_data_config(tiny_data)
    prepare_dataset(data)
    return Path(data.val[0]) if isinstance(data.val, list) else Path(data.val)


@pytest.fixture(scope="module")
def source_dir(val_images, once) -> Path:
    """The 8 val images, a truncated JPEG, a 10-frame mp4 at 12.5 fps and a video that is not one (made once per
    test run)."""
    return once("detect-source", lambda folder: _fill_source(folder, val_images))


def _fill_source(folder: Path, val_images: Path) -> None:
    images = sorted(val_images.glob("*.jpg"))
    for f in images:
        (folder / f.name).write_bytes(f.read_bytes())
    (folder / "broken.jpg").write_bytes(images[1].read_bytes()[:400])
    writer = cv2.VideoWriter(str(folder / "clip.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), VIDEO_FPS, (80, 64))
    for f in images[:VIDEO_FRAMES] + images[:VIDEO_FRAMES - len(images)]:
        writer.write(cv2.resize(cv2.imread(str(f)), (80, 64)))
    writer.release()
    (folder / "notavideo.mp4").write_text("not a video\n")
    (folder / "readme.md").write_text("ignored: neither an image nor a video\n")


def _close_rows(a: bytes, b: bytes) -> bool:
    """Two label files alike: the same rows and classes, each value within 1 in its last printed digit (a rank's
    batch of another size may move a value's last bits on some CPUs: docs/architecture.md, "Why the numbers do not
    depend on the world size")."""
    ra, rb = (np.array([r.split() for r in x.decode().splitlines()], float).reshape(-1, 6) for x in (a, b))
    return ra.shape == rb.shape and np.array_equal(ra[:, 0], rb[:, 0]) and np.abs(ra - rb).max(initial=0) <= 1.5e-6


@pytest.fixture(scope="module")
def one_rank(tiny_v5n, source_dir, once) -> tuple[str, Path]:
    """detect.py on source_dir in one process (run once per test run): (its output, its run folder)."""
    def build(project: Path) -> None:
        p = run([PYTHON, "detect.py", "--weights", tiny_v5n, "--source", source_dir, *COMMON, "--save-crop",
                 "--workers", "1", "--project", project, "--name", "one"], timeout=300)
        (project / "output.txt").write_text(out(p))

    project = once("detect-one-rank", build)
    return (project / "output.txt").read_text(), project / "one"


@pytest.mark.slow
def test_folder_with_images_video_and_corrupt_files(one_rank, source_dir):
    text, run_dir = one_rank
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["images"], summary["videos"], summary["frames"]) == (8, 1, VIDEO_FRAMES)
    skipped = dict(summary["skipped"])
    assert sorted(skipped) == [str(source_dir / "broken.jpg"), str(source_dir / "notavideo.mp4")]
    assert "truncated JPEG" in skipped[str(source_dir / "broken.jpg")]
    assert "cannot open video" in skipped[str(source_dir / "notavideo.mp4")]
    assert f"skipped {source_dir / 'broken.jpg'}: truncated JPEG" in text and "2 skipped" in text
    assert sum(summary["detections"].values()) > 0 and "Speed: " in text
    for f in sorted(source_dir.glob("val_*.jpg")):  # annotated copies at the original size, boxes drawn
        drawn = cv2.imread(str(run_dir / f.name))
        assert drawn.shape == cv2.imread(str(f)).shape and not np.array_equal(drawn, cv2.imread(str(f)))
    labels = sorted(p.name for p in (run_dir / "labels").glob("*.txt"))
    assert [n for n in labels if n.startswith("clip_")] == sorted(f"clip_{i}.txt" for i in range(1, VIDEO_FRAMES + 1))
    rows = np.array([r.split() for p in (run_dir / "labels").glob("*.txt") for r in p.read_text().splitlines()], float)
    assert rows.shape[1] == 6 and rows[:, 1:5].min() >= 0 and rows[:, 1:5].max() <= 1 and rows[:, 5].min() >= 0.25
    assert any((run_dir / "crops").rglob("*.jpg"))
    video = cv2.VideoCapture(str(run_dir / "clip.mp4"))  # plays back: frame count, rate and size kept
    assert video.isOpened() and video.get(cv2.CAP_PROP_FPS) == pytest.approx(VIDEO_FPS, abs=0.01)
    frames = 0
    while True:
        ok, frame = video.read()
        if not ok:
            break
        assert frame.shape[:2] == (64, 80)
        frames += 1
    assert frames == VIDEO_FRAMES
    assert not (run_dir / "notavideo.mp4").exists() and not (run_dir / "broken.jpg").exists()


@pytest.mark.slow
@pytest.mark.dist
def test_two_ranks_write_the_same_files_once(one_rank, tiny_v5n, source_dir, tmp_path):
    _, one = one_rank
    two = tmp_path / "two"
    run([*TORCHRUN, "detect.py", "--weights", tiny_v5n, "--source", source_dir, *COMMON, "--save-crop", "--workers",
         "1", "--project", tmp_path, "--name", "two"], timeout=300)
    a, b = _files(one), _files(two)
    assert sorted(a) == sorted(b)
    labels = [k for k in a if k.endswith(".txt")]
    assert labels and all(a[k] == b[k] for k in a if k not in labels)  # images, video and crops byte for byte
    assert all(_close_rows(a[k], b[k]) for k in labels), [k for k in labels if a[k] != b[k]]  # to the last digit
    a, b = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    timing = ("speed_ms", "wall_s", "world_size", "save_dir")
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    assert b["world_size"] == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["two"]  # one folder, by rank 0


def _detect(argv: list[str]) -> dict:
    from yolotrain.app import detect

    summary = detect.main(detect.parse_opt(argv))
    return json.loads((Path(summary.save_dir) / "summary.json").read_text())


@pytest.mark.slow
def test_glob_and_txt_list_give_the_folder_run_labels(one_rank, tiny_v5n, source_dir, tmp_path, one_thread,
                                                      restore_logger):
    _, one = one_rank
    base = ["--weights", str(tiny_v5n), *COMMON, "--workers", "0", "--nosave", "--project", str(tmp_path)]
    s = _detect([*base, "--source", str(source_dir / "val_00000[0-3].jpg"), "--name", "glob"])
    assert (s["images"], s["videos"], s["skipped"]) == (4, 0, [])
    lst = tmp_path / "list.txt"
    lst.write_text("# relative to this file\n" + "".join(f"{source_dir.name}/val_00000{i}.jpg\n" for i in (5, 6))
                   + f"{source_dir / 'val_000007.jpg'}\nmissing.jpg\n")
    (tmp_path / source_dir.name).symlink_to(source_dir)
    s = _detect([*base, "--source", str(lst), "--name", "list"])
    assert (s["images"], s["skipped"]) == (3, [[str(tmp_path / "missing.jpg"), f"listed in {lst} but not found"]])
    got = {**_files(tmp_path / "glob"), **_files(tmp_path / "list")}
    assert got and got == {k: v for k, v in _files(one).items() if k in got}
    assert sorted(got) == [f"labels/val_00000{i}.txt" for i in (0, 1, 2, 3, 5, 6, 7)]  # --nosave: labels only


@pytest.mark.slow
def test_boxes_equal_val_py_at_its_settings(tiny_v5n, tiny_data, val_images, tmp_path, one_thread, restore_logger):
    """detect.py --multi-label and val.py --no-rect at the same thresholds write the same label files."""
    from yolotrain.app import val

    thresholds = ["--conf-thres", "0.25", "--iou-thres", "0.45", "--max-det", "300", "--batch-size", "4",
                  "--workers", "0", "--save-txt", "--save-conf", "--project", str(tmp_path)]
    val.main(val.parse_opt(["--weights", str(tiny_v5n), "--data", str(tiny_data), "--no-rect", "--noplots",
                            *thresholds, "--name", "val"]))
    _detect(["--weights", str(tiny_v5n), "--source", str(val_images), "--multi-label", "--nosave", *thresholds,
             "--name", "detect"])
    a, b = _files(tmp_path / "val" / "labels"), _files(tmp_path / "detect" / "labels")
    assert a and a == b


def _one_error(capsys, argv: list[str]) -> str:
    from yolotrain.app import detect

    assert detect.cli(argv) == 1
    out = capsys.readouterr()
    text = out.out + out.err
    errors = [line for line in text.splitlines() if line.startswith("ERROR")]
    assert "Traceback" not in text and len(errors) == 1, text
    return errors[0]


def test_bad_input_is_one_clear_error(source_dir, tmp_path, capsys, restore_logger):
    argv = ["--project", str(tmp_path / "runs")]
    weights = str(tmp_path / "never_read.pt")  # sources are checked first
    assert _one_error(capsys, ["--weights", weights, "--source", str(tmp_path / "nope"), *argv]) == \
        f"ERROR: {tmp_path / 'nope'}: does not exist"
    (tmp_path / "empty").mkdir()
    assert _one_error(capsys, ["--weights", weights, "--source", str(tmp_path / "empty"), *argv]).startswith(
        f"ERROR: {tmp_path / 'empty'}: folder has no images or videos")
    fake = tmp_path / "fake.pt"
    fake.write_text("not a checkpoint")
    assert _one_error(capsys, ["--weights", str(fake), "--source", str(source_dir), *argv]).startswith(
        f"ERROR: {fake}: not a readable yolotrain checkpoint")
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_onnx_without_metadata_is_one_clear_error(source_dir, tmp_path, capsys, restore_logger):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, 64, 64])
    y = helper.make_tensor_value_info("output0", TensorProto.FLOAT, [1, 3, 64, 64])
    graph = helper.make_graph([helper.make_node("Identity", ["images"], ["output0"])], "foreign", [x], [y])
    path = tmp_path / "foreign.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    assert _one_error(capsys, ["--weights", str(path), "--source", str(source_dir), "--project", str(tmp_path)]) \
        .startswith(f"ERROR: {path}: no yolotrain metadata")


@pytest.mark.slow
def test_missing_source_exits_1_with_one_line(tiny_v5n, tmp_path):
    p = run([PYTHON, "detect.py", "--weights", tiny_v5n, "--source", tmp_path / "nope.jpg"], ok=False)
    assert p.returncode == 1 and "Traceback" not in out(p)
    assert out(p).strip() == f"ERROR: {tmp_path / 'nope.jpg'}: does not exist"


# ---------------------------------------------------------------- library units
def test_letterbox_equals_the_val_loaders_square_input(tmp_path):
    from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels

    rng = np.random.default_rng(0)
    (tmp_path / "images").mkdir()
    for i, (h, w) in enumerate([(40, 130), (130, 40), (64, 64), (200, 90), (17, 300)]):
        cv2.imwrite(str(tmp_path / "images" / f"im{i}.png"), rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
    dataset = LoadImagesAndLabels(DatasetSpec(str(tmp_path / "images"), nc=1, img_size=96), verbose=False)
    for k, f in enumerate(dataset.im_files):
        image, _, _, placed, _ = dataset[k]
        mine, my_placed = letterbox_image(cv2.imread(f), 96)
        assert torch.equal(mine, image) and my_placed == placed


def test_sources_resolve_in_order_with_unique_stems(tmp_path):
    (tmp_path / "a" / "deep").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    for f in ("a/x.jpg", "a/y.png", "a/deep/z.jpg", "b/x.jpg", "b/v.mp4", "b/notes.txt"):
        (tmp_path / f).write_bytes(b"")
    s = resolve_sources([str(tmp_path / "b"), str(tmp_path / "a"), str(tmp_path / "a" / "x.jpg")])
    assert s.images == [str(tmp_path / p) for p in ("b/x.jpg", "a/x.jpg", "a/y.png")]  # folders: not recursive
    assert s.videos == [str(tmp_path / "b/v.mp4")] and s.duplicates == 1
    assert [s.stems[p] for p in s.images + s.videos] == ["x", "x_2", "y", "v"]
    g = resolve_sources([str(tmp_path / "**" / "*.jpg")])  # a ** glob recurses
    assert g.images == sorted(str(tmp_path / p) for p in ("a/x.jpg", "a/deep/z.jpg", "b/x.jpg"))
    assert unique_stems(["p/x.jpg", "q/x.jpg", "r/x_2.jpg", "s/x.jpg"]) == {"p/x.jpg": "x", "q/x.jpg": "x_2",
                                                                           "r/x_2.jpg": "x_2_2", "s/x.jpg": "x_3"}
    with pytest.raises(UserError, match="notes.txt: the list names no files"):
        resolve_sources([str(tmp_path / "b" / "notes.txt")])
    (tmp_path / "model.yaml").write_text("x: 1\n")
    with pytest.raises(UserError, match="not an image, a video, a folder or a .txt list"):
        resolve_sources([str(tmp_path / "model.yaml")])
    with pytest.raises(UserError, match="no images or videos match"):
        resolve_sources([str(tmp_path / "*.gif")])


def test_videos_go_whole_to_the_least_loaded_rank():
    assert assign_videos([100, 10, 50, 50], 2) == [0, 0, 1, 1]  # 100 + 10 | 50 + 50
    assert assign_videos([100, 10, 50, 50], 2, loads=[60, 0]) == [1, 0, 0, 1]  # 60 + 10 + 50 | 100 + 50
    assert assign_videos([5, 5], 3, loads=[0, 2, 0]) == [0, 2]
    assert assign_videos([0, 0, 0], 1) == [0, 0, 0]


def test_drawn_box_has_the_class_colour_and_a_label():
    from yolotrain.utils.eval.plots import class_color, draw_detections

    img = np.zeros((200, 300, 3), np.uint8)
    draw_detections(img, np.array([[50, 80, 250, 180, 0.9, 3]]), ["a", "b", "c", "star"], line_width=2)
    bgr = class_color(3)[::-1]
    assert tuple(img[130, 50]) == bgr and tuple(img[180, 150]) == bgr  # left and bottom edges
    assert (img[60:78, 52:100] != 0).any()  # the 'star 0.90' tab above the box
    assert not img[100:160, 70:230].any()  # inside stays untouched
    plain = np.zeros_like(img)
    draw_detections(plain, np.array([[50, 80, 250, 180, 0.9, 3]]), None, line_width=2, labels=False)
    assert not plain[60:78, 52:100].any()


def test_cli_numbers_are_range_checked():
    from yolotrain.app import detect
    from tests.helpers import check_defaults, check_numeric_flags

    parser = detect.build_parser()
    assert check_numeric_flags(parser) == [] and check_defaults(parser) == []


@pytest.mark.slow  # trains tiny_v8n when no test has
def test_half_on_cpu_runs_a_checkpoint_in_bf16_near_fp32(tiny_v8n, val_images, one_thread):
    """detect.py --half on CPU: bf16 autocast for a checkpoint (an export keeps its own precision);
    boxes, decoded in fp32, stay within a pixel of fp32 inference's and scores within 0.02. (The
    comparison is before NMS: this barely trained model has many near-tied boxes NMS may order
    either way.)"""
    from yolotrain.utils.infer.backends import load_backend
    from yolotrain.utils.infer.predict import PredictOptions, Predictor

    cpu = torch.device("cpu")
    boxed = [letterbox_image(cv2.imread(str(f)), 64) for f in sorted(val_images.glob("*.jpg"))]
    images, placements = torch.stack([b for b, _ in boxed]), [p for _, p in boxed]
    decoded = []
    for half in (False, True):
        predictor = Predictor(load_backend(tiny_v8n, cpu), cpu, PredictOptions(half=half))
        forward = predictor.backend.forward
        predictor.backend.forward = lambda x, forward=forward: (out := forward(x), decoded.append(out[0]))[0]
        assert predictor.bf16 is half and len(predictor(images, placements)) == len(images)
    fp32, bf16 = decoded
    assert fp32.dtype == bf16.dtype == torch.float32 and not torch.equal(fp32, bf16)
    assert (fp32[..., :4] - bf16[..., :4]).abs().max() < 1 and (fp32[..., 4:] - bf16[..., 4:]).abs().max() < 0.02
