"""Greedy acceptance of the demo draft against the demo target on held-out stdlib prompts.

Prompts: ``--num-prompts`` chunks of ``--prompt-tokens`` tokens from the files that
``train_demo_pair.py`` held out. For each k it runs ``specserve.LLM`` (or, with
``--backend reference``, the tiny no-KV-cache loop below) at temperature 0 and prints
vLLM's metrics: acceptance rate = accepted / draft tokens; mean acceptance length =
1 + accepted / drafts (verification steps with >= 1 draft token). Every speculative
output is also checked token for token against target-only greedy output.

    PYTHONPATH=. python examples/measure_demo_acceptance.py --k 2 4 8   # or after pip install -e .
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_pair import read_texts, split_files, stdlib_files  # noqa: E402

from specserve.demo_models import DRAFT_PATH, TARGET_PATH  # noqa: E402

CHUNK_STRIDE = 256  # candidate prompt starts inside each held-out file, in tokens


def heldout_prompts(tokenizer, num_prompts: int, prompt_tokens: int, max_tokens: int) -> list[str]:
    """``num_prompts`` evenly spaced held-out chunks, decoded back to text."""
    _, heldout = split_files(stdlib_files())
    chunks = []
    for text in read_texts(heldout):
        ids = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
        for start in range(0, len(ids) - prompt_tokens - max_tokens, CHUNK_STRIDE):
            chunks.append(ids[start : start + prompt_tokens])
    if len(chunks) < num_prompts:
        raise ValueError(f"only {len(chunks)} held-out chunks for --num-prompts {num_prompts}")
    step = len(chunks) / num_prompts
    return [tokenizer.decode(chunks[int(i * step)]) for i in range(num_prompts)]


# ------------------------------------------------------------ reference (no specserve)


@torch.no_grad()
def greedy_next(model, ids: list[int], n: int = 1) -> list[int]:
    """Argmax of the model at the last ``n`` positions of ``ids`` (full forward, no cache)."""
    logits = model(input_ids=torch.tensor([ids])).logits[0, -n:]
    return logits.argmax(-1).tolist()  # host sync: tokens drive the Python loop


def reference_generate(target, draft, prompt_ids, k, max_tokens, eos_id) -> tuple[list[int], dict]:
    """Greedy speculative decoding, one sequence; drafts are clamped to max_tokens - 1 - generated."""
    ids, out = list(prompt_ids), []
    num_drafts = num_draft_tokens = num_accepted = 0
    while len(out) < max_tokens and (not out or out[-1] != eos_id):
        n = min(k, max_tokens - len(out) - 1)
        draft_ids = []
        for _ in range(n):
            draft_ids += greedy_next(draft, ids + draft_ids)
        target_ids = greedy_next(target, ids + draft_ids, n + 1)  # [n + 1]
        accepted = 0
        while accepted < n and draft_ids[accepted] == target_ids[accepted]:
            accepted += 1
        new = draft_ids[:accepted] + [target_ids[accepted]]  # + recovered or bonus token
        if eos_id in new:
            new = new[: new.index(eos_id) + 1]
        ids += new
        out += new
        if n:
            num_drafts, num_draft_tokens, num_accepted = num_drafts + 1, num_draft_tokens + n, num_accepted + accepted
    metrics = {"num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens, "num_accepted_tokens": num_accepted}
    return out[:max_tokens], metrics


def run_reference(prompts, k, max_tokens):
    tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
    target = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=torch.float32).eval()
    results = []
    for prompt in prompts:
        prompt_ids = tokenizer.encode(prompt)
        results.append(reference_generate(target, draft, prompt_ids, k, max_tokens, tokenizer.eos_token_id))
    return results


# --------------------------------------------------------------------------- specserve


def run_specserve(prompts, k, max_tokens):
    from specserve import LLM, SamplingParams

    draft = str(DRAFT_PATH) if k else None
    llm = LLM(target=str(TARGET_PATH), draft=draft, target_backend="hf", num_speculative_tokens=k, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    llm.shutdown()
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    return [(list(o.token_ids), {key: getattr(o.metrics, key) for key in keys}) for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="num_speculative_tokens values")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=48)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--backend", choices=["specserve", "reference"], default="specserve")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
    prompts = heldout_prompts(tokenizer, args.num_prompts, args.prompt_tokens, args.max_tokens)
    run = run_specserve if args.backend == "specserve" else run_reference
    baseline = [ids for ids, _ in run(prompts, 0, args.max_tokens)]  # target-only greedy

    rows = []
    for k in args.k:
        t0 = time.time()
        results = run(prompts, k, args.max_tokens)
        totals = {key: sum(m[key] for _, m in results) for key in results[0][1]}
        rows.append({
            "k": k, **totals,
            "acceptance_rate": totals["num_accepted_tokens"] / totals["num_draft_tokens"],
            "mean_acceptance_length": 1 + totals["num_accepted_tokens"] / totals["num_drafts"],
            "num_outputs_differing_from_target_greedy": sum(ids != b for (ids, _), b in zip(results, baseline)),
            "seconds": round(time.time() - t0, 1),
        })

    print(f"backend {args.backend}: {args.num_prompts} held-out prompts x {args.prompt_tokens} tokens, "
          f"max_tokens {args.max_tokens}, temperature 0\n")
    print("| k | acceptance rate | mean acceptance length | drafts | draft tokens | accepted | outputs != target greedy |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['k']} | {r['acceptance_rate']:.3f} | {r['mean_acceptance_length']:.2f} | {r['num_drafts']} "
              f"| {r['num_draft_tokens']} | {r['num_accepted_tokens']} | {r['num_outputs_differing_from_target_greedy']} |")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
