"""Structured outputs on specserve's own engine: a grammar masks the target's distribution at every
verified position (each after the drafts before it), so greedy output equals target-only constrained
decoding token for token, sampled outputs always follow the grammar, and drafts the grammar forbids are
cut before the verify. The demo pair (a byte-level vocabulary that can spell JSON), float32."""

from __future__ import annotations

import json
import re

import pytest

from specserve import LLM, SamplingParams

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2}},
          "required": ["name", "size"]}
CONSTRAINTS = {
    "json": ("json", json.dumps(SCHEMA)),
    "json_object": ("json_object", ""),
    "regex": ("regex", r"(def|class) [a-z_]{1,8}\((x|self)\):"),
    "choice": ("choice", json.dumps(["import os", "import sys", "pass"])),
    "grammar": ("grammar", 'root ::= "return " num (" + " num)*\nnum ::= [1-9] [0-9]?'),
}
PROMPTS = ["def parse(text):\n", "class Stack:\n", "import "]


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return isinstance(value["name"], str) and isinstance(value["size"], int)
    if kind == "json_object":
        return isinstance(json.loads(text), dict)
    if kind == "choice":
        return text in json.loads(CONSTRAINTS["choice"][1])
    if kind == "regex":
        return re.fullmatch(CONSTRAINTS["regex"][1], text) is not None
    return re.fullmatch(r"return [1-9][0-9]?( \+ [1-9][0-9]?)*", text) is not None


@pytest.fixture(scope="module")
def engines():
    with LLM("demo:target", dtype="float32") as plain, \
            LLM("demo:target", draft="demo:draft", dtype="float32", num_speculative_tokens=4, adaptive=False) as spec:
        yield plain, spec


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_greedy_constrained_output_equals_target_only(engines, kind):
    plain, spec = engines
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=CONSTRAINTS[kind])
    ref = plain.generate(PROMPTS, params, use_tqdm=False)
    outs = spec.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    for o in outs:
        if o.finish_reason == "stop":  # (a length cut may end mid-value; what was made still follows the grammar)
            assert valid(kind, o.text), (kind, o.text)
    m = [o.metrics for o in outs]
    # drafts the grammar forbids are cut before the verify: every verified draft was grammatical
    assert sum(x.num_accepted_tokens for x in m) <= sum(x.num_draft_tokens for x in m)


def test_sampled_outputs_follow_the_grammar(engines):
    _, spec = engines
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=s, structured_outputs=CONSTRAINTS["json"]) for s in range(6)]
    outs = spec.generate(["def f(x):\n"] * 6, params, use_tqdm=False)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished and all(valid("json", o.text) for o in finished)


@pytest.mark.parametrize("constraint, message", [
    (("json", '{"type": "object", "properties": 3}'), "cannot be compiled"),
    (("regex", "(unclosed"), "cannot be compiled"),
    (("choice", "[]"), "non-empty list"),
    (("yaml", "a: 1"), "kind must be one of"),
    (("json", "not json"), "not valid JSON"),
])
def test_a_bad_constraint_is_a_value_error_naming_it(engines, constraint, message):
    _, spec = engines
    with pytest.raises(ValueError, match=f"structured_outputs.*{message}|{message}"):
        spec.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=constraint), use_tqdm=False)
