"""How draft messages travel: in-process calls, or length-prefixed msgpack frames over TCP.

Target side, an endpoint speaks to one draft: ``hello`` once, then per step ``send`` a
``ProposeRequest`` and ``recv`` its ``ProposeReply`` (split so a target can send to every
draft it uses before waiting on any). Draft side, ``DraftServer`` is one thread that
accepts connections, answers each request and then lets the service draft ahead until any
socket is readable again. A Ray actor call costs ~1 ms; a frame over loopback ~30 us, so
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
import selectors
import socket
import struct
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import msgpack

from .draft_service import DraftService
from .messages import Hello, HelloReply, ProposeReply, ProposeRequest, ProtocolError, decode, encode

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<IB")  # payload length, frame kind
MAX_FRAME_BYTES = 1 << 30
MESSAGE, MESSAGE_WITH_TENSOR, LINK_SETUP = 0, 1, 2  # frame kinds
_conn_ids = itertools.count()


class DraftUnavailable(ConnectionError):
    """The draft endpoint cannot answer: refused, closed, timed out or sent garbage."""


def send_frame(sock: socket.socket, data: bytes, kind: int = MESSAGE) -> None:
    sock.sendmsg([_HEADER.pack(len(data), kind), data])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("connection closed by peer")
        got += r
    return bytes(buf)


def recv_frame(sock: socket.socket) -> tuple[int, bytes]:
    size, kind = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    if kind not in (MESSAGE, MESSAGE_WITH_TENSOR, LINK_SETUP):
        raise ProtocolError(f"unknown frame kind {kind}")
    return kind, _recv_exact(sock, size)


class TensorLink(Protocol):
    """Where draft probabilities travel when not inline: one packed [rows, vocab] tensor per reply."""

    def send(self, tensor) -> None: ...

    def recv(self, rows: int, vocab: int): ...

    def close(self) -> None: ...


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


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"draft address must be host:port, got {address!r}")
    return host, int(port)


class SocketEndpoint:
    """A target's TCP connection to one draft server (and, optionally, a tensor link beside it)."""

    def __init__(self, address: str, delay_ms: float = 0.0, connect_timeout_s: float = 2.0, link_factory=None):
        self.name = address
        self.delay_s = delay_ms / 1000.0
        self.link_factory = link_factory  # (group name) -> TensorLink of rank 0; None: probabilities inline
        self.link: TensorLink | None = None
        self.tensor_bytes = 0
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
        self.send(msg)
        reply = self.recv(timeout_s)
        if not isinstance(reply, HelloReply):
            raise self._call_failed(ProtocolError(f"expected HelloReply, got {type(reply).__name__}"))
        if reply.error is None and self.link_factory is not None:
            self._setup_link(timeout_s)
        return reply

    def _setup_link(self, timeout_s: float) -> None:
        """Both ends join a fresh two-rank group (the draft in a helper thread, this end here)."""
        group = f"specserve-{uuid.uuid4().hex[:12]}"
        try:
            self.sock.settimeout(timeout_s)
            send_frame(self.sock, msgpack.packb({"group": group}), LINK_SETUP)
            self.link = self.link_factory(group)
            kind, data = recv_frame(self.sock)
            answer = msgpack.unpackb(data) if kind == LINK_SETUP else {"error": "no link setup answer"}
        except (OSError, ProtocolError, RuntimeError) as exc:
            raise self._call_failed(exc) from None
        if answer.get("error"):
            raise self._call_failed(RuntimeError(f"tensor link: {answer['error']}"))

    def send(self, msg) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        try:
            self.sock.settimeout(10.0)
            send_frame(self.sock, encode(msg))
        except OSError as exc:
            raise self._call_failed(exc) from None

    def recv(self, timeout_s: float):
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
        if self.delay_s:
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

    def send(self, req: ProposeRequest) -> None:
        if self.delay_s:
            time.sleep(self.delay_s)
        if self._ordered and self._pending is not None:
            self._pending.result()
        self._replies.append(self.service.handle(self.conn, req))
        if self._ahead is not None:
            try:
                self._pending = self._ahead.submit(self.service.prepare, self.conn)
            except RuntimeError:  # the interpreter is exiting (executors refuse work): no drafting ahead
                self._pending = None

    def recv(self, timeout_s: float) -> ProposeReply:
        reply = self._replies.popleft()
        if self.delay_s:
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


