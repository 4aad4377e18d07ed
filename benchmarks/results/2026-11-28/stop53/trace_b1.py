"""Controller trace, specserve d=0ms (vLLM target, remote draft) at batch 1 in the two-device harness."""
import json, os, sys
os.environ["SPECSERVE_TRACE"] = "1"
if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    batch, runs, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    res = []
    with local_cluster(two_device=True, head="target"):
        r = SpecserveRunner(target, draft, {"num_speculative_tokens": 4, "draft_min_timeout_s": 5.0}, options)
        v = VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options}) if "vllm" in sys.argv else None
        try:
            for i in range(runs):
                rec = r.run(prompts, batch, 64, True)
                line = {"run": i, "wall_s": rec["wall_s"], "tok_s": sum(map(len, rec["token_ids"])) / rec["wall_s"], "realized": rec["realized"]}
                if v is not None:
                    vr = v.run(prompts, batch, 64, True); line["vllm_tok_s"] = sum(map(len, vr["token_ids"])) / vr["wall_s"]
                print(json.dumps({k: (round(x, 1) if isinstance(x, float) else x) for k, x in line.items()}), flush=True)
                res.append(line)
            spec = r.llm.metrics().get("speculation", {})
            json.dump({"runs": res, "spec": spec}, open(out, "w"))
        finally:
            r.close()
            if v: v.close()
