"""The one configuration schema: Python API, CLI flags and Serve YAML all come from it.

``SpecserveConfig`` nests one section per concern: ``target`` and ``draft`` (model,
backend, dtype, device, parallelism, placement, replicas), ``speculation``, ``engine``
(limits), ``channel`` (the draft link), ``cluster`` (Ray) and ``server`` (HTTP). Every
field has a description and a default here and nowhere else; ``flat_fields`` names each
field once for the CLI (``--draft-num-gpus``) and for ``LLM(...)`` keywords
(``draft_num_gpus=``). Pydantic models, frozen, unknown keys rejected. Backend- and
drafter-specific options pass through ``backend_options`` / ``drafter_options`` without
the core knowing them. Knows nothing of Ray or models beyond names.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

logger = logging.getLogger(__name__)

DEFAULT_ROLE_LABEL = "specserve.io/role"
TARGET_BACKEND_ENV = "SPECSERVE_TARGET_BACKEND"  # the target's backend when none is named (default auto)
DEMO_ALIASES = ("demo:target", "demo:draft", "demo:eagle")  # the pair (and the target's EAGLE-3 head) in specserve/demo_models
DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")
VLLM_UNSUPPORTED_DTYPES = ("float64",)  # dtypes vLLM has no kernels for: backend auto picks hf for them


def bool_or_auto(value: str) -> bool | str | None:
    """A true/false/auto setting as the CLI and the environment spell it (true/yes/1, false/no/0, auto,
    any case); None for anything else."""
    low = value.lower()
    if low in ("true", "yes", "1"):
        return True
    if low in ("false", "no", "0"):
        return False
    return "auto" if low == "auto" else None


def _env_switch(name: str, default: str) -> bool | str:
    """A true/false/auto setting from the environment (``default`` when unset)."""
    value = bool_or_auto((os.environ.get(name) or default).strip())
    if value is None:
        raise ValueError(f"{name}={os.environ.get(name)!r}: expected true, false or auto")
    return value


@functools.cache
def _say_once(message: str) -> None:
    logger.info(message)


def vllm_installed() -> bool:
    """Whether vLLM can be imported here, without importing it (seconds)."""
    return importlib.util.find_spec("vllm") is not None


def resolve_model(model: str) -> str:
    """Map ``demo:target`` / ``demo:draft`` / ``demo:eagle`` to the shipped demo models; other names pass through."""
    if model in DEMO_ALIASES:
        from .demo_models import DRAFT_PATH, EAGLE_PATH, TARGET_PATH

        path = {"demo:target": TARGET_PATH, "demo:draft": DRAFT_PATH, "demo:eagle": EAGLE_PATH}[model]
        if not (path / "config.json").exists():
            raise ValueError(f"{model!r}: the demo model pair is missing from this install ({path})")
        return str(path)
    return model


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SideConfig(_Section):
    """One model side (the target or the draft): what runs, how, and where."""

    model: str = Field("", description="Model directory or hub id ('demo:target' / 'demo:draft': the shipped demo pair).")
    backend: str = Field(default_factory=lambda: os.environ.get(TARGET_BACKEND_ENV) or "auto",
                         description="Model backend: auto (vllm where vLLM is installed and can take the side, else hf), hf "
                                     "(transformers, specserve's own engine), vllm, sim (latency-model simulator). The target's "
                                     f"default is auto (env {TARGET_BACKEND_ENV} sets it), the draft's hf.")
    dtype: Literal[DTYPES] = Field("float32", description="Weights and activations dtype ('auto': the checkpoint's).")
    device: str = Field("cpu", description="Torch device of this side, e.g. cpu, cuda, cuda:1.")
    device_map: str | None = Field(None, description="transformers device_map, e.g. 'auto' to spread one side over its GPUs.")
    tensor_parallel_size: int = Field(1, ge=1, description="Tensor parallelism of this side (backends that shard, e.g. vllm).")
    trust_remote_code: bool = Field(False, description="Allow model code from the model's repository.")
    backend_options: dict[str, Any] = Field(default_factory=dict, description="Extra keyword arguments for the backend, passed through.")
    num_replicas: int = Field(1, ge=1, description="Serve: replicas of this side (data parallel targets, a draft pool).")
    autoscaling: dict[str, Any] | None = Field(None, description="Serve: autoscaling_config of this side's deployment (overrides num_replicas).")
    num_cpus: float = Field(0.5, ge=0, description="Ray: CPUs reserved per replica of this side.")
    num_gpus: float = Field(0.0, ge=0, description="Ray: GPUs reserved per replica of this side.")
    label_selector: dict[str, str] = Field(default_factory=dict, description="Ray: node labels this side must run on (default: specserve.io/role=<side>).")
    resources: dict[str, float] = Field(default_factory=dict, description="Ray: custom resources per replica, e.g. {draft_node: 1}.")

    @field_validator("model")
    @classmethod
    def _model(cls, v: str) -> str:
        return resolve_model(v) if v else v

    @model_validator(mode="after")
    def _auto_backend(self):
        if self.backend == "auto":  # resolved where the configuration is read: a cluster's nodes share one environment
            object.__setattr__(self, "backend", self._resolve_auto())
        return self

    def _resolve_auto(self) -> str:
        """vLLM where it is importable and the side asks nothing only transformers does (a device_map, float64, a
        device other than CPU or CUDA); else hf."""
        if self.backend_options:
            raise ValueError("backend_options are one backend's own keywords: name that backend too (backend: vllm or hf)")
        if self.device_map is not None or self.dtype in VLLM_UNSUPPORTED_DTYPES or not (self.device == "cpu" or self.device.startswith("cuda")):
            return "hf"
        if not vllm_installed():
            return "hf"
        _say_once("backend auto: vllm (vLLM is installed; backend hf runs specserve's own engine instead)")
        return "vllm"

    @model_validator(mode="after")
    def _gpus(self):
        if self.num_gpus >= 1 and self.num_gpus < self.tensor_parallel_size:
            raise ValueError(f"num_gpus={self.num_gpus:g} is fewer than tensor_parallel_size={self.tensor_parallel_size}")
        return self


class DraftConfig(SideConfig):
    backend: str = Field("hf", description="Model backend of the draft: hf (transformers), vllm, sim (latency-model simulator); "
                                           "auto is hf.")
    drafter: Literal["model", "ngram"] = Field("model", description="How drafts are made: a draft model, or ngram prompt lookup (no model).")
    drafter_options: dict[str, Any] = Field(default_factory=dict, description="Drafter options, e.g. {ngram_min: 1, ngram_max: 4}.")
    compile: bool | Literal["auto"] = Field(
        default_factory=lambda: _env_switch("SPECSERVE_DRAFT_COMPILE", "auto"),
        description="hf drafts (EAGLE / MTP heads too): run the draft's forward through torch.compile, compiled for the drafting shapes when the draft "
                    "starts (~15-60 s on one CPU core; a small model's forward on CPU 1.1-1.5x faster per call); auto: a CPU draft in a "
                    "process of its own (a Ray actor, a Serve replica, `specserve draft`); a draft that cannot compile runs "
                    "eager (env SPECSERVE_DRAFT_COMPILE sets the default).")

    def _resolve_auto(self) -> str:
        return "hf"  # a draft is small: transformers, compiled, is its fast path


class SpeculationConfig(_Section):
    num_speculative_tokens: int = Field(4, ge=0, le=32, description="Draft tokens per step (k); the most when adaptive. 0: target-only.")
    adaptive: bool = Field(True, description="Choose k each step from measured acceptance and costs (k=0 when speculation does not pay), and whether a draft answers from its speculation cache alone; both target engines (specserve's, vLLM's).")
    cache_only: bool = Field(False, description="With adaptive false: drafts answer from their speculation caches alone (a block holds what was drafted ahead; nothing is drafted while the target waits), to measure that arm; adaptive chooses it per step where a draft drafts ahead.")
    draft_probs: bool = Field(True, description="Sampled requests: the draft samples and sends its probabilities (else greedy point-mass drafts).")
    draft_ahead: bool | Literal["auto"] = Field("auto", description="While the target verifies, the draft drafts ahead for the likeliest verdicts (speculation cache); auto: wherever the draft has compute of its own (another host, another GPU, or CPU cores disjoint from the target's), off where it would take the target's.")
    draft_ahead_preempt: bool = Field(True, description="Stop drafting ahead as soon as the next request arrives; false finishes the tree first (deterministic hits, for tests and measurements).")
    draft_trees: bool = Field(False, description="A draft that drafts ahead over a socket sends the target its speculation cache once it has drafted it; a step whose every block is in it takes them without waiting for the draft (it hears of them in the same message as the deltas). Off by default: it hides the round trip, but the trees are grown a round trip shorter and the controller rates the speculation it enables too well at batch 8 and 32; in the benchmarks it won only with a link delay (see benchmarks/README.md).")
    fanout: int = Field(4, ge=1, le=16, description="Speculation cache: most candidate tokens per verdict position.")
    max_branches: int | None = Field(None, ge=1, description="Speculation cache: most branches per sequence (default (k+1) x fanout; fewer when the time the target's verify leaves does not fit them).")
    head_fc: Literal["auto", "draft", "target"] = Field("auto", description="Where an EAGLE-3 head's fc runs: on the target (one H-wide row per committed position crosses the link instead of three; a 3H x H product per row on the target) or on the draft; auto: the target when it computes on a GPU, where that product costs next to nothing.")
    first_step_drafts: bool = Field(False, description="A new sequence's block is asked in its first step. specserve's engine: that step speculates too, so its first token waits for a verify step and for the draft to prefill the prompt; the vLLM target engine: the step that prefilled it waits for the draft's prefill and block before it returns (and its first token). Off: greedy and unseeded requests take the first token from the prefill, ask from their next step, and the draft prefills them and drafts their first block ahead meanwhile; seeded sampled requests always speculate from the first step.")
    draft_timeout_s: float = Field(10.0, gt=0, description="Longest wait for a draft reply (steady state uses ~20x the measured round trip).")
    draft_min_timeout_s: float = Field(0.5, gt=0, description="Shortest timeout of a draft reply.")


class EngineConfig(_Section):
    max_num_seqs: int = Field(256, ge=1, description="Most sequences verified together in one step.")
    max_model_len: int | None = Field(None, ge=2, description="Context limit in tokens (default: the target's).")
    cpu_threads: int | None = Field(None, ge=1, description="Torch threads per process on CPU (default: in-process half the cores, in Ray actors Ray's num_cpus).")


class ChannelConfig(_Section):
    delay_ms: float = Field(default_factory=lambda: float(os.environ.get("SPECSERVE_CHANNEL_DELAY_MS", "0") or 0), ge=0,
                            description="Emulated one-way link delay in ms (testing; env SPECSERVE_CHANNEL_DELAY_MS).")
    draft_port: int = Field(0, ge=0, le=65535, description="TCP port the draft listens on (0: any free port; set it to open a firewall).")
    tensors: Literal["inline", "collective"] = Field("inline", description="Draft probabilities: inline in the messages, or over ray.util.collective.")
    collective_backend: Literal["gloo", "nccl"] = Field("gloo", description="Backend of the collective tensor path: gloo (CPU), nccl (GPUs).")
    draft_token: str | None = Field(None, repr=False, description="Shared secret a target proves (challenge-response) before a draft accepts it (default: env SPECSERVE_DRAFT_TOKEN; LLM(ray=True) and Serve make one per app when none is set).")
    draft_token_file: str | None = Field(None, description="Read draft_token from this file.")
    max_draft_seqs: int = Field(4096, ge=1, description="Most sequences one target connection may hold open on a draft; more are refused (decoded target-only, exact).")
    max_frame_mb: float = Field(64.0, gt=0, le=1024, description="Largest message a draft accepts from an authenticated target, in MiB (before authentication: 64 KiB).")


class ClusterConfig(_Section):
    address: str | None = Field(None, description="Ray cluster: host:port or 'auto' to join; 'local' to start a fresh one; default RAY_ADDRESS, else a fresh local one.")
    role_label: str = Field(DEFAULT_ROLE_LABEL, description="Label key that pins each side when it sets no label_selector.")
    use_role_labels: bool | Literal["auto"] = Field("auto", description="Pin sides by the role label: true, false, or auto (when some node has it).")
    placement_timeout_s: float = Field(30.0, gt=0, description="How long to wait for the sides' resources before failing.")
    runtime_env: dict[str, Any] = Field(default_factory=dict, description="Ray runtime_env for the specserve actors.")
    normal_priority: bool = Field(True, description="Run the model actors and the HTTP router at normal CPU priority instead of Ray's worker niceness (15), so Ray's own daemons do not preempt a step on a busy host and a target step on the same cores does not starve the router (needs CAP_SYS_NICE; otherwise they stay as Ray started them).")


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="HTTP host (0.0.0.0 to expose).")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port.")
    model_name: str | None = Field(None, description="Model id served in /v1/models (default: 'demo' for the shipped pair, else the target's folder name).")
    api_key: str | None = Field(None, description="Require 'Authorization: Bearer <key>' (also env SPECSERVE_API_KEY).")
    api_key_file: str | None = Field(None, description="Read the API key from this file.")
    open_metrics: bool = Field(False, description="Serve /metrics and the docs without the API key.")
    max_pending_requests: int = Field(256, ge=1, description="Requests in flight beyond this get 429 + Retry-After.")
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024, description="Largest request body; larger ones get 413.")
    request_timeout_s: float = Field(600.0, gt=0, description="Longest a generation request may take; then it is aborted (503 before output, an in-band error after).")
    router_num_cpus: float = Field(0.1, ge=0, description="Ray: CPUs reserved for each HTTP router replica.")
    router_num_replicas: int = Field(1, ge=1, description="HTTP router replicas (more than one: Serve's proxy balances them on the port).")
    ingress: Literal["direct", "proxy"] = Field("direct", description="How HTTP reaches the router when `specserve serve` starts Ray: direct (the router replica serves the port itself, Serve's direct ingress; Serve's proxy moves to port + 1) or proxy (Serve's proxy on the port, one more hop per request and chunk; also what several router replicas get). A cluster you join decides by its head's environment (see cluster/README.md).")
    direct_streams: bool = Field(True, description="Stream each request's tokens from its target replica to the router over an authenticated TCP connection instead of a Serve handle call (faster first token and per-token delivery; the handle remains the fallback).")
    stream_token: str | None = Field(None, description="Secret the router proves to target replicas on direct streams (generated per app when unset).")
    stream_spares: int = Field(2, ge=0, le=64, description="Direct-stream connections the router keeps open and authenticated ahead of need, per target replica, so a request's first bytes to the target are the request itself (0: connect per request).")
    resume_limit: int = Field(3, ge=0, le=100, description="How many times one request (each of its n choices) may be resumed on another target replica, from the output it already has, after its replica died, stalled, failed it or stopped (0: such a request fails instead). The next failure fails it with an error saying why.")
    stall_timeout_s: float = Field(8.0, gt=0, description="A target replica whose engine took no step for this long while a request on it got no output is stalled: the request is cut off there and resumed on another. Detected within about this plus 2 s (the replicas' heartbeat and the router's check). Keep it above the longest single engine step (a long prompt's prefill on specserve's own engine).")
    target_restart_wait_s: float = Field(60.0, ge=0, description="How long a request whose target replica failed waits for a replica to be up (Serve restarts a dead one) when no other is, before failing; new requests meanwhile get a fast 503 unless they set wait_for_target, which waits this long too.")


class SpecserveConfig(_Section):
    target: SideConfig = Field(default_factory=SideConfig, description="The target model: the output follows its distribution exactly.")
    draft: DraftConfig | None = Field(None, description="The draft model (null: target-only decoding).")
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig, description="Speculative decoding.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Limits of the target engine.")
    channel: ChannelConfig = Field(default_factory=ChannelConfig, description="The draft/target link.")
    cluster: ClusterConfig = Field(default_factory=ClusterConfig, description="Ray cluster and placement.")
    server: ServerConfig = Field(default_factory=ServerConfig, description="The OpenAI-compatible HTTP server.")

    @model_validator(mode="after")
    def _cross(self):
        if not self.target.model:
            raise ValueError("target.model is required (a model directory, hub id or demo:target)")
        if self.draft is not None and self.draft.drafter == "model" and not self.draft.model:
            raise ValueError("draft.model is required when draft.drafter is 'model' (or use drafter: ngram)")
        if self.draft is not None and self.draft.drafter == "ngram":
            lo, hi = self.draft.drafter_options.get("ngram_min", 1), self.draft.drafter_options.get("ngram_max", 4)
            if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
                raise ValueError(f"drafter_options ngram_min/ngram_max must satisfy 1 <= min <= max, got {lo}, {hi}")
        return self

    @property
    def speculative(self) -> bool:
        return self.draft is not None and self.speculation.num_speculative_tokens > 0

    @property
    def model_name(self) -> str:
        """The id served in /v1/models: the configured name, ``demo`` for the shipped pair, else the target's folder."""
        if self.server.model_name:
            return self.server.model_name
        from .demo_models import TARGET_PATH

        if Path(self.target.model) == TARGET_PATH:
            return "demo"
        return Path(self.target.model.rstrip("/")).name

    def with_draft_token(self) -> "SpecserveConfig":
        """This configuration with the draft channel's secret resolved (``draft_token``, its file, or
        ``$SPECSERVE_DRAFT_TOKEN``) or, when none is set, a fresh one: for deployments that start both
        sides themselves (``LLM(ray=True)``, Serve apps), so every draft port they open is authenticated."""
        from .secret import new_token, resolve_token

        if not self.speculative:
            return self
        token = resolve_token(self.channel.draft_token, self.channel.draft_token_file) or new_token()
        return self.model_copy(update={"channel": self.channel.model_copy(update={"draft_token": token, "draft_token_file": None})})

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, source: "SpecserveConfig | dict | str | Path | None" = None, **overrides) -> "SpecserveConfig":
        """From a config, a dict, or a YAML/JSON file path, then flat overrides (``draft_num_gpus=1``)."""
        if isinstance(source, SpecserveConfig):
            data = source.model_dump()
        elif isinstance(source, (str, Path)):
            data = read_config_file(source)
        else:
            data = dict(source or {})
        try:
            return cls.model_validate(apply_flat(normalize(data), overrides))
        except ValidationError as exc:
            raise ValueError(f"invalid configuration: {validation_message(exc)}") from None


