"""Engine configuration: one ``SideConfig`` per model (target, draft) and an ``EngineConfig``.

Frozen dataclasses validated in ``__post_init__``; plain dicts in and out so the same
config crosses to Ray actors and comes from YAML/HTTP boundaries. Each side has its own
backend, dtype, device, parallelism and placement, independent of the other side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

NGRAM = "ngram"
DEFAULT_ROLE_LABEL = "specserve.io/role"
DEMO_ALIASES = ("demo:target", "demo:draft")  # the pair shipped in specserve/demo_models


def resolve_model(model: str) -> str:
    """Map ``demo:target`` / ``demo:draft`` to the shipped demo pair; other names pass through."""
    if model in DEMO_ALIASES:
        from .demo_models import DRAFT_PATH, TARGET_PATH

        path = TARGET_PATH if model == "demo:target" else DRAFT_PATH
        if not (path / "config.json").exists():
            raise ValueError(f"{model!r}: the demo model pair is missing from this install ({path})")
        return str(path)
    return model


@dataclass(frozen=True)
class SideConfig:
    model: str  # directory or hub id (draft: also "ngram")
    backend: str = "hf"
    dtype: str = "float32"
    device: str = "cpu"
    device_map: str | dict | None = None  # e.g. "auto": one side spread over its GPUs
    tensor_parallel_size: int = 1  # for backends that shard (vllm); hf uses device_map
    trust_remote_code: bool = False
    # Placement (Ray only): resources of this side's bundle and where it may land.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    label_selector: dict[str, str] = field(default_factory=dict)
    resources: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty string, got {self.model!r}")
        object.__setattr__(self, "model", resolve_model(self.model))
        from .backends.hf import DTYPES

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.num_cpus < 0 or self.num_gpus < 0:
            raise ValueError(f"num_cpus and num_gpus must be >= 0, got {self.num_cpus}, {self.num_gpus}")
        if self.num_gpus and self.num_gpus < self.tensor_parallel_size and self.num_gpus >= 1:
            raise ValueError(
                f"num_gpus={self.num_gpus} is fewer than tensor_parallel_size={self.tensor_parallel_size}"
            )

    @property
    def is_ngram(self) -> bool:
        return self.model == NGRAM

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class EngineConfig:
    target: SideConfig
    draft: SideConfig | None = None
    num_speculative_tokens: int = 4
    max_num_seqs: int = 256
    max_model_len: int | None = None
    draft_probs: bool = True  # sampled requests: send draft probabilities (else greedy point-mass drafts)
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if isinstance(self.target, dict):
            object.__setattr__(self, "target", SideConfig(**self.target))
        if isinstance(self.draft, dict):
            object.__setattr__(self, "draft", SideConfig(**self.draft))
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 32:
            raise ValueError(f"num_speculative_tokens must be an integer in [0, 32], got {k!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.target.is_ngram:
            raise ValueError("target must be a model, not 'ngram'")

    @property
    def speculative(self) -> bool:
        return self.draft is not None and self.num_speculative_tokens > 0

    def to_dict(self) -> dict:
        d = asdict(self)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "EngineConfig":
        return cls(**d)
