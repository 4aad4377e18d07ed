"""OpenAI's response shapes from a job's choice streams: one JSON body, or SSE chunks.

``Responses.start`` opens the request's ``n`` choices (choice i's seed is seed + i, as vLLM seeds
them) and waits for each one's first delta, so streaming and non-streaming requests fail the same
way before any output (an HTTP error); later failures of a stream travel in-band, without
internals. ``body`` collects every choice into one response; ``chunks`` merges the choices' deltas
as they come (each with its index and the response's id) and ends with the usage. Echo, logprobs
(with their text offsets, kept across a resume), prompt logprobs and tool calls are shaped here.
Knows nothing of replicas: a ``ChoiceStream`` hides them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid

from ..outputs import SpecMetrics, StepDelta
from ..rng import MAX_SEED
from .edge import error_body
from .http import APIError, LogprobsFormatter, usage_body
from .jobs import Job
from .resume import ChoiceStream, Resumes

logger = logging.getLogger("specserve.serve")


def echo_entries(token_ids: list[int], prompt_logprobs: list | None) -> list:
    """The prompt's logprob entries for an echoed completion: the first token's logprob is null."""
    entries = list(prompt_logprobs or ())
    if len(entries) != len(token_ids):
        entries = [None] * len(token_ids)
    return [[[t, None]] if e is None else e for t, e in zip(token_ids, entries)]


def tool_call_message(body, text: str, finish: str | None) -> tuple[dict, str | None]:
    """The assistant's message for tool_choice required (the output is a JSON array of {name,
    parameters}) or a named function (the output is its arguments), and the finish reason vLLM
    gives (tool_calls for required, stop for a named one). An output cut short (max_tokens) is no
    call: it stays the content."""
    def call(name: str, arguments: str) -> dict:
        return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function", "function": {"name": name, "arguments": arguments}}

    if isinstance(body.tool_choice, str):  # required
        try:
            calls = [call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
        except (ValueError, TypeError, KeyError):
            return {"role": "assistant", "content": text, "tool_calls": []}, finish
        return {"role": "assistant", "content": "", "tool_calls": calls}, "tool_calls" if finish == "stop" else finish
    return {"role": "assistant", "content": "", "tool_calls": [call(body.tool_choice.function.name, text)]}, finish


def in_band_error(rid: str, exc: BaseException) -> dict:
    """A stream's failure after its first chunk, as one error event (no internals)."""
    if isinstance(exc, APIError):
        return error_body(exc.message, exc.type, exc.param, exc.code)
    logger.error("stream %s failed", rid, exc_info=exc)
    return error_body(f"generation failed (request {rid}); the server logs have the details", "server_error")


