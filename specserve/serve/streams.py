"""Direct token streams from a target replica to the router: one authenticated TCP connection per request.

Why: a Serve handle call is a hop through Ray's object store and the replica's scheduling, and on
the request path it cost more than the engine's own first step (benchmarks/bench_http.py: the
router -> target hop was the largest share of time to first token, and added to every streamed
token). The router still finds targets, liveness and load through the Registry and falls back to
the Serve handle whenever a direct stream cannot be opened; only the bytes of a request and its
deltas take the shorter way.

Protocol (msgpack frames, a 4-byte little-endian length first):

- the target sends ``{"challenge": hex}`` when it accepts;
- the router proves the app's secret in a small frame, ``{"proof": HMAC(secret, "router:" + challenge)}``,
  then sends the request, ``{"request_id", "token_ids", "params"}`` (``SamplingParams`` fields), and
  for a request resumed from another replica ``"committed"`` (``Committed``: the output it has);
- the target then sends one ``StepDelta`` dict per step that added tokens (the last has
  ``finished``), or one ``{"error": message, "kind": "invalid" | "busy" | "auth" | "internal" |
  "stopping" | "unresumable"}`` (``stopping``: the replica is shutting down and hands the request
  back to be resumed; ``unresumable``: this target cannot resume it from its committed output).

Closing the connection, from either side, aborts the request on the target. The listening port
is bounded: a connection has ``HELLO_TIMEOUT_S`` to prove the secret, nothing over
``PROOF_FRAME_BYTES`` is read before the proof, at most ``MAX_UNPROVEN`` connections may be
proving it at once, and at most ``max_streams`` requests stream at once (beyond: ``busy``, and the
router uses the Serve handle). A proven connection then has ``HELLO_TIMEOUT_S`` to send its request,
or ``SPARE_IDLE_S`` while fewer than ``MAX_SPARES`` proven connections wait: the router keeps a
few connections proven ahead of need (``SparePool``), so a request's first bytes are its request,
not a handshake (one round trip through both event loops less before the first token). Knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
import time
from collections import deque

import msgpack

from ..outputs import CannotResume, Committed
from ..sampling_params import SamplingParams
from ..secret import new_challenge, prove, verify

logger = logging.getLogger("specserve.serve")

_LEN = struct.Struct("<I")
HELLO_TIMEOUT_S = 5.0  # a new connection's time to send its request
MAX_UNPROVEN = 64  # connections that may be proving the secret at once; beyond, new ones are closed at once
PROOF_FRAME_BYTES = 4096  # what is read from a connection before it proves the secret
SPARE_IDLE_S = 30.0  # how long a proven connection may wait for its request (while spares are few)
MAX_SPARES = 64  # proven connections that may wait that long at once; beyond, HELLO_TIMEOUT_S
SPARE_MAX_AGE_S = 20.0  # the router retires a spare this old (before the target would drop it)
DELTA_FRAME_BYTES = 64 << 20  # the router's cap on one delta (prompt logprobs of a long prompt are the largest)


class TargetGone(ConnectionError):
    """The target replica's stream ended without finishing: the replica died or dropped it."""


class TargetStopping(TargetGone):
    """The target replica is shutting down (a scale-down) and handed the request back to be resumed elsewhere."""


class StreamRefused(Exception):
    """The target would not stream this request (busy, or the secret did not match): use the Serve handle."""


def _pack(obj) -> bytes:
    data = msgpack.packb(obj, use_bin_type=True)
    return _LEN.pack(len(data)) + data


async def _read(reader: asyncio.StreamReader, limit: int):
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > limit:
        raise ValueError(f"frame of {size} bytes exceeds the {limit}-byte limit")
    return msgpack.unpackb(await reader.readexactly(size), raw=False, strict_map_key=False)


