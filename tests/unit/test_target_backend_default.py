"""The target's default backend (auto): vLLM where it is installed and can take the side, else
specserve's own engine; the draft's default stays transformers. The vLLM end of it runs for real in
tests/vllm/test_entry_points.py (the batch CLI with no backend named)."""

from __future__ import annotations

import pytest

import specserve.config as config_module
from specserve.config import TARGET_BACKEND_ENV, SpecserveConfig


@pytest.fixture
def vllm_here(monkeypatch):
    monkeypatch.delenv(TARGET_BACKEND_ENV, raising=False)  # (the suite pins hf for speed; these tests read the default)
    monkeypatch.setattr(config_module, "vllm_installed", lambda: True)


def load(**overrides) -> SpecserveConfig:
    return SpecserveConfig.load(target="demo:target", draft="demo:draft", **overrides)


def test_auto_picks_vllm_for_the_target_where_it_is_installed(vllm_here):
    cfg = load()
    assert (cfg.target.backend, cfg.draft.backend) == ("vllm", "hf")
    assert SpecserveConfig.load(cfg.model_dump()).target.backend == "vllm"  # resolved once, carried as such
    assert load(target_backend="auto", draft_backend="auto").draft.backend == "hf"


def test_auto_is_specserves_engine_without_vllm_or_where_vllm_cannot_take_the_side(vllm_here, monkeypatch):
    assert load(dtype="float64").target.backend == "hf"  # vLLM has no float64
    assert load(target_device_map="auto").target.backend == "hf"  # a transformers placement
    assert load(target_device="mps").target.backend == "hf"
    assert load(target_backend="hf").target.backend == "hf"  # named: kept
    monkeypatch.setattr(config_module, "vllm_installed", lambda: False)
    assert load().target.backend == "hf"


def test_the_environment_sets_the_targets_default(vllm_here, monkeypatch):
    monkeypatch.setenv(TARGET_BACKEND_ENV, "hf")
    assert load().target.backend == "hf"
    assert load(target_backend="vllm").target.backend == "vllm"  # a named backend wins


def test_backend_options_without_a_backend_are_refused(vllm_here):
    with pytest.raises(ValueError, match="backend_options are one backend's own keywords: name that backend too"):
        load(target_backend_options={"enforce_eager": True})
    assert load(target_backend="vllm", target_backend_options={"enforce_eager": True}).target.backend_options == {"enforce_eager": True}


def test_an_eagle_head_passes_the_checks_with_the_default_vllm_target(vllm_here):
    from specserve.preflight import check_models

    check_models(SpecserveConfig.load(target="demo:target", draft="demo:eagle"))  # vLLM's path feeds a head its rows
    with pytest.raises(ValueError, match="is an EAGLE head: it needs a target that sends it its hidden states"):
        check_models(SpecserveConfig.load(target="demo:target", draft="demo:eagle", target_backend="sim"))
