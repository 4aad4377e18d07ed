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

from ..doc_blocks import COMMAND_LANGUAGES, all_blocks, block

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"


def test_configuration_page_is_what_the_schema_generates():
    assert PAGE.read_text() == render(), f"docs/configuration.md is out of date with specserve/config.py: run `{COMMAND}`"


def test_the_pages_regenerate_command_runs_as_written():
    text = PAGE.read_text()
    assert block("config-page").strip() == COMMAND
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
                         timeout=300, cwd=ROOT, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert (tmp_path / "site" / "index.html").is_file()


def _names_the_tests_run() -> set[str]:
    """Every ``block("NAME")`` a test module asks for."""
    found = set()
    for path in (ROOT / "tests").rglob("*.py"):
        found.update(re.findall(r"""\bblock\(\s*["']([a-z0-9][a-z0-9-]*)["']\s*\)""", path.read_text()))
    return found


def test_every_command_block_is_run_by_a_test_or_says_why_not():
    """A bash or python block in README.md or docs/ carries `<!-- test: NAME -->`, and some test runs NAME,
    or `<!-- not tested: REASON -->`, saying what CI lacks."""
    blocks = all_blocks()
    unmarked = [b.where for b in blocks if b.language in COMMAND_LANGUAGES and not (b.test or b.not_tested)]
    assert not unmarked, ("these command blocks carry neither <!-- test: NAME --> (and a test that runs block('NAME')) "
                          f"nor <!-- not tested: REASON -->: {', '.join(unmarked)}")
    run = _names_the_tests_run()
    orphans = sorted({f"{b.test} ({b.where})" for b in blocks if b.test and b.test not in run})
    assert not orphans, f"marked 'test: NAME' but no test runs block('NAME'): {', '.join(orphans)}"
    marked = {b.test for b in blocks if b.test}
    assert not run - marked, f"tests ask for blocks no page has: {sorted(run - marked)}"
    for name in marked:
        copies = [b for b in blocks if b.test == name]
        assert len({b.text for b in copies}) == 1, f"the blocks marked 'test: {name}' differ: {[b.where for b in copies]}"


def test_a_not_tested_block_says_why():
    for b in all_blocks():
        if b.not_tested is not None:
            assert len(b.not_tested.split()) >= 3, f"{b.where}: say what CI lacks to run it, not {b.not_tested!r}"


def test_the_http_page_names_every_request_field():
    """docs/http.md sorts every field of the request models into honoured, neutral-only or without effect."""
    from specserve.serve.protocol import NEUTRAL, ChatCompletionRequest, CompletionRequest

    text = (ROOT / "docs" / "http.md").read_text()
    fields = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | set(NEUTRAL)
    missing = sorted(f for f in fields if f"`{f}`" not in text)
    assert not missing, f"docs/http.md does not say what happens to these request fields: {missing}"


def test_the_benchmarks_pages_simulated_pair_builds(tmp_path):
    out = subprocess.run([sys.executable, "-c", block("sim-pair")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]


def test_the_vllm_page_lists_every_vllm_internal_the_seam_relies_on():
    from specserve.vllm import seam

    text = (ROOT / "docs" / "vllm.md").read_text()
    names = set(seam.RUNNER_METHODS) | set(seam.RUNNER_ATTRIBUTES)
    names |= {where.rpartition(":")[2].rpartition(".")[2] for where, _ in seam.CALLS.values()}
    names |= {where.rpartition(":")[2] for where in seam.READS if ":" in where}
    names |= {attr for attrs in seam.READS.values() for attr in attrs}
    missing = sorted(n for n in names if n not in text)
    assert not missing, f"docs/vllm.md does not name these vLLM internals of specserve/vllm/seam.py: {missing}"
    assert f"vLLM {seam.CHECKED[0]}.{seam.CHECKED[1]}" in text, "the page names another vLLM version than seam.CHECKED"
