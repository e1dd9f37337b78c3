"""--cache ram|disk (utils/data/imgcache.py): same pixels as the uncached path, reuse, invalidation,
cheap pickling, a clear refusal when it does not fit, and one build per node under torchrun."""
from __future__ import annotations

import pickle
from pathlib import Path

import cv2
import numpy as np
import pytest

from tests.helpers import ROOT, TORCHRUN, run
from yolotrain.utils.data import imgcache
from yolotrain.utils.data.augment import resize_long_side
from yolotrain.utils.data.split import FileCacheSource
from yolotrain.utils.core.errors import UserError


def _uncached(f: str, img_size: int, augment: bool):
    """What LoadImagesAndLabels.load_image returns without a cache."""
    img = cv2.imread(f)
    return resize_long_side(img, img_size, augment), img.shape[:2]


@pytest.fixture()
def images(tmp_path) -> list[str]:
    """Odd sizes (landscape, portrait, smaller than img_size, exactly img_size), jpg and png."""
    rng = np.random.default_rng(0)
    d = tmp_path / "data" / "images" / "train"
    d.mkdir(parents=True)
    (tmp_path / "data" / "labels" / "train").mkdir(parents=True)
    files = []
    for i, (h, w) in enumerate([(97, 131), (150, 61), (40, 30), (64, 64), (120, 200), (33, 257)]):
        f = d / f"im{i}.{'png' if i % 2 else 'jpg'}"
        cv2.imwrite(str(f), rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        files.append(str(f))
    return files


@pytest.fixture()
def shm(tmp_path, monkeypatch) -> Path:
    """A stand-in for /dev/shm so tests never leave RAM-backed files behind."""
    d = tmp_path / "shm"
    d.mkdir()
    monkeypatch.setattr(imgcache, "SHM", d)
    return d


@pytest.mark.parametrize("augment", [True, False])
@pytest.mark.parametrize("mode", ["ram", "disk"])
def test_cached_images_equal_uncached(images, shm, tmp_path, augment, mode):
    cache = imgcache.build_or_open(images, 64, augment, mode, FileCacheSource(images), num_threads=2)
    assert cache.built and cache.file.parent == (shm if mode == "ram" else tmp_path / "data" / "labels")
    assert cache.file.name.endswith(".imgcache.npy") and cache.index_file.is_file() and len(cache) == len(images)
    for i, f in enumerate(images):
        img, hw0 = cache.get(i)
        ref, ref_hw0 = _uncached(f, 64, augment)
        assert hw0 == ref_hw0 and img.shape == ref.shape and img.dtype == np.uint8
        assert np.array_equal(img, ref), f
        assert img.flags.writeable  # augmentation writes in place
        img[:] = 0  # and must not reach the cache
        assert np.array_equal(cache.get(i)[0], ref)


def test_inter_area_and_linear_get_separate_files(images, shm):
    a = imgcache.build_or_open(images, 32, True, "ram", FileCacheSource(images))
    b = imgcache.build_or_open(images, 32, False, "ram", FileCacheSource(images))
    c = imgcache.build_or_open(images, 48, False, "ram", FileCacheSource(images))
    assert len({a.file, b.file, c.file}) == 3


def test_second_open_reuses_the_file(images, shm):
    first = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    mtime = first.file.stat().st_mtime_ns
    second = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    assert not second.built and second.file == first.file and second.file.stat().st_mtime_ns == mtime


def test_changed_image_makes_a_new_file_and_drops_the_stale_one(images, shm):
    first = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    cv2.imwrite(images[0], np.full((50, 70, 3), 7, np.uint8))
    second = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    assert second.built and second.file != first.file
    assert np.array_equal(second.get(0)[0], _uncached(images[0], 64, False)[0])
    assert not first.file.exists()  # a stale RAM cache would hold memory until reboot


def test_incomplete_build_is_rebuilt(images, shm):
    first = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    first.index_file.unlink()  # as if killed before the index (written last) landed
    assert imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images)).built


