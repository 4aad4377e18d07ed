"""How draft messages travel: in-process calls, or length-prefixed msgpack frames over TCP.

Target side, an endpoint speaks to one draft: ``hello`` once, then per step ``send`` a
``ProposeRequest`` and ``recv`` its ``ProposeReply`` (split so a target can send to every
draft it uses before waiting on any). Draft side, ``DraftServer`` is one thread that
accepts connections, answers each request and then lets the service draft ahead until any
socket is readable again. A Ray actor call costs ~1 ms; a frame over loopback ~30 us, so
the step path uses sockets and Ray only places and supervises the processes.
``delay_ms`` emulates a slow link (one way, applied in both directions). Knows nothing of
Ray or models; every failure surfaces as ``DraftUnavailable``.
"""

from __future__ import annotations

import itertools
import logging
import selectors
import socket
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from .draft_service import DraftService
from .messages import Hello, HelloReply, ProposeReply, ProposeRequest, ProtocolError, decode, encode

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
_conn_ids = itertools.count()


class DraftUnavailable(ConnectionError):
    """The draft endpoint cannot answer: refused, closed, timed out or sent garbage."""


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendmsg([_HEADER.pack(len(data)), data])


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionError("connection closed by peer")
        got += r
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    return _recv_exact(sock, size)


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"draft address must be host:port, got {address!r}")
    return host, int(port)


class SocketEndpoint:
    """A target's TCP connection to one draft server."""

    def __init__(self, address: str, delay_ms: float = 0.0, connect_timeout_s: float = 2.0):
        self.name = address
        self.delay_s = delay_ms / 1000.0
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
        return reply

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
            msg = decode(recv_frame(self.sock))
        except (OSError, ProtocolError) as exc:
            raise self._call_failed(exc) from None
        if self.delay_s:
            time.sleep(self.delay_s)
        return msg

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class LocalEndpoint:
    """An in-process draft: direct calls; drafting ahead runs on a helper thread (torch drops the GIL)."""

    def __init__(self, service: DraftService, name: str = "local"):
        self.name = name
        self.service = service
        self.conn = f"{name}-{next(_conn_ids)}"
        self._reply: ProposeReply | None = None
        self._ahead = ThreadPoolExecutor(1, thread_name_prefix="specserve-draft-ahead") if service.drafts_ahead else None

    def hello(self, msg: Hello, timeout_s: float) -> HelloReply:
        return self.service.hello(self.conn, msg)

    def send(self, req: ProposeRequest) -> None:
        self._reply = self.service.handle(self.conn, req)
        if self._ahead is not None:
            self._ahead.submit(self.service.prepare, self.conn)

    def recv(self, timeout_s: float) -> ProposeReply:
        reply, self._reply = self._reply, None
        assert reply is not None
        return reply

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.shutdown(wait=True)
        self.service.drop(self.conn)


class DraftServer:
    """TCP front of a ``DraftService``: one thread accepts, answers, then drafts ahead."""

    def __init__(self, service: DraftService, host: str = "0.0.0.0", port: int = 0, advertise_host: str | None = None):
        self.service = service
        self.listener = socket.create_server((host, port), reuse_port=False)
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
            msg = decode(recv_frame(sock))
            if isinstance(msg, Hello):
                send_frame(sock, encode(self.service.hello(conn, msg)))
                return False
            if not isinstance(msg, ProposeRequest):
                raise ProtocolError(f"unexpected {type(msg).__name__}")
            send_frame(sock, encode(self.service.handle(conn, msg)))
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

    def _drop(self, sock: socket.socket) -> None:
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
