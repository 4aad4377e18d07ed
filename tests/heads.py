"""Random-weight EAGLE-1 / EAGLE-3 heads for a saved target, written in vLLM's native layout or the speculators format."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def _layer_config(target_config: dict, intermediate: int | None = None) -> dict:
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
            "rope_theta", "max_position_embeddings", "vocab_size", "hidden_act")
    cfg = {k: target_config[k] for k in keys if k in target_config}
    cfg["intermediate_size"] = intermediate or 2 * target_config["hidden_size"]
    cfg["num_hidden_layers"] = 1
    cfg["model_type"] = "llama"
    return cfg


def make_eagle3_head(path, target: str, layer_ids=None, draft_vocab_size: int | None = None, fmt: str = "vllm",
                     seed: int = 0, scale: float = 0.3, with_embedding: bool = False, **overrides) -> str:
    """An EAGLE-3 head for ``target`` (a saved transformers model directory)."""
    torch.manual_seed(seed)
    tc = json.loads((Path(target) / "config.json").read_text())
    layer = _layer_config(tc)
    h, vocab = tc["hidden_size"], tc["vocab_size"]
    dv = draft_vocab_size or vocab
    heads, kv = tc["num_attention_heads"], tc.get("num_key_value_heads", tc["num_attention_heads"])
    hd = tc.get("head_dim") or h // heads
    inter = layer["intermediate_size"]
    n_aux = len(layer_ids) if layer_ids else 3
    prefix = "midlayer." if fmt == "vllm" else "layers.0."
    w = {
        "fc.weight": torch.randn(h, n_aux * h) * scale / (n_aux * h) ** 0.5,
        prefix + "self_attn.q_proj.weight": torch.randn(heads * hd, 2 * h) * scale / h ** 0.5,
        prefix + "self_attn.k_proj.weight": torch.randn(kv * hd, 2 * h) * scale / h ** 0.5,
        prefix + "self_attn.v_proj.weight": torch.randn(kv * hd, 2 * h) * scale / h ** 0.5,
        prefix + "self_attn.o_proj.weight": torch.randn(h, heads * hd) * scale / h ** 0.5,
        prefix + "mlp.gate_proj.weight": torch.randn(inter, h) * scale / h ** 0.5,
        prefix + "mlp.up_proj.weight": torch.randn(inter, h) * scale / h ** 0.5,
        prefix + "mlp.down_proj.weight": torch.randn(h, inter) * scale / inter ** 0.5,
        prefix + "input_layernorm.weight": torch.ones(h),
        prefix + "hidden_norm.weight": torch.ones(h),
        prefix + "post_attention_layernorm.weight": torch.ones(h),
        "norm.weight": torch.ones(h),
        "lm_head.weight": torch.randn(dv, h) * 3.0 / h ** 0.5,
    }
    if dv != vocab:  # a reduced draft vocabulary: every other id, mapped back by offset
        ids = torch.arange(0, 2 * dv, 2)[:dv] % vocab
        w["d2t"] = ids - torch.arange(dv)
        w["t2d"] = torch.zeros(vocab, dtype=torch.bool)
        w["t2d"][ids] = True
    if with_embedding:
        w["embed_tokens.weight"] = torch.randn(vocab, h) * 0.1
    if fmt == "vllm":
        cfg = {**layer, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": dv, "target_hidden_size": h}
        if layer_ids:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    else:
        cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"], "transformer_layer_config": layer,
               "draft_vocab_size": dv, "target_hidden_size": h, "norm_before_residual": True,
               "speculators_config": {"algorithm": "eagle3", "verifier": {"name_or_path": str(target)}}}
        if layer_ids:
            cfg["eagle_aux_hidden_state_layer_ids"] = list(layer_ids)
    cfg.update(overrides)
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in w.items()}, str(Path(path) / "model.safetensors"))
    return str(path)


def make_eagle_head(path, target: str, seed: int = 0, scale: float = 0.3) -> str:
    """An EAGLE-1 head (vLLM's ``EagleLlamaForCausalLM``): embedding and LM head come from the target."""
    torch.manual_seed(seed)
    tc = json.loads((Path(target) / "config.json").read_text())
    layer = _layer_config(tc)
    h = tc["hidden_size"]
    heads, kv = tc["num_attention_heads"], tc.get("num_key_value_heads", tc["num_attention_heads"])
    hd = tc.get("head_dim") or h // heads
    inter = layer["intermediate_size"]
    w = {
        "fc.weight": torch.randn(h, 2 * h) * scale / (2 * h) ** 0.5,
        "layers.0.self_attn.q_proj.weight": torch.randn(heads * hd, h) * scale / h ** 0.5,
        "layers.0.self_attn.k_proj.weight": torch.randn(kv * hd, h) * scale / h ** 0.5,
        "layers.0.self_attn.v_proj.weight": torch.randn(kv * hd, h) * scale / h ** 0.5,
        "layers.0.self_attn.o_proj.weight": torch.randn(h, heads * hd) * scale / h ** 0.5,
        "layers.0.mlp.gate_proj.weight": torch.randn(inter, h) * scale / h ** 0.5,
        "layers.0.mlp.up_proj.weight": torch.randn(inter, h) * scale / h ** 0.5,
        "layers.0.mlp.down_proj.weight": torch.randn(h, inter) * scale / inter ** 0.5,
        "layers.0.post_attention_layernorm.weight": torch.ones(h),
    }
    cfg = {**layer, "architectures": ["EagleLlamaForCausalLM"]}
    Path(path).mkdir(parents=True, exist_ok=True)
    (Path(path) / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file({k: v.contiguous() for k, v in w.items()}, str(Path(path) / "model.safetensors"))
    return str(path)