def test_pickle_is_tiny_and_reads_the_same(images, shm):
    cache = imgcache.build_or_open(images, 64, True, "ram", FileCacheSource(images))
    cache.get(0)  # mapped in this process: the map must not travel
    blob = pickle.dumps(cache)
    assert len(blob) < 1024, len(blob)
    copy = pickle.loads(blob)
    for i in range(len(images)):
        assert np.array_equal(copy.get(i)[0], cache.get(i)[0])


def test_shapes_from_the_label_scan_are_used(images, shm, monkeypatch):
    image_hw = np.array([cv2.imread(f).shape[:2] for f in images])
    monkeypatch.setattr(imgcache, "header_hw", lambda files: pytest.fail("re-read headers"))
    cache = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images), image_hw=image_hw)
    assert np.array_equal(cache.get(5)[0], _uncached(images[5], 64, False)[0])


def test_an_image_unreadable_at_build_time_is_left_to_the_dataset(images, shm):
    image_hw = np.array([cv2.imread(f).shape[:2] for f in images])
    Path(images[2]).write_bytes(b"not a picture any more")  # broken after the scan recorded its size
    cache = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images), image_hw=image_hw)
    assert cache.meta["uncached"] == 1 and cache.get(2) is None
    assert np.array_equal(cache.get(3)[0], _uncached(images[3], 64, False)[0])


def test_wrong_header_size_falls_back_to_disk(images, shm):
    image_hw = np.array([cv2.imread(f).shape[:2] for f in images])
    image_hw[1] = (10, 10)  # a lying header: this image is left to the dataset's own read
    cache = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images), image_hw=image_hw)
    assert cache.meta["uncached"] == 1 and cache.get(1) is None
    for i, f in enumerate(images):
        if i != 1:
            assert np.array_equal(cache.get(i)[0], _uncached(f, 64, False)[0])


def test_refuses_when_it_does_not_fit(images, shm, monkeypatch):
    monkeypatch.setattr(imgcache, "free_bytes", lambda folder, mode: (1_100_000, f"is free in {folder}"))
    with pytest.raises(UserError, match=r"--cache ram needs .* for 6 images at 64 px but only 1.1 MB is free in "
                                        r".*shm.*use --cache disk or no cache"):
        imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    assert not list(shm.iterdir())


def test_unknown_mode_is_a_user_error(images):
    with pytest.raises(UserError, match="--cache memory"):
        imgcache.build_or_open(images, 64, False, "memory", FileCacheSource(images))


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_two_ranks_one_build(images, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    lst = tmp_path / "images.txt"
    lst.write_text("\n".join(images))
    run([*TORCHRUN, ROOT / "tests" / "scripts" / "imgcache_ranks.py", lst, out], timeout=240)
    r0, r1 = ((out / f"rank{r}").read_text().split() for r in (0, 1))
    assert r0[0] == r1[0]  # the same file
    assert (r0[1], r1[1]) == ("True", "False")  # built once, by local rank 0
    assert r0[2] == r1[2]  # the same bytes
    assert len(list((out / "cache").glob("*.imgcache.npy"))) == 1


def test_disk_cache_follows_the_label_cache_folder(images, tmp_path):
    src = tmp_path / "data" / "images" / "train"
    cache = imgcache.build_or_open(images, 64, False, "disk", FileCacheSource(images, path=str(src)))
    assert cache.file.parent == tmp_path / "data" / "labels" and cache.file.name.startswith("train.")
    elsewhere = imgcache.build_or_open(images, 64, False, "disk", FileCacheSource(images, cache_dir=tmp_path / "cd"))
    assert elsewhere.file.parent == tmp_path / "cd"


def test_corrupt_index_is_rebuilt(images, shm):
    first = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    first.index_file.write_bytes(b"not a zip")
    again = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    assert again.built and np.array_equal(again.get(2)[0], _uncached(images[2], 64, False)[0])


def test_stale_sweep_spares_other_sizes(images, shm):
    other_size = imgcache.build_or_open(images, 48, False, "ram", FileCacheSource(images))
    first = imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    cv2.imwrite(images[3], np.full((20, 90, 3), 9, np.uint8))
    imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))
    assert not first.file.exists() and other_size.file.exists()


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


