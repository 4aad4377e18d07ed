"""vLLM side by side, one run, same prompts: target-only, colocated draft model, and specserve's remote drafts.

Configurations (each engine alone on the machine while it is measured, all on one local
two-node Ray cluster labelled target / draft, one torch thread per process):

- ``vllm``: plain vLLM, target only.
- ``vllm+draft_model``: plain vLLM with its colocated ``draft_model`` speculation.
- ``specserve vllm+hf``: specserve, vLLM target (``RemoteDraftProposer``) on the target node,
  transformers draft on the draft node, over TCP.
- ``specserve vllm+vllm``: the same with a vLLM draft (``VLLMDrafter``).

Batch 1 runs the prompts one after another, batch 8 all at once, ``--repeats`` times each
(median and min-max). Printed per row: tokens/s,
acceptance rate, mean acceptance length, ratio to ``vllm+draft_model``, and whether the output
equals ``vllm``'s token for token; for the vLLM draft, how much of each proposal's context
it recomputed (prefix caching keeps full KV blocks only). JSON with ``--json``. Timings on a
shared 2-core CPU are noisy: read the ratios, not the digits.

    python -m benchmarks.bench_vllm [--max-tokens 128] [--k 4] [--repeats 3] [--compiled] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from .bench_cluster import ROLE, local_cluster
from .scenarios import heldout_prompts as load_prompts


class PlainVLLM:
    """A ``vllm.LLM`` in an actor; ``generate`` returns token ids and vLLM's spec-decode counter deltas."""

    def __init__(self, **kwargs):
        from vllm import LLM

        self.llm = LLM(**kwargs)

    def _counters(self) -> dict:
        return {m.name: m.value for m in self.llm.get_metrics() if "spec_decode" in m.name and hasattr(m, "value")}

    def generate(self, prompts, max_tokens: int) -> dict:
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        torch.get_num_threads()  # this thread's OpenMP count = torch's (specserve.vllm.options.sync_omp_threads)
        before = self._counters()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        after = self._counters()
        return {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "spec": {k: after[k] - before.get(k, 0) for k in after}}


