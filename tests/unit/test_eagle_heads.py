"""EAGLE-1 / EAGLE-3 draft heads fed the target's hidden states: loading, exactness, the rows they read, refusals."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.draft_service import DraftService
from specserve.eagle import head_spec, load_head
from specserve.messages import Hello, OpenSeq, ProposeRequest, VerifyResult, decode, encode
from specserve.reference import reference_generate

from ..conftest import make_model
from ..heads import make_eagle3_head, make_eagle_head

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(12, 40)), [3], [20, 21, 22, 20, 21, 22, 20]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    target = make_model(root / "target", seed=0, tokenizer=True, hidden=64, layers=4)
    return {
        "target": str(root / "target"),
        "target_model": target,
        "eagle3": make_eagle3_head(root / "eagle3", str(root / "target"), layer_ids=[1, 2, 3]),
        "eagle3_reduced": make_eagle3_head(root / "eagle3_reduced", str(root / "target"), layer_ids=[0, 2, 3],
                                           draft_vocab_size=32, seed=1),
        "eagle3_speculators": make_eagle3_head(root / "eagle3_spec", str(root / "target"), fmt="speculators",
                                               layer_ids=[1, 2, 3], seed=2, with_embedding=True),
        "eagle3_default_layers": make_eagle3_head(root / "eagle3_default", str(root / "target"), seed=3),  # (2, 2, 1): collide
        "eagle": make_eagle_head(root / "eagle", str(root / "target"), seed=4),
    }


@pytest.fixture(scope="module")
def reference(heads):
    target = AutoModelForCausalLM.from_pretrained(heads["target"], dtype=torch.float64).eval()
    return [reference_generate(target, p, GREEDY) for p in PROMPTS]


def test_formats_are_recognised(heads, tiny_pair):
    assert head_spec(heads["eagle3"]).kind == "eagle3" and head_spec(heads["eagle3"]).layer_ids == (1, 2, 3)
    assert head_spec(heads["eagle3_reduced"]).draft_vocab_size == 32
    spec = head_spec(heads["eagle3_speculators"])
    assert spec.kind == "eagle3" and spec.norm_before_residual and spec.verifier == heads["target"]
    assert head_spec(heads["eagle"]).kind == "eagle"
    assert head_spec(tiny_pair["target"]) is None  # a plain causal LM drafts as a model


@pytest.mark.parametrize("head", ["eagle3", "eagle3_reduced", "eagle3_speculators", "eagle"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_with_a_head_equals_target_only(heads, reference, head, k):
    with LLM(heads["target"], draft=heads[head], num_speculative_tokens=k, dtype="float64", adaptive=False) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # the head drafted


@pytest.mark.parametrize("head", ["eagle3", "eagle3_reduced", "eagle"])
def test_a_head_drafting_ahead_hits_and_equals_target_only(heads, reference, head, ordered_draft_ahead):
    """The speculation cache with a head: branches drafted on the head's own rows answer blocks with no
    forward on the critical path (hits), the real rows are read afterwards, and greedy output is the target's."""
    with LLM(heads["target"], draft=heads[head], num_speculative_tokens=3, dtype="float64", adaptive=False, draft_ahead=True,
             draft_ahead_preempt=False) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        m = llm.metrics()
    assert [o.token_ids for o in outs] == reference
    assert 0 < m["num_cache_hits"] < m["num_blocks"]  # (a random head misses often, and hits some)


@pytest.fixture(scope="module")
def small_vocab_head(tmp_path_factory):
    """A 12-token target with tame logits (so every token is sampled) and a random EAGLE-3 head for it."""
    root = tmp_path_factory.mktemp("smallvocab_head")
    make_model(root / "t", seed=10, vocab_size=12, hidden=64, layers=4)
    model = AutoModelForCausalLM.from_pretrained(root / "t")
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(0.1)
    model.save_pretrained(root / "t")
    return str(root / "t"), make_eagle3_head(root / "h", str(root / "t"), layer_ids=[1, 2, 3], seed=5)


