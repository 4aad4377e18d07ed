"""A/B in the two-device harness, one cluster, interleaved rounds: a probe that measured nothing keeps the arm's
rating and runs again soon (the new default) against the old controller (env SPECSERVE_EXPERIMENT_NO_RETRY=1 in the
target's actor, an experiment-only switch, see ab_retry_switch.patch), beside vLLM target-only.
Usage: python ab_retry.py BATCH ROUNDS"""
import statistics, sys
if __name__ == "__main__":
    from benchmarks.bench_cluster import THREAD_ENV, local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve import LLM
    from specserve.config import resolve_model

    class Runner(SpecserveRunner):
        def __init__(self, target, draft, vllm_options, env):
            self.own_engine = False
            self.llm = LLM(target, draft=draft, ray=True, target_backend="vllm", target_backend_options=vllm_options,
                           target_num_cpus=0.25, draft_num_cpus=0.25, cpu_threads=1, runtime_env={"env_vars": {**THREAD_ENV, **env}})

    batch, runs = int(sys.argv[1]), int(sys.argv[2])
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        rs = {"vllm": VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options}),
              "retry": Runner(target, draft, options, {}),
              "old": Runner(target, draft, options, {"SPECSERVE_EXPERIMENT_NO_RETRY": "1"})}
        res = {k: [] for k in rs}
        ref = None
        try:
            for r in rs.values(): r.run(prompts, batch, 64, True)
            names = list(rs)
            for i in range(runs):
                for n in names[i % len(names):] + names[:i % len(names)]:
                    rec = rs[n].run(prompts, batch, 64, True)
                    ref = ref or rec["token_ids"]
                    assert rec["token_ids"] == ref, f"{n}: output differs from the first run's"
                    res[n].append(sum(map(len, rec["token_ids"])) / rec["wall_s"])
                    extra = "" if n == "vllm" else f" spec steps {rec['num_speculative_steps']}/{rec['num_steps']}"
                    print(f"round {i} {n} {res[n][-1]:.0f} tok/s{extra}", flush=True)
            print("medians", {n: round(statistics.median(v)) for n, v in res.items()})
            print("retry/old by round", [round(a / b, 3) for a, b in zip(res["retry"], res["old"])])
            for n in names[1:]:
                print(n, "/ vllm by round", [round(a / b, 3) for a, b in zip(res[n], res["vllm"])])
        finally:
            for r in rs.values(): r.close()
