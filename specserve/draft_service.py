"""A draft endpoint independent of how requests reach it: one lock, answer first, prepare after.

Data flow: a transport (an in-process call, the TCP server, a Ray actor method) hands each
connection's ``Hello`` to ``hello`` (vocabulary check by fingerprint: the draft refuses a
target whose token ids mean other tokens; whether to draft ahead for it, from where each side
computes: ``devices.shares_compute``) and each ``ProposeRequest`` to ``handle``, which
answers under the compute lock; once the reply has left, the transport calls ``prepare``,
which drafts ahead and stops the moment another request is waiting, then (for a request with
``tree`` set, over a transport that can send unasked: the TCP server) ``tree``, the cache just
drafted, which the target takes its next blocks from without asking. One ``DraftSide`` per
connection, all sharing one drafter (one model, one KV pool): several targets can share one
draft. Knows nothing of sockets or Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Callable

from .devices import shares_compute
from .draft import DraftSide, Drafter
from .messages import DraftTree, Hello, HelloReply, ProposeReply, ProposeRequest, ProtocolError
from .models import check_vocab_compatible

logger = logging.getLogger(__name__)


class DraftService:
    def __init__(self, drafter: Drafter, fingerprint: dict, draft_id: str, info: dict | None = None, ahead: bool | str = True,
                 max_seqs: int | None = None):
        """``ahead``: draft ahead (when the drafter can): True, False, or "auto": for each target
        whose compute the draft does not share (another host, another GPU, disjoint CPU cores;
        ``info["placement"]`` is this side's report, the target sends its own in the hello)."""
        self.drafter = drafter
        self.ahead = ahead
        self.max_seqs = max_seqs  # per connection (a target): more are refused, and that target decodes them alone
        self.no_ahead: set[str] = set()  # connections that do not get drafting ahead
        self.ahead_by_conn: dict[str, tuple[bool, str]] = {}  # connection -> (drafting ahead, why)
        self.fingerprint = fingerprint
        self.draft_id = draft_id
        self.info = dict(info or {})
        self.lock = threading.Lock()
        self._waiting = 0  # requests queued for the lock: prepare() yields to them
        self._waiting_lock = threading.Lock()
        self.sides: dict[str, DraftSide] = {}
        self.targets: dict[str, dict] = {}  # connection -> {target, num_requests}: who uses this draft
        self.counters = {"num_requests": 0, "num_blocks": 0, "num_cache_hits": 0, "num_cache_misses": 0,
                         "draft_time_hidden_s": 0.0, "compute_s": 0.0, "prepare_s": 0.0, "num_connections": 0}
        self.last_reply_at = 0.0

    def hello(self, conn: str, msg: Hello) -> HelloReply:
        try:
            check_vocab_compatible(msg.vocab, self.fingerprint)
            check_head = getattr(self.drafter, "check_target", None)  # an EAGLE head: the target's hidden states fit it
            if check_head is not None:
                check_head({**msg.info, "vocab_size": (msg.vocab or {}).get("vocab_size")})
        except ValueError as exc:
            logger.warning("refusing target %s: %s", msg.target_id, exc)
            return HelloReply(self.draft_id, None, str(exc), self.info)
        with self.lock:
            old = self.sides.pop(conn, None)
            if old is not None:
                old.close_all()
            widths = _widths(msg.vocab, self.fingerprint)
            self.sides[conn] = DraftSide(self.drafter, namespace=f"{conn}/", vocab_limit=widths[0], max_seqs=self.max_seqs,
                                         rows_combined=msg.info.get("hidden_fc") is not None)
            self.targets[conn] = {"target": msg.target_id, "num_requests": 0}
            ahead, why = self._ahead_for(msg.info)
            if ahead:
                self.no_ahead.discard(conn)
            else:
                self.no_ahead.add(conn)
            self.ahead_by_conn[conn] = (ahead, why)
            self.counters["num_connections"] += 1
        logger.info("target %s connected as %s: drafting ahead %s (%s)%s", msg.target_id, conn, "on" if ahead else "off", why,
                    f"; {widths[1]}" if widths[1] else "")
        head = getattr(self.drafter, "hidden_layers", None)
        # "trees": this draft answers a request with ``tree`` set by a DraftTree after drafting ahead (its cache
        # for the next verdicts), where the transport can send one unasked.
        return HelloReply(self.draft_id, self.fingerprint, None, {**self.info, "draft_ahead": ahead, "draft_ahead_reason": why,
                                                                  "trees": ahead,
                                                                  "vocab_note": widths[1],
                                                                  **({"hidden_layers": list(head)} if head else {})})

    def _ahead_for(self, target_info: dict) -> tuple[bool, str]:
        """Whether this connection gets drafting ahead, and why (said once per connection)."""
        if not self.drafts_ahead:
            return False, "off: this drafter keeps no speculation cache" if self.ahead is not False else "off: draft_ahead=false"
        if self.ahead is True:
            return True, "on: draft_ahead=true"
        shared, why = shares_compute(target_info.get("placement"), self.info.get("placement"))
        return (False, f"auto, off: {why}") if shared else (True, f"auto, on: {why}")

    def handle(self, conn: str, req: ProposeRequest) -> ProposeReply:
        arrived = time.perf_counter()
        with self._waiting_lock:
            self._waiting += 1
        try:
            self.lock.acquire()
        finally:
            with self._waiting_lock:
                self._waiting -= 1
        queued = time.perf_counter() - arrived
        try:
            side = self.sides.get(conn)
            if side is None:
                raise ProtocolError(f"connection {conn!r} sent a request before Hello")
            reply = side.handle(req)
            reply = dataclasses.replace(reply, stats=dataclasses.replace(reply.stats, queue_s=queued))
            self.targets[conn]["num_requests"] += 1
            c = self.counters
            c["num_requests"] += 1
            c["compute_s"] += reply.stats.compute_s
            c["draft_time_hidden_s"] += reply.stats.hidden_s
            for b in reply.blocks:
                if b.draft_token_ids:
                    c["num_blocks"] += 1
                    c["num_cache_hits" if b.cache_hit else "num_cache_misses"] += 1
            self.last_reply_at = time.perf_counter()
            return reply
        finally:
            self.lock.release()

    @property
    def drafts_ahead(self) -> bool:
        """Whether ``prepare`` can have work to do (the drafter keeps a speculation cache)."""
        return getattr(self.drafter, "fanout", 0) > 0 and self.ahead is not False

    def request_waiting(self) -> bool:
        return self._waiting > 0

    def prepare(self, conn: str, should_stop: Callable[[], bool] | None = None) -> None:
        if conn in self.no_ahead:
            return
        stop = should_stop or self.request_waiting
        with self.lock:
            side = self.sides.get(conn)
            if side is None:
                return
            start = time.perf_counter()
            side.prepare(stop)
            self.counters["prepare_s"] += time.perf_counter() - start

    def tree(self, conn: str, step: int, elapsed_s: float = 0.0) -> DraftTree:
        """The cache drafted ahead for this connection's last request with ``tree`` set (empty when there is
        none: every such request gets its DraftTree)."""
        with self.lock:
            side = self.sides.get(conn)
            return side.tree(step, elapsed_s) if side is not None else DraftTree(step, [], elapsed_s)

    def drop(self, conn: str) -> None:
        """The connection is gone: free its sequences."""
        with self.lock:
            side = self.sides.pop(conn, None)
            self.targets.pop(conn, None)
            self.ahead_by_conn.pop(conn, None)
            if side is not None:
                side.close_all()
                logger.info("connection %s closed: freed its sequences", conn)

    @property
    def num_seqs(self) -> int:
        return sum(s.num_seqs for s in list(self.sides.values()))

    def metrics(self) -> dict:
        by_target: dict[str, dict] = {}
        for conn, t in list(self.targets.items()):
            side = self.sides.get(conn)
            entry = by_target.setdefault(t["target"], {"num_requests": 0, "num_seqs": 0})
            entry["num_requests"] += t["num_requests"]
            entry["num_seqs"] += side.num_seqs if side is not None else 0
            entry["draft_ahead"], entry["draft_ahead_reason"] = self.ahead_by_conn.get(conn, (False, ""))
        return {**self.counters, "draft_id": self.draft_id, "num_seqs": self.num_seqs, "by_target": by_target,
                "num_live_connections": len(self.sides), "draft_step_s": self.drafter.step_time_s,
                "compiled": bool(getattr(getattr(self.drafter, "backend", None), "compiled", False)),
                **getattr(self.drafter, "tree_counts", {})}


def _widths(target: dict | None, draft: dict | None) -> tuple[int | None, str | None]:
    """(the id limit the draft must keep to, or None; what to say about the two LM-head widths)."""
    t, d = (target or {}).get("vocab_size"), (draft or {}).get("vocab_size")
    if not t or not d or t == d:
        return None, None
    if d > t:
        return t, f"the draft's LM head is wider than the target's ({d} vs {t} ids): it proposes ids below {t} only"
    return None, f"the target's LM head is wider than the draft's ({t} vs {d} ids): ids from {d} up are never drafted"
