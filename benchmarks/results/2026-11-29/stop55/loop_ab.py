"""In one process, no Ray: vLLM's own sustained loop (as bench_vllm's PlainVLLM) against specserve's engine loop
(VLLMEngineCore + EngineLoop, target-only, the same window). Usage: taskset -c 0 python loop_ab.py MODE BATCH [profile]
MODE: vllm | specserve. Prints the median of 7 runs (after 2 untimed) in tok/s."""
import os, sys, time, statistics
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"; os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if __name__ == "__main__":
    mode, batch = sys.argv[1], int(sys.argv[2])
    import torch; torch.set_num_threads(1)
    from specserve.config import resolve_model
    from benchmarks.scenarios import heldout_prompts
    target = resolve_model("demo:target")
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    opts = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    if mode == "vllm":
        from benchmarks.bench_vllm import PlainVLLM
        p = PlainVLLM(model=target, dtype="float32", seed=0, disable_log_stats=True, **opts)
        run = lambda: p.run(prompts, batch, 64, True)
    else:
        from specserve import LLM, SamplingParams
        llm = LLM(target, draft=None, target_backend="vllm", target_backend_options=opts, cpu_threads=1)
        sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        def run():
            t = time.perf_counter(); outs = llm.generate(prompts, sp, use_tqdm=False, max_in_flight=batch)
            return {"wall_s": time.perf_counter() - t, "token_ids": [o.token_ids for o in outs]}
    for _ in range(2): run()
    rates = []
    for _ in range(7):
        r = run(); rates.append(sum(map(len, r["token_ids"])) / r["wall_s"])
    print(mode, batch, "median tok/s %.1f" % statistics.median(rates), [round(x) for x in rates], flush=True)
    if len(sys.argv) > 3:
        import cProfile, pstats
        pr = cProfile.Profile(); pr.enable()
        for _ in range(3): run()
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(30)
