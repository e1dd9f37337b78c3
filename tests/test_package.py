"""The installed form: a wheel built from this checkout, installed into a fresh venv that reuses the suite's
packages (torch and the rest, through a .pth file), used from an empty folder with a YOLOv5-style ``utils`` and
``models`` first on sys.path. The checkout form is the rest of the suite."""
from __future__ import annotations

import shutil
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.conftest import TINY_YAML
from tests.helpers import LIBRARY_MODULES, ROOT, TINY, run, run_env

# what setup.py packs: the package's folder and the files its metadata reads
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "yolotrain", *(p.name for p in ROOT.glob("requirements*.txt")))
SHIPPED = ("yolotrain/models/yolov8.yaml", "yolotrain/models/yolov5n.yaml", "yolotrain/hyps/hyp.scratch-low.yaml",
           "yolotrain/data/shapes.yaml", "yolotrain/utils/engine/step.py", "yolotrain/app/train.py")


def _build(folder: Path) -> None:
    """The wheel (from a copy of the sources, so the checkout gets no build/ folder) and a venv holding it."""
    src = folder / "src"
    src.mkdir()
    for name in SOURCES:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy2
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                         if (ROOT / name).is_dir() else {}))
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", folder / "dist", src])
    venv = folder / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    purelib = run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    (Path(purelib.stdout.strip()) / "suite.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run([venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", *(folder / "dist").glob("*.whl")])


@pytest.fixture(scope="session")
def installed(once) -> Path:
    """The folder holding dist/ (the wheel) and venv/ (yolotrain installed from it)."""
    return once("wheel", _build)


@pytest.fixture
def beside_yolov5(tmp_path) -> tuple[Path, dict]:
    """An empty working folder, and an environment whose sys.path starts with a YOLOv5-style checkout whose
    ``utils`` and ``models`` fail loudly when imported."""
    v5 = tmp_path / "yolov5"
    for name in ("utils", "models"):
        (v5 / name).mkdir(parents=True)
        (v5 / name / "__init__.py").write_text(f"raise ImportError('the YOLOv5 checkout\\'s {name} was imported')\n")
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiny.yaml").write_text(TINY_YAML)
    return work, run_env(PYTHONPATH=str(v5))  # the YOLOv5 checkout, not this one, on the path


def _site_files(venv: Path) -> set[str]:
    """The installed package's files, bytecode aside (what a run must not add to)."""
    package = next((venv / "lib").glob("python*/site-packages/yolotrain"))
    return {str(p.relative_to(package)) for p in package.rglob("*") if "__pycache__" not in p.parts}


