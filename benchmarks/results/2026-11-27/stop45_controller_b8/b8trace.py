"""Demo pair, batch 8, two-device harness: what the controller's cycles say vs what the runs deliver.

A scratch script of stop 45, kept with its output (trace_b8.json): from the repository root,
``PYTHONPATH=. python benchmarks/results/2026-11-27/stop45_controller_b8/b8trace.py [batch] [--full]`` (~4 min); it
writes b8trace_<batch>.json in the working directory. vLLM target-only and specserve (defaults, ``SPECSERVE_TRACE=1``) in
one cluster, one untimed run each, then four runs alternating; per specserve run, the controller's cycles by arm, and
with ``--full`` (stop 46; written to full_<batch>.json) its whole trace: batch, tokens, ms, arm, pure, prompt tokens per
cycle.
"""
import json
import statistics
import sys
from collections import defaultdict

if __name__ == "__main__":
    from benchmarks.bench_cluster import THREAD_ENV, local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model

    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    THREAD_ENV["SPECSERVE_TRACE"] = "1"
    full = "--full" in sys.argv
    args = [a for a in sys.argv[1:] if a != "--full"]
    batch = int(args[0]) if args else 8
    prompts, _ = heldout_prompts(target, max(24, 3 * batch), 32)
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    with local_cluster(two_device=True):
        to = VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, **options})
        ss = SpecserveRunner(target, draft, {"num_speculative_tokens": 4, "draft_min_timeout_s": 5.0}, options)
        for r in (to, ss):
            r.run(prompts, batch, 64)
        out = []
        for rep in range(4):
            for name, r in (("to", to), ("ss", ss)) if rep % 2 == 0 else (("ss", ss), ("to", to)):
                n0 = len(ss.llm.metrics()["speculation"].get("trace", [])) if name == "ss" else 0
                rec = r.run(prompts, batch, 64)
                toks = sum(map(len, rec["token_ids"]))
                line = {"name": name, "rep": rep, "tok_s": toks / rec["wall_s"], "steps": rec["num_steps"], "wall_s": rec["wall_s"]}
                if name == "ss":
                    spec = ss.llm.metrics()["speculation"]
                    tr = spec.get("trace", [])[n0:]
                    by = defaultdict(list)
                    for b, ntok, ms, arm, pure, pf in tr:
                        by[str(arm)].append((b, ntok, ms, pure, pf))
                    line["arms"] = {a: {"cycles": len(v), "ms_median": statistics.median(x[2] for x in v),
                                        "ms_mean": statistics.mean(x[2] for x in v),
                                        "tok_per_seq": sum(x[1] for x in v) / sum(x[0] for x in v),
                                        "share_time": sum(x[2] for x in v)} for a, v in by.items()}
                    tot = sum(x[2] for v in by.values() for x in v)
                    for a in line["arms"]:
                        line["arms"][a]["share_time"] = round(line["arms"][a]["share_time"] / tot, 3)
                    line["realized"] = spec.get("realized_tokens_per_s")
                    line["k"] = spec.get("k")
                    if full:
                        line["trace"] = tr
                print(json.dumps(line), flush=True)
                out.append(line)
        json.dump(out, open(f"{'full' if full else 'b8trace'}_{batch}.json", "w"), indent=1)
