"""Every wire message round-trips through msgpack; bad bytes give ProtocolError."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from specserve.messages import (PROTOCOL_VERSION, CloseSeq, DraftBlock, OpenSeq, ProposeReply, ProposeRequest,
                                ProtocolError, VerifyResult, decode, encode)

OPEN = OpenSeq("r1", [1, 2, 3], temperature=0.7, top_k=5, top_p=0.9, seed=42)
RESULT = VerifyResult("r1", step=3, base_len=10, num_accepted=2, token_ids=[4, 5, 6])
CLOSE = CloseSeq("r2", "aborted")
BLOCK = DraftBlock("r1", step=4, base_len=13, draft_token_ids=[7, 8], draft_probs=np.random.rand(2, 11).astype(np.float32))


@pytest.mark.parametrize("msg", [
    OPEN, RESULT, CLOSE, BLOCK, DraftBlock("r3", 1, 2, [], None),
    ProposeRequest(5, 4, [OPEN], [RESULT], [CLOSE], ["r1"]),
    ProposeReply(5, [BLOCK, DraftBlock("r3", 5, 2, [1], None)], ["r9"]),
])
def test_round_trip(msg):
    back = decode(encode(msg))
    assert type(back) is type(msg)
    if isinstance(msg, (DraftBlock, ProposeReply)):
        blocks = [msg] if isinstance(msg, DraftBlock) else msg.blocks
        back_blocks = [back] if isinstance(back, DraftBlock) else back.blocks
        for a, b in zip(blocks, back_blocks):
            assert (a.request_id, a.step, a.base_len, a.draft_token_ids) == (b.request_id, b.step, b.base_len, b.draft_token_ids)
            assert (a.draft_probs is None and b.draft_probs is None) or np.array_equal(a.draft_probs, b.draft_probs)
    else:
        assert back == msg


def test_verify_result_is_a_kv_delta():
    assert RESULT.rollback_to == 12 and RESULT.committed_len == 13


@pytest.mark.parametrize("data, match", [
    (b"\xc1garbage", "malformed message bytes"),
    (msgpack.packb([1, 2]), "expected a map"),
    (msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "CloseSeq", "body": {"request_id": "x"}}), "unsupported protocol version"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "Bogus", "body": {}}), "unknown message type 'Bogus'"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "CloseSeq", "body": {"request_id": "x", "evil": 1}}), "unknown fields"),
    (msgpack.packb({"v": PROTOCOL_VERSION, "type": "VerifyResult", "body": {"request_id": "x"}}), "bad VerifyResult"),
])
def test_bad_bytes(data, match):
    with pytest.raises(ProtocolError, match=match):
        decode(data)


def test_no_pickle_on_the_wire():
    assert b"\x80\x04" not in encode(BLOCK)  # pickle protocol header
    with pytest.raises(TypeError):
        encode(object())
