"""OpenAI-compatible request bodies (pydantic) and the args of the Serve application.

Unknown fields are rejected (400 naming them) rather than ignored; OpenAI fields that
specserve does not implement (n > 1, logprobs, tools, penalties ...) are accepted only at
their neutral value. Knows nothing of Ray or the engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..sampling_params import SamplingParams


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = Field(False, description="Send a final chunk with token usage.")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., description="Model id, as listed by GET /v1/models.")
    max_tokens: int | None = Field(None, ge=1, description="Most tokens to generate.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 is greedy (lossless token for token).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=-1, description="vLLM extension: keep the k most likely tokens (0 or -1: off).")
    stop: str | list[str] | None = Field(None, description="Up to 4 strings that end the output (excluded from it).")
    seed: int | None = Field(None, description="Per-request seed: same seed, same output.")
    stream: bool = Field(False, description="Stream server-sent events.")
    stream_options: StreamOptions | None = Field(None, description="Only with stream: include_usage.")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS.")
    user: str | None = Field(None, description="Accepted and ignored (OpenAI's end-user id).")
    # OpenAI fields accepted only at their neutral value.
    n: int = Field(1, description="Must be 1: one choice per request.")
    logprobs: Any = Field(None, description="Not supported: must be null/false.")
    presence_penalty: float = Field(0.0, description="Not supported: must be 0.")
    frequency_penalty: float = Field(0.0, description="Not supported: must be 0.")
    logit_bias: dict | None = Field(None, description="Not supported: must be null.")

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
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise ValueError(f"stop accepts at most 4 sequences, got {len(self.stop)}")
        return self

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            max_tokens=self.max_tokens or default_max_tokens, stop=self.stop or (), seed=self.seed,
            ignore_eos=self.ignore_eos,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(..., description="One prompt: text or token ids.")
    echo: bool = Field(False, description="Not supported: must be false.")
    best_of: int | None = Field(None, description="Not supported: must be null or 1.")
    suffix: str | None = Field(None, description="Not supported: must be null.")

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "developer"] = Field(..., description="Who wrote the message.")
    content: str | list[dict] = Field(..., description="Text, or a list of {'type': 'text', 'text': ...} parts.")
    name: str | None = Field(None, description="Optional author name.")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"message content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(part.get("text", ""))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1, description="The conversation so far.")
    max_completion_tokens: int | None = Field(None, ge=1, description="Newer name for max_tokens.")
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


class ServeArgs(BaseModel):
    """Arguments of ``specserve.serve:build_app`` (from a Serve YAML, the CLI or Python)."""

    model_config = ConfigDict(extra="forbid")

    target: str = Field(..., description="Target model: directory or hub id.")
    draft: str | None = Field(None, description="Draft model directory/id, 'ngram', or null for target-only.")
    model_name: str | None = Field(None, description="Id served in /v1/models (default: the target's folder name).")
    num_speculative_tokens: int = Field(4, ge=0, le=32, description="Draft tokens per verification step (k).")
    dtype: str = Field("float32", description="Target dtype.")
    draft_dtype: str | None = Field(None, description="Draft dtype (default: dtype).")
    device: str = Field("cpu", description="Target device, e.g. cuda.")
    draft_device: str | None = Field(None, description="Draft device (default: device).")
    target_num_gpus: float = Field(0, ge=0, description="GPUs in the target's bundle.")
    draft_num_gpus: float = Field(0, ge=0, description="GPUs in the draft's bundle.")
    target_num_cpus: float = Field(0.5, ge=0, description="CPUs in the target's bundle.")
    draft_num_cpus: float = Field(0.5, ge=0, description="CPUs in the draft's bundle.")
    target_label: dict[str, str] | None = Field(None, description="Label selector for the target node (default specserve.io/role=target).")
    draft_label: dict[str, str] | None = Field(None, description="Label selector for the draft node (default specserve.io/role=draft).")
    use_role_labels: bool | Literal["auto"] = Field("auto", description="Pin sides by the specserve.io/role label: true, false, or auto (when some node has it).")
    target_resources: dict[str, float] = Field(default_factory=dict, description="Custom resources for the target bundle.")
    draft_resources: dict[str, float] = Field(default_factory=dict, description="Custom resources for the draft bundle.")
    channel: Literal["ray", "collective"] = Field("ray", description="Draft/target link.")
    collective_backend: Literal["gloo", "nccl"] = Field("gloo", description="Backend of the collective channel.")
    channel_delay_ms: float = Field(0.0, ge=0, description="Emulated one-way link delay (testing).")
    draft_timeout_s: float = Field(10.0, gt=0, description="Draft step timeout before falling back to target-only.")
    max_num_seqs: int = Field(64, ge=1, description="Most sequences verified together per step.")
    max_model_len: int | None = Field(None, ge=2, description="Context limit (default: the model's).")
    max_pending_requests: int = Field(256, ge=1, description="In-flight requests beyond this get 429 + Retry-After.")
    api_key: str | None = Field(None, description="Require 'Authorization: Bearer <key>' (or env SPECSERVE_API_KEY).")
    trust_remote_code: bool = Field(False, description="Passed to transformers.")

    def engine_config(self):
        from ..config import EngineConfig, SideConfig

        draft = None
        if self.draft is not None:
            draft = SideConfig(self.draft, dtype=self.draft_dtype or self.dtype, device=self.draft_device or self.device,
                               num_cpus=self.draft_num_cpus, num_gpus=self.draft_num_gpus,
                               label_selector=self.draft_label or {}, resources=self.draft_resources,
                               trust_remote_code=self.trust_remote_code)
        target = SideConfig(self.target, dtype=self.dtype, device=self.device, num_cpus=self.target_num_cpus,
                            num_gpus=self.target_num_gpus, label_selector=self.target_label or {},
                            resources=self.target_resources, trust_remote_code=self.trust_remote_code)
        return EngineConfig(target=target, draft=draft, num_speculative_tokens=self.num_speculative_tokens,
                            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len)

    def placement(self):
        from ..distributed.placement import Placement

        return Placement(use_role_labels=self.use_role_labels, channel=self.channel,
                         collective_backend=self.collective_backend, channel_delay_ms=self.channel_delay_ms,
                         draft_timeout_s=self.draft_timeout_s)