class Responses:
    def __init__(self, resumes: Resumes, directory, model_name: str, request_timeout_s: float):
        self.resumes, self.directory, self.model_name, self.request_timeout_s = resumes, directory, model_name, request_timeout_s

    @property
    def tokenizer(self):
        return self.directory.tokenizer

    async def start(self, job: Job) -> list[ChoiceStream]:
        """The job's ``n`` choices, each with its first delta; all of them, or none (an error before
        any output is the request's HTTP error)."""
        body, n = job.body, job.body.n or 1
        deadline = time.monotonic() + self.request_timeout_s
        seeds = [job.params.seed] if n == 1 else [None if job.params.seed is None else (job.params.seed + i) % (MAX_SEED + 1)
                                                  for i in range(n)]
        choices = [ChoiceStream(self.resumes, job.request_id if n == 1 else f"{job.request_id}-{i}", job.token_ids,
                                dataclasses.replace(job.params, seed=seed), deadline, bool(body.wait_for_target))
                   for i, seed in enumerate(seeds)]
        results = await asyncio.gather(*[c.start() for c in choices], return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            for c in choices:
                c.close()
            if isinstance(failed[0], APIError):
                raise failed[0]
            logger.error("request %s failed before its first token", job.request_id, exc_info=failed[0])
            raise APIError(500, f"generation failed (request {job.request_id}); the server logs have the details", "server_error")
        return choices

    # -- one body ----------------------------------------------------------------------------
    async def body(self, job: Job, choices: list[ChoiceStream]) -> dict:
        """One response body with a choice per stream (index i: the i-th)."""
        tasks = [asyncio.ensure_future(self._collect(job, c)) for c in choices]
        try:
            bodies = await asyncio.gather(*tasks)
        finally:  # one choice failed (or the caller left): the others stop too
            for t in tasks:
                t.cancel()
            for c in choices:
                c.close()
        if len(bodies) == 1:
            return bodies[0]
        merged, metrics = bodies[0], SpecMetrics()
        merged["choices"] = [{**b["choices"][0], "index": i} for i, b in enumerate(bodies)]
        merged["usage"] = usage_body(merged["usage"]["prompt_tokens"], sum(b["usage"]["completion_tokens"] for b in bodies))
        for b in bodies:
            metrics.merge(SpecMetrics.from_dict(b["specserve"]))
        merged["specserve"] = {**metrics.to_dict(), "target": [b["specserve"]["target"] for b in bodies],
                               "num_resumes": sum(b["specserve"]["num_resumes"] for b in bodies)}
        return merged

    async def _collect(self, job: Job, c: ChoiceStream) -> dict:
        out, body, chat, token_ids = c.out, job.body, job.chat, job.token_ids
        try:
            while not out.finished:
                await c.next()
        except APIError:
            raise
        except Exception:
            logger.exception("request %s failed", c.request_id)
            raise APIError(500, f"generation failed (request {c.request_id}); the server logs have the details", "server_error") from None
        prompt_only = not chat and body.max_tokens == 0  # echo of the prompt alone (one token was made to get there)
        text, entries = ("", []) if prompt_only else (out.text, out.logprobs)
        finish = "length" if prompt_only else out.finish_reason
        if body.echo:
            text = self.echo_text(job) + text
            if not chat and out.logprobs is not None:
                entries = echo_entries(token_ids, out.prompt_logprobs) + entries
        choice = {"index": 0, "finish_reason": finish}
        if chat and body.calls_tools:
            choice["message"], choice["finish_reason"] = tool_call_message(body, text, finish)
        elif chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if out.logprobs is not None or not chat:
            choice["logprobs"] = self._formatter(job)(entries) if out.logprobs is not None else None
        if body.return_token_ids:
            choice.update(prompt_token_ids=list(token_ids), token_ids=[] if prompt_only else list(out.token_ids))
        response = {
            "id": job.request_id, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": self.model_name, "choices": [choice],
            "usage": usage_body(len(token_ids), 0 if prompt_only else len(out.token_ids)),
            "specserve": {**out.metrics.to_dict(), "target": c.first_source, "num_resumes": c.num_resumes},
        }
        if body.prompt_logprobs is not None:  # vLLM's place for them: the choice's (completions), the response's (chat)
            (response if chat else choice)["prompt_logprobs"] = self._prompt_logprobs(out.prompt_logprobs or [None])
        return response

    def echo_text(self, job: Job) -> str:
        """What echo prepends: the prompt (completions; its text as sent unless truncated) or the last
        message's content when it is the assistant's (chat, as vLLM)."""
        body = job.body
        if job.chat:
            last = body.messages[-1]
            return last.text() if last.role == "assistant" else ""
        if isinstance(body.prompt, str) and body.truncate_prompt_tokens is None:
            return body.prompt
        return self.tokenizer.decode(job.token_ids) if self.tokenizer is not None else ""

    def _prompt_logprobs(self, entries: list) -> list:
        """Prompt logprobs as vLLM's JSON: per token None (the first) or {id: {logprob, rank, decoded_token}}."""
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else str  # noqa: E731
        out = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            (tok, lp, *rank), tops = e[0], e[1:]
            d = {str(t): {"logprob": max(v, -9999.0), "rank": r + 1, "decoded_token": decode(t)} for r, (t, v) in enumerate(tops)}
            d.setdefault(str(tok), {"logprob": max(lp, -9999.0), "rank": rank[0] if rank else None, "decoded_token": decode(tok)})
            out.append(d)
        return out

    def _formatter(self, job: Job) -> LogprobsFormatter:
        return LogprobsFormatter(self.tokenizer, job.chat, bool(job.body.return_tokens_as_token_ids))

    # -- chunks --------------------------------------------------------------------------------
    async def chunks(self, job: Job, choices: list[ChoiceStream]):
        """The streams of the ``n`` choices as one stream: chunks as they come, each with its choice's
        index and the response's id; one usage chunk at the end, over all of them."""
        if len(choices) == 1:
            async for chunk in self._chunks(job, choices[0]):
                yield chunk
            return
        queue: asyncio.Queue = asyncio.Queue()
        counts = [0] * len(choices)

        async def pump(i: int, c: ChoiceStream) -> None:
            try:
                async for chunk in self._chunks(job, c, index=i, counts=counts):
                    await queue.put(chunk)
            finally:
                await queue.put(None)

        tasks = [asyncio.ensure_future(pump(i, c)) for i, c in enumerate(choices)]
        try:
            ended = 0
            while ended < len(tasks):
                chunk = await queue.get()
                if chunk is None:
                    ended += 1
                else:
                    yield chunk
            if job.body.include_usage:
                yield {"id": job.request_id, "object": "chat.completion.chunk" if job.chat else "text_completion",
                       "created": int(time.time()), "model": self.model_name, "choices": [],
                       "usage": usage_body(len(job.token_ids), sum(counts))}
        finally:
            for t in tasks:
                t.cancel()

    async def _chunks(self, job: Job, c: ChoiceStream, index: int = 0, counts: list | None = None):
        """One choice's output as streaming chunks (dicts); a failure after the first is one in-band
        error chunk. One of ``n`` choices: ``index``, and its token count left in ``counts`` (the
        caller sends the usage)."""
        body, chat, token_ids, out = job.body, job.chat, job.token_ids, c.out
        kind = "chat.completion.chunk" if chat else "text_completion"
        created, rid = int(time.time()), job.request_id
        logprobs = self._formatter(job) if body.num_logprobs is not None else None
        prompt_only = not chat and body.max_tokens == 0
        echo = [body.echo]  # the first chunk with output carries the echoed prompt
        num_before = [0]  # the output's tokens before this delta (continuous usage counts them)

        def chunk(d: StepDelta | None, first_chunk=False) -> dict:
            text, finish = (d.text if d else ""), (d.finish_reason if d is not None and d.finished else None)
            entries = d.logprobs if d is not None else None
            if prompt_only and d is not None:
                text, entries, finish = "", ([] if entries is not None else None), ("length" if d.finished else None)
            if echo[0] and d is not None:
                echo[0] = False
                text = self.echo_text(job) + text
                if not chat and entries is not None:
                    entries = echo_entries(token_ids, d.prompt_logprobs) + entries
            if chat:
                delta = {"role": "assistant", "content": text or ""} if first_chunk else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
            if body.return_token_ids and d is not None:
                choice["token_ids"] = [] if prompt_only else list(d.token_ids)
            if logprobs is not None and entries is not None:
                choice["logprobs"] = logprobs(entries)
            body_ = {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [choice]}
            if finish is not None:
                body_["specserve"] = {**out.metrics.to_dict(), "num_resumes": c.num_resumes}
            if body.continuous_usage:  # this choice's tokens so far, as vLLM counts them
                body_["usage"] = usage_body(len(token_ids), 0 if prompt_only else num_before[0] + (len(d.token_ids) if d else 0))
            return body_

        try:
            if chat:
                yield chunk(None, first_chunk=True)
            d = c.first
            while True:
                if d.text or d.finished or echo[0] or ((body.return_token_ids or logprobs is not None) and d.token_ids):
                    yield chunk(d)
                num_before[0] += len(d.token_ids)
                if d.finished:
                    break
                d = await c.next()
            made = 0 if prompt_only else len(out.token_ids)
            if counts is not None:
                counts[index] = made
            elif body.include_usage:
                yield {"id": rid, "object": kind, "created": created, "model": self.model_name, "choices": [],
                       "usage": usage_body(len(token_ids), made)}
        except Exception as exc:  # after the stream started, errors travel in-band, without internals
            yield in_band_error(c.request_id, exc)
        finally:
            c.close()