def read_config_file(path: str | Path) -> dict:
    import yaml

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} does not exist")
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as exc:
        raise ValueError(f"config file {str(p)!r} is not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {str(p)!r} must hold a mapping, got {type(data).__name__}")
    return data


def normalize(data: dict) -> dict:
    """Accept shorthand: ``target: path`` and ``draft: path | ngram | none`` for the model alone."""
    data = dict(data)
    if isinstance(data.get("target"), str):
        data["target"] = {"model": data["target"]}
    draft = data.get("draft")
    if isinstance(draft, str):
        data["draft"] = None if draft.lower() in ("none", "") else ({"drafter": "ngram"} if draft == "ngram" else {"model": draft})
    return data


# -- one flat name per field: CLI flags and LLM(...) keywords ----------------------------------
_SECTION_PREFIX = {"target": "target_", "draft": "draft_", "speculation": "", "engine": "", "channel": "", "cluster": "",
                   "server": ""}
_RENAMES = {("target", "model"): "target", ("draft", "model"): "draft", ("channel", "delay_ms"): "channel_delay_ms",
            ("channel", "tensors"): "channel_tensors", ("cluster", "address"): "address",
            ("cluster", "runtime_env"): "runtime_env"}
# Shortcuts that set a field on both sides (the draft's only when it does not set its own).
SHARED_SIDE_FIELDS = ("dtype", "device", "trust_remote_code")