class DraftServer:
    """TCP front of a ``DraftService``: one thread accepts, answers, then drafts ahead."""

    def __init__(self, service: DraftService, host: str = "0.0.0.0", port: int = 0, advertise_host: str | None = None,
                 link_factory=None):
        self.service = service
        self.link_factory = link_factory  # (group name) -> TensorLink of rank 1; None: refuse tensor links
        self.links: dict[socket.socket, TensorLink] = {}
        self.listener = _listen(host, port)
        self.listener.setblocking(False)
        bound_port = self.listener.getsockname()[1]
        self.address = f"{advertise_host or _routable_ip()}:{bound_port}"
        self._stop = threading.Event()
        self._conns: dict[socket.socket, str] = {}
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
                elif self._answer(sock):
                    answered.append(self._conns[sock])
            for conn in answered:
                if self.service.drafts_ahead:
                    self.service.prepare(conn, self._readable)

    def _accept(self) -> None:
        try:
            sock, peer = self.listener.accept()
        except BlockingIOError:
            return
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._conns[sock] = f"tcp-{next(_conn_ids)}-{peer[0]}"
        self._sel.register(sock, selectors.EVENT_READ)

    def _answer(self, sock: socket.socket) -> bool:
        """Read one frame and answer it; True if it was a propose request."""
        conn = self._conns[sock]
        try:
            sock.settimeout(30.0)  # a frame that started must finish
            kind, data = recv_frame(sock)
            if kind == LINK_SETUP:
                self._setup_link(sock, msgpack.unpackb(data))
                return False
            msg = decode(data)
            if isinstance(msg, Hello):
                send_frame(sock, encode(self.service.hello(conn, msg)))
                return False
            if not isinstance(msg, ProposeRequest):
                raise ProtocolError(f"unexpected {type(msg).__name__}")
            reply = self.service.handle(conn, msg)
            link = self.links.get(sock)
            layout = packed = None
            if link is not None:
                reply, layout, packed = strip_probs(reply)
            if layout is None:
                send_frame(sock, encode(reply))
            else:
                send_frame(sock, msgpack.packb([layout, encode(reply)]), MESSAGE_WITH_TENSOR)
                link.send(packed)
            return True
        except (OSError, ProtocolError) as exc:
            if not isinstance(exc, ConnectionError):
                logger.warning("dropping connection %s: %s", conn, exc)
            self._drop(sock)
            return False
        except Exception:  # a bug while answering: this connection's target resyncs, the server lives on
            logger.exception("draft failed answering %s; dropping the connection", conn)
            self._drop(sock)
            return False

    def _setup_link(self, sock: socket.socket, request) -> None:
        """Join the target's two-rank group (blocking until it joins too), then answer."""
        if self.link_factory is None or not isinstance(request, dict) or not isinstance(request.get("group"), str):
            send_frame(sock, msgpack.packb({"error": "this draft offers no tensor link"}), LINK_SETUP)
            return
        try:
            self.links[sock] = self.link_factory(request["group"])
            send_frame(sock, msgpack.packb({"ok": True}), LINK_SETUP)
        except Exception as exc:  # the target falls back to reconnecting (and says why)
            logger.warning("tensor link %s failed: %s", request["group"], exc)
            send_frame(sock, msgpack.packb({"error": f"{type(exc).__name__}: {exc}"}), LINK_SETUP)

    def _drop(self, sock: socket.socket) -> None:
        link = self.links.pop(sock, None)
        if link is not None:
            link.close()
        conn = self._conns.pop(sock, None)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        if conn is not None:
            self.service.drop(conn)

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
