"""The draft port is authenticated and bounded (real sockets on loopback, the demo-free tiny pair).

A target proves the shared secret before the draft accepts anything from it, and the draft proves
it back; a connection without it is refused before any model work; a stranger that sends garbage,
a huge frame or nothing at all is dropped without slowing the real target; a target over the
per-connection limits gets its extra sequences refused and decodes them target-only, exact.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import SamplingParams
from specserve.adaptive import SpeculationController
from specserve.build import build_draft_service, build_target
from specserve.config import SpecserveConfig
from specserve.engine import EngineCore, EngineLoop
from specserve.messages import Hello
from specserve.pool import DraftPool
from specserve.reference import reference_generate
from specserve.secret import new_token, prove, verify
from specserve.transport import HELLO_TIMEOUT_S, DraftServer, SocketEndpoint, _HEADER

PROMPTS = [list(range(3 + i, 9 + 2 * i)) for i in range(5)]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
TOKEN = new_token()


@pytest.fixture(scope="module")
def reference(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    return [reference_generate(target, p, GREEDY) for p in PROMPTS]


def server_for(tiny_pair, token=TOKEN, **overrides) -> DraftServer:
    cfg = SpecserveConfig.load(target=tiny_pair["target"], draft=tiny_pair["perturbed"], dtype="float64", **overrides)
    service = build_draft_service(cfg, "d0")
    return DraftServer(service, host="127.0.0.1", advertise_host="127.0.0.1", token=token)


def core_for(tiny_pair, address: str, token) -> EngineCore:
    cfg = SpecserveConfig.load(target=tiny_pair["target"], draft=tiny_pair["perturbed"], dtype="float64",
                               num_speculative_tokens=3, adaptive=False)
    target = build_target(cfg)
    core = EngineCore(target, None, SpeculationController(3, adaptive=False), 64)
    core.pool = DraftPool(discover=lambda: {"d0": address}, connect=lambda n, a: SocketEndpoint(a, token=token),
                          hello=Hello("t0", target.vocab_fingerprint()), reopen=core.reopen, background=False,
                          min_timeout_s=30.0, max_timeout_s=60.0)
    return core


def generate(core: EngineCore) -> tuple[list[list[int]], list]:
    loop = EngineLoop(core)
    done, outs, errors, finished = threading.Event(), {}, [], set()

    def sink_for(i):
        def sink(item):
            if isinstance(item, Exception):
                errors.append(item)
            else:
                outs.setdefault(i, []).extend(item.token_ids)
            if isinstance(item, Exception) or item.finished:
                finished.add(i)
                if len(finished) == len(PROMPTS):
                    done.set()
        return sink

    try:
        loop.submit_many([(f"r{i}", p, GREEDY, sink_for(i)) for i, p in enumerate(PROMPTS)])
        assert done.wait(120)
    finally:
        loop.shutdown()
    return [outs.get(i, []) for i in range(len(PROMPTS))], errors


def test_proofs_are_bound_to_the_secret_the_role_and_the_challenge():
    proof = prove(TOKEN, "target", "c1")
    assert verify(TOKEN, "target", "c1", proof)
    assert not verify(TOKEN, "target", "c2", proof)  # a proof is good for one challenge
    assert not verify(TOKEN, "draft", "c1", proof)  # and one role: a draft cannot replay the target's
    assert not verify(new_token(), "target", "c1", proof) and not verify(TOKEN, "target", "c1", "")
    assert verify(None, "target", "c1", "") and prove(None, "target", "c1") == ""  # no secret: nothing to prove


def test_a_target_with_the_secret_is_served(tiny_pair, reference):
    server = server_for(tiny_pair)
    try:
        core = core_for(tiny_pair, server.address, TOKEN)
        assert core.pool.has_drafts
        outs, errors = generate(core)
        assert errors == [] and outs == reference and core.totals.num_accepted_tokens > 0
    finally:
        server.close()


@pytest.mark.parametrize("target_token, draft_token, why", [
    (None, TOKEN, "this draft requires a token"),
    ("wrong", TOKEN, "authentication failed"),
    (TOKEN, None, "could not prove it holds this target's token"),  # the target checks the draft too
], ids=["target-has-none", "target-has-a-wrong-one", "draft-has-none"])  # (named: the token is random per process)
def test_without_the_right_secret_nothing_is_opened(tiny_pair, reference, target_token, draft_token, why):
    server = server_for(tiny_pair, token=draft_token)
    try:
        core = core_for(tiny_pair, server.address, target_token)
        assert not core.pool.has_drafts and why in core.pool.refused["d0"]
        assert server.service.counters["num_connections"] == 0 or draft_token is None  # the draft never saw a hello
        assert server.service.num_seqs == 0
        outs, errors = generate(core)  # the target decodes alone, exact
        assert errors == [] and outs == reference
    finally:
        server.close()


def test_strangers_are_dropped_and_the_target_is_not_held_up(tiny_pair, reference):
    server = server_for(tiny_pair)
    host, port = server.address.split(":")
    strangers = []
    try:
        for i in range(20):
            s = socket.create_connection((host, int(port)))
            if i % 4 == 0:
                s.sendall(b"GET / HTTP/1.1\r\n\r\n" * 50)  # garbage
            elif i % 4 == 1:
                s.sendall(_HEADER.pack(1 << 30, 0))  # a frame far over the limit before proving anything
            elif i % 4 == 2:
                s.sendall(_HEADER.pack(100, 0) + b"x" * 10)  # half a frame, then silence
            strangers.append(s)  # (i % 4 == 3: connects and says nothing)
        core = core_for(tiny_pair, server.address, TOKEN)
        outs, errors = generate(core)
        assert errors == [] and outs == reference and core.totals.num_accepted_tokens > 0
        deadline = time.monotonic() + HELLO_TIMEOUT_S + 30  # (the silent ones are dropped at their deadline)
        while time.monotonic() < deadline and server._conns:
            time.sleep(0.1)
        assert not server._conns and server.counters["num_dropped"] == len(strangers) + 1  # (+ the target, done)
        assert server.service.counters["num_connections"] == 1  # only the real target ever reached the draft
    finally:
        for s in strangers:
            s.close()
        server.close()


def test_sequences_over_the_connection_limit_decode_target_only(tiny_pair, reference):
    server = server_for(tiny_pair, max_draft_seqs=2)
    try:
        core = core_for(tiny_pair, server.address, TOKEN)
        outs, errors = generate(core)
        assert errors == [] and outs == reference
        assert core.pool.counters["num_seqs_refused"] == len(PROMPTS) - 2
        assert server.service.num_seqs == 0  # all closed at the end
    finally:
        server.close()


def test_a_frame_larger_than_the_socket_buffer_arrives_whole():
    """sendmsg may send part of a large frame; the rest must follow (else the peer waits forever
    and the draft is timed out; an EAGLE head's prompt rows at batch 32 make such frames)."""
    import socket
    import threading

    from specserve.transport import MESSAGE_WITH_TENSOR, recv_frame, send_frame

    a, b = socket.socketpair()
    a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    payload = bytes(range(256)) * 40_000  # ~10 MB, far over both buffers
    got = {}
    reader = threading.Thread(target=lambda: got.update(frame=recv_frame(b)))
    reader.start()
    a.settimeout(30.0)
    send_frame(a, payload, MESSAGE_WITH_TENSOR)
    reader.join(30.0)
    a.close()
    b.close()
    assert got["frame"] == (MESSAGE_WITH_TENSOR, payload)