def _section_models() -> dict[str, type[BaseModel]]:
    return {"target": SideConfig, "draft": DraftConfig, "speculation": SpeculationConfig, "engine": EngineConfig,
            "channel": ChannelConfig, "cluster": ClusterConfig, "server": ServerConfig}


def flat_fields() -> dict[str, tuple[str, str, Any]]:
    """{flat name: (section, field, FieldInfo)} for every field of every section."""
    out = {}
    for section, model in _section_models().items():
        for name, info in model.model_fields.items():
            flat = _RENAMES.get((section, name), _SECTION_PREFIX[section] + name)
            assert flat not in out, f"two config fields map to --{flat}"
            out[flat] = (section, name, info)
    return out


def apply_flat(data: dict, overrides: dict) -> dict:
    """Apply flat overrides (``draft_num_gpus=1``, ``dtype='float64'``) onto nested config data."""
    fields = flat_fields()
    shared = {k: overrides[k] for k in SHARED_SIDE_FIELDS if k in overrides}
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for key, value in overrides.items():
        if key in shared:
            continue
        if key not in fields:
            raise TypeError(f"unknown configuration field {key!r}; see `specserve serve --help` for the names")
        section, name, _ = fields[key]
        if section == "draft" and name == "model":
            draft = normalize({"draft": value})["draft"] if isinstance(value, str) or value is None else value
            data["draft"] = None if draft is None else {**(data.get("draft") or {}), **draft}
            continue
        if section == "target" and name == "model":
            data["target"] = {**(data.get("target") or {}), "model": value}
            continue
        if section == "draft" and data.get("draft") is None:
            data["draft"] = {}
        data[section] = {**(data.get(section) or {}), name: value}
    for name, value in shared.items():
        data["target"] = {**(data.get("target") or {}), name: value}
        if data.get("draft") is not None and f"draft_{name}" not in overrides:
            data["draft"] = {**data["draft"], name: value}
    return data


def validation_message(exc: ValidationError) -> str:
    """A pydantic error as one line per problem, naming the field by its flat name."""
    fields = {(s, n): flat for flat, (s, n, _) in flat_fields().items()}
    lines = []
    for err in exc.errors():
        loc = tuple(str(x) for x in err["loc"])
        where = fields.get(loc[:2], ".".join(loc)) if loc else "config"
        lines.append(f"{where}: {err['msg'].removeprefix('Value error, ')}")
    return "; ".join(lines)
