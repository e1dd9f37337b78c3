"""The yolotrain package, built from the checkout (``pip install .``): docs/architecture.md, "One source tree, two
forms".

The checkout keeps utils/, models/, hyps/ and data/ at its top for ``python train.py``; in the wheel they sit
inside the package as yolotrain.utils, yolotrain.models, yolotrain/hyps and yolotrain/data, so an installed
yolotrain imports no top-level ``utils`` or ``models`` and lives beside a YOLOv5 checkout on sys.path.
Dependencies are the requirements files' (requirements.txt; each requirements-<extra>.txt is an extra).
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
FOLDERS = {"yolotrain": "yolotrain", "yolotrain.utils": "utils", "yolotrain.models": "models",
           "yolotrain.hyps": "hyps", "yolotrain.data": "data"}  # package -> its folder in the checkout
EXTRAS = ("export", "s3", "track", "tune")


def requirements(name: str) -> list[str]:
    """A requirements file's requirements, without its comments."""
    lines = (line.split("#", 1)[0].strip() for line in (HERE / name).read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def packages() -> list[str]:
    """Every package of the wheel: each folder's own and the code packages under it."""
    found = []
    for name, folder in FOLDERS.items():
        found += [name, *(f"{name}.{sub}" for sub in find_packages(str(HERE / folder)))]
    return found


setup(
    packages=packages(),
    package_dir=FOLDERS,
    package_data={"yolotrain.models": ["*.yaml"], "yolotrain.hyps": ["*.yaml"], "yolotrain.data": ["*.yaml"]},
    install_requires=requirements("requirements.txt"),
    extras_require={extra: requirements(f"requirements-{extra}.txt") for extra in EXTRAS},
)
