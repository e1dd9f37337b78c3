"""Label scan on a corpus of broken datasets: every bad file is named with its reason (and line),
every good image and box survives, the files on disk are unchanged, and an unusable dataset is one
clear UserError. Also ``read_image_bgr`` on every image mode the scan accepts."""
from __future__ import annotations

import hashlib
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

from yolotrain.utils.core.errors import UserError
from yolotrain.utils.data.dataset import DatasetSpec, LoadImagesAndLabels
from yolotrain.utils.data.images import read_image_bgr
from yolotrain.utils.data.labelcache import load_or_scan
from yolotrain.utils.data.labels import (ScanResult, format_summary, img2label_paths, require_usable, resolve_image_files,
                               scan_labels)

NC = 3
GOOD_ROW = "0 0.5 0.5 0.4 0.4\n"
RED, BLUE = (255, 0, 0), (0, 0, 255)  # RGB

# label file of badrows.jpg: (line, text, reason in the message or None for a good row)
BAD_ROWS = [
    (1, "0 0.5 0.5 0.2 0.2", None),
    (2, "0 0.5 0.5 0.2", "expected 5 columns"),
    (3, "0 0.5 abc 0.2 0.2", "non-numeric value 'abc'"),
    (4, "0 nan 0.5 0.2 0.2", "non-finite value"),
    (5, "1 0.5 inf 0.2 0.2", "non-finite value"),
    (6, "3 0.5 0.5 0.2 0.2", "class outside [0, 2]"),
    (7, "-1 0.5 0.5 0.2 0.2", "class outside [0, 2]"),
    (8, "1.5 0.5 0.5 0.2 0.2", "class 1.5 is not an integer"),
    (9, "0 1.2 0.5 0.2 0.2", "coordinates not normalised"),
    (10, "0 0.5 0.5 0 0.2", "width and height must be > 0"),
    (11, "0 0.5 0.5 0.2 0.2", None),  # duplicate of line 1: removed with a warning
    (12, "2.0 0.25 0.25 0.1 0.1", None),  # integral float class: fine
    (13, "1 0.95 0.5 0.2 0.2", "box extends outside the image, clipped"),  # kept, clipped
    (14, "1 0.1 0.1 0.3 0.1 0.2 0.3", None),  # polygon -> box (0.2, 0.2, 0.2, 0.2)
    (15, "2 1_0 0.5 0.2 0.2", "non-numeric value '1_0'"),
    (16, "1 0.5005 0.5 1.0 0.2", None),  # pokes out by < tolerance: silently clipped
]


