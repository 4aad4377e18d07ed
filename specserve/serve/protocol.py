"""OpenAI-compatible request bodies (pydantic), validated once at the edge.

Everything that reaches the engine is range-checked here, so nothing that passed can fail
later for being out of range: seeds fit the generator and the wire, booleans are not taken
as integers, strings are valid Unicode (no lone surrogates), NaN/infinity are rejected,
chat content parts have the right types. Every field of vLLM's request models is known
(``tests/unit/test_protocol_fields.py`` checks it against the installed vLLM); unknown fields
are rejected (400 naming them); fields specserve does not implement yet (tools, structured
outputs ...) are accepted only at their neutral value (``NEUTRAL``). Knows nothing of Ray or the engine.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from ..rng import MAX_SEED
from ..sampling_params import MAX_LOGPROBS, SamplingParams

MAX_STOP_CHARS = 1024
MAX_N = 16  # choices per request: each is a sequence on the target, so one request's share is bounded


def _unicode(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("must be valid Unicode text (it contains an unpaired surrogate)") from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]
TokenId = Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: StrictBool | None = Field(False, description="Send a final chunk with token usage.")
    continuous_usage_stats: StrictBool | None = Field(False, description="With include_usage: every chunk carries the usage so far (its choice's tokens), as vLLM sends it.")


def _plain(value):
    if hasattr(value, "dtype") and hasattr(value, "tolist"):  # numpy, without importing it
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


# vLLM request fields specserve accepts at their neutral value only: name -> (the neutral values, why
# another is refused). A neutral value is a no-op; any other value is a 400 naming the field.
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "best_of": ((1, None), "one choice per request"),
    "use_beam_search": ((False, None), "beam search is not speculative decoding"),
    "length_penalty": ((1.0, 1, None), "it applies to beam search only"),
    "logprob_token_ids": ((None, []), "logprobs of chosen token ids are not reported yet"),
    "suffix": ((None, ""), "no insertion models are served"),
    "prompt_embeds": ((None,), "prompts are text or token ids"),
    "watermarking": ((None, False), "no watermarking"),
    "routed_experts_prompt_start": ((0, None), "no expert routing is reported"),
    "return_token_offsets": ((None, False), "token offsets are not reported"),
    "mm_payload": (("tensors", None), "text models only"),
    "return_mm_kwargs": ((None, False), "text models only"),
    "kv_transfer_params": ((None,), "no disaggregated prefill"),
    "ec_transfer_params": ((None,), "no disaggregated prefill"),
    "vllm_xargs": ((None,), "no custom logits processors"),
    "repetition_detection": ((None,), "not supported"),
    "thinking_token_budget": ((None,), "no reasoning parser"),
    "stream_interval": ((None, 1), "every step's tokens are streamed as they come"),
    "priority": ((0, None), "requests are served first come, first served"),
    # chat
    "reasoning_effort": ((None,), "no reasoning parser"),
    "documents": ((None,), "the chat template gets messages only"),
    "chat_template": ((None,), "a request cannot replace the model's chat template"),
    "media_io_kwargs": ((None,), "text models only"),
    "mm_processor_kwargs": ((None,), "text models only"),
    "return_prompt_text": ((None, False), "not supported"),
}


def _neutral(description: str = ""):
    return Field(None, description=description or "Accepted at its neutral value only (400 otherwise).")


class JSONSchemaFormat(_Body):
    name: Text | None = Field(None, max_length=256, description="The schema's name.")
    description: Text | None = Field(None, description="What the schema is for.")
    schema_: dict | None = Field(None, alias="schema", description="The JSON schema the output follows.")
    strict: StrictBool | None = Field(None, description="Accepted: the schema is always followed exactly.")


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"] = Field(..., description="text (no constraint), any JSON object, or a schema.")
    json_schema: JSONSchemaFormat | None = Field(None, description="With type json_schema: the schema.")

    @model_validator(mode="after")
    def _schema(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format: type json_schema needs json_schema.schema")
        return self

    def constraint(self) -> tuple[str, str] | None:
        if self.type == "json_object":
            return "json_object", ""
        if self.type == "json_schema":
            return "json", json.dumps(self.json_schema.schema_)
        return None


class StructuredOutputs(_Body):
    json_: dict | Text | None = Field(None, alias="json", description="A JSON schema the output follows.")
    regex: Text | None = Field(None, description="A regular expression the output matches.")
    choice: list[Text] | None = Field(None, min_length=1, description="The output is one of these strings.")
    grammar: Text | None = Field(None, description="An EBNF grammar (xgrammar's / GBNF syntax).")
    json_object: StrictBool | None = Field(None, description="Any JSON object.")
    disable_any_whitespace: StrictBool = Field(False, description="Only false: whitespace follows the grammar's default.")
    disable_additional_properties: StrictBool = Field(False, description="Only false.")
    whitespace_pattern: Text | None = Field(None, description="Only null.")
    structural_tag: Text | None = Field(None, description="Only null: structural tags are not supported.")

    @model_validator(mode="after")
    def _one(self):
        for name in ("disable_any_whitespace", "disable_additional_properties", "whitespace_pattern", "structural_tag"):
            if getattr(self, name):
                raise ValueError(f"structured_outputs.{name} is not supported by specserve (only its neutral value)")
        kinds = [k for k in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object")
        return self

    def constraint(self) -> tuple[str, str]:
        if self.json_ is not None:
            return "json", self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(self.choice)
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}  # older vLLM names


class _SamplingFields(_Body):
    model: Text | None = Field(None, description="Model id, as listed by GET /v1/models (optional: the served one).")
    max_tokens: StrictInt | None = Field(None, ge=0, le=2**31 - 1, description="Most tokens to generate (0: only with echo, the prompt alone).")
    temperature: float | None = Field(1.0, ge=0.0, le=2.0, description="0 is greedy (lossless token for token).")
    top_p: float | None = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (the most likely token is always kept).")
    top_k: StrictInt | None = Field(0, ge=-1, le=2**31 - 1, description="vLLM extension: keep the k most likely tokens (0 or -1: off).")
    min_p: float | None = Field(0.0, ge=0.0, le=1.0, description="vLLM extension: drop tokens below min_p x the most likely one's probability.")
    presence_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, description="Minus this for every token already in the output.")
    frequency_penalty: float | None = Field(0.0, ge=-2.0, le=2.0, description="Minus this times each token's count in the output.")
    repetition_penalty: float | None = Field(1.0, gt=0.0, description="vLLM extension: prompt and output tokens' logits divided (> 0) or multiplied (< 0) by this.")
    logit_bias: dict[str, float] | None = Field(None, max_length=1024, description="Token id (as a string) -> bias in [-100, 100], added to the logits.")
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1, max_length=1 << 20, description="vLLM extension: only these tokens.")
    bad_words: list[Text] | None = Field(None, max_length=128, description="vLLM extension: words never generated.")
    min_tokens: StrictInt = Field(0, ge=0, le=2**31 - 1, description="vLLM extension: no stop (EOS, stop ids, stop strings) before this many tokens.")
    stop: Text | list[Text] | None = Field(None, description="Up to 4 strings that end the output (excluded from it).")
    include_stop_str_in_output: StrictBool = Field(False, description="vLLM extension: keep the matched stop string in the text.")
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED, description=f"Per-request seed in [0, {MAX_SEED}]: same seed, same output.")
    stream: StrictBool | None = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream: include_usage, continuous_usage_stats.")
    ignore_eos: StrictBool = Field(False, description="vLLM extension: keep generating past EOS.")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64, description="vLLM extension: token ids that end the output.")
    skip_special_tokens: StrictBool = Field(True, description="vLLM extension: leave special tokens out of the text.")
    spaces_between_special_tokens: StrictBool = Field(True, description="vLLM extension: accepted; fast tokenizers (what specserve detokenizes with) ignore it.")
    add_special_tokens: StrictBool | None = Field(None, description="vLLM extension: add the tokenizer's special tokens (BOS) to a text prompt "
                                                                   "(default: yes for completions, no for chat, whose template has them).")
    truncate_prompt_tokens: StrictInt | None = Field(None, ge=-1, le=2**31 - 1, description="vLLM extension: keep only this many prompt tokens (-1: the context's worth).")
    truncation_side: Literal["left", "right"] | None = Field(None, description="Which end truncate_prompt_tokens cuts (default left: the last tokens stay).")
    user: Text | None = Field(None, max_length=256, description="Accepted and ignored (OpenAI's end-user id).")
    request_id: Text | None = Field(None, max_length=256, description="vLLM extension: the caller's id for this request (logs, the response's id).")
    session_id: Text | None = Field(None, max_length=256, description="vLLM extension: accepted and ignored.")
    cache_salt: Text | None = Field(None, max_length=256, description="vLLM extension: accepted; there is no prefix cache shared between requests to salt.")
    return_token_ids: StrictBool | None = Field(False, description="vLLM extension: add the prompt's and the output's token ids to each choice.")
    idx_in_batch: StrictInt | None = Field(None, description="Accepted and ignored: the row index Ray Data's processor adds.")
    wait_for_target: StrictBool = Field(False, description="specserve extension: when no target replica is up (one is restarting), wait for one "
                                                           "(up to server.target_restart_wait_s) instead of the immediate 503.")
    # vLLM fields accepted only at their neutral value (NEUTRAL says why another value is refused).
    n: StrictInt | None = Field(1, ge=1, le=MAX_N, description=f"Choices to generate (up to {MAX_N}); with a seed, choice i uses seed + i, as vLLM.")
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="vLLM extension: each prompt token's logprob and the "
                                                "top-N (the target's raw logprobs, from its prefill); not with stream.")
    logprob_token_ids: Any = _neutral()
    use_beam_search: Any = _neutral()
    length_penalty: Any = _neutral()
    structured_outputs: StructuredOutputs | None = Field(None, description="vLLM extension: one constraint (json, json_object, "
                                                         "regex, choice or grammar) every token follows.")
    guided_json: dict | Text | None = Field(None, description="Older vLLM name of structured_outputs.json.")
    guided_regex: Text | None = Field(None, description="Older vLLM name of structured_outputs.regex.")
    guided_choice: list[Text] | None = Field(None, description="Older vLLM name of structured_outputs.choice.")
    guided_grammar: Text | None = Field(None, description="Older vLLM name of structured_outputs.grammar.")
    prompt_embeds: Any = _neutral()
    watermarking: Any = _neutral()
    return_tokens_as_token_ids: StrictBool | None = Field(None, description="vLLM extension: logprobs name tokens 'token_id:<id>' instead of their text.")
    routed_experts_prompt_start: Any = _neutral()
    return_token_offsets: Any = _neutral()
    mm_payload: Any = _neutral()
    return_mm_kwargs: Any = _neutral()
    kv_transfer_params: Any = _neutral()
    ec_transfer_params: Any = _neutral()
    vllm_xargs: Any = _neutral()
    repetition_detection: Any = _neutral()
    thinking_token_budget: Any = _neutral()
    stream_interval: Any = _neutral()
    priority: Any = _neutral()
    response_format: ResponseFormat | None = Field(None, description="{'type': 'text' | 'json_object' | 'json_schema', 'json_schema': "
                                                   "{'name', 'schema', 'strict'}}: the output follows the schema.")

    @model_validator(mode="before")
    @classmethod
    def _plain_values(cls, data):
        """NumPy arrays and scalars as plain lists and numbers: Ray Data hands a row's list columns
        over as arrays (a token-id prompt, stop lists); JSON never contains them."""
        if isinstance(data, dict):
            return {k: _plain(v) for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _neutral(self):
        for name in self.model_fields_set:
            if name in NEUTRAL:
                allowed, why = NEUTRAL[name]
                value = getattr(self, name)
                if not any(value == a and type(value) is not bool or value is a for a in allowed):
                    raise ValueError(f"{name}={value!r} is not supported by specserve: {why}")
        constraints = [name for name, value in self._constraint_fields() if value]
        if len(constraints) > 1:
            raise ValueError(f"only one constraint per request: got {', '.join(constraints)}")
        if self.prompt_logprobs and self.stream:
            raise ValueError("prompt_logprobs are not available with stream=true")
        so = self.stream_options
        if so is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4:
            raise ValueError(f"stop accepts at most 4 sequences, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be non-empty and at most {MAX_STOP_CHARS} characters")
        for key in self.logit_bias or {}:
            if not key.strip().isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
        return self

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        pick = lambda name, default: default if getattr(self, name) is None else getattr(self, name)  # noqa: E731
        return SamplingParams(
            temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0), top_k=pick("top_k", 0),
            max_tokens=max(1, default_max_tokens if self.max_tokens is None else self.max_tokens),  # (0: echo only; one is made and dropped)
            stop=self.stop or (), seed=self.seed,
            ignore_eos=self.ignore_eos, stop_token_ids=tuple(self.stop_token_ids or ()), skip_special_tokens=self.skip_special_tokens,
            min_p=pick("min_p", 0.0), presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0), repetition_penalty=pick("repetition_penalty", 1.0),
            min_tokens=self.min_tokens, logit_bias=tuple((int(k), v) for k, v in (self.logit_bias or {}).items()),
            logprobs=self.num_logprobs, prompt_logprobs=self.num_prompt_logprobs,
            allowed_token_ids=tuple(self.allowed_token_ids) if self.allowed_token_ids is not None else None,
            bad_words=tuple(self.bad_words or ()), include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.constraint(),
        )

    def _constraint_fields(self) -> list[tuple[str, Any]]:
        """(field, value) of each field that sets a constraint, in the order they take effect."""
        fields = [("response_format", self.response_format.constraint() if self.response_format is not None else None),
                  ("structured_outputs", self.structured_outputs)] + [(name, getattr(self, name)) for name in GUIDED]
        return [(name, value) for name, value in fields if value is not None]

    @property
    def constraint_field(self) -> str | None:
        """The request field the constraint came from (for error messages)."""
        if getattr(self, "calls_tools", False):
            return "tools"
        return next((name for name, _ in self._constraint_fields()), None)

    def constraint(self) -> tuple[str, str] | None:
        """(kind, constraint) of ``SamplingParams.structured_outputs``, from whichever field set one."""
        for name, value in self._constraint_fields():
            if name == "response_format":
                return value
            if name == "structured_outputs":
                return value.constraint()
            return GUIDED[name], value if isinstance(value, str) else json.dumps(value)
        return None

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as ``truncate_prompt_tokens`` / ``truncation_side`` leave it."""
        n = self.truncate_prompt_tokens
        if n is None:
            return token_ids
        n = max_model_len if n == -1 else n
        if n == 0 or len(token_ids) <= n:
            return token_ids
        return token_ids[:n] if self.truncation_side == "right" else token_ids[-n:]

    @property
    def num_logprobs(self) -> int | None:
        """Top logprobs per generated token (None: no logprobs); each request kind says how it asks."""
        return None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """Top logprobs per prompt token (None: none): asked for, or (echo) as many as per generated token."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.num_logprobs if getattr(self, "echo", False) else None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM: ``continuous_usage_stats``, which takes ``include_usage`` too)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]] = Field(..., description="One prompt: text or token ids.")
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Each token's logprob and the top-N (the target's raw logprobs).")
    echo: StrictBool | None = Field(False, description="Prepend the prompt to the text (with logprobs: the prompt tokens' logprobs too, the first null).")
    best_of: Any = _neutral("Must be null or 1.")
    suffix: Any = _neutral("Must be null.")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _single_prompt(self):
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"prompt: batched prompts ({len(p)}) are not supported; send one request per prompt")
            self.prompt = p[0]
        if isinstance(self.prompt, (str, list)) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo: the prompt alone)")
        return self


class TextPart(_Body):
    type: Literal["text"] = Field(..., description="Only text parts are supported.")
    text: Text = Field(..., description="The text of this part.")


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer"] = Field(..., description="Who wrote the message.")
    content: Text | list[TextPart] = Field(..., description="Text, or a list of {'type': 'text', 'text': ...} parts.")
    name: Text | None = Field(None, max_length=256, description="Optional author name.")

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionDef(_Body):
    name: Text = Field(..., min_length=1, max_length=64, description="The function's name.")
    description: Text | None = Field(None, description="What it does (the chat template may show it).")
    parameters: dict | None = Field(None, description="A JSON schema of its arguments.")
    strict: StrictBool | None = Field(None, description="Accepted: the schema is always followed exactly.")


class Tool(_Body):
    type: Literal["function"] = Field(..., description="Only functions.")
    function: FunctionDef = Field(..., description="The function.")


class FunctionName(_Body):
    name: Text = Field(..., description="The function to call.")


class NamedToolChoice(_Body):
    type: Literal["function"] = Field(..., description="Only functions.")
    function: FunctionName = Field(..., description="Which one.")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=2**31 - 1, description="Newer name for max_tokens.")
    add_generation_prompt: StrictBool = Field(True, description="vLLM extension: end the rendered prompt with the assistant's turn opening.")
    continue_final_message: StrictBool = Field(False, description="vLLM extension: continue the last (assistant) message instead of opening a new one.")
    chat_template_kwargs: dict[str, StrictBool | StrictInt | float | Text | None] | None = Field(
        None, max_length=32, description="vLLM extension: extra variables for the chat template (e.g. enable_thinking).")
    include_reasoning: StrictBool = Field(True, description="vLLM extension: accepted; no reasoning parser runs, so the text is whole.")
    parallel_tool_calls: StrictBool | None = Field(True, description="With tool_choice required: false allows one call only.")
    logprobs: StrictBool | None = Field(False, description="Each token's logprob (the target's raw logprobs).")
    echo: StrictBool = Field(False, description="vLLM extension: prepend the last message's content when it is the assistant's.")
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With logprobs: the N most likely tokens at each position.")
    tools: list[Tool] | None = Field(None, max_length=128, description="Functions the model may call (the chat template sees them).")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="none (default): plain text; required: one or more calls, as a JSON array the output follows; "
                          "a named function: its arguments, following its parameters' schema. auto needs a tool parser: 400.")
    reasoning_effort: Any = _neutral()
    documents: Any = _neutral()
    chat_template: Any = _neutral()
    media_io_kwargs: Any = _neutral()
    mm_processor_kwargs: Any = _neutral()
    return_prompt_text: Any = _neutral()

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _chat_fields(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in self.model_fields_set:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
        if self.max_completion_tokens and not self.max_tokens:
            self.max_tokens = self.max_completion_tokens
        if self.max_tokens == 0:
            raise ValueError("max_tokens must be at least 1")
        choice = self.tool_choice
        if choice == "auto" and self.tools:
            raise ValueError("tool_choice=auto needs a tool parser, which specserve does not run: use required or a named function")
        if choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
        if self.calls_tools and self.stream:
            raise ValueError("tool calls come whole: with tool_choice required or a named function, stream must be false")
        if self.calls_tools and super().constraint() is not None:
            raise ValueError("only one constraint per request: tool_choice and a response format")
        return self

    @property
    def calls_tools(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, NamedToolChoice)

    def constraint(self) -> tuple[str, str] | None:
        """With tool_choice required: a JSON array of {name, parameters} objects, one of the tools each
        (vLLM's schema); with a named function: that function's parameters."""
        if isinstance(self.tool_choice, NamedToolChoice):
            tool = next(t for t in self.tools if t.function.name == self.tool_choice.function.name)
            return "json", json.dumps(tool.function.parameters or {"type": "object", "properties": {}})
        if self.tool_choice == "required":
            calls = [{"properties": {"name": {"type": "string", "enum": [t.function.name]},
                                     "parameters": t.function.parameters or {"type": "object", "properties": {}}},
                      "required": ["name", "parameters"]} for t in self.tools]
            schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
            if self.parallel_tool_calls is False:
                schema["maxItems"] = 1
            return "json", json.dumps(schema)
        return super().constraint()


class ErrorDetail(BaseModel):
    message: str = Field(..., description="What was wrong, in words.")
    type: str = Field(..., description="invalid_request_error, authentication_error, not_found_error, rate_limit_error, server_error ...")
    param: str | None = Field(None, description="The request field at fault, if any.")
    code: str | None = Field(None, description="A machine-readable code, if any.")


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every 4xx/5xx this server sends has this shape."""

    error: ErrorDetail
