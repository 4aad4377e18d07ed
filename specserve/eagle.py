"""EAGLE-1, EAGLE-3 and DeepSeek-V3 / Qwen3-Next MTP draft heads: recognised from a checkpoint's config.json, built from transformers' parts.

A head drafts from the target's own hidden states: at position t it reads the target's
row for t and the embedding of token t + 1 and predicts token t + 2; its next step reads
its own output row in place of the target's. ``head_spec`` reads vLLM's native layouts
(``LlamaForCausalLMEagle3`` / ``Eagle3LlamaForCausalLM``: ``midlayer``, ``fc`` over the
target's aux layers, its own norm and LM head over a reduced vocabulary with ``d2t``;
``EagleLlamaForCausalLM``: ``fc`` over cat(embedding, hidden), one decoder layer) and the
``speculators`` format (``speculators_model_type: eagle3``). Weights the head shares with
its target (embedding, LM head) are read from the target's safetensors by name, those
tensors only. A DeepSeek-V3 checkpoint whose config has ``num_nextn_predict_layers`` holds
its own head: its multi-token-prediction layer, stored as layer N (vLLM's DeepSeekMTP;
``MtpHead``), read by name from the checkpoint without the rest; so does a Qwen3-Next checkpoint
holding ``mtp.*`` tensors (vLLM's Qwen3NextMTP; ``Qwen3NextMtpHead``). Knows nothing of drafting
or the wire.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

EAGLE3_ARCHS = {"LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"}
EAGLE_ARCHS = {"EagleLlamaForCausalLM", "LlamaForCausalLMEagle"}
FINAL = -1  # a head that reads the target's final (normed) hidden state (EAGLE-1)


MTP_MODEL_TYPES = {"deepseek_v3", "qwen3_next"}  # checkpoints whose multi-token-prediction layer drafts
QWEN3_NEXT_MTP_PREFIX = "mtp."  # where a Qwen3-Next checkpoint keeps it


@dataclass(frozen=True)
class HeadSpec:
    kind: str  # "eagle3", "eagle" or "mtp"
    config: dict  # the Llama layer's config (hidden_size, heads, rope, ...)
    vocab_size: int  # the target's vocabulary (ids the head emits)
    draft_vocab_size: int  # the head's LM head width (EAGLE-3 may reduce it; d2t maps back)
    target_hidden_size: int
    layer_ids: tuple[int, ...] | None  # the target's aux layers (EAGLE-3; None: vLLM's default for the target's depth)
    norm_before_residual: bool
    verifier: str | None  # the target the head was trained for (speculators format), if it says


def _read_config(path: str) -> dict | None:
    file = os.path.join(os.path.expanduser(path), "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        return json.load(f)


def head_spec(path: str) -> HeadSpec | None:
    """The head a checkpoint directory holds, or None when it is not an EAGLE head (a plain LM)."""
    cfg = _read_config(path)
    if cfg is None:
        return None
    archs = set(cfg.get("architectures") or [])
    if cfg.get("model_type") in MTP_MODEL_TYPES and _has_mtp_layer(path, cfg):
        vocab = int(cfg["vocab_size"])
        return HeadSpec("mtp", cfg, vocab, vocab, int(cfg["hidden_size"]), None, False, None)
    if cfg.get("speculators_model_type") == "eagle3":
        layer = dict(cfg.get("transformer_layer_config") or {})
        verifier = (cfg.get("speculators_config") or {}).get("verifier") or {}
        kind, norm_before_residual, name = "eagle3", bool(cfg.get("norm_before_residual", True)), verifier.get("name_or_path")
        extra = cfg
    elif cfg.get("speculators_model_type"):
        raise ValueError(f"draft {path!r}: speculators_model_type {cfg['speculators_model_type']!r} is not supported "
                         "(supported: eagle3)")
    elif archs & EAGLE3_ARCHS:
        layer, kind, norm_before_residual, name, extra = cfg, "eagle3", bool(cfg.get("norm_before_residual", False)), None, cfg
    elif archs & EAGLE_ARCHS:
        layer, kind, norm_before_residual, name, extra = cfg, "eagle", False, None, cfg
    else:
        return None
    for unsupported in ("norm_before_fc", "fc_norm"):
        if extra.get(unsupported) or (extra.get("eagle_config") or {}).get(unsupported):
            raise ValueError(f"draft {path!r}: {unsupported}=true EAGLE-3 heads are not supported yet")
    layer_ids = extra.get("eagle_aux_hidden_state_layer_ids") or (extra.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vocab = int(layer.get("vocab_size") or extra.get("vocab_size") or 0)
    hidden = int(layer["hidden_size"])
    return HeadSpec(kind, layer, vocab, int(extra.get("draft_vocab_size") or vocab),
                    int(extra.get("target_hidden_size") or hidden), tuple(int(i) for i in layer_ids) if layer_ids else None,
                    norm_before_residual, name)


def _has_mtp_layer(path: str, cfg: dict) -> bool:
    """DeepSeek-V3 says so in its config (``num_nextn_predict_layers``); a Qwen3-Next checkpoint holds
    ``mtp.*`` tensors (its config need not say: vLLM assumes one layer), found from the safetensors
    index or the files' headers, no tensor read."""
    if cfg.get("model_type") == "deepseek_v3":
        return int(cfg.get("num_nextn_predict_layers") or 0) >= 1
    root = os.path.expanduser(path)
    index = os.path.join(root, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return any(k.startswith(QWEN3_NEXT_MTP_PREFIX) for k in json.load(f).get("weight_map", {}))
    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(root, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            if any(k.startswith(QWEN3_NEXT_MTP_PREFIX) for k in f.keys()):
                return True
    return False


def target_layers(spec: HeadSpec, num_target_layers: int) -> tuple[int, ...]:
    """The target rows the head reads: EAGLE-3's aux layers (vLLM's default (2, N//2, N-3) unless
    the head names them), or the final hidden state (EAGLE-1, MTP)."""
    if spec.kind in ("eagle", "mtp"):
        return (FINAL,)
    if spec.layer_ids is not None:
        return spec.layer_ids
    return (2, num_target_layers // 2, num_target_layers - 3)


def target_info(config) -> dict:
    """What ``check_target`` reads, from the target's transformers config (as its hello says it)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    return {"hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers, "vocab_size": getattr(c, "vocab_size", None)}


def check_target(spec: HeadSpec, target: dict) -> None:
    """``ValueError`` naming the field when the head cannot read this target (``target``: the target's
    hello: hidden_size, num_hidden_layers, vocab_size)."""
    hidden, depth, vocab = target.get("hidden_size"), target.get("num_hidden_layers"), target.get("vocab_size")
    if hidden is None or depth is None:
        raise ValueError("the target does not expose hidden states (an EAGLE head needs specserve's own target engine, or its "
                         "vLLM target engine started with the head as its draft)")
    if spec.target_hidden_size != hidden:
        raise ValueError(f"target_hidden_size: the head reads {spec.target_hidden_size}-wide hidden states, the target's "
                         f"hidden_size is {hidden}")
    layers = target_layers(spec, depth)
    if spec.kind == "eagle3" and (len(set(layers)) != len(layers) or not all(0 <= i < depth for i in layers)):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids: {list(layers)} must be distinct layers of the target's "
                         f"{depth} (0..{depth - 1}); set it in the head's config.json")
    if vocab is not None and spec.vocab_size != vocab:
        raise ValueError(f"vocab_size: the head emits ids of a {spec.vocab_size}-token vocabulary, the target's has {vocab}")


# -- modules -----------------------------------------------------------------------------------
def _llama_config(spec: HeadSpec):
    from transformers import LlamaConfig

    keys = {k: v for k, v in spec.config.items() if k not in ("architectures", "auto_map", "model_type")}
    keys["num_hidden_layers"] = 1
    keys["vocab_size"] = spec.vocab_size
    cfg = LlamaConfig(**keys)
    cfg._attn_implementation = "sdpa"
    return cfg


class _Head(nn.Module):
    """Shared by both kinds: ``forward`` takes H-wide rows (``combine`` the target's first) and
    returns logits over the target's vocabulary and the rows the next step reads."""

    fc_digest: str | None = None  # EAGLE-3: its fc as stored, hashed (``_digest``; set by ``load_head``)

    def __init__(self, spec: HeadSpec):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.spec = spec
        self.config = _llama_config(spec)
        h = self.config.hidden_size
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.rotary = LlamaRotaryEmbedding(self.config)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))

    def combine(self, rows: torch.Tensor) -> torch.Tensor:  # [n, width of the target rows] -> [n, H]
        return rows

    def _logits(self, out: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(out)
        if self.spec.draft_vocab_size == self.spec.vocab_size:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.spec.vocab_size), float("-inf"))
        full[..., torch.arange(self.spec.draft_vocab_size, device=logits.device) + self.d2t] = logits
        return full


class Eagle3Head(_Head):
    def __init__(self, spec: HeadSpec, num_aux: int):
        super().__init__(spec)
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm

        c, h = self.config, self.config.hidden_size
        self.fc = nn.Linear(spec.target_hidden_size * num_aux, h, bias=False)
        attn = LlamaAttention(c, layer_idx=0)
        for name in ("q_proj", "k_proj", "v_proj"):  # the layer reads cat(embedding, hidden): 2H wide
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=old.bias is not None))
        self.self_attn = attn
        self.mlp = LlamaMLP(c)
        self.input_layernorm = LlamaRMSNorm(h, eps=c.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=c.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=c.rms_norm_eps)
        self.norm = LlamaRMSNorm(h, eps=c.rms_norm_eps)

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        return self.fc(rows)

    def forward(self, input_ids, position_ids, attention_mask, past_key_values, hidden_states, logits_to_keep=1, **_):
        embeds = self.input_layernorm(self.embed_tokens(input_ids))
        if self.spec.norm_before_residual:
            hidden = residual = self.hidden_norm(hidden_states)
        else:
            residual, hidden = hidden_states, self.hidden_norm(hidden_states)
        position_embeddings = self.rotary(embeds, position_ids)
        attn = self.self_attn(torch.cat([embeds, hidden], dim=-1), position_embeddings, attention_mask, past_key_values)[0]
        residual = attn + residual
        prenorm = self.mlp(self.post_attention_layernorm(residual)) + residual
        out = self.norm(prenorm[:, -logits_to_keep:])
        return SimpleNamespace(logits=self._logits(out), hidden=prenorm[:, -logits_to_keep:])


