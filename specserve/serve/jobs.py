"""From an OpenAI request body to a ``Job`` the targets can run: the model checked, the prompt
tokenized (a thread, off the event loop; the chat template for chat), lengths and sampling
parameters validated and any constraint compiled once here, so a request that cannot run is a 400
at the edge. The tokenizer comes from a target replica (``TargetDirectory``). Knows nothing of
replicas or streams.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass

from ..sampling_params import SamplingParams
from .http import APIError

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class Job:
    """A validated request: its body, the response id, the prompt's tokens and the sampling parameters."""

    body: object  # protocol.CompletionRequest or protocol.ChatCompletionRequest
    chat: bool
    request_id: str
    token_ids: list[int]
    params: SamplingParams


class JobMaker:
    def __init__(self, directory, model_name: str):
        self.directory, self.model_name = directory, model_name
        self._grammar_cache = None  # structured.Grammars: constraints compiled at the edge

    @property
    def info(self) -> dict:
        return self.directory.info

    @property
    def tokenizer(self):
        return self.directory.tokenizer

    def check_model(self, model) -> None:
        if model is not None and model != self.model_name:  # (vLLM: no model means the served one)
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def _job(self, body, chat: bool, token_ids: list, params: SamplingParams) -> Job:
        prefix = "chatcmpl" if chat else "cmpl"
        rid = f"{prefix}-{body.request_id or ''}{'-' if body.request_id else ''}{uuid.uuid4().hex}"
        return Job(body, chat, rid, token_ids, params)

    async def completion(self, body) -> Job:
        self.check_model(body.model)
        await self.directory.ready(self._wait_s(body))
        token_ids = await self._tokens(body.prompt, body.add_special_tokens is not False)
        token_ids = body.truncate(token_ids, self.info["max_model_len"])
        params = await self._params(body, COMPLETIONS_DEFAULT_MAX_TOKENS, token_ids)
        return self._job(body, False, token_ids, params)

    async def chat(self, body) -> Job:
        self.check_model(body.model)
        await self.directory.ready(self._wait_s(body))
        tokenizer = self.tokenizer
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise APIError(400, f"model {self.model_name!r} has no chat template: use /v1/completions", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None

        def render():
            # The template's text, then tokens (with special tokens only if asked: the template has them),
            # as vLLM renders chat prompts; tools go to the template, as vLLM passes them.
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
                continue_final_message=body.continue_final_message, tokenize=False, tools=tools, **(body.chat_template_kwargs or {}))
            return list(tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens)))

        try:
            token_ids = await asyncio.to_thread(render)
        except Exception as exc:  # a template that cannot render these messages is the request's fault
            raise APIError(400, f"the chat template cannot render these messages: {type(exc).__name__}", param="messages") from None
        token_ids = body.truncate(token_ids, self.info["max_model_len"])
        params = await self._params(body, max(1, self.info["max_model_len"] - len(token_ids)), token_ids)
        return self._job(body, True, token_ids, params)

    def _wait_s(self, body) -> float:
        """How long a request that asked to wait (``wait_for_target``) may wait for a target replica to come up."""
        return self.directory.server.target_restart_wait_s if body.wait_for_target else 0.0

    async def _tokens(self, prompt, add_special_tokens: bool = True) -> list:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as a list of token ids", param="prompt")
            return await asyncio.to_thread(self.tokenizer.encode, prompt, add_special_tokens=add_special_tokens)
        vocab = self.info["vocab"]["vocab_size"]
        bad = [t for t in prompt if t >= vocab]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab}), got {bad[:3]}", param="prompt")
        return list(prompt)

    def _check_lengths(self, token_ids: list, max_tokens: int) -> None:
        limit = self.info["max_model_len"]
        if len(token_ids) >= limit or len(token_ids) + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(token_ids) + max_tokens} tokens ({len(token_ids)} in the prompt, {max_tokens} for the completion).",
                param="max_tokens" if len(token_ids) < limit else "prompt", code="context_length_exceeded",
            )

    async def _params(self, body, default_max_tokens: int, token_ids: list) -> SamplingParams:
        try:
            params = body.sampling_params(default_max_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc)) from None
        self._check_lengths(token_ids, params.max_tokens)
        if params.stop and self.tokenizer is None:
            raise APIError(400, "stop strings need a tokenizer; this model has none", param="stop")
        if params.structured_outputs is not None:  # compiled here once, so a grammar that cannot be is a 400 at the edge
            try:
                await asyncio.to_thread(self._grammars().compile, *params.structured_outputs)
            except (ValueError, ImportError) as exc:
                raise APIError(400, str(exc), param=body.constraint_field) from None
        return params

    def _grammars(self):
        if self._grammar_cache is None:
            from ..structured import Grammars

            try:
                self._grammar_cache = Grammars(self.tokenizer, self.info["vocab"]["vocab_size"])
            except ValueError as exc:  # no tokenizer
                raise ValueError(f"structured_outputs: {exc}") from None
        return self._grammar_cache