def test_sampling_with_a_head_drafting_ahead_follows_the_target(small_vocab_head, ordered_draft_ahead):
    """Blocks from the cache were drafted on the head's own rows, not the target's: what an unseeded
    sampled request emits with them must still follow the target's distribution (chi-square on the
    first three tokens, marginalised exactly)."""
    from .test_sampling_lossless import NUM_SAMPLES, PROMPT, chi2_pvalue, exact_distributions

    target, head = small_vocab_head
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    with LLM(target, draft=head, num_speculative_tokens=3, dtype="float64", adaptive=False, draft_ahead=True,
             draft_ahead_preempt=False) as llm:
        outs = llm.generate([PROMPT] * NUM_SAMPLES, params, use_tqdm=False)
        hits = llm.metrics()["num_cache_hits"]
    assert hits > NUM_SAMPLES // 10  # the cache answered blocks deciding tokens 2 and 3
    for i, p in enumerate(exact_distributions(target, 1.0, 0, 1.0)):
        assert chi2_pvalue([o.token_ids[i] for o in outs], p) > 1e-4


def test_a_seeded_request_draws_the_same_with_a_head_drafting_ahead_or_not(small_vocab_head, ordered_draft_ahead):
    """A head's cached blocks differ from those drafted on demand, so a request with its own seed gets
    none: its tokens do not depend on drafting ahead. The same requests unseeded do hit (the control)."""
    from .test_sampling_lossless import PROMPT

    target, head = small_vocab_head
    seeded = [SamplingParams(temperature=1.0, max_tokens=12, seed=s, ignore_eos=True) for s in range(8)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    outs, hits = {}, {}
    for ahead, params in ((True, seeded), (False, seeded), ("control", unseeded)):
        with LLM(target, draft=head, num_speculative_tokens=3, dtype="float64", adaptive=False, draft_ahead=bool(ahead),
                 draft_ahead_preempt=False) as llm:
            outs[ahead] = [o.token_ids for o in llm.generate([PROMPT] * 8, params, use_tqdm=False)]
            hits[ahead] = llm.metrics()["num_cache_hits"]
    assert outs[True] == outs[False]
    assert hits[True] == 0 and hits["control"] > 0


def test_the_heads_fc_on_the_target_gives_the_head_the_same_rows(heads, reference, monkeypatch):
    """``head_fc: target``: the target applies the head's fc before its rows leave and the head skips it.
    The H-wide rows the head reads are the ones it computes from the three rows itself (float64), so the
    blocks and the greedy output are the same too."""
    from specserve.head_drafter import HeadDrafter

    fed: list = []
    original = HeadDrafter._feed

    def record(self, s):
        tokens, rows = original(self, s)
        fed.append((tuple(s.token_ids), rows.clone()))
        return tokens, rows

    monkeypatch.setattr(HeadDrafter, "_feed", record)
    runs = {}
    for fc in ("draft", "target"):
        fed.clear()
        with LLM(heads["target"], draft=heads["eagle3"], num_speculative_tokens=3, dtype="float64", adaptive=False,
                 head_fc=fc) as llm:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            combined = llm._engine.loop.core.target.hidden_fc is not None
        runs[fc] = ([o.token_ids for o in outs], dict(fed), combined)
    assert runs["draft"][0] == runs["target"][0] == reference
    assert (runs["draft"][2], runs["target"][2]) == (False, True)
    mine, theirs = runs["draft"][1], runs["target"][1]
    assert mine.keys() == theirs.keys() and len(mine) > 20
    for key in mine:
        assert torch.allclose(mine[key], theirs[key], rtol=1e-9, atol=1e-12), key


def _reference_block(head, target, tokens: list[int], layers, k: int) -> list[int]:
    """What a head should draft after ``tokens``, computed without any cache: the target's rows for
    positions 0..n-2 beside tokens 1..n-1, then its own rows, by full forwards."""
    with torch.no_grad():
        out = target(torch.tensor([tokens[:-1]]), output_hidden_states=True)
        rows = head.combine(torch.cat([out.hidden_states[i][0] for i in layers], dim=-1))
        ids, block = list(tokens[1:]), []
        for _ in range(k):
            n = len(ids)
            mask = torch.full((n, n), float("-inf"), dtype=rows.dtype).triu(1)[None, None]
            res = head(torch.tensor([ids]), torch.arange(n)[None], mask, None, rows[None], logits_to_keep=1)
            block.append(int(res.logits[0, -1].argmax()))
            ids.append(block[-1])
            rows = torch.cat([rows, res.hidden[0]])
    return block


def check_blocks_against_full_forwards(monkeypatch, target_path: str, head_path: str, target_model, dtype: str) -> None:
    """Every block the head drafts inside the engine (prompt rows at open, verify rows after each step,
    the KV cut back each block) equals the block computed from scratch with full forwards."""
    from specserve.head_drafter import HeadDrafter

    blocks = []
    original = HeadDrafter.propose

    def record(self, seqs, ks, draft_misses=True):
        out = original(self, seqs, ks, draft_misses)
        blocks.extend((list(s.token_ids), p.token_ids) for s, p in zip(seqs, out) if p.token_ids)
        return out

    monkeypatch.setattr(HeadDrafter, "propose", record)
    with LLM(target_path, draft=head_path, num_speculative_tokens=3, dtype=dtype, adaptive=False) as llm:
        llm.generate(PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        drafter = llm._engine.draft_service.drafter
    assert len(blocks) >= 9
    for tokens, block in blocks:
        assert block == _reference_block(drafter.head, target_model, tokens, drafter.hidden_layers, len(block)), tokens


@pytest.mark.parametrize("head", ["eagle3", "eagle3_reduced", "eagle"])
def test_head_reads_the_targets_rows_at_the_right_positions(heads, head, monkeypatch):
    check_blocks_against_full_forwards(monkeypatch, heads["target"], heads[head], heads["target_model"].double().eval(), "float64")


def test_speculators_head_reads_the_shared_embedding_only_when_it_has_none(heads):
    target = heads["target_model"]
    own = load_head(heads["eagle3_speculators"], heads["target"], 4)
    shared = load_head(heads["eagle3"], heads["target"], 4)
    emb = target.get_input_embeddings().weight
    assert torch.equal(shared.embed_tokens.weight, emb)
    assert not torch.equal(own.embed_tokens.weight, emb)


@pytest.mark.parametrize("field, change", [
    ("target_hidden_size", {"target_hidden_size": 48}),
    ("eagle_aux_hidden_state_layer_ids", {"eagle_aux_hidden_state_layer_ids": [1, 2, 9]}),
    ("vocab_size", {"vocab_size": 80}),
])
def test_a_head_that_does_not_fit_its_target_is_refused(heads, tmp_path, field, change):
    bad = tmp_path / "bad"
    make_eagle3_head(bad, heads["target"], layer_ids=[1, 2, 3])
    cfg = json.loads((bad / "config.json").read_text())
    cfg.update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=field):
        LLM(heads["target"], draft=str(bad), dtype="float64")


def test_default_aux_layers_that_collide_are_refused_with_the_fix(heads):
    with pytest.raises(ValueError, match="eagle_aux_hidden_state_layer_ids.*config.json"):
        LLM(heads["target"], draft=heads["eagle3_default_layers"])


def test_the_draft_refuses_a_target_of_other_width_at_connect(heads):
    from specserve.config import SpecserveConfig
    from specserve.build import build_draft_service

    cfg = SpecserveConfig.model_validate({"target": {"model": heads["target"], "dtype": "float64"},
                                          "draft": {"model": heads["eagle3"], "dtype": "float64"}})
    service: DraftService = build_draft_service(cfg)
    fingerprint = service.fingerprint
    ok = service.hello("c1", Hello("t", fingerprint, {"hidden_size": 64, "num_hidden_layers": 4}))
    assert ok.error is None and ok.info["hidden_layers"] == [1, 2, 3]
    wide = service.hello("c2", Hello("t", fingerprint, {"hidden_size": 128, "num_hidden_layers": 4}))
    assert wide.error is not None and "target_hidden_size" in wide.error
    blind = service.hello("c3", Hello("t", fingerprint, {}))  # e.g. a target engine without hidden states
    assert blind.error is not None and "hidden states" in blind.error
    own_fc = service.drafter.fc_digest
    assert own_fc and service.hello("c4", Hello("t", fingerprint, {"hidden_size": 64, "num_hidden_layers": 4, "hidden_fc": own_fc})).error is None
    other = service.hello("c5", Hello("t", fingerprint, {"hidden_size": 64, "num_hidden_layers": 4, "hidden_fc": "0" * 16}))
    assert other.error is not None and "hidden_fc" in other.error  # the target applies another head's fc


def test_a_resynced_sequence_without_rows_still_drafts_and_stays_exact(heads, reference):
    """A sequence re-opened mid-generation comes without the rows of its past (zeros are read)."""
    from specserve.engine import EngineCore

    original = EngineCore.reopen

    def reopen_without_rows(self, request_id):
        msg = original(self, request_id)
        return None if msg is None else OpenSeq(msg.request_id, msg.token_ids, msg.temperature, msg.top_k, msg.top_p, msg.seed)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(EngineCore, "reopen", reopen_without_rows)
        with LLM(heads["target"], draft=heads["eagle3"], num_speculative_tokens=3, dtype="float64", adaptive=False) as llm:
            outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_hidden_states_round_trip_in_their_own_dtype(dtype):
    rows = torch.randn(3, 12).to(dtype)
    req = ProposeRequest(1, [OpenSeq("a", [1, 2, 3, 4], hidden_states=rows)],
                         [VerifyResult("b", 4, 1, [5, 6], hidden_states=rows[:2])], [], ["a"], [2])
    back = decode(encode(req))
    assert back.opens[0].hidden_states.dtype == dtype and torch.equal(back.opens[0].hidden_states, rows)
    assert torch.equal(back.results[0].hidden_states, rows[:2])
    assert len(encode(req)) < 5 * 12 * rows.element_size() + 400  # raw bytes, not a float32 copy or text


def test_coalesced_results_concatenate_their_rows():
    a = VerifyResult("r", 10, 2, [1, 2, 3], hidden_states=torch.ones(3, 4))
    b = VerifyResult("r", 13, 0, [4], hidden_states=torch.zeros(1, 4))
    both = a.then(b)
    assert both.committed_len == 14 and both.hidden_states.shape == (4, 4)
    assert torch.equal(both.hidden_states[3], torch.zeros(4))


def test_rows_leave_a_request_as_one_packed_tensor_and_come_back_in_place():
    from specserve.transport import _hidden_layout, attach_hidden, strip_hidden

    rows = torch.randn(7, 6).to(torch.bfloat16)
    req = ProposeRequest(3, [OpenSeq("a", [1, 2, 3, 4], hidden_states=rows[:3]), OpenSeq("b", [5])],
                         [VerifyResult("c", 4, 2, [6, 7, 8], hidden_states=rows[3:6]), VerifyResult("d", 2, 0, [9], hidden_states=rows[6:])],
                         [], ["a"], [2])
    bare, layout, packed = strip_hidden(req)
    assert packed.dtype == torch.bfloat16 and torch.equal(packed, rows)
    assert all(m.hidden_states is None for m in [*bare.opens, *bare.results])
    back = attach_hidden(decode(encode(bare)), *_hidden_layout(layout, bare)[:1], packed)
    assert back.opens[1].hidden_states is None
    for a, b in zip([*req.opens, *req.results], [*back.opens, *back.results]):
        assert (a.hidden_states is None and b.hidden_states is None) or torch.equal(a.hidden_states, b.hidden_states)


@pytest.mark.parametrize("layout", [
    {"rows": [3, -1, 3], "width": 6, "dtype": "bfloat16"},  # one entry short
    {"rows": [3, -2, 3, 1], "width": 6, "dtype": "bfloat16"},  # negative count
    {"rows": [3, -1, 3, 1], "width": 6, "dtype": "int64"},  # not a float dtype
    {"rows": [3, -1, 3, 1], "width": 0, "dtype": "bfloat16"},
    {"rows": [3, -1, 3, 1], "width": 6, "dtype": ["bfloat16"]},
    ["rows"],
])
def test_a_malformed_row_layout_is_a_protocol_error(layout):
    from specserve.messages import ProtocolError
    from specserve.transport import _hidden_layout

    req = ProposeRequest(3, [OpenSeq("a", [1, 2]), OpenSeq("b", [5])], [VerifyResult("c", 4, 2, [6]), VerifyResult("d", 2, 0, [9])])
    with pytest.raises(ProtocolError):
        _hidden_layout(layout, req)