class EagleHead(_Head):
    def __init__(self, spec: HeadSpec):
        super().__init__(spec)
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        h = self.config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = LlamaDecoderLayer(self.config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE-1's first layer has none

    def forward(self, input_ids, position_ids, attention_mask, past_key_values, hidden_states, logits_to_keep=1, **_):
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden_states], dim=-1))
        position_embeddings = self.rotary(x, position_ids)
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                         position_embeddings=position_embeddings)
        out = out[0] if isinstance(out, tuple) else out
        out = out[:, -logits_to_keep:]
        return SimpleNamespace(logits=self._logits(out), hidden=out)


def _hf_config(spec: HeadSpec, config_class, **override):
    """An MTP checkpoint's config as transformers' ``config_class`` (sdpa attention), with ``override``."""
    keys = {k: v for k, v in spec.config.items() if k not in ("architectures", "auto_map", "model_type", "transformers_version")}
    config = config_class(**{**keys, **override})
    config._attn_implementation = "sdpa"
    return config


class MtpHead(_Head):
    """DeepSeek-V3's multi-token-prediction layer, as vLLM's DeepSeekMTP runs it: eh_proj over
    cat(enorm(embedding), hnorm(the target's final hidden state)) (the embedding zeroed at
    position 0), one DeepSeek-V3 decoder layer (MLA attention and the MoE block, as layer N is in
    the checkpoint), then shared_head: its norm and LM head. The rows the next step reads are
    the layer's output before that norm."""

    def __init__(self, spec: HeadSpec):
        nn.Module.__init__(self)
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (DeepseekV3DecoderLayer, DeepseekV3RMSNorm,
                                                                          DeepseekV3RotaryEmbedding)

        self.spec = spec
        self.config = c = _hf_config(spec, DeepseekV3Config)
        h, eps = c.hidden_size, c.rms_norm_eps
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.enorm, self.hnorm = DeepseekV3RMSNorm(h, eps=eps), DeepseekV3RMSNorm(h, eps=eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DeepseekV3DecoderLayer(c, layer_idx=c.num_hidden_layers)
        self.layer.self_attn.layer_idx = 0  # (the head's own cache holds this one layer)
        self.rotary = DeepseekV3RotaryEmbedding(c)
        self.norm = DeepseekV3RMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, spec.vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.vocab_size, dtype=torch.long))  # (the identity: unused)

    def forward(self, input_ids, position_ids, attention_mask, past_key_values, hidden_states, logits_to_keep=1, **_):
        embeds = self.embed_tokens(input_ids).masked_fill((position_ids == 0)[..., None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden_states)], dim=-1))
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                         position_embeddings=self.rotary(x, position_ids))
        out = (out[0] if isinstance(out, tuple) else out)[:, -logits_to_keep:]
        return SimpleNamespace(logits=self._logits(self.norm(out)), hidden=out)


