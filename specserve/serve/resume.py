"""One choice of one request as ``StepDelta``s, whichever target replica holds it: a replica that dies,
stalls, fails the request or stops hands it to another, which resumes it from the output the caller
already has, exactly.

``ChoiceStream`` keeps what it has delivered (``out``: the committed output) and reads the current
``Attempt`` (a direct stream, or the Serve handle's stream). When the attempt breaks (the connection
or the actor is gone, the engine failed the request, the replica hands it back while stopping, or
the ``Watchdog`` finds the replica stalled and cuts it off, so it cannot emit later), it opens the
rest on another replica with the prompt, the same parameters and seed, and the committed output
as output (``Committed``): the target rebuilds the request's state from it (``target.resume_state``)
and goes on where the first left off. A replica that failed the request is not chosen again while
another is up; with none up, the choice waits for one (Serve restarts replicas) up to
``server.target_restart_wait_s``; after ``server.resume_limit`` resumes the request fails, saying
why. Per delta the undisturbed path costs one clock read; the watchdog looks at every open attempt
twice a second. Knows nothing of HTTP response shapes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from ..outputs import CannotResume, Committed, RequestOutput, StepDelta
from .http import APIError, is_dead_replica, unavailable
from .streams import StreamRefused, TargetStopping

logger = logging.getLogger("specserve.serve")
WATCH_S = 0.5  # how often the watchdog looks at the open attempts (stalls and deadlines)
RESUME_BACKOFF_S = 0.25  # before resuming through the Serve handle, which may route to the replica that just failed
WHY = {"death": "its target replica died", "stall": "its target replica stopped making progress",
       "error": "its target replica failed it", "scale_down": "its target replica was stopping"}


class Interrupted(Exception):
    """The watchdog cut an attempt off (its replica stalled, or the request's deadline passed)."""


class HandleStream:
    """A Serve streaming call to the Target deployment (the fallback when no direct stream can be
    opened) with ``interrupt``; Serve chooses the replica, so its name is known from the first delta."""

    target_name = None

    def __init__(self, gen):
        self.gen = gen
        self._interrupted = asyncio.get_running_loop().create_future()

    async def __anext__(self) -> dict:
        nxt = asyncio.ensure_future(self.gen.__anext__())
        done, _ = await asyncio.wait({nxt, self._interrupted}, return_when=asyncio.FIRST_COMPLETED)
        if nxt in done:
            return nxt.result()
        nxt.cancel()
        raise Interrupted()

    def interrupt(self) -> None:
        if not self._interrupted.done():
            self._interrupted.set_result(None)

    def cancel(self) -> None:
        self.gen.cancel()


@dataclasses.dataclass(eq=False)
class Attempt:
    """One replica's stream of a choice."""

    stream: object  # streams.DirectStream or HandleStream
    target: str | None  # the replica's name (None until the Serve handle's first delta names it)
    deadline: float  # the request's (monotonic)
    last_at: float  # when it last delivered, or opened
    interrupted: str | None = None  # why the watchdog cut it off: "stall" or "timeout"

    def interrupt(self, why: str) -> None:
        if self.interrupted is None:
            self.interrupted = why
            self.stream.interrupt()


def cause_of(exc: BaseException) -> str:
    """Why an attempt failed, as ``specserve_requests_resumed_total`` counts it."""
    if isinstance(exc, TargetStopping):
        return "scale_down"
    return "death" if is_dead_replica(exc) or isinstance(exc, StopAsyncIteration) else "error"


class Resumes:
    """What every choice of this router shares: the directory of replicas, the Serve handle, the
    limits, the metrics and the watchdog over open attempts."""

    def __init__(self, directory, target, server, metrics):
        self.directory, self.target, self.server, self.metrics = directory, target, server, metrics
        self.open_attempts: set[Attempt] = set()
        self._watchdog: asyncio.Task | None = None

    def watch(self, attempt: Attempt) -> None:
        self.open_attempts.add(attempt)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCH_S)
            now, stall_s = time.monotonic(), self.server.stall_timeout_s
            for a in list(self.open_attempts):
                if a.interrupted is not None:
                    continue
                if now > a.deadline:
                    a.interrupt("timeout")
                elif now - a.last_at > stall_s:
                    # Silent for the stall bound, and so is its replica's engine (or, through the handle
                    # before the first delta names the replica, no replica is up at all).
                    if a.target is None:
                        if not self.directory.alive():
                            a.interrupt("death")
                    elif (idle := self.directory.idle_s(a.target)) is not None and idle > stall_s:
                        a.interrupt("stall")

    async def open(self, c: "ChoiceStream") -> Attempt:
        """An attempt for the choice's rest on a replica that has not failed it (direct stream, else the
        Serve handle); waits for one to come up when none is and the choice may wait."""
        received = c.first_source is not None  # (a choice that has output waits for a replica; a new one gets the fast 503)
        committed = Committed(tuple(c.out.token_ids), len(c.out.text)).to_dict() if c.out.token_ids else None
        params = dataclasses.replace(c.params, prompt_logprobs=None) if received and c.params.prompt_logprobs is not None else c.params
        rid = c.request_id if not c.num_resumes else f"{c.request_id}-r{c.num_resumes}"
        tokens, wire = list(c.token_ids), params.to_dict()
        waited = None
        while True:
            failed = set(c.failed)
            up = self.directory.usable_names()
            # A replica that only failed the request (no death, no stall) may take it again when no other is up.
            exclude = failed if up - failed else {n for n in failed if c.failed[n] != "error"}
            gen = await self.directory.open_direct(rid, tokens, wire, committed, exclude)
            if gen is not None:
                return self._attempt(c, gen, gen.target_name)
            if self.directory.alive() and (up - exclude or not up):
                if c.num_resumes:
                    await asyncio.sleep(RESUME_BACKOFF_S)
                return self._attempt(c, HandleStream(self.target.options(stream=True).stream.remote(rid, tokens, wire, committed)), None)
            if not (received or c.wait_for_target or self.directory.lapsed()):
                raise unavailable("no target replica is available (it is restarting); retry shortly")
            now = time.monotonic()
            waited = now if waited is None else waited
            if now - waited >= self.server.target_restart_wait_s or now >= c.deadline:
                raise unavailable(f"request {c.request_id}: {WHY.get(c.cause, 'its target replica failed')} and no other "
                                  f"came up within target_restart_wait_s ({self.server.target_restart_wait_s:g} s); retry")
            await asyncio.sleep(0.1)

    def _attempt(self, c: "ChoiceStream", stream, target: str | None) -> Attempt:
        a = Attempt(stream, target, c.deadline, time.monotonic())
        self.watch(a)
        return a

    def close(self, a: Attempt) -> None:
        self.open_attempts.discard(a)
        a.stream.cancel()


