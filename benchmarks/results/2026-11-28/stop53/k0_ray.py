"""A/B in the two-device harness: vLLM target-only, specserve target-only (no proposer), specserve with the proposer forced to k=0."""
import json, os, sys, statistics
os.environ["SPECSERVE_EXPERIMENT_K0"] = "1"
if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    batch, runs = int(sys.argv[1]), int(sys.argv[2])
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        rs = {"vllm": VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options}),
              "ss-noproposer": SpecserveRunner(target, draft, {"num_speculative_tokens": 0}, options),
              "ss-proposer-k0": SpecserveRunner(target, draft, {"num_speculative_tokens": 4, "draft_min_timeout_s": 5.0}, options)}
        res = {k: [] for k in rs}
        try:
            for r in rs.values(): r.run(prompts, batch, 64, True)
            names = list(rs)
            for i in range(runs):
                for n in names[i % 3:] + names[:i % 3]:
                    rec = rs[n].run(prompts, batch, 64, True)
                    res[n].append(sum(map(len, rec["token_ids"])) / rec["wall_s"])
                print({n: round(v[-1]) for n, v in res.items()}, flush=True)
            print("medians", {n: round(statistics.median(v)) for n, v in res.items()})
        finally:
            for r in rs.values(): r.close()
