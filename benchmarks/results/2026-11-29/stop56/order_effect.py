"""Does the run before a run change its speed? One cluster (two-device harness), vLLM target-only and two identical
specserve systems (defaults), rounds alternating [vllm, A, B] and [vllm, B, A]: each round one specserve system runs
right after vLLM and the other right after a specserve system. Usage: python order_effect.py BATCH ROUNDS"""
import statistics, sys
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
              "A": SpecserveRunner(target, draft, {}, options), "B": SpecserveRunner(target, draft, {}, options)}
        after_vllm, after_spec = [], []
        try:
            for r in rs.values(): r.run(prompts, batch, 64, True)
            for i in range(runs):
                order = ["vllm", "A", "B"] if i % 2 == 0 else ["vllm", "B", "A"]
                tok = {}
                for n in order:
                    rec = rs[n].run(prompts, batch, 64, True)
                    tok[n] = sum(map(len, rec["token_ids"])) / rec["wall_s"]
                    spec = "" if n == "vllm" else f" (spec steps {rec['num_speculative_steps']}/{rec['num_steps']})"
                    print(f"round {i} {n} {tok[n]:.0f} tok/s{spec}", flush=True)
                after_vllm.append(tok[order[1]] / tok["vllm"])
                after_spec.append(tok[order[2]] / tok["vllm"])
                print(f"round {i}: right after vLLM {after_vllm[-1]:.3f}x vLLM, right after specserve {after_spec[-1]:.3f}x vLLM", flush=True)
            print("medians: right after vLLM", round(statistics.median(after_vllm), 3), "right after specserve", round(statistics.median(after_spec), 3))
            print("(after vLLM) / (after specserve) by round", [round(a / b, 3) for a, b in zip(after_vllm, after_spec)])
        finally:
            for r in rs.values(): r.close()
