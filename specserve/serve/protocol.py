"""OpenAI-compatible request bodies (pydantic), validated once at the edge.

Everything that reaches the engine is range-checked here, so nothing that passed can fail
later for being out of range: seeds fit the generator and the wire, booleans are not taken
as integers, strings are valid Unicode (no lone surrogates), NaN/infinity are rejected,
chat content parts have the right types. Unknown fields are rejected (400 naming them);
OpenAI fields specserve does not implement (n > 1, logprobs, tools, penalties ...) are
accepted only at their neutral value. Knows nothing of Ray or the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from ..rng import MAX_SEED
from ..sampling_params import SamplingParams

MAX_STOP_CHARS = 1024


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
    include_usage: StrictBool = Field(False, description="Send a final chunk with token usage.")


def _plain(value):
    if hasattr(value, "dtype") and hasattr(value, "tolist"):  # numpy, without importing it
        return value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class _SamplingFields(_Body):
    model: Text = Field(..., description="Model id, as listed by GET /v1/models.")
    max_tokens: StrictInt | None = Field(None, ge=1, le=2**31 - 1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy (lossless token for token).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass (the most likely token is always kept).")
    top_k: StrictInt = Field(0, ge=-1, le=2**31 - 1, description="vLLM extension: keep the k most likely tokens (0 or -1: off).")
    stop: Text | list[Text] | None = Field(None, description="Up to 4 strings that end the output (excluded from it).")
    seed: StrictInt | None = Field(None, ge=0, le=MAX_SEED, description=f"Per-request seed in [0, {MAX_SEED}]: same seed, same output.")
    stream: StrictBool = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream: include_usage.")
    ignore_eos: StrictBool = Field(False, description="vLLM extension: keep generating past EOS.")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64, description="vLLM extension: token ids that end the output.")
    skip_special_tokens: StrictBool = Field(True, description="vLLM extension: leave special tokens out of the text.")
    user: Text | None = Field(None, max_length=256, description="Accepted and ignored (OpenAI's end-user id).")
    request_id: Text | None = Field(None, max_length=256, description="vLLM extension: the caller's id for this request (logs, the response's id).")
    return_token_ids: StrictBool = Field(False, description="vLLM extension: add the prompt's and the output's token ids to each choice.")
    idx_in_batch: StrictInt | None = Field(None, description="Accepted and ignored: the row index Ray Data's processor adds.")
    # OpenAI fields accepted only at their neutral value.
    n: StrictInt = Field(1, description="Must be 1: one choice per request.")
    logprobs: Any = Field(None, description="Not supported: must be null/false.")
    presence_penalty: float = Field(0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(0.0, description="Not supported: must be 0.")
    logit_bias: dict | None = Field(None, description="Not supported: must be null.")

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
        for name, neutral in (("n", 1), ("presence_penalty", 0.0), ("frequency_penalty", 0.0)):
            if getattr(self, name) != neutral:
                raise ValueError(f"{name}={getattr(self, name)!r} is not supported by specserve (only {neutral})")
        if self.logprobs not in (None, False, 0):
            raise ValueError("logprobs is not supported by specserve")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by specserve")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if len(stops) > 4:
            raise ValueError(f"stop accepts at most 4 sequences, got {len(stops)}")
        if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences must be non-empty and at most {MAX_STOP_CHARS} characters")
        return self

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens or default_max_tokens, stop=self.stop or (), seed=self.seed,
            ignore_eos=self.ignore_eos, stop_token_ids=tuple(self.stop_token_ids or ()), skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: Text | list[TokenId] | list[Text] | list[list[TokenId]] = Field(..., description="One prompt: text or token ids.")
    echo: StrictBool = Field(False, description="Not supported: must be false.")
    best_of: StrictInt | None = Field(None, description="Not supported: must be null or 1.")
    suffix: Text | None = Field(None, description="Not supported: must be null.")

    @model_validator(mode="after")
    def _single_prompt(self):
        if self.echo:
            raise ValueError("echo is not supported by specserve")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported by specserve")
        if self.suffix:
            raise ValueError("suffix is not supported by specserve")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ValueError(f"prompt: batched prompts ({len(p)}) are not supported; send one request per prompt")
            self.prompt = p[0]
        if isinstance(self.prompt, (str, list)) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty")
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


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=2**31 - 1, description="Newer name for max_tokens.")
    tools: list | None = Field(None, description="Not supported: must be null.")
    tool_choice: Any = Field(None, description="Not supported: must be null.")
    response_format: dict | None = Field(None, description="Only {'type': 'text'}.")

    @model_validator(mode="after")
    def _chat_neutral(self):
        if self.tools:
            raise ValueError("tools are not supported by specserve")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported by specserve")
        if self.response_format not in (None, {"type": "text"}):
            raise ValueError("response_format other than text is not supported by specserve")
        if self.max_completion_tokens and not self.max_tokens:
            self.max_tokens = self.max_completion_tokens
        return self


class ErrorDetail(BaseModel):
    message: str = Field(..., description="What was wrong, in words.")
    type: str = Field(..., description="invalid_request_error, authentication_error, not_found_error, rate_limit_error, server_error ...")
    param: str | None = Field(None, description="The request field at fault, if any.")
    code: str | None = Field(None, description="A machine-readable code, if any.")


class ErrorResponse(BaseModel):
    """OpenAI's error envelope: every 4xx/5xx this server sends has this shape."""

    error: ErrorDetail
