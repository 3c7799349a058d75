"""The package map pyproject.toml cannot state alone: the checkout's folders install under the one
import name `loragw` (engine/ as loragw.engine, ...), every subfolder found, none missed (the
C sources' folder too, so their files are package data)."""

from setuptools import find_namespace_packages, setup

FOLDERS = ("engine", "kernels", "adapters", "gateway", "demo")
found = find_namespace_packages(include=[f"{f}*" for f in FOLDERS], exclude=["*__pycache__*"])

setup(
    packages=["loragw", *(f"loragw.{p}" for p in found)],
    package_dir={"loragw": "loragw", **{f"loragw.{f}": f for f in FOLDERS}},
)
