"""The documentation: the configuration page is the schema's, the site builds strictly, and every
command block in README.md and docs/ is either run by a test or says why CI cannot run it."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specserve.docs_config import COMMAND, render

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def test_configuration_page_is_what_the_schema_generates():
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date with specserve/config.py: run `{COMMAND}`"


def test_the_pages_regenerate_command_runs_as_written():
    text = PAGE.read_text()
    m = re.search(r"<!-- test: config-page -->\s*```bash\n(.*?)\n```", text, re.S)
    assert m and m.group(1) == COMMAND
    program, _, target = COMMAND.partition(">")
    assert target.strip() == "docs/configuration.md"
    out = subprocess.run(shlex.split(program), capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == text, f"run `{COMMAND}`"


def test_the_docs_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link, an anchor that is not there or a nav entry without its page fails."""
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs is not installed (it is in the test extra: pip install -c constraints-cpu.txt -e '.[test]')")
    out = subprocess.run([mkdocs, "build", "--strict", "--site-dir", str(tmp_path / "site")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").is_file()
