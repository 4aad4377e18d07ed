"""A DeepSeek-V3 checkpoint's multi-token-prediction layer as the draft (``draft=`` the target's own
directory): found from config.json, read by name from the checkpoint (per-expert tensors stacked as
transformers' block holds them), fed the target's final hidden state like EAGLE-1; greedy output is
the target's, with and without drafting ahead, and every block equals the one computed from scratch.
float32: transformers' grouped MoE kernel takes no float64."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from specserve import LLM, SamplingParams
from specserve.eagle import MtpHead, head_spec

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(12, 40)), [3], [20, 21, 22, 20, 21, 22, 20]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """A 2-layer DeepSeek-V3 (MLA, one dense and one MoE layer) whose checkpoint also holds an MTP layer
    (``model.layers.2.*``, experts one tensor each, as released checkpoints store them)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    root = tmp_path_factory.mktemp("mtp") / "target"
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                           num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, topk_group=1, kv_lora_rank=16,
                           q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_nextn_predict_layers=1,
                           max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = DeepseekV3ForCausalLM(cfg).eval()
    target.save_pretrained(root)
    head = MtpHead(head_spec(str(root)))
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.ones_like(p) if name.endswith("norm.weight") or "layernorm" in name else torch.randn_like(p) * 0.1)
        head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
    tensors = {}
    for name, t in head.state_dict().items():
        if name.startswith("rotary.") or name == "d2t":
            continue
        if name == "layer.mlp.experts.gate_up_proj":
            for e, w in enumerate(t):
                tensors[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"], tensors[f"model.layers.2.mlp.experts.{e}.up_proj.weight"] = w.chunk(2)
            continue
        if name == "layer.mlp.experts.down_proj":
            for e, w in enumerate(t):
                tensors[f"model.layers.2.mlp.experts.{e}.down_proj.weight"] = w
            continue
        for local, stored in (("layer.", ""), ("norm.", "shared_head.norm."), ("lm_head.", "shared_head.head.")):
            if name.startswith(local):
                name = stored + name[len(local):]
                break
        tensors[f"model.layers.2.{name}"] = t.float().contiguous().clone()
    save_file(tensors, str(root / "mtp.safetensors"))
    return {"path": str(root), "target": target, "head_state": {k: v.clone() for k, v in head.state_dict().items()}}


def test_the_checkpoint_is_its_own_draft_head(mtp_target):
    from specserve.eagle import load_head

    spec = head_spec(mtp_target["path"])
    assert spec.kind == "mtp"
    head = load_head(mtp_target["path"], mtp_target["path"], 2)
    for name, t in head.state_dict().items():
        if not name.startswith("rotary.") and name != "d2t":
            assert torch.allclose(t, mtp_target["head_state"][name].float()), name


@pytest.mark.parametrize("ahead", [False, True])
def test_greedy_with_the_mtp_layer_equals_target_only(mtp_target, ahead, ordered_draft_ahead):
    path = mtp_target["path"]
    with LLM(path, dtype="float32") as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with LLM(path, draft=path, num_speculative_tokens=3, dtype="float32", adaptive=False, draft_ahead=ahead,
             draft_ahead_preempt=False) as llm:
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        hits = llm.metrics()["num_cache_hits"]
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert ahead or hits == 0  # (a random layer seldom foresees the target's token: drafting ahead runs, rarely hits)


def test_the_mtp_layer_reads_the_targets_rows_at_the_right_positions(mtp_target, monkeypatch):
    """Every block drafted inside the engine equals the block computed from scratch with full forwards."""
    from .test_eagle_heads import check_blocks_against_full_forwards

    check_blocks_against_full_forwards(monkeypatch, mtp_target["path"], mtp_target["path"], mtp_target["target"], "float32")
