"""A/B in the two-device harness, one cluster, interleaved rounds: the draft's glue with the tree's first depth in one call
(the new default) against a separate glue call (env SPECSERVE_EXPERIMENT_NOFOLD=1 in the draft's actor, an experiment-only
switch, see ab_fold_switch.patch), beside vLLM target-only. Usage: python ab_fold.py BATCH ROUNDS"""
import os, sys, statistics
if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_cluster import THREAD_ENV
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve import LLM
    from specserve.config import resolve_model

    class Runner(SpecserveRunner):
        def __init__(self, target, draft, options, vllm_options, env):
            self.own_engine = False
            self.llm = LLM(target, draft=draft, ray=True, target_backend="vllm", target_backend_options=vllm_options,
                           target_num_cpus=0.25, draft_num_cpus=0.25, cpu_threads=1, runtime_env={"env_vars": {**THREAD_ENV, **env}}, **options)

    batch, runs = int(sys.argv[1]), int(sys.argv[2])
    pair = os.environ.get("PAIR")
    target, draft = (f"{pair}/target", f"{pair}/draft") if pair else (resolve_model("demo:target"), resolve_model("demo:draft"))
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        rs = {"vllm": VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options}),
              "fold": Runner(target, draft, {}, options, {}),
              "separate": Runner(target, draft, {}, options, {"SPECSERVE_EXPERIMENT_NOFOLD": "1"})}
        res = {k: [] for k in rs}
        ref = None
        try:
            for r in rs.values(): r.run(prompts, batch, 64, True)
            names = list(rs)
            for i in range(runs):
                for n in names[i % len(names):] + names[:i % len(names)]:
                    import ray
                    dm = lambda: ray.get(rs[n].llm._engine.drafts[0].metrics.remote()) if n != "vllm" else {}  # noqa: E731
                    m0 = dm()
                    rec = rs[n].run(prompts, batch, 64, True)
                    m1 = dm()
                    trees = {k: m1[k] - m0.get(k, 0) for k in ("num_trees", "num_trees_folded", "num_tree_forwards", "num_cache_hits", "num_cache_misses") if k in m1}
                    ref = ref or rec["token_ids"]
                    assert rec["token_ids"] == ref, f"{n}: output differs from the first run's"
                    res[n].append(sum(map(len, rec["token_ids"])) / rec["wall_s"])
                    extra = "" if n == "vllm" else f" hits {rec['num_cache_hits']}/{rec['num_blocks']} spec steps {rec['num_speculative_steps']} accepted {rec['num_accepted_tokens']} {trees}"
                    print(f"round {i} {n} {res[n][-1]:.0f} tok/s{extra}", flush=True)
            print("medians", {n: round(statistics.median(v)) for n, v in res.items()})
            print("fold/separate by round", [round(a / b, 3) for a, b in zip(res["fold"], res["separate"])])
            for n in names[1:]:
                print(n, "coverage", rs[n].llm.metrics().get("speculation", {}).get("coverage_per_pos"))
        finally:
            for r in rs.values(): r.close()
