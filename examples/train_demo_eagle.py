"""Train the EAGLE-3 head shipped in ``specserve/demo_models/eagle/`` against the demo target.

Data flow: the demo pair's corpus (this interpreter's stdlib sources, the same train/held-out
split, the demo tokenizer) -> the frozen demo target (float32) gives, per window, the rows of
its layers 1, 2, 3 and its next-token distributions -> the head (``specserve.eagle.Eagle3Head``,
the class specserve drafts with) learns KL(target || head) at each position, unrolled for
``--ttt-steps`` drafts the way it drafts (EAGLE-3's training-time test: draft j reads the head's
own row of draft j - 1 and attends to the target-fed positions and its own chain) -> vLLM's
native layout (``LlamaForCausalLMEagle3``: ``midlayer.*``, ``fc``, ``norm``, ``lm_head``; the
embedding stays the target's) in float16, with its config and card. CPU only, seeded.

    python examples/train_demo_eagle.py --out specserve/demo_models/eagle          # ~25 min on 1 core
    python examples/train_demo_eagle.py --out specserve/demo_models/eagle --measure-only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve.config import resolve_model
from specserve.eagle import Eagle3Head, HeadSpec

LAYER_IDS = [1, 2, 3]  # vLLM's default (2, N//2, N-3) collides for the demo target's 4 layers
STEP_WEIGHTS = (1.0, 0.8, 0.6, 0.5)

_spec = importlib.util.spec_from_file_location("train_demo_pair", Path(__file__).with_name("train_demo_pair.py"))
pair = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pair)


def head_config(target_config: dict) -> dict:
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
            "max_position_embeddings", "vocab_size", "hidden_act", "attention_bias", "mlp_bias", "tie_word_embeddings")
    cfg = {k: target_config[k] for k in keep if k in target_config}
    cfg.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", num_hidden_layers=1,
               intermediate_size=2 * target_config["hidden_size"], draft_vocab_size=target_config["vocab_size"],
               target_hidden_size=target_config["hidden_size"], eagle_aux_hidden_state_layer_ids=LAYER_IDS,
               tie_word_embeddings=False, dtype="float16")
    return cfg


def chain_mask(t: int, steps: int) -> torch.Tensor:
    """[steps * t, steps * t] additive mask: block j (draft j + 1) entry u sees the target-fed
    entries 0..u of block 0 and entry u of blocks 1..j (its own chain); block 0 is causal."""
    q_block, q_u = torch.arange(steps)[:, None].expand(steps, t).reshape(-1), torch.arange(t).repeat(steps)
    k_block, k_u = q_block, q_u
    causal = (k_block[None] == 0) & (k_u[None] <= q_u[:, None])
    chain = (k_block[None] > 0) & (k_block[None] <= q_block[:, None]) & (k_u[None] == q_u[:, None])
    return torch.zeros(steps * t, steps * t).masked_fill_(~(causal | chain), float("-inf"))


def head_forward(head: Eagle3Head, ids: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor):
    out = head(ids, positions, mask[None, None].expand(ids.shape[0], 1, -1, -1), None, rows, logits_to_keep=ids.shape[1])
    return out.logits, out.hidden


def train(head: Eagle3Head, target, stream, args) -> dict:
    gen = torch.Generator().manual_seed(args.seed + 3)
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    t0, steps = time.time(), args.ttt_steps
    for step in range(args.steps):
        if time.time() - t0 > args.minutes * 60:
            print(f"[eagle] budget hit at step {step}/{args.steps}", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = pair.lr_at(step, args.steps, args.lr, 50)
        x = pair.sample_windows(stream, gen)[:, : args.seq_len + 1]  # [B, T + 1]
        with torch.no_grad():
            out = target(x, output_hidden_states=True)
            aux = torch.cat([out.hidden_states[i] for i in LAYER_IDS], dim=-1)  # [B, T + 1, 3H]
            p_target = out.logits.float().log_softmax(-1)  # position t predicts x[t + 1]
        t = x.shape[1] - steps  # head entries u = 0..t-1 of every block
        # Block j entry u: position u + j, token x[u + j + 1], predicts x[u + j + 2].
        ids = torch.cat([x[:, j + 1: j + 1 + t] for j in range(steps)], dim=1)
        positions = torch.cat([torch.arange(j, j + t) for j in range(steps)])[None].expand(x.shape[0], -1)
        targets = [p_target[:, j + 1: j + 1 + t] for j in range(steps)]
        rows = head.combine(aux[:, :t])
        loss, agree = 0.0, []
        own = None
        for j in range(steps):  # block j reads the head's own rows of block j - 1
            blocks = j + 1
            hidden = rows if j == 0 else torch.cat([rows] + own, dim=1)
            logits, out_rows = head_forward(head, ids[:, : blocks * t], hidden, positions[:, : blocks * t], chain_mask(t, blocks))
            q = logits[:, j * t:].float().log_softmax(-1)
            loss = loss + STEP_WEIGHTS[j] * F.kl_div(q.flatten(0, 1), targets[j].flatten(0, 1), log_target=True,
                                                     reduction="batchmean")
            agree.append((q.argmax(-1) == targets[j].argmax(-1)).float().mean().item())
            # The next block's rows: this block's outputs, one position on (entry u reads entry u of block j).
            own = ([] if own is None else own) + [out_rows[:, j * t: (j + 1) * t]]
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"[eagle] step {step:4d}/{args.steps} loss {loss.item():.3f} top1-agree per draft "
                  f"{' '.join(f'{a:.3f}' for a in agree)} {(time.time() - t0) / 60:.1f} min", flush=True)
    return {"steps": step + 1, "train_seconds": round(time.time() - t0, 1), "final_top1_agree": [round(a, 3) for a in agree]}


def save(head: Eagle3Head, cfg: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    names = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight"}
    for prefix in ("self_attn.", "mlp.", "input_layernorm.", "hidden_norm.", "post_attention_layernorm."):
        for n, _ in head.named_parameters():
            if n.startswith(prefix):
                names[n] = "midlayer." + n
    state = dict(head.named_parameters())
    save_file({new: state[old].detach().to(torch.float16).contiguous() for old, new in names.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def measure(head_dir: str, ks=(2, 3, 4), num_prompts: int = 16, prompt_tokens: int = 64, max_tokens: int = 64) -> dict:
    """Greedy acceptance on held-out prompts (``measure_demo_acceptance``'s), the head against the demo
    draft model at the same k, adaptive k off; every output checked against target-only."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from measure_demo_acceptance import heldout_prompts

    from specserve import LLM, SamplingParams

    target = resolve_model("demo:target")
    prompts = heldout_prompts(AutoTokenizer.from_pretrained(target), num_prompts, prompt_tokens, max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(target, draft=None, target_backend="hf", dtype="float32") as llm:
        reference = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    out = {}
    for name, draft in (("eagle3 head", head_dir), ("demo draft model", resolve_model("demo:draft"))):
        for k in ks:
            with LLM(target, draft=draft, target_backend="hf", num_speculative_tokens=k, adaptive=False, dtype="float32") as llm:
                outs = llm.generate(prompts, params, use_tqdm=False)
            assert [o.token_ids for o in outs] == reference, "speculative output differs from target-only"
            drafts, drafted, accepted = (sum(getattr(o.metrics, f) for o in outs)
                                         for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
            out[f"{name} k={k}"] = {"acceptance_rate": round(accepted / drafted, 3),
                                    "mean_acceptance_length": round(1 + accepted / drafts, 3)}
            print(f"[measure] {name} k={k}: {out[f'{name} k={k}']}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="specserve/demo_models/eagle")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--minutes", type=float, default=20.0, help="hard cap on training time")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--ttt-steps", type=int, default=3, help="drafts unrolled per training window (1-4)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--measure-only", action="store_true", help="measure the head already in --out (no training)")
    args = p.parse_args()
    if args.measure_only:
        summary_file = Path(args.out) / "training_summary.json"
        summary = json.loads(summary_file.read_text())
        summary["heldout_acceptance"] = measure(args.out)
        summary_file.write_text(json.dumps(summary, indent=2) + "\n")
        return
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    target_dir = resolve_model("demo:target")
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    train_files, _ = pair.split_files(pair.stdlib_files())
    stream = pair.encode_stream(tokenizer, pair.read_texts(train_files))
    cfg = head_config(json.loads((Path(target_dir) / "config.json").read_text()))
    head = Eagle3Head(HeadSpec("eagle3", cfg, cfg["vocab_size"], cfg["draft_vocab_size"], cfg["target_hidden_size"],
                               tuple(LAYER_IDS), False, None), len(LAYER_IDS))
    with torch.no_grad():  # the target's embedding (shared, frozen) and LM head (a starting point)
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight)
        head.lm_head.weight.copy_(target.get_output_embeddings().weight)
        head.norm.weight.copy_(target.model.norm.weight)
    head.embed_tokens.weight.requires_grad_(False)
    summary = {"args": vars(args), "train_tokens": len(stream), **train(head, target, stream, args)}
    save(head, cfg, Path(args.out))
    summary["heldout_acceptance"] = measure(args.out)
    (Path(args.out) / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"saved to {args.out}: {summary}")


if __name__ == "__main__":
    main()