class Qwen3NextMtpHead(_Head):
    """Qwen3-Next's multi-token-prediction layer (``mtp.*``), as vLLM's Qwen3NextMTP runs it: fc over
    cat(pre_fc_norm_embedding(embedding), pre_fc_norm_hidden(the target's final hidden state)), one
    full-attention Qwen3-Next decoder layer (gated attention, the MoE block with its shared expert),
    then its norm and the target's LM head. Unlike DeepSeek-V3's layer, the rows the next step reads
    are the normed output (what vLLM's MTP returns), and position 0's embedding is not zeroed."""

    def __init__(self, spec: HeadSpec):
        nn.Module.__init__(self)
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextDecoderLayer, Qwen3NextRMSNorm,
                                                                        Qwen3NextRotaryEmbedding)

        self.spec = spec
        self.config = c = _hf_config(spec, Qwen3NextConfig)
        h, eps = c.hidden_size, c.rms_norm_eps
        # vLLM builds it as layer 0 of its own stack (which decides dense or MoE), with full attention.
        layer_config = _hf_config(spec, Qwen3NextConfig, layer_types=["full_attention"] * c.num_hidden_layers)
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        self.pre_fc_norm_embedding, self.pre_fc_norm_hidden = Qwen3NextRMSNorm(h, eps=eps), Qwen3NextRMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = Qwen3NextDecoderLayer(layer_config, layer_idx=0)
        self.rotary = Qwen3NextRotaryEmbedding(c)
        self.norm = Qwen3NextRMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, spec.vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.vocab_size, dtype=torch.long))  # (the identity: unused)

    def forward(self, input_ids, position_ids, attention_mask, past_key_values, hidden_states, logits_to_keep=1, **_):
        embeds = self.pre_fc_norm_embedding(self.embed_tokens(input_ids))
        x = self.fc(torch.cat([embeds, self.pre_fc_norm_hidden(hidden_states)], dim=-1))
        out = self.layer(x, attention_mask=attention_mask, position_ids=position_ids, past_key_values=past_key_values,
                         position_embeddings=self.rotary(x, position_ids))
        out = self.norm((out[0] if isinstance(out, tuple) else out)[:, -logits_to_keep:])
        return SimpleNamespace(logits=self._logits(out), hidden=out)


