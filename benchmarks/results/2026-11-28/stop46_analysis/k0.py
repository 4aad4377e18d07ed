"""In one process on one core: vLLM target-only engine loop vs specserve's VLLMEngineCore with speculation
configured but no draft connected (k = 0 every step): what the spec config + proposer + specserve loop cost."""
import os, sys, time, statistics
if __name__ == "__main__":
    os.sched_setaffinity(0, {0})
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch; torch.set_num_threads(1)
    from specserve.config import SpecserveConfig, resolve_model
    from specserve.build import DraftLink
    from specserve.vllm.target import VLLMEngineCore
    from specserve.sampling_params import SamplingParams as SP
    from benchmarks.scenarios import heldout_prompts
    target = resolve_model("demo:target")
    B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
    prompts, _ = heldout_prompts(target, 3 * B, 32)
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    which = sys.argv[2]
    def loop_vllm(engine, step):
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, output_kind=getattr(RequestOutputKind, os.environ.get("KIND", "CUMULATIVE")))
        done, added, times = 0, 0, []
        t0 = time.perf_counter()
        while done < len(prompts):
            while added < len(prompts) and added - done < B:
                engine.add_request(f"r{time.time()}-{added}", TokensPrompt(prompt_token_ids=prompts[added]), params); added += 1
            s = time.perf_counter()
            for o in step():
                if o.finished: done += 1
            times.append(time.perf_counter() - s)
        return time.perf_counter() - t0, times
    if which == "vllm":
        from vllm import LLM
        llm = LLM(model=target, dtype="float32", seed=0, disable_log_stats=True, max_num_seqs=256, **options)
        eng = llm.llm_engine
        for rep in range(6):
            if rep % 2 == 0: os.environ['KIND'] = 'CUMULATIVE'
            else: os.environ['KIND'] = 'FINAL_ONLY'
            wall, ts = loop_vllm(eng, eng.step)
            print("vllm", os.environ.get("KIND"), rep, round(wall, 3), "median step ms", round(statistics.median(ts) * 1e3, 2), flush=True)
    else:
        cfg = SpecserveConfig.load(None, target=target, draft="demo:draft", target_backend="vllm", target_backend_options=options,
                                   num_speculative_tokens=4)
        link = DraftLink(lambda: {}, lambda name, svc: None, "local", background=False, hello_info={"in_process": True})
        core = VLLMEngineCore(cfg, link)
        params = SP(temperature=0.0, max_tokens=64, ignore_eos=True)
        for rep in range(4):
            done, added, times = 0, 0, []
            t0 = time.perf_counter()
            live = 0
            while done < len(prompts):
                while added < len(prompts) and live < B:
                    core.waiting.append((f"s{rep}-{added}", prompts[added], params)); added += 1; live += 1
                s = time.perf_counter()
                res = core.step()
                times.append(time.perf_counter() - s)
                for dl in res.deltas:
                    if dl.finished: done += 1; live -= 1
            wall = time.perf_counter() - t0
            print("core", rep, round(wall, 3), "median step ms", round(statistics.median(times) * 1e3, 2), core.metrics()["per_step"]["overhead_ms"], flush=True)
