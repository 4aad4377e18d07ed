"""How draft messages travel: in-process calls, or length-prefixed msgpack frames over TCP.

Target side, an endpoint speaks to one draft: ``hello`` once (answering the draft's
``Challenge`` with its proof of the shared secret, ``secret.py``, and checking the draft's),
then per step ``send`` a ``ProposeRequest`` and ``recv`` its ``ProposeReply`` (split so a
target can send to every draft it uses before waiting on any). Draft side, ``DraftServer``
is one thread that accepts connections, reads every socket without blocking (a frame is
handled once it has fully arrived, so no peer can stall the others), answers each request
and then lets the service draft ahead until any socket is readable again. Nothing from a
connection reaches the draft before it has proven the secret (when the draft has one); an
unproven connection may send one small frame within a few seconds, and only so many may
wait at once. A Ray actor call costs ~1 ms; a frame over loopback ~30 us, so
the step path uses sockets and Ray only places and supervises the processes.
Draft probabilities travel inline by default; with a ``TensorLink`` (e.g. a ``ray.util.collective``
group: gloo on CPUs, NCCL between GPUs) a reply's probabilities are stripped into one packed
tensor sent over the link right after the frame. ``delay_ms`` emulates a slow link (one way,
applied in both directions). Knows nothing of Ray or models; every failure surfaces as
``DraftUnavailable``.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import logging
import select
import selectors
import socket
import struct
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import msgpack

from .draft_service import DraftService
from .messages import (TENSOR_DTYPES, Challenge, DraftTree, Hello, HelloReply, ProposeReply, ProposeRequest, ProtocolError, decode,
                       encode)
from .secret import new_challenge, prove, verify

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<IB")  # payload length, frame kind
MAX_FRAME_BYTES = 1 << 30  # what a target accepts from a draft it authenticated
HELLO_FRAME_BYTES = 64 << 10  # what a draft accepts from a connection that has not proven the secret yet
HELLO_TIMEOUT_S = 5.0  # how long a new connection has to prove it
MAX_UNPROVEN = 64  # connections that may wait to prove it at once (beyond: the longest-waiting is closed)
MESSAGE, MESSAGE_WITH_TENSOR, LINK_SETUP = 0, 1, 2  # frame kinds
_conn_ids = itertools.count()


class DraftUnavailable(ConnectionError):
    """The draft endpoint cannot answer: refused, closed, timed out or sent garbage."""


def send_frame(sock: socket.socket, data: bytes, kind: int = MESSAGE) -> None:
    header = _HEADER.pack(len(data), kind)
    sent = sock.sendmsg([header, data])
    # sendmsg may send part of a large frame (a full socket buffer); the rest follows in order, or
    # the peer would wait for bytes that never come (and the target time the draft out).
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent < len(header) + len(data):
        sock.sendall(memoryview(data)[sent - len(header):])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("connection closed by peer")
        got += r
    return bytes(buf)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> tuple[int, bytes]:
    size, kind = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > limit:
        raise ProtocolError(f"frame of {size} bytes exceeds the {limit}-byte limit")
    if kind not in (MESSAGE, MESSAGE_WITH_TENSOR, LINK_SETUP):
        raise ProtocolError(f"unknown frame kind {kind}")
    return kind, _recv_exact(sock, size)


class TensorLink(Protocol):
    """Where tensors travel when not inline: per reply one packed [rows, vocab] float32 tensor of draft
    probabilities, per request one packed [rows, width] tensor of the target's hidden states (a head's)."""

    def send(self, tensor) -> None: ...

    def recv(self, rows: int, width: int, dtype=None): ...

    def close(self) -> None: ...


class BoundedLink:
    """A ``TensorLink`` whose transfers have a deadline: a collective send or receive waits for its
    peer, and a peer that vanished mid-transfer would otherwise hold this thread for the backend's
    own timeout (gloo: 30 min). Past the deadline the transfer raises ``TimeoutError`` and the
    caller drops the connection; the stuck transfer is abandoned on its helper thread."""

    def __init__(self, link: TensorLink, timeout_s: float = 10.0):
        self.link, self.timeout_s = link, timeout_s
        self._io = ThreadPoolExecutor(1, thread_name_prefix="specserve-tensor-link")

    def _run(self, fn, *args):
        try:
            return self._io.submit(fn, *args).result(timeout=self.timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"tensor link transfer took over {self.timeout_s:g}s") from None

    def send(self, tensor) -> None:
        self._run(self.link.send, tensor)

    def recv(self, rows: int, width: int, dtype=None):
        return self._run(self.link.recv, rows, width, dtype)

    def close(self) -> None:
        self._io.shutdown(wait=False)
        self.link.close()


def strip_probs(reply: ProposeReply):
    """(reply without probabilities, layout, packed [rows, vocab] float32 tensor) or (reply, None, None)."""
    import torch

    with_probs = [b for b in reply.blocks if b.draft_probs is not None and len(b.draft_token_ids)]
    if not with_probs:
        return reply, None, None
    packed = torch.cat([torch.as_tensor(b.draft_probs, dtype=torch.float32) for b in with_probs])
    rows = [len(b.draft_token_ids) if b.draft_probs is not None and len(b.draft_token_ids) else 0 for b in reply.blocks]
    blocks = [dataclasses.replace(b, draft_probs=None) for b in reply.blocks]
    return dataclasses.replace(reply, blocks=blocks), {"rows": rows, "vocab": int(packed.shape[1])}, packed


def attach_probs(reply: ProposeReply, layout: dict, packed) -> ProposeReply:
    blocks, start = [], 0
    for b, n in zip(reply.blocks, layout["rows"]):
        blocks.append(dataclasses.replace(b, draft_probs=packed[start:start + n]) if n else b)
        start += n
    return dataclasses.replace(reply, blocks=blocks)


def strip_hidden(req: ProposeRequest):
    """(request without hidden rows, layout, packed [rows, width] tensor in their dtype) or (req, None, None)."""
    import torch

    items = [*req.opens, *req.results]
    present = [m.hidden_states for m in items if m.hidden_states is not None]
    if not present or not sum(h.shape[0] for h in present):
        return req, None, None
    packed = torch.cat(present)
    layout = {"rows": [-1 if m.hidden_states is None else int(m.hidden_states.shape[0]) for m in items],
              "width": int(packed.shape[1]), "dtype": str(packed.dtype).split(".")[-1]}
    opens = [dataclasses.replace(o, hidden_states=None) for o in req.opens]
    results = [dataclasses.replace(r, hidden_states=None) for r in req.results]
    return dataclasses.replace(req, opens=opens, results=results), layout, packed


def _hidden_layout(layout, req: ProposeRequest) -> tuple[list[int], int, str]:
    """A request's hidden-row layout, checked (ProtocolError) before any tensor is received for it."""
    ok = isinstance(layout, dict) and isinstance(layout.get("rows"), list) and isinstance(layout.get("width"), int)
    rows = layout.get("rows") if ok else None
    if not ok or len(rows) != len(req.opens) + len(req.results) or not all(isinstance(n, int) and n >= -1 for n in rows) \
            or not isinstance(layout.get("dtype"), str) or layout["dtype"] not in TENSOR_DTYPES or not 0 < layout["width"] <= 1 << 20:
        raise ProtocolError("bad hidden-state layout")
    return rows, layout["width"], layout["dtype"]