def _mtp_weights(path: str, num_layers: int, model_type: str = "deepseek_v3") -> dict[str, torch.Tensor]:
    """The MTP layer's tensors, by name: the rest of the checkpoint is never read. DeepSeek-V3 stores
    it as layer N (``model.layers.<N>.*``, its norm and LM head under ``shared_head``), Qwen3-Next
    under ``mtp.`` (``mtp.layers.0.*``, ``mtp.fc``, ``mtp.norm``, ``mtp.pre_fc_norm_*``)."""
    from safetensors import safe_open

    if model_type == "qwen3_next":
        prefix, rename = QWEN3_NEXT_MTP_PREFIX, {"layers.0.": "layer."}
        stored = prefix + "layers.0."  # (where the layer's own tensors are)
    else:
        prefix, rename = f"model.layers.{num_layers}.", {"shared_head.norm.": "norm.", "shared_head.head.": "lm_head."}
        stored = prefix
    out: dict[str, torch.Tensor] = {}
    for file in _safetensors(path):
        with safe_open(file, framework="pt") as f:
            for key in f.keys():
                if not key.startswith(prefix):
                    continue
                name = key[len(prefix):]
                for old, new in rename.items():
                    if name.startswith(old):
                        name = new + name[len(old):]
                if name.split(".")[0] in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
                    name = "layer." + name
                out[name] = f.get_tensor(key)
    # Released checkpoints keep one tensor per expert; transformers' block holds them stacked.
    per_expert = sorted({int(k.split(".")[3]) for k in out if k.startswith("layer.mlp.experts.") and k.split(".")[3].isdigit()})
    if per_expert:
        def e(i: int, name: str) -> torch.Tensor:
            if f"layer.mlp.experts.{i}.{name}.weight" not in out:
                raise ValueError(f"draft {path!r}: the MTP layer lacks {stored}mlp.experts.{i}.{name}.weight")
            return out.pop(f"layer.mlp.experts.{i}.{name}.weight")

        experts = [(e(i, "gate_proj"), e(i, "up_proj"), e(i, "down_proj")) for i in per_expert]
        out["layer.mlp.experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in experts])
        out["layer.mlp.experts.down_proj"] = torch.stack([d for _, _, d in experts])
    return out


# -- loading -----------------------------------------------------------------------------------
def _local_name(name: str, kind: str) -> str:
    """A checkpoint's tensor name (vLLM native or speculators) as this module names it."""
    for prefix in ("model.", "midlayer.", "layers.0."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    name = name.replace("draft_id_to_target_id", "d2t")
    if kind == "eagle" and name.split(".")[0] in ("self_attn", "mlp", "post_attention_layernorm", "input_layernorm"):
        name = "layer." + name
    return name


def _safetensors(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(os.path.expanduser(path), "*.safetensors")))
    if not files:
        raise ValueError(f"{path!r} holds no .safetensors weights")
    return files


def _shared_from_target(target: str, names: dict[str, tuple[str, ...]]) -> dict[str, torch.Tensor]:
    """The tensors a head shares with its target, read by name from the target's safetensors only."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in _safetensors(target):
        with safe_open(file, framework="pt") as f:
            keys = set(f.keys())
            for local, candidates in names.items():
                for key in candidates:
                    if local not in found and key in keys:
                        found[local] = f.get_tensor(key)
    return found


def _digest(weight: torch.Tensor) -> str:
    """What both sides compare to know they apply the same fc: a hash of the tensor as the checkpoint stores it."""
    import hashlib

    return hashlib.sha256(weight.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def head_fc(path: str) -> tuple[torch.Tensor, str] | None:
    """An EAGLE-3 head's fc weight as its checkpoint stores it, and its digest (None: a head without one),
    read by name: the target reads this much of the head and nothing else."""
    spec = head_spec(path)
    if spec is None or spec.kind != "eagle3":
        return None
    found = _shared_from_target(path, {"fc.weight": ("fc.weight", "model.fc.weight")})
    if "fc.weight" not in found:
        raise ValueError(f"draft {path!r}: the head's checkpoint holds no fc.weight")
    return found["fc.weight"], _digest(found["fc.weight"])


def fc_runs_on_target(mode: str, target_device: str) -> bool:
    """``speculation.head_fc``: whether an EAGLE-3 head's fc runs on a target computing on ``target_device``."""
    return mode == "target" or (mode == "auto" and str(target_device).startswith("cuda"))


def target_fc(cfg, target_device: str) -> tuple[torch.Tensor, str] | None:
    """The head's fc (weight, digest) when the target applies it before its rows travel, else None."""
    d = cfg.draft
    if d is None or not d.model or d.backend != "hf" or not fc_runs_on_target(cfg.speculation.head_fc, target_device):
        return None
    return head_fc(d.model)


def load_head(path: str, target: str, num_target_layers: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> _Head:
    """The head in ``path``; embedding (and EAGLE-1's LM head) from ``target`` when the head has none."""
    from safetensors.torch import load_file

    spec = head_spec(path)
    if spec is None:
        raise ValueError(f"draft {path!r} is not a draft head (config.json names no EAGLE architecture nor an MTP layer)")
    layers = target_layers(spec, num_target_layers)
    weights: dict[str, torch.Tensor] = {}
    if spec.kind == "mtp":  # the layer lives in the target's own checkpoint
        model_type = spec.config.get("model_type")
        head = Qwen3NextMtpHead(spec) if model_type == "qwen3_next" else MtpHead(spec)
        weights = _mtp_weights(path, head.config.num_hidden_layers, model_type)
    else:
        head = Eagle3Head(spec, len(layers)) if spec.kind == "eagle3" else EagleHead(spec)
        for file in _safetensors(path):
            for name, t in load_file(file).items():
                if name != "t2d":
                    weights[_local_name(name, spec.kind)] = t
        if "fc.weight" in weights and spec.kind == "eagle3":  # as stored: a target applying this fc sends the same digest
            head.fc_digest = _digest(weights["fc.weight"])
    wanted = {"embed_tokens.weight": ("model.embed_tokens.weight", "embed_tokens.weight")}
    if spec.kind in ("eagle", "mtp"):  # EAGLE-1 decodes with the target's LM head (tied: its embedding); MTP may share it
        wanted["lm_head.weight"] = ("lm_head.weight", "model.embed_tokens.weight")
    missing = {k: v for k, v in wanted.items() if k not in weights}
    if missing:
        weights.update(_shared_from_target(target, missing))
    own = dict(head.named_parameters()) | dict(head.named_buffers())
    own = {k: v for k, v in own.items() if not k.startswith("rotary.")}
    if spec.draft_vocab_size == spec.vocab_size:
        own.pop("d2t")  # the identity map (and unused)
    absent = sorted(set(own) - set(weights))
    if absent:
        raise ValueError(f"draft {path!r}: weights missing for {absent[:6]} (not in the head nor in the target {target!r})")
    for name, t in weights.items():
        if name not in own:
            continue  # e.g. a rotary cache or t2d
        if tuple(t.shape) != tuple(own[name].shape):
            raise ValueError(f"draft {path!r}: {name} has shape {tuple(t.shape)}, the config implies {tuple(own[name].shape)}")
        with torch.no_grad():
            own[name].copy_(t)
    head.to(device=device, dtype=dtype)  # (floating tensors only: d2t stays int64)
    return head.eval().requires_grad_(False)  # inference only: no autograd graph behind the rows it combines
