"""Every wire message round-trips through msgpack; anything malformed is a ProtocolError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.messages import (PROTOCOL_VERSION, CloseSeq, DraftBlock, DraftStats, Hello, HelloReply, OpenSeq,
                                ProposeReply, ProposeRequest, ProtocolError, VerifyResult, decode, encode)
from specserve.rng import MAX_SEED

OPEN = OpenSeq("r1", [1, 2, 3], temperature=0.7, top_k=5, top_p=0.9, seed=MAX_SEED)
RESULT = VerifyResult("r1", base_len=10, num_accepted=2, token_ids=[4, 5, 6])
CLOSE = CloseSeq("r2")
BLOCK = DraftBlock("r1", base_len=13, draft_token_ids=[7, 8], draft_probs=np.random.rand(2, 11).astype(np.float32), num_cached=2)


@pytest.mark.parametrize("msg", [
    OPEN, RESULT, CLOSE, BLOCK, DraftBlock("r3", 2, [], None),
    Hello("t1", {"tokenizer_sha": "ab", "num_tokens": 3, "vocab_size": 4}),
    HelloReply("d1", None, "vocabularies differ", {"node_id": "x"}),
    ProposeRequest(5, [OPEN], [RESULT], [CLOSE], ["r1", "r4"], [4, 2]),
    ProposeReply(5, [BLOCK, DraftBlock("r3", 2, [1], None)], ["r9"], DraftStats(queue_s=0.001, compute_s=0.1, forward_s=0.05, num_forwards=3, hidden_s=0.2, draft_step_s=0.01)),
])
def test_round_trip(msg):
    back = decode(encode(msg))
    assert type(back) is type(msg)
    if isinstance(msg, (DraftBlock, ProposeReply)):
        blocks = [msg] if isinstance(msg, DraftBlock) else msg.blocks
        back_blocks = [back] if isinstance(back, DraftBlock) else back.blocks
        for a, b in zip(blocks, back_blocks):
            assert (a.request_id, a.base_len, a.draft_token_ids, a.cache_hit) == (b.request_id, b.base_len, b.draft_token_ids, b.cache_hit)
            assert (a.draft_probs is None and b.draft_probs is None) or np.array_equal(a.draft_probs, b.draft_probs)
        if isinstance(msg, ProposeReply):
            assert back.stats == msg.stats and back.missing == msg.missing
    else:
        assert back == msg


def test_verify_results_are_kv_deltas_that_coalesce():
    assert RESULT.committed_len == 13
    later = VerifyResult("r1", 13, 0, [9])
    assert RESULT.then(later) == VerifyResult("r1", 10, 2, [4, 5, 6, 9])


@pytest.mark.parametrize("data, match", [
    (b"\xc1garbage", "malformed message bytes"),
    (msgpack.packb([1, 2]), "expected a map"),
    (msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "CloseSeq", "body": {"request_id": "x"}}), "unsupported protocol version"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "Bogus", "body": {}}), "unknown message type 'Bogus'"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "CloseSeq", "body": {"request_id": "x", "evil": 1}}), "unknown fields"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "VerifyResult", "body": {"request_id": "x"}}), "bad VerifyResult"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "OpenSeq", "body": {"request_id": 3, "token_ids": [1]}}), "must be str"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "OpenSeq", "body": {"request_id": "a", "token_ids": [True]}}), "list"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "ProposeRequest", "body": {"step": 1, "request_ids": ["a"]}}), "num_draft_tokens"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "DraftBlock", "body": {"request_id": "a", "base_len": 1, "draft_token_ids": [],
                    "draft_probs": {"dtype": "O", "shape": [1], "data": b"x"}}}), "draft_probs"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "DraftBlock", "body": {"request_id": "a", "base_len": 1, "draft_token_ids": [5],
                    "num_cached": 2}}), "num_cached must be in"),
    ("not bytes", "must be bytes"),
])
def test_bad_bytes(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_no_pickle_on_the_wire():
    assert b"\x80\x04" not in encode(BLOCK)  # pickle protocol header
    with pytest.raises(TypeError):
        encode(object())


_leaf = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**64), max_value=2**64), st.floats(allow_nan=True),
                  st.text(max_size=8), st.binary(max_size=8))
_value = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4), max_leaves=12)
_field_names = st.sampled_from(["request_id", "token_ids", "step", "opens", "results", "closes", "blocks", "stats", "base_len",
                                "num_accepted", "draft_token_ids", "draft_probs", "request_ids", "num_draft_tokens", "seed",
                                "temperature", "vocab", "target_id", "error", "info", "x"])
_envelope = st.fixed_dictionaries({
    "v": st.one_of(st.just(PROTOCOL_VERSION), _leaf),
    "type": st.one_of(st.sampled_from(["OpenSeq", "VerifyResult", "CloseSeq", "ProposeRequest", "DraftBlock", "ProposeReply",
                                       "Hello", "HelloReply", "DraftStats"]), _leaf),
    "body": st.one_of(st.dictionaries(_field_names, _value, max_size=6), _value),
})


@settings(max_examples=400, deadline=None)
@given(_envelope)
def test_decode_is_total(envelope):
    """Random envelopes decode to a message or raise ProtocolError: nothing else escapes."""
    try:
        data = msgpack.packb(envelope, use_bin_type=True)
    except (OverflowError, TypeError, ValueError):
        return  # not representable in msgpack at all
    try:
        msg = decode(data)
    except ProtocolError:
        return
    assert decode(encode(msg)) is not None  # whatever decoded re-encodes


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_decode_random_bytes(data):
    try:
        decode(data)
    except ProtocolError:
        pass
