"""b1 A/B in the two-device harness: tree shape knobs of the draft's speculation cache."""
import json, os, sys, statistics
if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    batch, runs, variants = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3])
    pair = os.environ.get("PAIR")  # a directory with target/ and draft/ (examples/make_realistic_pair.py), else the demo pair
    target, draft = (f"{pair}/target", f"{pair}/draft") if pair else (resolve_model("demo:target"), resolve_model("demo:draft"))
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        rs = {"vllm": VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options})}
        for name, extra in variants.items():
            rs[name] = SpecserveRunner(target, draft, {"num_speculative_tokens": 4, "draft_min_timeout_s": 5.0, **extra}, options)
        res = {k: [] for k in rs}; info = {k: None for k in rs}
        try:
            for r in rs.values(): r.run(prompts, batch, 64, True)
            names = list(rs)
            for i in range(runs):
                for n in names[i % len(names):] + names[:i % len(names)]:
                    rec = rs[n].run(prompts, batch, 64, True)
                    res[n].append(sum(map(len, rec["token_ids"])) / rec["wall_s"])
                    if n != "vllm": info[n] = rec.get("realized")
                print({n: round(v[-1]) for n, v in res.items()}, flush=True)
            print("medians", {n: round(statistics.median(v)) for n, v in res.items()})
            for n in names[1:]:
                print(n, "realized", info[n], "coverage", rs[n].llm.metrics().get("speculation", {}).get("coverage_per_pos"))
        finally:
            for r in rs.values(): r.close()