def run_plain(kwargs: dict, prompts, max_tokens: int, warmup, repeats: int = 3) -> dict:
    import ray

    actor = ray.remote(PlainVLLM).options(num_cpus=0.5, label_selector={ROLE: "target"}).remote(**kwargs)
    try:
        ray.get(actor.generate.remote(warmup, 8))
        rows = {}
        for batch in (1, 8):
            walls = []
            for _ in range(repeats):
                start, token_ids, spec = time.perf_counter(), [], {}
                for group in ([[p] for p in prompts] if batch == 1 else [prompts]):
                    r = ray.get(actor.generate.remote(group, max_tokens))
                    token_ids += r["token_ids"]
                    spec = {k: spec.get(k, 0) + v for k, v in r["spec"].items()}
                walls.append(time.perf_counter() - start)
            wall = statistics.median(walls)
            drafted, accepted = spec.get("vllm:spec_decode_num_draft_tokens", 0), spec.get("vllm:spec_decode_num_accepted_tokens", 0)
            drafts = spec.get("vllm:spec_decode_num_drafts", 0)
            rows[batch] = {"wall_s": wall, "walls": walls, "tokens": sum(map(len, token_ids)), "token_ids": token_ids,
                           "acceptance_rate": accepted / drafted if drafted else None,
                           "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
        return rows
    finally:
        ray.kill(actor)


def run_specserve(draft_backend: str, options: dict, prompts, max_tokens: int, k: int, warmup, repeats: int = 3) -> dict:
    import ray

    from specserve import LLM, SamplingParams

    draft_options = {"draft_backend_options": options} if draft_backend == "vllm" else {}
    llm = LLM("demo:target", draft="demo:draft", ray=True, target_backend="vllm", target_backend_options=options,
              draft_backend=draft_backend, num_speculative_tokens=k, target_num_cpus=0.5, draft_num_cpus=0.5,
              draft_min_timeout_s=5.0, **draft_options)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        rows = {}
        for batch in (1, 8):
            walls = []
            for _ in range(repeats):
                start, outs = time.perf_counter(), []
                for group in ([[p] for p in prompts] if batch == 1 else [prompts]):
                    outs += llm.generate(group, params, use_tqdm=False)
                walls.append(time.perf_counter() - start)
            wall = statistics.median(walls)
            drafted = sum(o.metrics.num_draft_tokens for o in outs)
            accepted = sum(o.metrics.num_accepted_tokens for o in outs)
            drafts = sum(o.metrics.num_drafts for o in outs)
            rows[batch] = {"wall_s": wall, "walls": walls, "tokens": sum(len(o.token_ids) for o in outs), "token_ids": [o.token_ids for o in outs],
                           "acceptance_rate": accepted / drafted if drafted else None,
                           "mean_acceptance_length": 1 + accepted / drafts if drafts else None}
        if draft_backend == "vllm":  # how much context each proposal recomputed (the rest came from the prefix cache)
            c = ray.get(llm._engine.drafts[0].__ray_call__.remote(lambda worker: dict(worker.service.drafter.counters)))
            rows["draft_recompute"] = {**c, "recomputed_per_proposal": c["num_recomputed_tokens"] / max(1, c["num_draft_tokens"]) *
                                       k, "recomputed_fraction": c["num_recomputed_tokens"] / max(1, c["num_context_tokens"])}
        return rows
    finally:
        llm.shutdown()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row; the table shows the median")
    p.add_argument("--compiled", action="store_true", help="torch.compile in every engine (default: eager, fast starts)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)

    from specserve.config import resolve_model

    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    prompts, _ = load_prompts(target, args.num_prompts, args.prompt_tokens)
    warmup = prompts[:2]
    options = {"enforce_eager": not args.compiled, "kv_cache_memory_bytes": 1 << 30}
    plain = {"model": target, "dtype": "float32", "seed": 0, "max_model_len": 512, "disable_log_stats": False, **options}
    results = {}
    with local_cluster():
        results["vllm"] = run_plain(plain, prompts, args.max_tokens, warmup, args.repeats)
        results["vllm+draft_model"] = run_plain({**plain, "speculative_config": {
            "method": "draft_model", "model": draft, "num_speculative_tokens": args.k}}, prompts, args.max_tokens, warmup, args.repeats)
        results["specserve vllm+hf"] = run_specserve("hf", options, prompts, args.max_tokens, args.k, warmup, args.repeats)
        results["specserve vllm+vllm"] = run_specserve("vllm", options, prompts, args.max_tokens, args.k, warmup, args.repeats)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)
    return results


def table(results: dict) -> str:
    base = results["vllm+draft_model"]
    lines = ["| configuration | batch | tok/s (median) | min-max | acceptance | mean acc. len | vs vllm+draft_model | exact |", "|---|---|---|---|---|---|---|---|"]
    for name, rows in results.items():
        for batch in (1, 8):
            r = rows[batch]
            tps = r["tokens"] / r["wall_s"]
            ratio = tps / (base[batch]["tokens"] / base[batch]["wall_s"])
            acc = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
            mal = f"{r['mean_acceptance_length']:.2f}" if r["mean_acceptance_length"] is not None else "-"
            exact = r["token_ids"] == results["vllm"][batch]["token_ids"]
            spread = "-".join(f"{r['tokens'] / w:.0f}" for w in (max(r["walls"]), min(r["walls"])))
            lines.append(f"| {name} | {batch} | {tps:.0f} | {spread} | {acc} | {mal} | {ratio:.2f}x | {exact} |")
    rc = results.get("specserve vllm+vllm", {}).get("draft_recompute")
    if rc:
        lines.append(f"\nvLLM draft: {rc['num_recomputed_tokens']} of {rc['num_context_tokens']} context tokens recomputed "
                     f"({rc['recomputed_fraction']:.0%}), about {rc['recomputed_per_proposal']:.1f} per proposal of k tokens")
    lines.append("(shared 2-core CPU; medians of --repeats runs, each engine alone on the machine while measured)")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
