"""k = 0 overhead of the custom_class proposer: plain vLLM vs vLLM + RemoteDraftProposer forced to k=0."""
import os, sys, time, cProfile, pstats
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"; os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
if __name__ == "__main__":
    mode, batch = sys.argv[1], int(sys.argv[2])
    import torch; torch.set_num_threads(1)
    from specserve.config import resolve_model
    import specserve.adaptive as ad
    from vllm import LLM, SamplingParams
    if mode.startswith("spec"):
        def choose(self, batch_size, have_draft=True, cache=False):
            self.arm, self.k, self.cache_only = (0, False), 0, False
            return 0
        ad.SpeculationController.choose = choose
        ad.SpeculationController.push_due = lambda self, *a, **k: False
        extra = dict(speculative_config={"method": "custom_class", "model": "specserve.vllm.RemoteDraftProposer", "num_speculative_tokens": 4})
    else:
        extra = {}
    llm = LLM(resolve_model("demo:target"), enforce_eager=True, max_model_len=512, kv_cache_memory_bytes=1 << 30, **extra)
    sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    prompts = [{"prompt_token_ids": list(range(10 + i, 74 + i))} for i in range(batch)]
    for _ in range(3): llm.generate(prompts, sp, use_tqdm=False)
    ts = []
    for _ in range(7):
        t = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); ts.append(time.perf_counter() - t)
    ts.sort(); print(mode, batch, "median ms/step %.3f" % (ts[3] / 64 * 1e3), [round(x / 64 * 1e3, 2) for x in ts])
    if len(sys.argv) > 3:
        pr = cProfile.Profile(); pr.enable()
        for _ in range(5): llm.generate(prompts, sp, use_tqdm=False)
        pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(35)
