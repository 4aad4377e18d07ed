"""Build a target/draft pair with a realistic cost ratio for CPU benchmarks, and check it.

Data flow: the shipped demo target (4 Llama layers) -> a ``--layers``-deep target built by
``specserve.demo_models.realistic.build_pair`` (the pair ``specserve demo`` runs by default):
after each trained layer come copies of it whose output projections are scaled by ``+scale``
and ``-scale`` in turn, so every copy costs a full layer of compute while consecutive pairs
nearly cancel (the outputs stay the demo target's); the demo draft is kept as the draft. Both
are written (float16, like the demo pair) with the tokenizer into ``--out/{target,draft}``.
``--check`` then measures, on this CPU with one torch thread, a decode step of each
(specserve's HF backend, batch 1) and the greedy acceptance on held-out prompts at k = 2..4,
and fails unless the target step costs >= 10x a draft step and the per-token acceptance is
>= 0.6. Nothing here is shipped as weights.

    python examples/make_realistic_pair.py --out /tmp/realistic_pair --check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specserve.demo_models.realistic import DEFAULT_LAYERS, DEFAULT_SCALE, build_pair

HERE = Path(__file__).resolve().parent

__all__ = ["build_pair", "decode_step_ms", "measure_acceptance"]


def decode_step_ms(model_dir: str, batch_size: int = 1, context: int = 64, steps: int = 30) -> float:
    """Median ms of one decode forward (one new token per sequence) through specserve's HF backend."""
    from specserve.backends.hf import HFBackend

    backend = HFBackend(model_dir, dtype="float32")
    seqs = [f"s{i}" for i in range(batch_size)]
    for s in seqs:
        backend.add(s)
    backend.forward(seqs, [[(7 * i + j) % 4000 + 1 for j in range(context)] for i in range(batch_size)], [1] * batch_size)
    times = []
    for _ in range(steps + 3):
        start = time.perf_counter()
        backend.forward(seqs, [[5]] * batch_size, [1] * batch_size)
        times.append(time.perf_counter() - start)
        for s in seqs:
            backend.truncate(s, context)  # same context every step
    return 1e3 * statistics.median(times[3:])


def per_token_acceptance(outs, k: int) -> float:
    """P(a draft token is accepted | the drafts before it were) at fixed k: accepted / positions reached.

    Position j > 0 is reached by the blocks that accepted position j - 1 (blocks cut short at a
    sequence's end count as reaching all k positions: a small overestimate of the denominator).
    """
    per_pos, drafts = [0] * k, 0
    for o in outs:
        drafts += o.metrics.num_drafts
        for j, n in enumerate(o.metrics.num_accepted_tokens_per_pos[:k]):
            per_pos[j] += n
    reached = drafts + sum(per_pos[: k - 1])
    return sum(per_pos) / reached if reached else 0.0


def measure_acceptance(target: str, draft: str, ks: list[int], num_prompts: int = 16, max_tokens: int = 64) -> list[dict]:
    """Greedy speculative runs at fixed k on held-out stdlib prompts; each output checked against target-only."""
    sys.path.insert(0, str(HERE))
    from measure_demo_acceptance import heldout_prompts
    from transformers import AutoTokenizer

    from specserve import LLM, SamplingParams

    prompts = heldout_prompts(AutoTokenizer.from_pretrained(target), num_prompts, 48, max_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(target, draft=None, target_backend="hf", cpu_threads=1) as llm:
        reference = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    rows = []
    for k in ks:
        with LLM(target, draft=draft, target_backend="hf", num_speculative_tokens=k, adaptive=False, cpu_threads=1, max_num_seqs=num_prompts) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        accepted, drafted = sum(o.metrics.num_accepted_tokens for o in outs), sum(o.metrics.num_draft_tokens for o in outs)
        drafts = sum(o.metrics.num_drafts for o in outs)
        rows.append({"k": k, "per_token_acceptance": per_token_acceptance(outs, k), "acceptance_rate": accepted / drafted,
                     "mean_acceptance_length": 1 + accepted / drafts,
                     "greedy_equals_target_only": [o.token_ids for o in outs] == reference})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for target/ and draft/ (created)")
    p.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help=f"target depth: 4 + a multiple of 8 [{DEFAULT_LAYERS}]")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE, help=f"output-projection scale of the inserted copies [{DEFAULT_SCALE}]")
    p.add_argument("--check", action="store_true", help="measure the step-cost ratio and the acceptance; exit 1 if too low")
    p.add_argument("--num-prompts", type=int, default=16, help="held-out prompts for the acceptance check [16]")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    target, draft = build_pair(args.out, args.layers, args.scale)
    print(f"wrote {target} ({args.layers} layers) and {draft}")
    if not args.check:
        return 0
    from specserve.demo_models import DRAFT_PATH, TARGET_PATH

    steps = {name: decode_step_ms(path) for name, path in
             (("target", target), ("draft", draft), ("demo target", str(TARGET_PATH)), ("demo draft", str(DRAFT_PATH)))}
    ratio = steps["target"] / steps["draft"]
    print("decode step, batch 1, context 64, 1 thread: " + ", ".join(f"{k} {v:.2f} ms" for k, v in steps.items()))
    print(f"target step / draft step = {ratio:.1f} (need >= 10)")
    rows = measure_acceptance(target, draft, [2, 3, 4], args.num_prompts)
    print("| k | per-token acceptance | acceptance rate | mean acceptance length | greedy == target-only |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['k']} | {r['per_token_acceptance']:.3f} | {r['acceptance_rate']:.3f} | {r['mean_acceptance_length']:.2f} "
              f"| {'yes' if r['greedy_equals_target_only'] else 'NO'} |")
    (Path(args.out) / "check.json").write_text(json.dumps({"step_ms": steps, "ratio": ratio, "acceptance": rows}, indent=1))
    ok = ratio >= 10 and all(r["per_token_acceptance"] >= 0.6 and r["greedy_equals_target_only"] for r in rows)
    print("check passed" if ok else "CHECK FAILED: the pair is not realistic enough on this machine")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
