"""The wheel of the running artcloud (backends/wheel.py) holds what setuptools would ship: the packages' modules
and the package data, not whatever else lies in the folder."""

from __future__ import annotations

import zipfile
from pathlib import Path

import tomllib

from artcloud.backends.wheel import PACKAGE, PACKAGE_DATA, build_wheel, package_files

ROOT = Path(__file__).resolve().parents[1]


def test_only_modules_and_package_data_are_packed(tmp_path):
    root = tmp_path / "artcloud"
    shipped = ["__init__.py", "a.py", "sub/__init__.py", "sub/b.py", "templates/artcloud-server.yaml",
               "locks/__init__.py", "locks/gpu.txt"]
    # editor backups and swap files, stray notes, bytecode, hidden folders, a folder that is no package, data
    # that package-data does not name
    stray = ["a.py~", "#a.py#", ".#a.py", "a.py.orig", ".a.py.swp", "notes.md", "a.pyc",
             "sub/__pycache__/b.cpython-311.pyc", ".hidden/x.py", "sub/.cache/y.py", "scratch/c.py",
             "templates/notes.txt", "templates/old/x.yaml", "locks/.gpu.txt.swp", "locks/gpu.txt.bak", "sub/data.txt"]
    for rel in shipped + stray:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    assert [name for name, _ in package_files(root)] == sorted(f"artcloud/{rel}" for rel in shipped)


def test_the_package_data_is_pyprojects():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["artcloud"]
    assert sorted(PACKAGE_DATA) == sorted(declared)


def test_the_wheel_holds_the_package_files_and_its_metadata(tmp_path):
    with zipfile.ZipFile(build_wheel(tmp_path)) as z:
        names = [n for n in z.namelist() if ".dist-info/" not in n]
    assert names == [name for name, _ in package_files()]
    assert PACKAGE == ROOT / "artcloud" and "artcloud/backends/wheel.py" in names and "artcloud/locks/gpu.txt" in names
