"""Latency model of the simulator backend: seconds per forward from a model and a device profile.

Data flow: ``load_profile("qwen3-32b-dgx-spark")`` reads the model (``sim_profiles/models.yaml``)
and the device (``hardware.yaml``) -> ``LatencyModel.forward_s(num_new, context)`` = fixed
overhead + max(bytes moved / bandwidth, flops / throughput), where bytes = the weights once
plus every sequence's KV cache and flops = 2 x params x new tokens plus attention.
``load_link("10gbe")`` -> ``Link.one_way_s(num_bytes)``. Pure Python and PyYAML; knows
nothing of torch, tokens or specserve's engine.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "sim_profiles"


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_params: float
    bytes_per_param: float
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    kv_bytes_per_value: float | None = None  # default: bytes_per_param
    hf_id: str = ""

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        per_value = self.kv_bytes_per_value if self.kv_bytes_per_value is not None else self.bytes_per_param
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * per_value


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bandwidth_gb_s: float
    peak_tflops: float
    bandwidth_efficiency: float = 1.0
    compute_efficiency: float = 1.0
    forward_overhead_ms: float = 0.0
    description: str = ""


@dataclass(frozen=True)
class LatencyModel:
    """A model on a device: how long one batched forward takes."""

    name: str
    model: ModelSpec
    hardware: Hardware

    def forward_s(
        self,
        num_new: list[int],  # [batch_size] new tokens per sequence
        context: list[int],  # [batch_size] tokens each sequence attends to (cached + new)
    ) -> float:
        m, h = self.model, self.hardware
        num_bytes = m.weight_bytes + m.kv_bytes_per_token * sum(context)
        attention = 4 * m.num_layers * m.num_heads * m.head_dim * sum(n * c for n, c in zip(num_new, context))
        flops = 2 * m.num_params * sum(num_new) + attention
        memory_s = num_bytes / (h.memory_bandwidth_gb_s * 1e9 * h.bandwidth_efficiency)
        compute_s = flops / (h.peak_tflops * 1e12 * h.compute_efficiency)
        return h.forward_overhead_ms * 1e-3 + max(memory_s, compute_s)

    def decode_step_s(self, batch_size: int = 1, context: int = 128) -> float:
        """One token for each of ``batch_size`` sequences of ``context`` tokens."""
        return self.forward_s([1] * batch_size, [context] * batch_size)


@dataclass(frozen=True)
class Link:
    name: str
    one_way_latency_ms: float
    bandwidth_gbit_s: float
    description: str = ""

    def one_way_s(self, num_bytes: float = 0.0) -> float:
        return self.one_way_latency_ms * 1e-3 + 8 * num_bytes / (self.bandwidth_gbit_s * 1e9)


@functools.lru_cache(maxsize=None)
def _read(file: str) -> dict:
    import yaml

    return yaml.safe_load((PROFILE_DIR / file).read_text())


_TEXT_FIELDS = {"name", "description", "hf_id"}


def _number(value) -> float | int:
    x = float(value)
    if x <= 0:
        raise ValueError(f"must be positive, got {value!r}")
    return int(x) if x.is_integer() else x


def _build(cls, name: str, data: dict):
    fields = set(cls.__dataclass_fields__)
    unknown = set(data) - fields
    if unknown:
        raise ValueError(f"sim profile {name!r}: unknown field(s) {sorted(unknown)}; expected {sorted(fields)}")
    try:  # numbers may come as strings (YAML 1.1 reads 32.8e9 as one)
        values = {k: v if k in _TEXT_FIELDS or v is None else _number(v) for k, v in data.items() if k != "name"}
        return cls(name=name, **values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sim profile {name!r}: {exc}") from None


def profile_names() -> list[str]:
    """Every '<model>-<hardware>' combination of the shipped files."""
    return [f"{m}-{h}" for m in _read("models.yaml") for h in _read("hardware.yaml")]


def link_names() -> list[str]:
    return list(_read("links.yaml"))


def load_profile(profile: str | dict) -> LatencyModel:
    """A shipped '<model>-<hardware>' name, a YAML file path, or a dict ``{model: {...}, hardware: {...}}``."""
    if isinstance(profile, dict):
        data, name = profile, profile.get("name", "custom")
    elif profile.endswith((".yaml", ".yml")):
        import yaml

        path = Path(profile).expanduser()
        if not path.is_file():
            raise ValueError(f"sim profile file {profile!r} does not exist")
        data, name = yaml.safe_load(path.read_text()), path.stem
    else:
        models, devices = _read("models.yaml"), _read("hardware.yaml")
        for hw in devices:
            model = profile.removesuffix(f"-{hw}")
            if profile.endswith(f"-{hw}") and model in models:
                return LatencyModel(profile, _build(ModelSpec, model, models[model]), _build(Hardware, hw, devices[hw]))
        raise ValueError(f"unknown sim profile {profile!r}; shipped: {', '.join(profile_names())} "
                         "(or a .yaml path, or a dict with 'model' and 'hardware')")
    if not isinstance(data, dict) or not isinstance(data.get("model"), dict) or not isinstance(data.get("hardware"), dict):
        raise ValueError(f"sim profile {name!r} must hold a 'model' mapping and a 'hardware' mapping")
    return LatencyModel(name, _build(ModelSpec, name, data["model"]), _build(Hardware, name, data["hardware"]))


def load_link(link: str | dict) -> Link:
    if isinstance(link, dict):
        return _build(Link, link.get("name", "custom"), link)
    links = _read("links.yaml")
    if link not in links:
        raise ValueError(f"unknown link profile {link!r}; shipped: {', '.join(links)}")
    return _build(Link, link, links[link])
