"""The version is written once, in pyproject.toml; the package reads it from its metadata."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import specserve

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's")

ROOT = Path(__file__).resolve().parents[2]


def test_version_is_the_installed_metadata_and_pyprojects():
    assert specserve.__version__ == version("specserve")
    assert specserve.__version__ == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"], \
        "the installed metadata is stale: reinstall (pip install -c constraints-cpu.txt --no-deps -e .)"


def test_the_cli_reports_the_same_version():
    out = subprocess.run([sys.executable, "-m", "specserve.cli", "--version"], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == f"specserve {specserve.__version__}", out.stdout + out.stderr


def test_package_data_names_only_files_that_exist():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["specserve"]
    for pattern in data:
        assert list((ROOT / "specserve").glob(pattern)), f"package-data lists {pattern!r}, which matches no file"