def test_the_wheel_holds_the_package_and_nothing_else(installed):
    wheel = next((installed / "dist").glob("yolotrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"yolotrain"}
    assert all(n in names for n in SHIPPED)
    stray = [n for n in names if any(part in ("tests", "bench", "__pycache__", "runs", "datasets")
                                     for part in n.split("/")) or n.endswith((".pyc", ".cache", ".npy", ".pt"))]
    assert stray == []
    info = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "yolotrain = yolotrain.__main__:main" in zipfile.ZipFile(wheel).read(info).decode()
    assert wheel.stat().st_size < 2_000_000  # code and yamls only


def test_the_installed_api_imports_from_any_folder_without_a_top_level_utils(installed, beside_yolov5):
    work, env = beside_yolov5
    probe = ("import sys; from yolotrain import YOLO; import yolotrain, yolotrain.app.train, yolotrain.app.val; "
             "from yolotrain.utils.data.config import DEMO_DATA, load_data_config; "
             "from yolotrain.utils.core.fileio import CHECKOUT, RUNS; "
             "assert not {m.split('.')[0] for m in sys.modules} & {'utils', 'models'}; "
             "print(yolotrain.__file__, CHECKOUT, RUNS, load_data_config(DEMO_DATA).root, sep='\\n')")
    where, checkout, runs, demo = run([installed / "venv" / "bin" / "python", "-c", probe], env=env,
                                      cwd=work).stdout.split()
    assert Path(where).is_relative_to(installed / "venv") and checkout == "False" and runs == "runs"
    assert Path(demo) == work.resolve() / "datasets" / "shapes"  # the built-in set is made here, not in site-packages
    walk = "import pkgutil, yolotrain; print(*sorted(m.name for m in pkgutil.iter_modules(yolotrain.__path__)))"
    listed = run([installed / "venv" / "bin" / "python", "-c", walk], env=env, cwd=work).stdout.split()
    assert set(listed) == LIBRARY_MODULES  # the same library modules as the checkout (test_layers)
    usage = run([installed / "venv" / "bin" / "yolotrain", "--help"], env=env, cwd=work).stdout
    assert usage.startswith("usage: yolotrain <tool>") and all(f"  {t} " in usage for t in ("train", "val", "shards"))
    helps = run([installed / "venv" / "bin" / "yolotrain", "val", "--help"], env=env, cwd=work).stdout
    assert helps.startswith("usage: yolotrain val") and "--weights" in helps


@pytest.mark.slow
def test_the_installed_command_trains_and_validates_beside_a_yolov5_checkout(installed, beside_yolov5, tiny_v5n):
    work, env = beside_yolov5
    yolotrain = installed / "venv" / "bin" / "yolotrain"
    before = _site_files(installed / "venv")
    trained = run([yolotrain, "train", "--data", "tiny.yaml", "--cfg", "models/yolov5n.yaml", "--hyp",
                   "hyps/hyp.scratch-low.yaml", "--epochs", "1", *TINY], env=env, cwd=work).stdout  # YOLOv5's paths
    best = work / "runs" / "train" / "exp" / "weights" / "best.pt"
    assert best.is_file() and (work / "shapes" / "images" / "train").is_dir()
    assert "  yolotrain val --weights runs/train/exp/weights/best.pt --data tiny.yaml" in trained  # pasteable here
    scored = run([yolotrain, "val", "--weights", best, "--data", "tiny.yaml", "--imgsz", "64"], env=env, cwd=work)
    assert "mAP50-95" in scored.stdout + scored.stderr and (work / "runs" / "val" / "exp").is_dir()
    # a checkpoint of the checkout form scores in the installed form, and the installed form's in the checkout's
    run([yolotrain, "val", "--weights", tiny_v5n, "--data", "tiny.yaml", "--imgsz", "64"], env=env, cwd=work)
    run([sys.executable, "val.py", "--weights", best, "--data", work / "tiny.yaml", "--imgsz", "64",
         "--project", work / "checkout-val"])
    assert _site_files(installed / "venv") == before  # no cache, run or dataset inside site-packages


@pytest.mark.slow
@pytest.mark.dist
def test_torchrun_and_the_api_start_two_ranks_from_the_installed_package(installed, beside_yolov5):
    work, env = beside_yolov5
    python = installed / "venv" / "bin" / "python"
    flags = ["--data", "tiny.yaml", "--cfg", "yolov5n.yaml", "--epochs", "1", "--device", "cpu", *TINY]
    out = run([python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "yolotrain",
               "train", *flags, "--name", "torchrun"], env=env, cwd=work)
    assert "Batch: global 4 = 2 x 2 per rank" in out.stdout
    assert "WARNING: each rank's batch is 2 images (global --batch-size 4 over 2 ranks)" in out.stdout + out.stderr
    assert (work / "runs" / "train" / "torchrun" / "weights" / "last.pt").is_file()
    api = ("from yolotrain import YOLO; "
           "r = YOLO('yolov5n.yaml').train(nproc=2, data='tiny.yaml', epochs=1, imgsz=64, batch_size=4, "
           "val_batch_size=4, workers=0, seed=3, name='api'); print(r.last)")
    last = run([python, "-c", api], env=env, cwd=work).stdout.strip().splitlines()[-1]
    assert Path(work, last).resolve() == (work / "runs" / "train" / "api" / "weights" / "last.pt").resolve()


@pytest.mark.slow
def test_the_documented_installed_examples_run_as_written(installed, beside_yolov5):
    """Every code block of README.md and docs/python.md marked `installed` (tests/test_docs.py: each block says
    what it is) runs as it is written, with the installed package, in an empty folder beside a YOLOv5 checkout."""
    from tests.test_docs import USER_PAGES, code_blocks

    work, env = beside_yolov5
    blocks = [(page, lang, body) for page in USER_PAGES
              for lang, kind, body in code_blocks((ROOT / page).read_text(encoding="utf-8")) if kind == "installed"]
    assert blocks, "no code block is marked installed"
    before = _site_files(installed / "venv")
    for page, lang, body in blocks:
        assert lang in ("python", "bash"), f"{page}: an installed block in {lang}"
        cmd = [installed / "venv" / "bin" / "python", "-c", body] if lang == "python" else ["bash", "-ec", body]
        env = dict(env, PATH=f"{installed / 'venv' / 'bin'}:{env['PATH']}")
        run(cmd, env=env, cwd=work, timeout=1800)
    assert (work / "datasets" / "shapes").is_dir() and _site_files(installed / "venv") == before
