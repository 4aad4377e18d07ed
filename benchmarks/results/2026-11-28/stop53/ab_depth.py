"""A/B in one run (two-device harness): the tree's cost model, old (every depth at the first's cost) vs new."""
import json, os, sys, statistics
if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks import bench_vllm
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner, THREAD_ENV
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    from specserve import LLM
    class Runner(SpecserveRunner):
        def __init__(self, target, draft, options, vllm_options, env):
            self.own_engine = False
            self.llm = LLM(target, draft=draft, ray=True, target_backend="vllm", target_backend_options=vllm_options,
                           target_num_cpus=0.25, draft_num_cpus=0.25, cpu_threads=1, runtime_env={"env_vars": {**THREAD_ENV, **env}}, **options)
    batches, runs = [int(b) for b in sys.argv[1].split(",")], int(sys.argv[2])
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    common = {"num_speculative_tokens": 4, "draft_min_timeout_s": 5.0}
    with local_cluster(two_device=True, head="target"):
        rs = {"vllm": VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options}),
              "old-tree": Runner(target, draft, common, options, {"SPECSERVE_EXP_OLD_TREE": "1"}),
              "new-tree": Runner(target, draft, common, options, {})}
        try:
            for batch in batches:
                prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
                res = {k: [] for k in rs}
                for r in rs.values(): r.run(prompts, batch, 64, True)
                names = list(rs)
                for i in range(runs):
                    for n in names[i % len(names):] + names[:i % len(names)]:
                        rec = rs[n].run(prompts, batch, 64, True)
                        res[n].append(sum(map(len, rec["token_ids"])) / rec["wall_s"])
                    print(batch, {n: round(v[-1]) for n, v in res.items()}, flush=True)
                med = {n: statistics.median(v) for n, v in res.items()}
                wins = sum(a > b for a, b in zip(res["new-tree"], res["old-tree"]))
                print("batch", batch, "medians", {n: round(v) for n, v in med.items()}, "new/old %.3f" % (med["new-tree"] / med["old-tree"]), f"new>old in {wins}/{runs}", flush=True)
                for n in ("old-tree", "new-tree"):
                    sp = rs[n].llm.metrics().get("speculation", {})
                    print("  ", n, "realized", sp.get("realized_tokens_per_s"), "coverage", {b: [round(c, 2) for c in v] for b, v in (sp.get("coverage_per_pos") or {}).items()}, flush=True)
        finally:
            for r in rs.values(): r.close()