def _sha(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _jpeg(path: Path, rgb: np.ndarray, **kw) -> None:
    Image.fromarray(rgb).save(path, quality=95, **kw)


def _patch_rgb(w: int = 48, h: int = 32) -> np.ndarray:
    """Blue image with a red top-left quarter: a known colour patch to find after decoding."""
    a = np.zeros((h, w, 3), np.uint8)
    a[:] = BLUE
    a[: h // 2, : w // 2] = RED
    return a


def _make_corpus(root: Path) -> dict[str, Path]:
    """Every kind of broken file next to good ones; returns name -> image path."""
    img_dir, lbl_dir = root / "images" / "train", root / "labels" / "train"
    img_dir.mkdir(parents=True)
    lbl_dir.mkdir(parents=True)
    p = {n: img_dir / n for n in ("good.jpg", "trunc.jpg", "trunc_bad.jpg", "zero.jpg", "text.jpg", "tiny.png",
                                  "rgba.png", "g16.png", "grey.png", "pal.png", "cmyk.jpg", "exif6.jpg",
                                  "nolabel.jpg", "emptylabel.jpg", "blank.jpg", "crlf.jpg", "badrows.jpg")}
    rgb = _patch_rgb()
    for n in ("good.jpg", "nolabel.jpg", "emptylabel.jpg", "blank.jpg", "crlf.jpg", "badrows.jpg"):
        _jpeg(p[n], rgb)
    full = cv2.imencode(".jpg", np.full((64, 64, 3), 90, np.uint8))[1].tobytes()
    p["trunc.jpg"].write_bytes(full[:-2])  # end marker missing: still decodes
    p["trunc_bad.jpg"].write_bytes(full[:200])  # cut inside the headers
    p["zero.jpg"].write_bytes(b"")
    p["text.jpg"].write_text("this is not an image\n")
    Image.new("RGB", (5, 5), RED).save(p["tiny.png"])
    rgba = np.zeros((30, 40, 4), np.uint8)
    rgba[:, :20] = (*RED, 255)  # opaque red left half
    rgba[:, 20:] = (0, 255, 0, 0)  # transparent (green underneath) right half
    Image.fromarray(rgba, "RGBA").save(p["rgba.png"])
    Image.fromarray(np.full((20, 30), 40000, np.uint16)).save(p["g16.png"])  # mode I;16
    Image.fromarray(np.full((20, 30), 77, np.uint8), "L").save(p["grey.png"])
    pal = Image.fromarray(np.tile(np.array([0, 1], np.uint8).repeat(15), (20, 1)), "P")
    pal.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    pal.save(p["pal.png"])
    cmyk = np.zeros((32, 48, 4), np.uint8)  # white
    cmyk[:, 24:, 0] = 255  # cyan right half
    Image.fromarray(cmyk, "CMYK").save(p["cmyk.jpg"], quality=95)
    stored = np.zeros((20, 40, 3), np.uint8)  # stored 40 wide x 20 tall, red patch top-left
    stored[:10, :10] = RED
    exif = Image.Exif()
    exif[0x0112] = 6  # display rotated 90 degrees clockwise: upright is 20 wide x 40 tall
    _jpeg(p["exif6.jpg"], stored, exif=exif.tobytes())

    def label(name: str, text: str) -> None:
        (lbl_dir / (Path(name).stem + ".txt")).write_bytes(text.encode())

    for n in p:
        if n not in ("nolabel.jpg",):
            label(n, GOOD_ROW)
    label("exif6.jpg", "1 0.75 0.125 0.5 0.25\n")  # the red patch in the upright image
    label("emptylabel.jpg", "")
    label("blank.jpg", "\n  \n\n")
    label("crlf.jpg", "0 0.5 0.5 0.2 0.2\r\n1 0.3 0.3 0.1 0.1\r\n\r\n\r\n")
    label("badrows.jpg", "".join(t + "\n" for _, t, _ in BAD_ROWS) + "\n\n")
    return p


@pytest.fixture
def corpus(tmp_path) -> tuple[Path, dict[str, Path]]:
    root = tmp_path / "broken"
    return root, _make_corpus(root)


def _scan(root: Path, **kw) -> tuple[ScanResult, bool]:
    src = root / "images" / "train"
    imgs = resolve_image_files(src)
    return load_or_scan(src, imgs, img2label_paths(imgs), NC, **kw)


def test_broken_corpus_reasons_counts_and_survivors(corpus):
    root, p = corpus
    before = _sha(root)
    result, hit = _scan(root)
    assert not hit
    text = "\n".join(result.msgs)
    lbl = lambda n: img2label_paths([str(p[n])])[0]  # noqa: E731

    # each bad image is named with its reason, and skipped
    for name, reason in (("trunc_bad.jpg", "truncated JPEG, not decodable"), ("zero.jpg", "empty file (0 bytes)"),
                         ("text.jpg", "unreadable image (not a recognised image format)"),
                         ("tiny.png", "image size 5x5 below 10 pixels")):
        assert f"{p[name]}: {reason}" in text and str(p[name]) not in result.img_files, name
    assert f"{p['trunc.jpg']}: truncated JPEG (no end marker), still readable" in text
    # each bad row is named with file, line and reason; the good rows stay
    for k, row, reason in BAD_ROWS:
        if reason:
            assert f"{lbl('badrows.jpg')}: line {k}: {reason}" in text, (k, row)
    assert f"{lbl('badrows.jpg')}: 1 duplicate label row(s) removed (line 11)" in text
    rows = result.labels[result.img_files.index(str(p["badrows.jpg"]))]
    expect = np.array([[0, 0.5, 0.5, 0.2, 0.2], [2, 0.25, 0.25, 0.1, 0.1], [1, 0.925, 0.5, 0.15, 0.2],
                       [1, 0.2, 0.2, 0.2, 0.2], [1, 0.50025, 0.5, 0.9995, 0.2]], np.float32)
    np.testing.assert_allclose(rows, expect, atol=1e-6)
    crlf = result.labels[result.img_files.index(str(p["crlf.jpg"]))]
    assert len(crlf) == 2 and lbl("crlf.jpg") not in text  # CRLF and trailing blank lines: accepted

    # every good image survives, with its upright size and labels
    good = set(p) - {"trunc_bad.jpg", "zero.jpg", "text.jpg", "tiny.png"}
    assert sorted(result.img_files) == sorted(str(p[n]) for n in good)
    size = {Path(f).name: tuple(hw) for f, hw in zip(result.img_files, result.image_hw.tolist())}
    assert size["exif6.jpg"] == (40, 20) and size["good.jpg"] == (32, 48) and size["rgba.png"] == (30, 40)
    c = result.counts
    assert (c["found"], c["missing"], c["empty"], c["corrupt"]) == (10, 1, 2, 4)
    assert (c["duplicates"], c["dropped"], c["clipped"]) == (1, 10, 1)
    assert c["images"] == 13 and c["backgrounds"] == 3
    assert c["instances"] == 5 + 2 + 8  # badrows + crlf + eight one-box files

    # nothing on disk changed; the only new file is the cache
    after = _sha(root)
    assert {k: v for k, v in after.items() if k in before} == before
    assert set(after) - set(before) == {"labels/train.cache.npz"}

    again, hit = _scan(root)  # the cache gives back the same scan
    assert hit and again.msgs == result.msgs and again.counts == result.counts
    assert all(np.array_equal(a, b) for a, b in zip(again.labels, result.labels))

    table = format_summary(c, "train")
    head, row = table.splitlines()
    assert head.split()[:2] == ["split", "images"] and "corrupt" in head and "bad rows" in head
    assert row.split()[0] == "train" and row.split()[1] == "13"
    assert dict(zip(["split", "images", "backgrounds", "boxes", "found", "missing", "empty", "corrupt"],
                    row.split()))["corrupt"] == "4"


def test_scan_is_the_same_serial_and_parallel(corpus):
    root, _ = corpus
    imgs = resolve_image_files(root / "images" / "train")
    a = scan_labels(imgs, img2label_paths(imgs), NC, num_workers=1)
    b = scan_labels(imgs, img2label_paths(imgs), NC, num_workers=4)
    assert a.img_files == b.img_files and a.msgs == b.msgs and a.counts == b.counts
    assert np.array_equal(a.image_hw, b.image_hw)


def test_read_image_bgr_every_mode(corpus):
    _, p = corpus
    bgr = lambda rgb: np.array(rgb[::-1])  # noqa: E731

    def close(pixel, expect, tol=6):
        assert np.abs(pixel.astype(int) - np.asarray(expect, int)).max() <= tol, (pixel, expect)

    for name in ("good.jpg", "rgba.png", "g16.png", "grey.png", "pal.png", "cmyk.jpg", "exif6.jpg", "trunc.jpg"):
        img = read_image_bgr(p[name])
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3 and img.flags.c_contiguous, name
    good = read_image_bgr(p["good.jpg"])
    assert np.array_equal(good, cv2.imread(str(p["good.jpg"])))  # plain JPEG: exactly what cv2 reads
    close(good[4, 4], bgr(RED)), close(good[28, 40], bgr(BLUE))
    rgba = read_image_bgr(p["rgba.png"])
    close(rgba[5, 5], bgr(RED), 0), close(rgba[5, 30], (114, 114, 114), 0)  # transparent -> grey 114
    close(read_image_bgr(p["g16.png"])[3, 3], (156, 156, 156), 0)  # 40000 / 65535 * 255
    close(read_image_bgr(p["grey.png"])[3, 3], (77, 77, 77), 0)
    pal = read_image_bgr(p["pal.png"])
    close(pal[3, 3], bgr((10, 20, 30)), 0), close(pal[3, 25], bgr((200, 100, 50)), 0)
    cmyk = read_image_bgr(p["cmyk.jpg"])
    close(cmyk[16, 5], (255, 255, 255)), close(cmyk[16, 40], bgr((0, 255, 255)))
    close(read_image_bgr(p["trunc.jpg"])[32, 32], (90, 90, 90))

    up = read_image_bgr(p["exif6.jpg"])  # upright: 20 wide, 40 tall, red patch now top-right
    assert up.shape[:2] == (40, 20)
    close(up[5, 15], bgr(RED), 30), close(up[5, 5], (0, 0, 0), 30), close(up[35, 15], (0, 0, 0), 30)
    xc, yc, w, h = 0.75, 0.125, 0.5, 0.25  # its label: the box covers the red patch
    box = up[int((yc - h / 2) * 40) + 2:int((yc + h / 2) * 40) - 2, int((xc - w / 2) * 20) + 2:int((xc + w / 2) * 20) - 2]
    assert (box[..., 2] > 200).all() and (box[..., :2] < 60).all()
    assert cv2.imread(str(p["exif6.jpg"])).shape[:2] == (40, 20)  # cv2.imread applies EXIF too

    for name in ("zero.jpg", "text.jpg", "trunc_bad.jpg"):
        with pytest.raises(UserError, match=str(p[name])):
            read_image_bgr(p[name])
    with pytest.raises(UserError, match="nope.jpg"):
        read_image_bgr(p["good.jpg"].with_name("nope.jpg"))


def test_no_usable_image_is_one_clear_error(tmp_path):
    bad = tmp_path / "allbad" / "images"
    bad.mkdir(parents=True)
    (bad / "a.jpg").write_bytes(b"")
    (bad / "b.png").write_text("nope")
    Image.new("RGB", (4, 4)).save(bad / "c.png")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(bad / "d.png")
    (bad / "d.png").write_bytes((bad / "d.png").read_bytes()[:2000])  # PNG cut inside its pixel data
    imgs = resolve_image_files(bad)
    result = scan_labels(imgs, img2label_paths(imgs), NC)
    assert result.counts["images"] == 0 and result.counts["corrupt"] == 4
    assert any(m.startswith(f"{bad / 'd.png'}: unreadable image") for m in result.msgs)
    with pytest.raises(UserError, match=r"allbad/images: no usable images \(4 corrupt of 4 found; first problems: .*a\.jpg: empty file"):
        require_usable(result, str(bad))
    with pytest.raises(UserError, match=r"allbad/images: no usable images"):
        LoadImagesAndLabels(DatasetSpec(bad, nc=NC), verbose=False)


# ---------------------------------------------------------------- splits without labels
def _split(root: Path, n: int, labels: str | None = "labels", split: str = "train", row: str = GOOD_ROW) -> Path:
    """n tiny images in root/images/<split>, with a one-box label each in root/<labels>/<split> (None: no labels)."""
    imgs = root / "images" / split
    imgs.mkdir(parents=True, exist_ok=True)
    for k in range(n):
        cv2.imwrite(str(imgs / f"{k}.jpg"), np.full((24, 32, 3), 60 + k, np.uint8))
        if labels:
            (root / labels / split).mkdir(parents=True, exist_ok=True)
            (root / labels / split / f"{k}.txt").write_text(row)
    return imgs


@pytest.mark.parametrize("misnamed", ["label", "Labels", "annotations", "ann"])
def test_misnamed_label_folder_is_one_clear_error(tmp_path, misnamed):
    imgs = _split(tmp_path / "ds", 4, labels=misnamed)
    with pytest.raises(UserError) as e:
        LoadImagesAndLabels(DatasetSpec(imgs, nc=NC), verbose=False, role="train")
    msg = str(e.value)
    assert msg.startswith(f"{imgs}: no label file found for any of its 4 images")
    assert f"Looked for label files in {tmp_path / 'ds' / 'labels' / 'train'}/:" in msg
    assert f"found {tmp_path / 'ds' / misnamed}/ beside the expected {tmp_path / 'ds' / 'labels'}/" in msg
    assert f"which holds {tmp_path / 'ds' / misnamed / 'train' / '0.txt'}" in msg
    assert "without an 'images' folder has its labels beside the image" in msg
    assert "no option to train without labels" in msg and "background images" in msg
    # the same split for validation or direct use is no error (validation warns: tests/test_data.py)
    assert len(LoadImagesAndLabels(DatasetSpec(imgs, nc=NC), verbose=False, role="val")) == 4
    assert len(LoadImagesAndLabels(DatasetSpec(imgs, nc=NC), verbose=False)) == 4


def test_annotations_beside_the_images_are_named(tmp_path):
    imgs = _split(tmp_path / "ds", 3, labels=None)
    for k in range(3):
        (imgs / f"{k}.txt").write_text(GOOD_ROW)
    (imgs / "0.xml").write_text("<annotation/>")
    with pytest.raises(UserError) as e:
        LoadImagesAndLabels(DatasetSpec(imgs, nc=NC), verbose=False, role="train")
    msg = str(e.value)
    expect = tmp_path / "ds" / "labels" / "train"
    assert f"3 .txt file(s) lie beside the images (e.g. {imgs / '0.txt'}): move them to {expect}/" in msg
    assert f"1 .xml file(s) lie beside the images (e.g. {imgs / '0.xml'}): Pascal VOC" in msg


def test_image_path_without_images_folder_looks_beside_the_images(tmp_path):
    pics = tmp_path / "ds" / "Images" / "train"
    pics.mkdir(parents=True)
    (tmp_path / "ds" / "labels" / "train").mkdir(parents=True)
    for k in range(2):
        cv2.imwrite(str(pics / f"{k}.jpg"), np.full((24, 32, 3), 90, np.uint8))
        (tmp_path / "ds" / "labels" / "train" / f"{k}.txt").write_text(GOOD_ROW)
    with pytest.raises(UserError) as e:
        LoadImagesAndLabels(DatasetSpec(pics, nc=NC), verbose=False, role="train")
    msg = str(e.value)
    assert f"Looked for label files in {pics}/:" in msg and f"({pics / '0.jpg'} -> {pics / '0.txt'})" in msg
    assert "has a folder named 'Images': the rule needs exactly 'images'" in msg
    assert f"found {tmp_path / 'ds' / 'labels'}/" in msg


def test_label_files_without_a_usable_row_are_an_error(tmp_path):
    imgs = _split(tmp_path / "ds", 3, row="")
    (tmp_path / "ds" / "labels" / "train" / "2.txt").write_text("7 0.5 0.5 0.2 0.2\n")  # class outside [0, 2]
    with pytest.raises(UserError, match=r"no usable label in any of its 3 images: 2 label file\(s\) empty, 1 with "
                                         r"only bad rows \(1 rows dropped"):
        LoadImagesAndLabels(DatasetSpec(imgs, nc=NC), verbose=False, role="train")


def test_no_labels_error_after_the_cache_names_the_same(tmp_path):
    """Ranks other than local rank 0 read the cache: they must reach the same verdict and message."""
    imgs = _split(tmp_path / "ds", 3, labels="label")
    messages = []
    for _ in range(2):
        with pytest.raises(UserError) as e:
            LoadImagesAndLabels(DatasetSpec(imgs, nc=NC), verbose=False, role="train")
        messages.append(str(e.value))
    assert messages[0] == messages[1]
    assert (tmp_path / "ds" / "labels" / "train.cache.npz").is_file()  # the second one came from it


def _misnamed_dataset(tmp_path: Path) -> Path:
    """A data yaml whose train labels sit in label/train and val labels where they belong."""
    root = tmp_path / "ds"
    _split(root, 6, labels="label", split="train")
    _split(root, 2, labels="labels", split="val")
    data = tmp_path / "misnamed.yaml"
    data.write_text(f"path: {root}\ntrain: images/train\nval: images/val\nnames: [a, b, c]\n")
    return data


TINY_TRAIN = ["--imgsz", "64", "--batch-size", "4", "--epochs", "1", "--workers", "0"]


@pytest.mark.slow
def test_train_py_refuses_a_split_without_labels(tmp_path):
    import subprocess
    import sys
    import time
    from tests.helpers import ROOT, run_env

    data, t0 = _misnamed_dataset(tmp_path), time.time()
    p = subprocess.run([sys.executable, "train.py", "--data", str(data), "--project", str(tmp_path / "runs"),
                        *TINY_TRAIN], cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert p.returncode == 1 and time.time() - t0 < 120, out[-3000:]
    assert f"ERROR: {tmp_path / 'ds' / 'images' / 'train'}: no label file found for any of its 6 images" in out
    assert f"found {tmp_path / 'ds' / 'label'}/ beside the expected" in out
    assert "Traceback" not in out and not (tmp_path / "runs" / "exp" / "weights" / "last.pt").exists()


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_refuses_a_split_without_labels_on_every_rank(tmp_path):
    import time
    from tests.helpers import ROOT, TORCHRUN, run

    data, t0 = _misnamed_dataset(tmp_path), time.time()
    p = run([*TORCHRUN, "train.py", "--data", data, "--project", tmp_path / "runs", *TINY_TRAIN], ok=False,
            timeout=200)
    out = p.stdout + p.stderr
    assert time.time() - t0 < 200, out[-3000:]
    assert out.count("no label file found for any of its 6 images") >= 2  # rank 0's and rank 1's own message
    assert "[rank 1] ERROR: " in out and "local rank 0 failed" not in out
    ours = [f'File "{ROOT / name}' for name in ("train.py", "val.py", "utils", "models")]
    assert not any(frame in out for frame in ours) and "UserError" not in out
