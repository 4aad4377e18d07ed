"""Two-device harness, one cluster, interleaved rounds at batch B: vLLM target-only, specserve's vLLM target with no draft
("none"), and specserve's defaults (remote draft; at batch 32 the controller decodes target-only in most steps).
Usage: python ab_k0.py BATCH ROUNDS"""
import sys, statistics
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
              "none": SpecserveRunner(target, draft, {"num_speculative_tokens": 0}, options),
              "defaults": SpecserveRunner(target, draft, {}, options)}
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
                    extra = "" if n == "vllm" else f" steps {rec['num_steps']} spec steps {rec['num_speculative_steps']} verify {rec['verify_ms']:.2f} ms overhead {rec['overhead_ms']:.2f} ms"
                    print(f"round {i} {n} {res[n][-1]:.0f} tok/s{extra}", flush=True)
            print("medians", {n: round(statistics.median(v)) for n, v in res.items()})
            for n in names[1:]:
                print(n, "/ vllm by round", [round(a / b, 3) for a, b in zip(res[n], res["vllm"])])
        finally:
            for r in rs.values(): r.close()
