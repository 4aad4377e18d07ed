"""The demo's realistic pair: built from the shipped target once, reused from the cache, never half-built."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.demo import DEMO_PROMPTS
from specserve.demo_models import TARGET_PATH, realistic
from specserve.demo_models.realistic import MARKER, cache_root, cached_pair, pair_key

LAYERS = 12  # the smallest depth with inserted layers (4 trained + one +/- pair after each): fast to build


def test_builds_once_then_reuses(tmp_path):
    target, draft, built = cached_pair(LAYERS, root=tmp_path)
    assert built and os.path.basename(os.path.dirname(target)) == f"realistic-pair-{pair_key(LAYERS)}"
    assert json.loads((tmp_path / f"realistic-pair-{pair_key(LAYERS)}" / MARKER).read_text())["num_layers"] == LAYERS
    with open(os.path.join(target, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == LAYERS
    weights = os.path.join(target, "model.safetensors")
    written = os.stat(weights).st_mtime_ns
    said = []
    again = cached_pair(LAYERS, root=tmp_path, say=said.append)
    assert again == (target, draft, False) and not said  # nothing rebuilt, nothing announced
    assert os.stat(weights).st_mtime_ns == written
    assert [p.name for p in tmp_path.iterdir()] == [f"realistic-pair-{pair_key(LAYERS)}"]  # no temporary folder left
    other, _, built_other = cached_pair(LAYERS + 8, root=tmp_path)  # other inputs: another pair beside it
    assert built_other and other != target


def test_a_half_written_cache_is_never_used(tmp_path, monkeypatch):
    final = tmp_path / f"realistic-pair-{pair_key(LAYERS)}"
    real_build = realistic.build_pair

    def killed(out, num_layers, scale):  # a build that dies after writing some of its files
        (out / "target").mkdir()
        (out / "target" / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(realistic, "build_pair", killed)
    with pytest.raises(KeyboardInterrupt):
        cached_pair(LAYERS, root=tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither the final folder nor the temporary one

    final.mkdir()  # a folder by the final name without its marker (e.g. copied in part)
    (final / "target").mkdir()
    stale = tmp_path / f".{final.name}.abc.tmp"  # a build killed so hard that it could not clean up
    stale.mkdir()
    os.utime(stale, (time.time() - 2 * realistic.STALE_BUILD_S,) * 2)
    monkeypatch.setattr(realistic, "build_pair", real_build)
    said = []
    target, _, built = cached_pair(LAYERS, root=tmp_path, say=said.append)
    assert built and len(said) == 1 and (final / MARKER).is_file() and os.path.isfile(os.path.join(target, "model.safetensors"))
    assert not stale.exists()


def test_cache_root_honours_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "specserve"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == realistic.Path.home() / ".cache" / "specserve"


def test_a_depth_the_builder_cannot_make_is_a_value_error(tmp_path):
    with pytest.raises(ValueError, match="num_layers must be 4 \\+ a multiple of 8"):
        cached_pair(10, root=tmp_path)
    assert [p for p in tmp_path.iterdir()] == []


def test_the_deep_target_generates_the_demo_targets_greedy_tokens(tmp_path):
    target, _, _ = cached_pair(LAYERS, root=tmp_path)
    tok = AutoTokenizer.from_pretrained(TARGET_PATH)
    shallow = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.float32).eval()
    deep = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assert deep.config.num_hidden_layers == LAYERS
    for prompt in DEMO_PROMPTS[:2]:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            want = shallow.generate(ids, max_new_tokens=24, do_sample=False)
            got = deep.generate(ids, max_new_tokens=24, do_sample=False)
        assert got.tolist() == want.tolist(), prompt
