"""Batch jobs that lose nothing: JSONL prompts in, JSONL outputs out as each finishes, resumable.

Data flow: ``read_jobs`` reads the input lazily (a job's index is its line number, from 0; a
line that is not a valid job becomes an error row at once) -> at most ``window`` requests in
flight on any engine with ``generate_async`` (``LLM`` in-process or on Ray, or a running app
through ``specserve.connect``) -> ``OutputFile`` writes each row as it finishes (``ordered``:
in input order, holding only the rows that wait for an earlier one), flushed at least every
second. ``resume`` first rewrites the output without its error rows and without a torn last
line, then skips every index already there; a request that fails becomes an error row and
the job goes on. ``stop()`` (Ctrl-C, SIGTERM) stops admitting and lets the requests in flight
finish; a second ``stop()`` abandons them (they are not written, so a resume redoes them).
Memory holds the window, the ordered buffer and one bit per index. Knows nothing of Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TextIO

from .sampling_params import SamplingParams

PARAM_FIELDS = frozenset(SamplingParams.__dataclass_fields__)


@dataclass
class Job:
    index: int
    prompt: object = None  # text or token ids
    params: SamplingParams | None = None
    error: str | None = None  # the line is not a valid job


def parse_line(line: str, defaults: dict) -> tuple[object, SamplingParams]:
    """One input line: ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}`` plus sampling fields."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc})") from None
    if not isinstance(row, dict) or ("prompt" in row) == ("prompt_token_ids" in row):
        raise ValueError("each line needs exactly one of 'prompt' or 'prompt_token_ids'")
    unknown = set(row) - PARAM_FIELDS - {"prompt", "prompt_token_ids"}
    if unknown:
        raise ValueError(f"unknown fields {sorted(unknown)}")
    prompt = row.get("prompt", row.get("prompt_token_ids"))
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))):
        raise ValueError("'prompt' must be a string and 'prompt_token_ids' a list of integers")
    return prompt, SamplingParams(**{**defaults, **{k: v for k, v in row.items() if k in PARAM_FIELDS}})


class Indices:
    """A set of non-negative ints as a bitmap: one bit per index (10 million lines: 1.25 MB)."""

    def __init__(self):
        self.bits = bytearray()
        self.count = 0

    def add(self, i: int) -> None:
        byte, bit = divmod(i, 8)
        if byte >= len(self.bits):
            self.bits.extend(bytes(byte - len(self.bits) + 1))
        if not self.bits[byte] >> bit & 1:
            self.bits[byte] |= 1 << bit
            self.count += 1

    def __contains__(self, i: int) -> bool:
        byte, bit = divmod(i, 8)
        return byte < len(self.bits) and bool(self.bits[byte] >> bit & 1)


def read_jobs(lines: Iterator[str], defaults: dict, done: Indices) -> Iterator[Job]:
    for index, line in enumerate(lines):
        if not line.strip() or index in done:
            continue
        try:
            prompt, params = parse_line(line, defaults)
        except (ValueError, TypeError) as exc:
            yield Job(index, error=f"line {index + 1}: {exc}")
            continue
        yield Job(index, prompt, params)


class OutputFile:
    """Rows appended as they finish, flushed at least every ``flush_s`` (``ordered``: in index order)."""

    def __init__(self, path: str, resume: bool, ordered: bool, flush_s: float = 1.0):
        self.path, self.ordered, self.flush_s = path, ordered, flush_s
        self.done = Indices()
        self.kept_errors = 0
        if resume and os.path.exists(path):
            self._rewrite_without_errors()
        self.file: TextIO = open(path, "a" if resume else "w", encoding="utf-8")
        self._flushed = time.monotonic()
        self._held: dict[int, dict] = {}  # ordered mode: rows waiting for an earlier index
        self.next_index = 0  # ordered mode: the next index to write (skipping those not in this run)

    def _rewrite_without_errors(self) -> None:
        """Keep every complete success row (streamed through a temporary file); drop error rows and a torn line."""
        tmp = f"{self.path}.resume-tmp"
        with open(self.path, encoding="utf-8", errors="replace") as src, open(tmp, "w", encoding="utf-8") as dst:
            for line in src:
                if not line.endswith("\n"):
                    break  # torn by a kill mid-write: redone
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if not isinstance(row, dict) or not isinstance(row.get("index"), int) or "error" in row or row["index"] in self.done:
                    continue
                self.done.add(row["index"])
                dst.write(line)
        os.replace(tmp, self.path)

    def write(self, row: dict, lowest_pending) -> None:
        """``lowest_pending()``: the smallest index still in flight (None: none), which ordered rows wait for."""
        if not self.ordered:
            self._emit(row)
        else:
            self._held[row["index"]] = row
            self.release(lowest_pending)
        self.flush(due=True)

    def flush(self, due: bool = False) -> None:
        """Flush (``due``: only when the last flush is ``flush_s`` old)."""
        if not due or time.monotonic() - self._flushed > self.flush_s:
            self.file.flush()
            self._flushed = time.monotonic()

    def release(self, lowest_pending) -> None:
        """Ordered mode: write every held row that no earlier index in flight comes before."""
        while self._held:
            first, waiting = min(self._held), lowest_pending()
            if waiting is not None and waiting < first:
                return
            self._emit(self._held.pop(first))

    @property
    def num_held(self) -> int:
        return len(self._held)

    def _emit(self, row: dict) -> None:
        self.file.write(json.dumps(row) + "\n")
        self.done.add(row["index"])

    def close(self) -> None:
        for i in sorted(self._held):  # stopped early: what was held is finished work, keep it
            self._emit(self._held.pop(i))
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