class StreamServer:
    """The target replica's end: a listening port on its own thread and event loop, feeding requests
    to the engine loop (``EngineLoop.stream``) and their deltas back."""

    def __init__(self, engine_loop, token: str, host: str, source: str, max_streams: int, max_request_bytes: int):
        if not token:
            raise ValueError("a direct stream server needs a secret (server.stream_token)")
        self.engine_loop, self.token, self.source = engine_loop, token, source
        self.max_streams, self.request_limit = max_streams, max(64 << 10, 4 * max_request_bytes)
        self.streaming = 0
        self.unproven = 0
        self.spares = 0  # proven connections waiting for their request
        self.num_streams = 0  # requests streamed (started) over this port
        self.num_refused = 0  # connections turned away: wrong secret, or too many streams open
        self.draining = False  # the replica is stopping: new requests are refused as busy (the router then uses the handle)
        self._tasks: set[asyncio.Task] = set()  # the streams running, which a stopping replica hands back
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.AbstractServer | None = None
        self.address: str | None = None
        self._error: BaseException | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        threading.Thread(target=self._run, args=(host,), name="specserve-streams", daemon=True).start()
        self._ready.wait(10)
        if self._error is not None:
            raise RuntimeError(f"could not listen for direct streams on {host}: {self._error}") from self._error

    def _run(self, host: str) -> None:
        self._loop = asyncio.new_event_loop()
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, host, 0))
            port = self._server.sockets[0].getsockname()[1]
            self.address = f"{host}:{port}"
        except OSError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.unproven >= MAX_UNPROVEN:  # a flood of strangers: the routers' next try gets in, or uses the handle
            self.num_refused += 1
            writer.transport.abort()
            return
        self._writers.add(writer)
        try:
            challenge = new_challenge()
            writer.write(_pack({"challenge": challenge}))
            self.unproven += 1
            try:  # the proof first, in a small frame: nothing large is read from a stranger
                proof = await asyncio.wait_for(_read(reader, PROOF_FRAME_BYTES), HELLO_TIMEOUT_S)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, msgpack.UnpackException, OSError):
                return  # silent, slow or oversized: not a router of this app
            finally:
                self.unproven -= 1
            if not isinstance(proof, dict) or not verify(self.token, "router", challenge, proof.get("proof")):
                self.num_refused += 1
                logger.warning("refused a direct stream: it did not prove the app's stream secret")
                writer.write(_pack({"error": "authentication failed", "kind": "auth"}))
                return
            idle_s = SPARE_IDLE_S if self.spares < MAX_SPARES else HELLO_TIMEOUT_S  # a router's spare waits
            self.spares += 1
            try:
                hello = await asyncio.wait_for(_read(reader, self.request_limit), idle_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError, msgpack.UnpackException, OSError):
                return  # retired by the router, idle too long, or oversized
            finally:
                self.spares -= 1
            if not isinstance(hello, dict):
                writer.write(_pack({"error": "the request must be a map", "kind": "invalid"}))
                return
            if self.draining or self.streaming >= self.max_streams:
                self.num_refused += 1
                why = "the target is stopping" if self.draining else f"{self.streaming} streams open"
                writer.write(_pack({"error": why, "kind": "busy"}))
                return
            self.streaming += 1
            self.num_streams += 1
            try:
                await self._stream(hello, reader, writer)
            finally:
                self.streaming -= 1
        except (ConnectionError, OSError):
            pass  # the router went away: the request was aborted where it ran
        except asyncio.CancelledError:
            pass  # the target is stopping; a cancelled handler is an "Exception in callback" to Python 3.11's streams
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _stream(self, hello: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            rid, tokens, params = str(hello["request_id"]), list(hello["token_ids"]), SamplingParams(**hello["params"])
            committed = Committed.from_dict(hello.get("committed"))
        except (KeyError, TypeError, ValueError) as exc:
            writer.write(_pack({"error": str(exc), "kind": "invalid"}))
            return
        # The router closing (or sending anything) ends the request: a watcher cancels this task wherever it
        # waits. (Not a wait on two futures per delta: that cost the replica's core ~10 us a token.)
        task, streaming = asyncio.current_task(), True

        def router_left(_) -> None:
            if streaming:  # (a callback already scheduled when the stream ended must not cancel its cleanup)
                task.cancel()

        gone = asyncio.ensure_future(reader.read(1))
        gone.add_done_callback(router_left)
        deltas = self.engine_loop.stream(rid, tokens, params, committed)
        self._tasks.add(task)
        try:
            async for item in deltas:
                writer.write(_pack({**vars(item), "source": self.source}))  # (shallow: asdict deep-copies, 10 us a delta)
                await writer.drain()
                if item.finished:
                    return
        except asyncio.CancelledError:
            if self.draining and not gone.done():  # handed back: the router resumes it on another replica
                writer.write(_pack({"error": "the target replica is stopping", "kind": "stopping"}))
                return
            if not gone.done() or gone.cancelled():
                raise  # the server is closing
        except CannotResume as exc:
            writer.write(_pack({"error": str(exc), "kind": "unresumable"}))
        except ValueError as exc:  # the engine's validation: the request's fault
            writer.write(_pack({"error": str(exc), "kind": "invalid"}))
        except Exception as exc:
            logger.exception("direct stream %s failed", rid)
            writer.write(_pack({"error": f"{type(exc).__name__}: {exc}", "kind": "internal"}))
        finally:
            streaming = False
            self._tasks.discard(task)
            gone.cancel()
            await deltas.aclose()  # unfinished: aborts the request on both sides

    def stats(self) -> dict:
        return {"address": self.address, "streaming": self.streaming, "spares": self.spares, "num_streams": self.num_streams,
                "num_refused": self.num_refused}

    def drain(self, timeout_s: float) -> bool:
        """Refuse new requests (as busy: the router serves them through the Serve handle, which a stopping
        replica no longer gets) and hand the open streams back (``stopping``: the router resumes each on
        another replica from what it has); wait up to ``timeout_s`` for them to close. True when they did."""
        self.draining = True
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(lambda: [t.cancel() for t in list(self._tasks)])
        deadline = time.monotonic() + timeout_s
        while self.streaming and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self.streaming

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop listening, abort every open stream (its request too) and stop the thread."""
        loop = self._loop
        if loop is None or not loop.is_running():
            return

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):  # the routers see their streams end unfinished
                writer.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.call_soon(loop.stop)

        try:
            asyncio.run_coroutine_threadsafe(stop(), loop).result(timeout_s)
        except Exception as exc:  # shutting down anyway
            logger.debug("closing the stream server: %s", exc)


class DirectStream:
    """The router's end of one request: ``__anext__`` gives the target's delta dicts and ``cancel``
    closes the connection (aborting the request), as a Serve streaming call's generator does."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, on_close=None, resend=None):
        self.reader, self.writer = reader, writer
        self.finished = False
        self._on_close = on_close  # called once, when the stream ends or is cancelled
        # On a spare connection: how to send the request again on a fresh one, should the target have
        # dropped the spare before reading it (restarted, or it idled out). Only before the first frame.
        self._resend = resend

    def __aiter__(self):
        return self

    async def __anext__(self) -> dict:
        if self.finished:
            raise StopAsyncIteration
        try:
            msg = await _read(self.reader, DELTA_FRAME_BYTES)
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError, msgpack.UnpackException) as exc:
            if self._resend is not None and isinstance(exc, (asyncio.IncompleteReadError, ConnectionError)):
                resend, self._resend = self._resend, None
                self.writer.close()
                try:
                    self.reader, self.writer = await resend()
                except (OSError, asyncio.TimeoutError, ConnectionError, ValueError, msgpack.UnpackException) as again:
                    self.cancel()
                    raise TargetGone(f"the target's stream broke: {type(again).__name__}") from None
                return await self.__anext__()
            self.cancel()
            raise TargetGone(f"the target's stream broke: {type(exc).__name__}") from None
        self._resend = None
        if not isinstance(msg, dict):
            self.cancel()
            raise TargetGone("the target sent a malformed frame")
        if "error" in msg:
            self.cancel()
            kind, text = msg.get("kind"), str(msg["error"])
            if kind == "invalid":
                raise ValueError(text)
            if kind in ("busy", "auth"):
                raise StreamRefused(text)
            if kind == "stopping":
                raise TargetStopping(text)
            if kind == "unresumable":
                raise CannotResume(text)
            raise RuntimeError(f"the target failed: {text}")
        if msg.get("finished"):
            self.finished = True
            self.cancel()
        return msg

    def cancel(self) -> None:
        self.finished = True
        if not self.writer.is_closing():
            self.writer.close()
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            on_close()

    def interrupt(self) -> None:
        """Break the connection now (from another task of the loop): a pending ``__anext__`` raises
        ``TargetGone``, and the target aborts the request when it next reads."""
        self._resend = None
        self.writer.transport.abort()