@pytest.fixture()
def host_ram(tmp_path, monkeypatch) -> Path:
    """A /proc/meminfo with 100 GiB available and an empty cgroup folder, both under tmp_path."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal:       {200 * 2**20} kB\nMemAvailable:   {100 * 2**20} kB\n")
    monkeypatch.setattr(imgcache, "MEMINFO", meminfo)
    monkeypatch.setattr(imgcache, "CGROUP", tmp_path / "cgroup")
    return tmp_path / "cgroup"


GIB = 2**30


@pytest.mark.parametrize("files, want", [
    ({}, 100 * GIB),  # no cgroup files: the host's MemAvailable
    ({"memory.max": "max\n", "memory.current": str(GIB), "memory.stat": "inactive_file 0\n"}, 100 * GIB),
    ({"memory.max": str(4 * GIB), "memory.current": str(3 * GIB), "memory.stat": f"anon 1\ninactive_file {GIB // 2}\n"},
     GIB + GIB // 2),  # v2 container: 4 GiB limit, 3 used, half a GiB of it reclaimable page cache
    ({"memory/memory.limit_in_bytes": str(8 * GIB), "memory/memory.usage_in_bytes": str(7 * GIB),
      "memory/memory.stat": "total_inactive_file 0\n"}, GIB),  # v1
    ({"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "5",
      "memory/memory.stat": ""}, 100 * GIB),  # v1 without a limit
    ({"memory.max": str(2 * GIB), "memory.current": str(3 * GIB), "memory.stat": ""}, 0),  # over the limit
])
def test_available_ram_is_capped_by_the_containers_cgroup(host_ram, files, want):
    _cgroup(host_ram, files)
    assert imgcache.available_ram() == want


def test_a_cache_that_fits_only_under_the_host_ram_is_refused_in_a_container(images, shm, host_ram, monkeypatch):
    """ram caches are limited by RAM (tmpfs pages are charged to the container): the cgroup limit counts."""
    monkeypatch.setattr(imgcache.shutil, "disk_usage", lambda folder: type("U", (), {"free": 50 * GIB})())
    _cgroup(host_ram, {"memory.max": str(GIB), "memory.current": str(GIB - 2**20), "memory.stat": ""})
    with pytest.raises(UserError, match=r"--cache ram needs .* but only 1.0 MB of RAM is available"):
        imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images))


def test_loader_workers_shared_memory_is_kept_free(images, shm, monkeypatch):
    """8 ranks x 8 workers at 640 px, batch 16, 4 batch buffers each: about 5 GB of /dev/shm that the cache must
    leave free."""
    node = imgcache.loader_shm_bytes(ranks=8, workers=8, batch_size=16, img_size=640)
    assert node == 8 * 8 * 4 * 16 * 3 * 640 * 640 and 4.9e9 < node < 5.1e9
    free = imgcache.MARGIN_BYTES + 2**24  # room for this small cache and the usual margin, not for the workers
    monkeypatch.setattr(imgcache, "free_bytes", lambda folder, mode: (free, f"is free in {folder}"))
    with pytest.raises(UserError, match=r"--cache ram needs .* \(5.3 GB must stay free, 5.0 GB of it for the loader "
                                        r"workers' shared-memory batches\); use --cache disk"):
        imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images), workers_shm=node)
    assert not list(shm.iterdir())
    assert imgcache.build_or_open(images, 64, False, "ram", FileCacheSource(images), workers_shm=2**20).built
    disk = FileCacheSource(images, cache_dir=shm / "d")
    assert imgcache.build_or_open(images, 64, False, "disk", disk, workers_shm=node).built


@pytest.mark.parametrize("mode", ["ram", "disk"])
def test_a_loader_over_image_files_keys_its_cache_by_the_files(images, shm, tmp_path, mode):
    """The loader's --cache over a folder is the file cache of its images in the dataset's order, beside the labels."""
    from yolotrain.utils.data.loader import create_dataloader

    src = tmp_path / "data" / "images" / "train"
    loader = create_dataloader(str(src), 64, 2, 32, nc=1, workers=0, cache=mode)
    files = list(loader.dataset.im_files)
    direct = imgcache.build_or_open(files, 64, False, mode, FileCacheSource(files, path=str(src)))
    assert loader.dataset.imgcache.file == direct.file and not direct.built
    assert direct.file.parent == (shm if mode == "ram" else tmp_path / "data" / "labels")