def attach_hidden(req: ProposeRequest, rows: list[int], packed) -> ProposeRequest:
    items, start = [], 0
    for m, n in zip([*req.opens, *req.results], rows):
        items.append(dataclasses.replace(m, hidden_states=packed[start:start + n]) if n >= 0 else m)
        start += max(n, 0)
    return dataclasses.replace(req, opens=items[:len(req.opens)], results=items[len(req.opens):])


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"draft address must be host:port, got {address!r}")
    return host, int(port)


class SocketEndpoint:
    """A target's TCP connection to one draft server (and, optionally, a tensor link beside it)."""

    trees = True  # the server sends DraftTrees unasked after drafting ahead (``DraftServer._send_trees``)

    def __init__(self, address: str, delay_ms: float = 0.0, connect_timeout_s: float = 2.0, link_factory=None,
                 token: str | None = None):
        self.name = address
        self.delay_s = delay_ms / 1000.0
        self.link_factory = link_factory  # (group name) -> TensorLink of rank 0; None: probabilities inline
        self.link: TensorLink | None = None
        self.tensor_bytes = 0  # draft probabilities received over the link
        self.hidden_bytes = 0  # hidden-state rows sent (over the link, or inline)
        self.token = token  # the shared secret (secret.py); None: this target has none to prove
        try:
            self.sock = socket.create_connection(parse_address(address), timeout=connect_timeout_s)
        except OSError as exc:
            raise DraftUnavailable(f"cannot connect to draft at {address}: {exc}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _call_failed(self, exc: BaseException) -> DraftUnavailable:
        self.close()
        kind = "timed out" if isinstance(exc, TimeoutError) else f"failed ({type(exc).__name__}: {exc})"
        return DraftUnavailable(f"draft at {self.name} {kind}")

    def hello(self, msg: Hello, timeout_s: float) -> HelloReply:
        """Answer the draft's challenge with this target's proof and its own challenge; check the draft's proof."""
        challenge = self.recv(min(timeout_s, HELLO_TIMEOUT_S))
        if not isinstance(challenge, Challenge):
            raise self._call_failed(ProtocolError(f"expected a Challenge, got {type(challenge).__name__}"))
        if challenge.required and not self.token:
            self.close()
            return HelloReply("?", None, "this draft requires a token: set draft_token / draft_token_file or "
                                         "SPECSERVE_DRAFT_TOKEN on the target side")
        mine = new_challenge()
        self.send(dataclasses.replace(msg, proof=prove(self.token, "target", challenge.nonce), challenge=mine))
        reply = self.recv(timeout_s)
        if not isinstance(reply, HelloReply):
            raise self._call_failed(ProtocolError(f"expected HelloReply, got {type(reply).__name__}"))
        if reply.error is None and self.token and not verify(self.token, "draft", mine, reply.proof):
            self.close()
            return HelloReply(reply.draft_id, None, "the draft could not prove it holds this target's token (another "
                                                    "draft, or another token): not using it")
        if reply.error is None and self.link_factory is not None:
            self._setup_link(timeout_s)
        return reply

    def _setup_link(self, timeout_s: float) -> None:
        """Both ends join a fresh two-rank group (the draft in a helper thread, this end here)."""
        group = f"specserve-{uuid.uuid4().hex[:12]}"
        try:
            self.sock.settimeout(timeout_s)
            send_frame(self.sock, msgpack.packb({"group": group}), LINK_SETUP)
            self.link = BoundedLink(self.link_factory(group))
            kind, data = recv_frame(self.sock)
            answer = msgpack.unpackb(data) if kind == LINK_SETUP else {"error": "no link setup answer"}
        except (OSError, ProtocolError, RuntimeError) as exc:
            raise self._call_failed(exc) from None
        if answer.get("error"):
            raise self._call_failed(RuntimeError(f"tensor link: {answer['error']}"))

    def send(self, msg, awaited: bool = True) -> None:
        """``awaited`` false: nobody waits on this message (pushed deltas), so the emulated delay is not slept."""
        if self.delay_s and awaited:
            time.sleep(self.delay_s)
        layout = packed = None
        if isinstance(msg, ProposeRequest):
            rows = [m.hidden_states for m in (*msg.opens, *msg.results) if m.hidden_states is not None]
            self.hidden_bytes += sum(h.numel() * h.element_size() for h in rows)
            if rows and self.link is not None:  # packed for the link; inline rows go as they are
                msg, layout, packed = strip_hidden(msg)
        try:
            self.sock.settimeout(10.0)
            if packed is not None:
                send_frame(self.sock, msgpack.packb([layout, encode(msg)]), MESSAGE_WITH_TENSOR)
                self.link.send(packed)
            else:
                send_frame(self.sock, encode(msg))
        except (OSError, RuntimeError) as exc:
            raise self._call_failed(exc) from None

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether an answer has (begun to) arrive, waiting up to ``timeout_s``."""
        try:
            return bool(select.select([self.sock], [], [], max(0.0, timeout_s))[0])
        except (OSError, ValueError):
            return True  # a broken socket: the read says so

    def recv(self, timeout_s: float, awaited: bool = True):
        try:
            self.sock.settimeout(timeout_s)
            kind, data = recv_frame(self.sock)
            if kind == MESSAGE_WITH_TENSOR and self.link is not None:
                layout, body = msgpack.unpackb(data)
                packed = self.link.recv(sum(layout["rows"]), layout["vocab"])
                self.tensor_bytes += packed.numel() * packed.element_size()
                msg = attach_probs(decode(body), layout, packed)
            elif kind == MESSAGE:
                msg = decode(data)
            else:
                raise ProtocolError(f"unexpected frame kind {kind}")
        except (OSError, ProtocolError, RuntimeError) as exc:
            raise self._call_failed(exc) from None
        if self.delay_s and awaited:
            time.sleep(self.delay_s)
        return msg

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass
        if self.link is not None:
            self.link.close()
            self.link = None


class LocalEndpoint:
    """An in-process draft: direct calls; drafting ahead runs on a helper thread (torch drops the GIL)."""

    trees = False  # no DraftTrees: a draft in the target's process shares its compute, its trees would not come sooner

    def __init__(self, service: DraftService, name: str = "local", delay_ms: float = 0.0):
        self.name = name
        self.service = service
        self.delay_s = delay_ms / 1000.0  # emulated link, as for sockets (in-process link sweeps)
        self.conn = f"{name}-{next(_conn_ids)}"
        self._replies: deque[ProposeReply] = deque()  # in order, like a socket's (pushed deltas are answered too)
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="specserve-draft-ahead") if service.drafts_ahead else None
        self._pending = None  # the last drafting-ahead job
        # Without preemption drafting ahead finishes before the next request, as the TCP server keeps it.
        self._ordered = not getattr(service.drafter, "preempt", True)

    def hello(self, msg: Hello, timeout_s: float) -> HelloReply:
        return self.service.hello(self.conn, msg)

    def send(self, req: ProposeRequest, awaited: bool = True) -> None:
        if self.delay_s and awaited:
            time.sleep(self.delay_s)
        if self._ordered and self._pending is not None:
            self._pending.result()
        self._replies.append(self.service.handle(self.conn, req))
        if self._ahead is not None:
            try:
                self._pending = self._ahead.submit(self.service.prepare, self.conn)
            except RuntimeError:  # the interpreter is exiting (executors refuse work): no drafting ahead
                self._pending = None

    def poll(self) -> bool:
        return bool(self._replies)

    def recv(self, timeout_s: float, awaited: bool = True) -> ProposeReply:
        reply = self._replies.popleft()
        if self.delay_s and awaited:
            time.sleep(self.delay_s)
        return reply

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
        self.service.drop(self.conn)


def _listen(host: str, port: int, wait_s: float = 15.0) -> socket.socket:
    """A listening socket. A fixed port still held by a draft that is being replaced (a killed
    replica's process can outlive the kill by seconds) is waited for, then named in the error."""
    deadline = time.monotonic() + (wait_s if port else 0.0)
    while True:
        try:
            return socket.create_server((host, port), reuse_port=False)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(exc.errno, f"draft_port {port} on {host} stayed in use for {wait_s:g}s "
                                             "(another draft or program holds it): pick another port, or 0 for any") from None
                raise
            time.sleep(0.2)


@dataclass
class _Conn:
    """One accepted connection: its bytes so far, and whether it proved the secret."""

    name: str
    challenge: str
    deadline: float  # to prove the secret by
    buffer: bytearray = field(default_factory=bytearray)
    proven: bool = False
    trees: list = field(default_factory=list)  # (step, arrival) of requests with ``tree`` set, answered, trees not sent


class DraftServer:
    """TCP front of a ``DraftService``: one thread accepts, answers, then drafts ahead.

    ``token``: the shared secret targets must prove (None: any target that speaks the protocol);
    ``max_frame_bytes``: the largest message a proven target may send."""

    def __init__(self, service: DraftService, host: str = "0.0.0.0", port: int = 0, advertise_host: str | None = None,
                 link_factory=None, token: str | None = None, max_frame_bytes: int = 64 << 20):
        self.service = service
        self.token = token
        self.max_frame_bytes = max_frame_bytes
        self.link_factory = link_factory  # (group name) -> TensorLink of rank 1; None: refuse tensor links
        self.links: dict[socket.socket, TensorLink] = {}
        self.listener = _listen(host, port)
        self.listener.setblocking(False)
        bound_port = self.listener.getsockname()[1]
        self.address = f"{advertise_host or _routable_ip()}:{bound_port}"
        self.counters = {"num_evicted_unproven": 0, "num_dropped": 0}
        self._stop = threading.Event()
        self._conns: dict[socket.socket, _Conn] = {}
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="specserve-draft-server", daemon=True)
        self._thread.start()

    def _readable(self) -> bool:
        return bool(self._sel.select(timeout=0))

    def _serve(self) -> None:
        while not self._stop.is_set():
            answered = []
            for key, _ in self._sel.select(timeout=0.5):
                sock = key.fileobj
                if sock is self.listener:
                    self._accept()
                elif sock in self._conns:
                    answered += self._read(sock)
            self._expire()
            for sock in answered:
                c = self._conns.get(sock)
                if c is None:
                    continue
                if self.service.drafts_ahead:
                    self.service.prepare(c.name, self._readable)
                self._send_trees(sock, c)

    def _send_trees(self, sock: socket.socket, c: _Conn) -> None:
        """A DraftTree for each request that asked for one, in order (only the last carries the cache:
        the earlier ones' blocks were superseded before drafting ahead)."""
        owed, c.trees = c.trees, []
        try:
            for i, (step, arrived) in enumerate(owed):
                elapsed = time.perf_counter() - arrived
                tree = self.service.tree(c.name, step, elapsed) if i == len(owed) - 1 else DraftTree(step, [], elapsed)
                if not self._send(sock, encode(tree)):
                    self._drop(sock)
                    return
        except Exception:  # a bug building a tree: this connection's target resyncs, the server lives on
            logger.exception("draft failed sending a tree to %s; dropping the connection", c.name)
            self._drop(sock)

    def _accept(self) -> None:
        try:
            sock, peer = self.listener.accept()
        except BlockingIOError:
            return
        unproven = [(c.deadline, s) for s, c in self._conns.items() if not c.proven]
        if len(unproven) >= MAX_UNPROVEN:
            # A flood of strangers: make room by closing the one that has waited longest. Refusing the
            # newcomer instead would lock a real target out for as long as the flood keeps the slots
            # full; a target proves itself within a round trip, so it outlives the churn.
            self.counters["num_evicted_unproven"] += 1
            self._drop(min(unproven, key=lambda t: t[0])[1])
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c = self._conns[sock] = _Conn(f"tcp-{next(_conn_ids)}-{peer[0]}", new_challenge(), time.monotonic() + HELLO_TIMEOUT_S)
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ)
        if not self._send(sock, encode(Challenge(c.challenge, required=self.token is not None))):
            self._drop(sock)

    def _expire(self) -> None:
        now = time.monotonic()
        for sock, c in list(self._conns.items()):
            if not c.proven and now > c.deadline:
                logger.debug("connection %s did not prove the secret in %gs: closed", c.name, HELLO_TIMEOUT_S)
                self._drop(sock)

    def _read(self, sock: socket.socket) -> list[str]:
        """Read what has arrived; handle each complete frame. Returns the connection if it got a propose request."""
        c = self._conns[sock]
        try:
            data = sock.recv(1 << 20)
        except BlockingIOError:
            return []
        except OSError:
            data = b""
        if not data:
            self._drop(sock)
            return []
        c.buffer += data
        answered = False
        limit = self.max_frame_bytes if c.proven else HELLO_FRAME_BYTES
        while len(c.buffer) >= _HEADER.size and sock in self._conns:
            size, kind = _HEADER.unpack_from(c.buffer)
            tensor_ok = kind == MESSAGE_WITH_TENSOR and sock in self.links  # a request with hidden rows on the link
            if size > limit or not (kind in (MESSAGE, LINK_SETUP) or tensor_ok):
                logger.warning("dropping connection %s: a %d-byte frame of kind %d (limit %d bytes)", c.name, size, kind, limit)
                self._drop(sock)
                return []
            if len(c.buffer) < _HEADER.size + size:
                break
            data = bytes(c.buffer[_HEADER.size:_HEADER.size + size])
            del c.buffer[:_HEADER.size + size]
            answered |= self._answer(sock, c, kind, data)
        return [sock] if answered and sock in self._conns else []

    def _send(self, sock: socket.socket, data: bytes, kind: int = MESSAGE, timeout_s: float = 10.0) -> bool:
        """Send one frame (blocking up to ``timeout_s``, then back to non-blocking reads); False if it failed."""
        try:
            sock.settimeout(timeout_s)
            send_frame(sock, data, kind)
            sock.setblocking(False)
            return True
        except OSError:
            return False

    def _answer(self, sock: socket.socket, c: _Conn, kind: int, data: bytes) -> bool:
        """Handle one frame; True if it was a propose request."""
        try:
            if not c.proven:
                return self._prove(sock, c, kind, data)
            if kind == LINK_SETUP:
                self._setup_link(sock, msgpack.unpackb(data))
                return False
            link = self.links.get(sock)
            if kind == MESSAGE_WITH_TENSOR:  # a request whose hidden-state rows follow over the link
                if link is None:
                    raise ProtocolError("a tensor frame on a connection without a tensor link")
                try:
                    layout, body = msgpack.unpackb(data)
                except Exception:
                    raise ProtocolError("malformed tensor frame") from None
                msg = decode(body)
                if not isinstance(msg, ProposeRequest):
                    raise ProtocolError(f"unexpected {type(msg).__name__}")
                rows, width, dtype = _hidden_layout(layout, msg)
                msg = attach_hidden(msg, rows, link.recv(sum(max(n, 0) for n in rows), width, TENSOR_DTYPES[dtype]))
            else:
                msg = decode(data)
            if not isinstance(msg, ProposeRequest):
                raise ProtocolError(f"unexpected {type(msg).__name__}")
            arrived = time.perf_counter()
            reply = self.service.handle(c.name, msg)
            if msg.tree:
                c.trees.append((msg.step, arrived))
            layout = packed = None
            if link is not None:
                reply, layout, packed = strip_probs(reply)
            if layout is None:
                ok = self._send(sock, encode(reply))
            else:
                ok = self._send(sock, msgpack.packb([layout, encode(reply)]), MESSAGE_WITH_TENSOR)
                link.send(packed)
            if not ok:
                self._drop(sock)
            return ok
        except (OSError, ProtocolError, ValueError) as exc:
            logger.warning("dropping connection %s: %s", c.name, exc)
            self._drop(sock)
            return False
        except Exception:  # a bug while answering: this connection's target resyncs, the server lives on
            logger.exception("draft failed answering %s; dropping the connection", c.name)
            self._drop(sock)
            return False

    def _prove(self, sock: socket.socket, c: _Conn, kind: int, data: bytes) -> bool:
        """The first frame must be a Hello proving the secret; anything else closes the connection."""
        msg = decode(data) if kind == MESSAGE else None
        if not isinstance(msg, Hello):
            raise ProtocolError("the first frame must be a Hello")
        if not verify(self.token, "target", c.challenge, msg.proof):
            logger.warning("refusing %s (target %r): it did not prove the draft's token", c.name, msg.target_id)
            self._send(sock, encode(HelloReply(self.service.draft_id, None, "authentication failed: wrong or missing draft token")))
            self._drop(sock)
            return False
        c.proven = True
        reply = dataclasses.replace(self.service.hello(c.name, msg), proof=prove(self.token, "draft", msg.challenge))
        if not self._send(sock, encode(reply)):
            self._drop(sock)
        return False

    def _setup_link(self, sock: socket.socket, request) -> None:
        """Join the target's two-rank group (blocking until it joins too), then answer."""
        if self.link_factory is None or not isinstance(request, dict) or not isinstance(request.get("group"), str):
            self._send(sock, msgpack.packb({"error": "this draft offers no tensor link"}), LINK_SETUP)
            return
        try:
            self.links[sock] = BoundedLink(self.link_factory(request["group"]))
            self._send(sock, msgpack.packb({"ok": True}), LINK_SETUP)
        except Exception as exc:  # the target falls back to reconnecting (and says why)
            logger.warning("tensor link %s failed: %s", request["group"], exc)
            self._send(sock, msgpack.packb({"error": f"{type(exc).__name__}: {exc}"}), LINK_SETUP)

    def _drop(self, sock: socket.socket) -> None:
        link = self.links.pop(sock, None)
        if link is not None:
            link.close()
        c = self._conns.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        if c is not None:
            self.counters["num_dropped"] += 1
            if c.proven:
                self.service.drop(c.name)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for sock in list(self._conns):
            self._drop(sock)
        self.listener.close()


def _routable_ip() -> str:
    """This host's address as other nodes see it (Ray's node IP when Ray runs here)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # Ray missing or not connected: fall back to the OS's view
        pass
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"