async def connect(address: str, token: str, timeout_s: float = 2.0) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a target replica's stream server with the secret proven: the next frame is a request."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout_s)
    try:
        first = await asyncio.wait_for(_read(reader, 4096), timeout_s)
        challenge = first.get("challenge") if isinstance(first, dict) else None
        if not isinstance(challenge, str):
            raise ConnectionError("the target sent no challenge")
        writer.write(_pack({"proof": prove(token, "router", challenge)}))
        await writer.drain()
    except BaseException:
        writer.close()
        raise
    return reader, writer


async def _send_request(writer: asyncio.StreamWriter, request_id: str, token_ids: list[int], params: dict,
                        committed: dict | None = None) -> None:
    request = {"request_id": request_id, "token_ids": list(token_ids), "params": params}
    if committed:
        request["committed"] = committed
    try:
        writer.write(_pack(request))
        await writer.drain()
    except BaseException:
        writer.close()
        raise


async def open_stream(address: str, token: str, request_id: str, token_ids: list[int], params: dict,
                      timeout_s: float = 2.0, on_close=None, committed: dict | None = None) -> DirectStream:
    """Connect to a target replica's stream server and send one request (``OSError`` if it cannot be
    reached); ``committed``: the output it resumes from (``Committed.to_dict``)."""
    reader, writer = await connect(address, token, timeout_s)
    await _send_request(writer, request_id, token_ids, params, committed)
    return DirectStream(reader, writer, on_close)


