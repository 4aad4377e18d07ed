"""On one CUDA GPU, what does an in-process draft do to specserve's own engine: its step time and
tokens/s, target-only and with the draft, and which arms (k) the adaptive controller ran?

Needs no model hub: builds a random-weight Llama target from a config (default ~1.1B parameters,
bfloat16) and a draft made of its first and last layers (the same embedding and LM head, so it
agrees with the target often enough to measure), saves both and loads them back through
``from_pretrained``. Then, at each batch size B (B requests in flight, greedy, ``--max-tokens`` each):

- ``specserve target-only``: ``LLM(target, device="cuda")``: tok/s and time per engine step;
- ``specserve + draft``: the same with the draft in-process on the same GPU (adaptive k), and how
  many steps ran each arm over the run, warm-up included;
- greedy exactness of every speculative row against target-only (bfloat16 batched numerics may flip
  near-ties; ``tests/gpu`` checks exactness in float32).

Writes ``--out``/gpu.md (also printed), gpu.json and gpu.png. ``scripts/gpu_check.sh`` runs
``tests/gpu`` and then this benchmark, each under its own time limit.

    python -m benchmarks.bench_gpu                          # batch 1, 8, 32; 64 tokens a request (under 200 s on an H200)
    python -m benchmarks.bench_gpu --max-tokens 128 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter
from pathlib import Path

from .cli import header, parser


def build_pair(root: Path, hidden: int, layers: int, vocab: int, dtype, middle_scale: float) -> tuple[str, str]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64, num_hidden_layers=layers,
                      num_attention_heads=hidden // 128, num_key_value_heads=max(1, hidden // 256), vocab_size=vocab,
                      max_position_embeddings=1024, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    target = LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():
        target.lm_head.weight.mul_(20.0)  # near-uniform random logits make every token a tie: sharpen the LM head
        for layer in target.model.layers[1:-1]:  # the middle layers (the draft leaves them out) move the output less
            layer.self_attn.o_proj.weight.mul_(middle_scale)
            layer.mlp.down_proj.weight.mul_(middle_scale)
    target.save_pretrained(root / "target")
    dcfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 2})
    draft = LlamaForCausalLM(dcfg).to(dtype)
    state = target.state_dict()
    keep = {0: 0, 1: layers - 1}
    mapped = {}
    for name in draft.state_dict():
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            mapped[name] = state[name.replace(f"model.layers.{i}.", f"model.layers.{keep[i]}.", 1)]
        else:
            mapped[name] = state[name]
    draft.load_state_dict(mapped)
    draft.save_pretrained(root / "draft")
    return str(root / "target"), str(root / "draft")


def add_pair_args(p: argparse.ArgumentParser) -> None:
    """The random pair (``build_pair``: its shape, where it is written) and its prompts' length; shared with
    ``dev/profile_gpu``."""
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens (random ids)")
    p.add_argument("--hidden", type=int, default=2048, help="the target's hidden size (a multiple of 128)")
    p.add_argument("--layers", type=int, default=16, help="the target's layers (the draft keeps the first and the last)")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size of both models")
    p.add_argument("--dtype", default="bfloat16", help="torch dtype of both models")
    p.add_argument("--middle-scale", type=float, default=0.03,
                   help="scale of the target's middle layers' output projections: sets how often the draft agrees")
    p.add_argument("--models", default=None, help="where the random pair is written; default: --out/pair")


def run_llm(target: str, draft: str | None, prompts, batch: int, max_tokens: int, dtype: str) -> tuple[dict, list]:
    from specserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    kw = dict(draft=draft, num_speculative_tokens=4) if draft else {}
    with LLM(target, target_backend="hf", device="cuda", dtype=dtype, max_num_seqs=max(32, batch), **kw) as llm:
        llm.generate(prompts[:batch], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
        before = llm.metrics()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False, max_in_flight=batch)
        wall = time.perf_counter() - start
        after = llm.metrics()
    steps = after["num_steps"] - before["num_steps"]
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    spec = after["speculation"]
    arms = Counter(f"k={a[0]}{'c' if a[1] else ''}" if a else "-" for a in (c[3] for c in spec.get("trace", [])))
    row = {"arms": dict(arms), "arm_by_bucket": spec.get("arm_by_bucket"), "predicted": spec.get("predicted_tokens_per_s"),
           "tok_s": tokens / wall, "step_ms": (after["timing"]["wall_s"] - before["timing"]["wall_s"]) / max(1, steps) * 1e3,
           "steps": steps, "tokens_per_step": tokens / max(1, steps),
           "acceptance": accepted / drafted if drafted else None}
    return row, [o.token_ids for o in outs]


def main(argv=None) -> None:
    p = parser("benchmarks.bench_gpu", __doc__)
    p.add_argument("--batch-sizes", default="1,8,32", help="requests in flight, comma-separated")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    add_pair_args(p)
    p.add_argument("--out", default="bench_out/gpu", help="folder for gpu.md, gpu.json and gpu.png")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu needs a CUDA GPU")
    title = header("benchmarks.bench_gpu", argv)
    dtype = getattr(torch, args.dtype)
    os.environ["SPECSERVE_TRACE"] = "1"  # the controller keeps its cycles: which arms (k) the run used
    root = Path(args.models or Path(args.out) / "pair")
    target, draft = build_pair(root, args.hidden, args.layers, args.vocab, dtype, args.middle_scale)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        n = max(8, 2 * batch)
        prompts = torch.randint(0, args.vocab, (n, args.prompt_tokens), generator=gen).tolist()
        plain, ref = run_llm(target, None, prompts, batch, args.max_tokens, args.dtype)
        spec, outs = run_llm(target, draft, prompts, batch, args.max_tokens, args.dtype)
        exact = sum(a == b for a, b in zip(outs, ref)) / len(ref)
        rows.append({"batch": batch, "target_only": plain, "speculative": spec, "speedup": spec["tok_s"] / plain["tok_s"],
                     "greedy_exact": exact})
        print(rows[-1], flush=True)
    device = torch.cuda.get_device_name(0)
    lines = [title, "", f"specserve's own engine on {device}, {args.dtype}; target {args.layers} layers x {args.hidden} "
             f"(random weights), draft = its first and last layers; greedy, k<=4, {args.max_tokens} tokens per request",
             "", "| batch | target-only step ms | + draft step ms | target-only tok/s | + draft tok/s | speed-up | "
             "acceptance | tokens/step | steps by arm | greedy exact |", "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        s = r["speculative"]
        acc = f"{s['acceptance']:.2f}" if s["acceptance"] is not None else "-"
        lines.append(f"| {r['batch']} | {r['target_only']['step_ms']:.2f} | {s['step_ms']:.2f} | "
                     f"{r['target_only']['tok_s']:.0f} | {s['tok_s']:.0f} | {r['speedup']:.2f}x | {acc} | "
                     f"{s['tokens_per_step']:.2f} | {' '.join(f'{a}:{n}' for a, n in sorted(s['arms'].items()))} | {r['greedy_exact']:.0%} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.md").write_text(table + "\n")
    (out / "gpu.json").write_text(json.dumps({"header": title, "device": device, "args": vars(args), "rows": rows}, indent=1))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.5))
        xs = [r["batch"] for r in rows]
        ax.plot(xs, [r["target_only"]["tok_s"] for r in rows], "o-", label="target-only")
        ax.plot(xs, [r["speculative"]["tok_s"] for r in rows], "s-", label="+ draft (adaptive k<=4)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight")
        ax.set_ylabel("tok/s")
        ax.set_title(device)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "gpu.png", dpi=120)
    except ImportError:
        print("matplotlib not installed: no plot")


if __name__ == "__main__":
    main()