class ChoiceStream:
    """One choice's deltas (``next``), resumed on another replica whenever its replica fails it;
    ``out`` is what the caller has been given, ``first`` the first delta (``start``)."""

    def __init__(self, resumes: Resumes, request_id: str, token_ids: list[int], params, deadline: float,
                 wait_for_target: bool = False):
        self.resumes, self.request_id, self.token_ids, self.params = resumes, request_id, token_ids, params
        self.deadline, self.wait_for_target = deadline, wait_for_target
        self.out = RequestOutput(request_id, None, token_ids)
        self.first: StepDelta | None = None
        self.first_source: str | None = None  # the replica that gave the first delta
        self.attempt: Attempt | None = None
        self.num_resumes = 0
        self.failed: dict[str, str] = {}  # replica -> why it failed this choice
        self.cause: str | None = None  # why the last resume began
        self._resuming_since: float | None = None

    async def start(self) -> StepDelta:
        """The first delta (a failure before it is the request's HTTP error)."""
        self.first = await self.next()
        return self.first

    async def next(self) -> StepDelta:
        while True:
            if self.attempt is None:
                self.attempt = await self.resumes.open(self)
            a = self.attempt
            try:
                chunk = await a.stream.__anext__()
            except CannotResume as exc:  # this replica cannot go on from the committed output (it says why)
                self.close()
                raise unavailable(f"request {self.request_id}: {WHY.get(self.cause, 'its target replica failed')}, and it "
                                  f"cannot be resumed: {str(exc).splitlines()[-1][:500]}") from None
            except ValueError as exc:  # the target's own validation: the request's fault
                self.close()
                raise APIError(400, str(exc).split("\n")[-1][:500]) from None
            except StreamRefused as exc:  # busy, or a secret from another app: the Serve handle serves it (for a while)
                logger.warning("target %s refused a direct stream (%s); using the Serve handle", a.target, exc)
                self.resumes.directory.avoid(a.target)
                self.close()
                continue
            except (Exception, StopAsyncIteration) as exc:  # (a stream that ends unfinished: its replica is gone)
                self._failed(a, a.interrupted or cause_of(exc), exc)
                continue
            now = time.monotonic()
            a.last_at = now
            if a.target is None:
                a.target = chunk.get("source")
            if self.first_source is None:
                self.first_source = chunk.get("source")
                self.resumes.directory.last_target_ok = now
            if self._resuming_since is not None:
                self.resumes.metrics.took(now - self._resuming_since)
                self._resuming_since = None
            delta = StepDelta.from_dict(chunk)
            self.out.add(delta)
            if delta.finished:
                self.close()
            return delta

    def _failed(self, a: Attempt, cause: str, exc: BaseException) -> None:
        self.close()
        if cause == "timeout":
            what = "exceeded" if self.first_source is not None else "got no output within"
            raise unavailable(f"request {self.request_id} {what} request_timeout_s ({self.resumes.server.request_timeout_s:g} s); retry later")
        if a.target is not None:
            self.failed[a.target] = cause
            if cause in ("death", "stall"):
                self.resumes.directory.suspect(a.target)
        limit = self.resumes.server.resume_limit
        if self.num_resumes >= limit:
            logger.warning("request %s failed: %s (%s: %s); resumed %d time(s), resume_limit %d", self.request_id, WHY[cause],
                           a.target, type(exc).__name__, self.num_resumes, limit)
            raise unavailable(f"request {self.request_id} failed: {WHY[cause]}"
                              + (f", after {self.num_resumes} resume(s) (resume_limit={limit})" if limit else "") + "; retry")
        self.num_resumes += 1
        self.cause = cause
        self.resumes.metrics.resumed(cause)
        self._resuming_since = time.monotonic()
        logger.warning("request %s: %s (%s: %s); resuming from %d committed tokens (resume %d of %d)", self.request_id, WHY[cause],
                       a.target or "a target replica", type(exc).__name__, len(self.out.token_ids), self.num_resumes, limit)

    def close(self) -> None:
        """Stop reading the current attempt (it aborts the request on its replica)."""
        if self.attempt is not None:
            self.resumes.close(self.attempt)
            self.attempt = None