@dataclass
class JobStats:
    written: int = 0
    failed: int = 0
    skipped: int = 0  # already done (resume)
    abandoned: int = 0  # in flight at a second stop
    tokens: int = 0
    stopped: bool = False


class BatchRunner:
    """Runs the jobs on ``engine`` (anything with ``async generate_async(prompt, params)``)."""

    def __init__(self, engine, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.engine, self.window = engine, window
        self._stops = 0
        self._admit = True
        self._tasks: set[asyncio.Task] = set()

    def stop(self) -> None:
        self._stops += 1
        self._admit = False
        if self._stops > 1:
            for t in self._tasks:
                t.cancel()

    async def run(self, jobs: Iterator[Job], out: OutputFile, progress=None, threaded: bool = False) -> JobStats:
        """``threaded``: the input may block (a pipe): it is read on a thread, so requests in flight
        finish (and are written) while the next line has not arrived."""
        stats = JobStats(skipped=out.done.count)
        in_flight: set[int] = set()
        slots = asyncio.Semaphore(self.window)

        def lowest_pending() -> int | None:
            return min(in_flight) if in_flight else None

        async def flusher() -> None:  # rows reach the disk within a second even when nothing else is written
            while True:
                await asyncio.sleep(out.flush_s)
                out.flush()

        ticker = asyncio.ensure_future(flusher())

        async def one(job: Job) -> None:
            try:
                result = await self.engine.generate_async(job.prompt, job.params)
                row = {"index": job.index, "prompt": job.prompt if isinstance(job.prompt, str) else None, "text": result.text,
                       "token_ids": result.token_ids, "finish_reason": result.finish_reason, "metrics": result.metrics.to_dict()}
                stats.tokens += len(result.token_ids)
            except asyncio.CancelledError:  # a second stop: abandoned (not written; a resume redoes it)
                stats.abandoned += 1
                in_flight.discard(job.index)
                out.release(lowest_pending)
                slots.release()  # (the admitting loop may be waiting for a slot)
                raise
            except Exception as exc:  # this request's failure is its own: an error row, and the job goes on
                row = {"index": job.index, "error": f"{type(exc).__name__}: {exc}"}
                stats.failed += 1
            in_flight.discard(job.index)
            out.write(row, lowest_pending)
            stats.written += 1
            if progress is not None:
                progress.update(1)
            slots.release()

        next_job = _reader(jobs, self.window, lambda: not self._admit) if threaded else (lambda: _done_future(next(jobs, None)))
        while self._admit:
            job = await next_job()
            if job is None or not self._admit:
                break
            if job.error is not None:
                out.write({"index": job.index, "error": job.error}, lowest_pending)
                stats.failed += 1
                stats.written += 1
                if progress is not None:
                    progress.update(1)
                continue
            await slots.acquire()
            while out.num_held >= self.window and self._admit:  # ordered: an early request is slow; hold at most a window
                await asyncio.sleep(0.01)
            if not self._admit:
                slots.release()
                break
            in_flight.add(job.index)
            task = asyncio.ensure_future(one(job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        stats.stopped = not self._admit
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        ticker.cancel()
        return stats


async def _done_future(value):
    return value


def _reader(jobs: Iterator[Job], size: int, stopped):
    """Jobs read ahead by a daemon thread into a bounded queue; the async side polls it (never blocks
    the event loop, and a stop does not wait for a line that may never come)."""
    q: queue.Queue = queue.Queue(maxsize=max(1, size))
    end = object()

    def read():
        try:
            for job in jobs:
                q.put(job)
        finally:
            q.put(end)

    threading.Thread(target=read, name="specserve-input", daemon=True).start()

    async def next_job():
        while not stopped():
            try:
                job = q.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.005)
                continue
            return None if job is end else job
        return None

    return next_job


def count_lines(path: str) -> int | None:
    """Lines in a file, read in chunks (a progress bar's total); None for stdin."""
    if path == "-":
        return None
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            n += chunk.count(b"\n")
    return n


def open_input(path: str) -> TextIO:
    return sys.stdin if path == "-" else open(path, encoding="utf-8")
