"""The router's direct streams from a target replica (specserve/serve/streams.py), over real TCP
against a real engine loop: the same tokens as the engine gives in-process, the secret checked
before anything runs, a bounded port, and a router that leaves aborting its request."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import msgpack
import pytest

from specserve import LLM, SamplingParams
from specserve.serve import streams
from specserve.secret import prove
from specserve.serve.streams import StreamRefused, StreamServer, TargetGone, open_stream

from ..conftest import wait_until

SECRET = "s3cret-for-tests"
PROMPT = [5, 9, 13, 2, 7]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_pair):
    with LLM(tiny_pair["target"], dtype="float64") as llm:
        yield llm


@pytest.fixture
def server(llm):
    srv = StreamServer(llm._engine.loop, SECRET, "127.0.0.1", "target-test", max_streams=2, max_request_bytes=1024)
    yield srv
    srv.close()


async def _collect(stream) -> list[dict]:
    return [d async for d in stream]


def test_stream_gives_the_engines_tokens(llm, server):
    expected = llm.generate([PROMPT], GREEDY)[0].token_ids
    deltas = asyncio.run(_collect_opened(server.address, SECRET, "r1", PROMPT, GREEDY.to_dict()))
    assert [t for d in deltas for t in d["token_ids"]] == expected
    assert deltas[-1]["finished"] and not any(d["finished"] for d in deltas[:-1])
    assert {d["source"] for d in deltas} == {"target-test"}
    assert server.stats()["num_streams"] == 1
    wait_until(lambda: server.stats()["streaming"] == 0, 10, message="the stream closed on the server")


async def _collect_opened(address, secret, rid, prompt, params):
    return await _collect(await open_stream(address, secret, rid, prompt, params))


def test_wrong_secret_is_refused_before_anything_runs(llm, server):
    before = llm._engine.loop.core.counters["num_steps"], server.stats()["num_streams"]
    with pytest.raises(StreamRefused, match="authentication"):
        asyncio.run(_collect_opened(server.address, "not-the-secret", "r2", PROMPT, GREEDY.to_dict()))
    assert server.stats()["num_refused"] == 1
    assert (llm._engine.loop.core.counters["num_steps"], server.stats()["num_streams"]) == before


def test_a_bad_request_is_a_value_error_naming_the_field(server):
    with pytest.raises(ValueError, match="temperature"):
        asyncio.run(_collect_opened(server.address, SECRET, "r3", PROMPT, {**GREEDY.to_dict(), "temperature": -1}))
    with pytest.raises(ValueError, match="token"):
        asyncio.run(_collect_opened(server.address, SECRET, "r4", [-5], GREEDY.to_dict()))


def _raw(address: str, prove_with: str | None = None) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    size = struct.unpack("<I", sock.recv(4))[0]
    challenge = msgpack.unpackb(sock.recv(size))["challenge"]
    if prove_with is not None:
        proof = msgpack.packb({"proof": prove(prove_with, "router", challenge)})
        sock.sendall(struct.pack("<I", len(proof)) + proof)
    return sock


def test_the_port_is_bounded(server, monkeypatch):
    # Before the proof nothing larger than PROOF_FRAME_BYTES is read: closed unread.
    monkeypatch.setattr(streams, "HELLO_TIMEOUT_S", 30)  # a server that read on would wait this long

    def closed_at_once(sock, header: int) -> bool:
        started = time.monotonic()
        sock.sendall(struct.pack("<I", header))
        return sock.recv(16) == b"" and time.monotonic() - started < 10

    assert closed_at_once(_raw(server.address), streams.PROOF_FRAME_BYTES + 1)
    # After it, a request over the limit (4 x max_request_bytes, at least 64 KiB): closed unread.
    assert closed_at_once(_raw(server.address, prove_with=SECRET), 1 << 20)
    # A connection that never sends its request is closed after HELLO_TIMEOUT_S.
    monkeypatch.setattr(streams, "HELLO_TIMEOUT_S", 0.5)
    sock = _raw(server.address)
    started = time.monotonic()
    assert sock.recv(16) == b""
    assert time.monotonic() - started < 5
    assert server.stats()["num_streams"] == 0
    # Strangers that hold connections open without proving anything: beyond MAX_UNPROVEN, closed at once.
    monkeypatch.setattr(streams, "HELLO_TIMEOUT_S", 30)
    monkeypatch.setattr(streams, "MAX_UNPROVEN", 1)
    holder = _raw(server.address)
    host, _, port = server.address.rpartition(":")
    extra = socket.create_connection((host, int(port)), timeout=10)
    assert extra.recv(16) == b""  # no challenge: turned away
    holder.close()
    wait_until(lambda: server.unproven == 0, 10, message="the holder's connection released")
    _raw(server.address).close()  # room again


def test_beyond_max_streams_the_router_is_told_busy(llm, server):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True).to_dict()

    async def main():
        a = await open_stream(server.address, SECRET, "b1", PROMPT, long)
        b = await open_stream(server.address, SECRET, "b2", PROMPT, long)
        await a.__anext__(), await b.__anext__()  # both streaming
        with pytest.raises(StreamRefused, match="streams open"):
            await _collect_opened(server.address, SECRET, "b3", PROMPT, long)
        a.cancel(), b.cancel()

    asyncio.run(main())
    assert server.stats()["num_refused"] == 1
    wait_until(lambda: llm._engine.loop.num_requests == 0, 10, message="both streams aborted")


def test_a_router_that_leaves_aborts_its_request(llm, server):
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True).to_dict()
    aborted = llm._engine.loop.core.counters["num_requests_aborted"]

    async def main():
        s = await open_stream(server.address, SECRET, "gone-1", PROMPT, long)
        await s.__anext__()
        s.cancel()

    asyncio.run(main())
    wait_until(lambda: llm._engine.loop.core.counters["num_requests_aborted"] == aborted + 1 and llm._engine.loop.num_requests == 0, 10,
               message="the request aborted on the engine")
    wait_until(lambda: server.stats()["streaming"] == 0, 10, message="the stream closed on the server")


def test_a_target_that_vanishes_mid_stream_is_target_gone(llm):
    srv = StreamServer(llm._engine.loop, SECRET, "127.0.0.1", "target-test", max_streams=2, max_request_bytes=1024)
    long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True).to_dict()

    async def main():
        s = await open_stream(srv.address, SECRET, "v1", PROMPT, long)
        await s.__anext__()
        srv.close()  # the replica shuts down: its connections drop
        with pytest.raises(TargetGone):
            while True:
                await asyncio.wait_for(s.__anext__(), 10)

    asyncio.run(main())
    wait_until(lambda: llm._engine.loop.num_requests == 0, 10, message="the request aborted when its replica closed")


def test_a_proven_connection_waits_for_its_request_a_bounded_time(server, monkeypatch):
    # A router's spare (proven, no request yet) may wait SPARE_IDLE_S, while fewer than MAX_SPARES wait.
    monkeypatch.setattr(streams, "SPARE_IDLE_S", 0.5)
    monkeypatch.setattr(streams, "HELLO_TIMEOUT_S", 30)
    spare = _raw(server.address, prove_with=SECRET)
    wait_until(lambda: server.stats()["spares"] == 1, 10, message="the proven connection counted as a spare")
    started = time.monotonic()
    assert spare.recv(16) == b""  # dropped after SPARE_IDLE_S
    assert time.monotonic() - started < 10
    wait_until(lambda: server.stats()["spares"] == 0, 10, message="the dropped spare uncounted")
    # Beyond MAX_SPARES a proven connection gets HELLO_TIMEOUT_S instead.
    monkeypatch.setattr(streams, "SPARE_IDLE_S", 30)
    monkeypatch.setattr(streams, "HELLO_TIMEOUT_S", 0.5)
    monkeypatch.setattr(streams, "MAX_SPARES", 1)
    held = _raw(server.address, prove_with=SECRET)
    wait_until(lambda: server.stats()["spares"] == 1, 10, message="one spare waiting")
    extra = _raw(server.address, prove_with=SECRET)
    started = time.monotonic()
    assert extra.recv(16) == b""
    assert time.monotonic() - started < 10
    held.close()
    assert server.stats()["num_streams"] == 0


def test_spares_are_proven_ahead_and_start_requests(llm, server):
    expected = llm.generate([PROMPT], GREEDY)[0].token_ids

    async def main():
        pool = streams.SparePool(SECRET, spares=2)
        pool.keep({server.address})
        await _until(lambda: pool.stats()["idle"] == 2 and server.stats()["spares"] == 2)
        stream = await pool.open(server.address, "sp1", PROMPT, GREEDY.to_dict())
        assert stream is not None and pool.stats()["taken"] == 1
        deltas = await _collect(stream)
        await _until(lambda: pool.stats()["idle"] == 2)  # refilled
        pool.keep(set())  # the target is gone: its spares closed
        assert pool.stats()["idle"] == 0
        pool.close()
        return deltas

    deltas = asyncio.run(main())
    assert [t for d in deltas for t in d["token_ids"]] == expected
    wait_until(lambda: server.stats()["spares"] == 0, 10, message="closed spares uncounted on the target")


def test_a_spare_the_target_dropped_unread_sends_the_request_again(llm, server, monkeypatch):
    expected = llm.generate([PROMPT], GREEDY)[0].token_ids
    monkeypatch.setattr(streams, "SPARE_IDLE_S", 0.3)

    async def main():
        pool = streams.SparePool(SECRET, spares=1)
        pool.keep({server.address})
        await _until(lambda: pool.stats()["idle"] == 1)
        # Blocking sleep: the target drops the spare, and this loop does not run to see it close.
        wait_until(lambda: server.stats()["spares"] == 0, 10, message="the target dropped the idle spare")
        stream = await pool.open(server.address, "drop-1", PROMPT, GREEDY.to_dict())
        assert stream is not None, "the pool did not notice the drop yet: the case under test"
        deltas = await _collect(stream)
        pool.close()
        return deltas

    deltas = asyncio.run(main())
    assert [t for d in deltas for t in d["token_ids"]] == expected
    assert {d["request_id"] for d in deltas} == {"drop-1-f"}  # sent once more, on a fresh connection
    assert server.stats()["num_streams"] == 1  # and served once


async def _until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)