class SparePool:
    """The router's proven connections opened ahead of need, ``spares`` per target address.

    ``take`` hands one out (None when there is none fit to use: the caller connects as before) and
    refills in the background; ``keep`` (called with every Registry snapshot) opens spares to the
    live targets, and closes those of targets gone and those older than ``SPARE_MAX_AGE_S`` (the
    target drops an idle one after ``SPARE_IDLE_S``). A spare can still be closed under the router's
    feet (the target restarted, or dropped it idle): the stream ``open`` gives then sends its request
    once more, on a fresh connection, before its first frame."""

    def __init__(self, token: str, spares: int, max_age_s: float = SPARE_MAX_AGE_S):
        self.token, self.spares, self.max_age_s = token, spares, max_age_s
        self._idle: dict[str, deque] = {}
        self._filling: dict[str, asyncio.Task] = {}
        self.num_taken = 0  # requests that started on a spare
        self.num_opened = 0

    def _fit(self, spare: tuple, now: float) -> bool:
        reader, writer, born = spare
        return now - born < self.max_age_s and not writer.is_closing() and not reader.at_eof() and reader.exception() is None

    async def open(self, address: str, request_id: str, token_ids: list[int], params: dict, on_close=None,
                   committed: dict | None = None) -> DirectStream | None:
        """``open_stream`` on a spare connection to ``address``; None when there is no spare fit to use.
        Should the target have dropped the spare unread, the stream sends the request once more, on a
        fresh connection, as ``<request_id>-f``."""
        spare = self.take(address)
        if spare is None:
            return None
        reader, writer = spare

        async def resend():
            fresh = await connect(address, self.token)
            await _send_request(fresh[1], f"{request_id}-f", token_ids, params, committed)
            return fresh

        try:
            await _send_request(writer, request_id, token_ids, params, committed)
        except (OSError, ConnectionError):
            reader, writer = await resend()
        return DirectStream(reader, writer, on_close, resend)

    def take(self, address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter] | None:
        idle, now = self._idle.get(address), time.monotonic()
        picked = None
        while idle and picked is None:
            spare = idle.popleft()
            if self._fit(spare, now):
                picked = spare[:2]
            else:
                spare[1].close()
        self._fill(address)
        if picked is not None:
            self.num_taken += 1
        return picked

    def keep(self, addresses: set[str]) -> None:
        now = time.monotonic()
        for address in list(self._idle):
            idle = self._idle[address]
            for spare in [s for s in idle if address not in addresses or not self._fit(s, now)]:
                idle.remove(spare)
                spare[1].close()
            if address not in addresses:
                del self._idle[address]
        for address in addresses:
            self._fill(address)

    def _fill(self, address: str) -> None:
        if self.spares <= 0 or address in self._filling or len(self._idle.get(address, ())) >= self.spares:
            return
        self._filling[address] = asyncio.get_running_loop().create_task(self._open(address))

    async def _open(self, address: str) -> None:
        try:
            idle = self._idle.setdefault(address, deque())
            while len(idle) < self.spares:
                reader, writer = await connect(address, self.token)
                self.num_opened += 1
                if self._idle.get(address) is not idle:  # the target went away meanwhile
                    writer.close()
                    return
                idle.append((reader, writer, time.monotonic()))
        except (OSError, asyncio.TimeoutError, ConnectionError, ValueError, msgpack.UnpackException) as exc:
            logger.debug("no spare stream to %s: %s", address, exc)  # requests connect as before
        finally:
            self._filling.pop(address, None)

    def stats(self) -> dict:
        return {"idle": sum(len(q) for q in self._idle.values()), "taken": self.num_taken, "opened": self.num_opened}

    def close(self) -> None:
        for task in self._filling.values():
            task.cancel()
        for idle in self._idle.values():
            for _, writer, _ in idle:
                writer.close()
        self._idle.clear()
