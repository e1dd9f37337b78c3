"""The yolotrain package, built from the checkout (``pip install .``): docs/architecture.md, "One source tree, two
forms".

The checkout is the package: yolotrain/ holds the library (yolotrain.utils, yolotrain.models) and the files it
ships (yolotrain/hyps, yolotrain/data, the model yamls), as the wheel does; the checkout's top-level utils/, models/,
hyps/ and data/ are links into it. Dependencies are the requirements files' (requirements.txt; each
requirements-<extra>.txt is an extra).
"""
from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
EXTRAS = ("export", "s3", "track", "tune")


def requirements(name: str) -> list[str]:
    """A requirements file's requirements, without its comments."""
    lines = (line.split("#", 1)[0].strip() for line in (HERE / name).read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


setup(
    packages=find_packages(str(HERE), include=["yolotrain", "yolotrain.*"]),
    package_data={"yolotrain": ["hyps/*.yaml", "data/*.yaml"], "yolotrain.models": ["*.yaml"]},
    install_requires=requirements("requirements.txt"),
    extras_require={extra: requirements(f"requirements-{extra}.txt") for extra in EXTRAS},
)
