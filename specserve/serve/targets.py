"""What the router knows of the target replicas: the Registry's snapshot, which replicas are up and
making progress, their load, their info and tokenizer, and direct streams to them (with spares).

Replicas announce themselves (and their metrics) to the Registry twice a second; the router polls
it twice a second. A replica is up while it is listed and the router has not seen it die; its
progress is its engine's step counter (``num_steps``) in those announcements, so a replica that is
listed but stopped stepping (a hung forward), or no longer listed (stopped, partitioned), has been
idle since the counter last moved; a snapshot older than ``FRESH_S`` tells nothing of progress.
A replica seen to die or stall is left out of the choices until a fresh snapshot shows it stepping
again, or listed with nothing to do. Knows nothing of HTTP or of requests beyond their tokens.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass

from .http import unavailable
from .streams import DirectStream, SparePool, open_stream

logger = logging.getLogger("specserve.serve")
REGISTRY_POLL_S = 0.5  # the Registry's snapshot: liveness, drafts' state, metrics (replicas announce every 0.5 s)
AVOID_S = 5.0  # a target whose direct stream was refused is reached through the Serve handle for this long
HEARTBEAT_LAG_S = 1.5  # an announcement reaches the router up to an announce and a poll period late (0.5 s each), and then some
FRESH_S = 1.5  # a snapshot older than this says nothing about a replica's progress (the Registry is slow or restarting)
SUSPECT_MAX_S = 60.0  # a replica seen to die or stall is back in the choices after this long, whatever its announcements say
LAPSE_S = 5.0  # a replica dropped from the listing but not seen to die is given this long (from its last listing) to reappear


@dataclass
class Progress:
    """A replica's engine step counter as last announced, when the router last saw it change, and when
    a snapshot last listed the replica."""

    num_steps: int
    changed_at: float
    listed_at: float


class TargetDirectory:
    def __init__(self, cfg, target, registry, model_name: str):
        self.cfg, self.server = cfg, cfg.server
        self.target, self.registry, self.model_name = target, registry, model_name
        self.snapshot: dict = {"draft": {}, "target": {}}
        self.snapshot_at = 0.0
        self.last_target_ok = 0.0  # when a replica last gave a request its first delta
        self.info: dict | None = None
        self.tokenizer = None
        self._info_lock = asyncio.Lock()
        self._poller: asyncio.Task | None = None
        self._warming: asyncio.Task | None = None  # fetching the target's info and tokenizer ahead of the first request
        self._progress: dict[str, Progress] = {}
        self._suspect: dict[str, float] = {}  # replica -> when it was seen dead or stalled
        self._streams_open: dict[str, int] = {}  # direct streams open per target replica (the router's load balance)
        self._avoid: dict[str, float] = {}  # target replica -> until when not to open direct streams to it
        server = self.server
        self._spares = SparePool(server.stream_token, server.stream_spares) if server.direct_streams and server.stream_token else None

    # -- the registry ---------------------------------------------------------------------------
    def ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def _poll(self) -> None:
        announced = False
        while True:
            await self.refresh(timeout_s=2)
            targets, drafts = len(self.snapshot["target"]), len(self.snapshot["draft"])
            connected = all(t.get("draft_up") for t in self.snapshot["target"].values())
            if self._spares is not None:
                self._spares.keep({t["stream_address"] for name, t in self.snapshot["target"].items()
                                   if t.get("stream_address") and self.usable(name)})
            if targets and self.info is None and (self._warming is None or self._warming.done()):
                # The target's info and tokenizer before the first request needs them (a task of its own:
                # the snapshot the fast 503 reads keeps its pace meanwhile).
                self._warming = asyncio.get_running_loop().create_task(self._warm())
            if not announced and targets and self.info is not None and (not self.cfg.speculative or (drafts and connected)):
                announced = True  # `serve run` forwards this line: it says when to connect
                logger.warning("ready: model id %r, %d target and %d draft replica(s) up", self.model_name, targets, drafts)
            await asyncio.sleep(REGISTRY_POLL_S)

    async def refresh(self, timeout_s: float) -> None:
        """A new snapshot from the Registry (kept as it was, and said stale, while the Registry restarts)."""
        try:
            self.snapshot = await asyncio.wait_for(self.registry.snapshot.remote(), timeout=timeout_s)
            self.snapshot_at = now = time.monotonic()
        except Exception as exc:
            logger.debug("registry poll failed: %s", exc)
            return
        for name, t in self.snapshot["target"].items():
            steps = int(t.get("num_steps", 0) or 0)
            seen = self._progress.get(name)
            if seen is None or seen.num_steps != steps:
                self._progress[name] = Progress(steps, now, now)
            else:
                seen.listed_at = now
        for name in [n for n, p in self._progress.items() if n not in self.snapshot["target"] and now - p.changed_at > 60]:
            del self._progress[name]
        for name in [n for n, since in self._suspect.items() if now - since > SUSPECT_MAX_S]:
            del self._suspect[name]

    async def _warm(self) -> None:
        try:
            await self.ready()
        except Exception as exc:  # not ready yet: the next poll tries again (a request would, too)
            logger.debug("router warm-up: %s", exc)

    async def ready(self, wait_s: float = 0.0) -> None:
        """Target info and tokenizer, fetched once from a target replica (no model files here); 503 when
        no replica is up, unless one comes up within ``wait_s``."""
        self.ensure_poller()
        if self.info is not None:
            deadline = time.monotonic() + wait_s
            while not self.alive():
                if time.monotonic() >= deadline and not self.lapsed():
                    raise unavailable("no target replica is available (it is restarting); retry shortly")
                await asyncio.sleep(0.1)
            return
        async with self._info_lock:
            if self.info is not None:
                return
            try:
                info = await asyncio.wait_for(self.target.ready.remote(), timeout=10 + wait_s)
                files = await asyncio.wait_for(self.target.tokenizer_files.remote(), timeout=30)
            except Exception as exc:
                logger.warning("target not ready: %s", exc)
                raise unavailable("the target is not ready yet; retry shortly") from None
            from ..distributed.client import load_tokenizer_from_files

            self.tokenizer = await asyncio.to_thread(load_tokenizer_from_files, files)
            self.info = info
            self.last_target_ok = time.monotonic()

    # -- liveness and progress --------------------------------------------------------------------
    def usable(self, name: str, now: float | None = None) -> bool:
        """A replica the router has not seen die or stall, or that a snapshot taken since shows
        stepping again, or listed with nothing to do (a hung one still holds what it was doing)."""
        since = self._suspect.get(name)
        if since is None:
            return True
        now = time.monotonic() if now is None else now
        t = self.snapshot["target"].get(name)
        if now - since > SUSPECT_MAX_S:
            return True
        if t is None or self.snapshot_at < since + HEARTBEAT_LAG_S:
            return False
        seen = self._progress.get(name)
        return (seen is not None and seen.changed_at > since + HEARTBEAT_LAG_S) or not (t.get("num_running") or t.get("num_waiting"))

    def alive(self) -> bool:
        """Is some target replica up? (Assumed while the snapshot is stale: the Registry restarts.)"""
        now = time.monotonic()
        if now - self.snapshot_at >= 3.0:
            return True
        if any(self.usable(name, now) for name in self.snapshot["target"]):
            return True
        last_suspect = max(self._suspect.values(), default=0.0)
        return now - self.last_target_ok < 1.0 and self.last_target_ok > last_suspect  # (just answered, not listed yet)

    def lapsed(self) -> bool:
        """Is a replica missing from the listing only for a moment? Listed within ``LAPSE_S`` and never
        seen to die or stall (a dead one stays listed until its last announcement expires, so only
        that says it is gone): its announcements may be late (a loaded machine, a slow Registry), so
        a new request waits for it instead of taking a 503 at once."""
        now = time.monotonic()
        return any(now - p.listed_at < LAPSE_S and name not in self.snapshot["target"] and name not in self._suspect
                   for name, p in self._progress.items())

    def idle_s(self, name: str) -> float | None:
        """How long this replica's engine had not stepped when the last snapshot was taken (it stopped
        announcing, or announces the same step count); None when that is not known (no recent snapshot,
        or a replica the router has not seen listed)."""
        seen = self._progress.get(name)
        if seen is None or time.monotonic() - self.snapshot_at > FRESH_S:
            return None
        return self.snapshot_at - seen.changed_at

    def suspect(self, name: str) -> None:
        """Leave a replica out of the choices (seen dead or stalled); see ``usable``."""
        self._suspect[name] = time.monotonic()

    def avoid(self, name: str) -> None:
        """Reach this replica through the Serve handle for a while (it refused a direct stream)."""
        self._avoid[name] = time.monotonic() + AVOID_S

    def usable_names(self) -> set[str]:
        now = time.monotonic()
        return {name for name in self.snapshot["target"] if self.usable(name, now)}

    # -- direct streams ---------------------------------------------------------------------------
    def pick(self, exclude: set[str] = frozenset()) -> tuple[str, str] | None:
        """(name, address) of the usable target replica with the fewest direct streams open from this
        router, among those that offer them and are not in ``exclude``; None when there is none."""
        if not self.server.direct_streams or not self.server.stream_token:
            return None
        now, best = time.monotonic(), None
        for name, t in self.snapshot["target"].items():
            address = t.get("stream_address")
            if address and name not in exclude and self._avoid.get(name, 0.0) <= now and self.usable(name, now):
                rank = (self._streams_open.get(name, 0), random.random())
                if best is None or rank < best[0]:
                    best = (rank, name, address)
        return None if best is None else best[1:]

    async def open_direct(self, rid: str, token_ids: list[int], params: dict, committed: dict | None,
                          exclude: set[str] = frozenset()) -> DirectStream | None:
        """A direct stream for the request to the replica ``pick`` chooses (on a spare connection when
        there is one), or to the next if that one cannot be reached; None when none can."""
        while True:
            picked = self.pick(exclude)
            if picked is None:
                return None
            name, address = picked

            def closed(name=name) -> None:
                self._streams_open[name] -= 1

            try:
                gen = None if self._spares is None else await self._spares.open(address, rid, token_ids, params, closed, committed)
                if gen is None:  # no spare connection: connect now
                    gen = await open_stream(address, self.server.stream_token, rid, token_ids, params, on_close=closed,
                                            committed=committed)
            except (OSError, asyncio.TimeoutError, ValueError) as exc:
                logger.warning("direct stream to %s failed (%s); trying another way", name, type(exc).__name__)
                self.avoid(name)
                continue
            self._streams_open[name] = self._streams_open.get(name, 0) + 1
            gen.target_name = name
            return gen
