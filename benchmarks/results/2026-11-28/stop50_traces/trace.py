"""Scratch: demo pair, two-device harness; vLLM TO and specserve alternating; per specserve run the controller's
cycles by arm and its decisions (SPECSERVE_TRACE=1)."""
import json, sys, statistics
from collections import defaultdict
if __name__ == "__main__":
    from benchmarks.bench_cluster import THREAD_ENV, local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    THREAD_ENV["SPECSERVE_TRACE"] = "1"
    batch, reps = int(sys.argv[1]), int(sys.argv[2])
    prompts, _ = heldout_prompts(target, max(24, 3 * batch), 32)
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    out = []
    with local_cluster(two_device=True):
        to = VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, **options})
        ss = SpecserveRunner(target, draft, {"num_speculative_tokens": 4, "draft_min_timeout_s": 5.0}, options)
        for r in (to, ss):
            r.run(prompts, batch, 64)
        for rep in range(reps):
            for name, r in (("to", to), ("ss", ss)) if rep % 2 == 0 else (("ss", ss), ("to", to)):
                spec0 = ss.llm.metrics()["speculation"]
                n0, d0 = len(spec0.get("trace", [])), len(spec0.get("decisions", []))
                rec = r.run(prompts, batch, 64)
                line = {"name": name, "rep": rep, "tok_s": sum(map(len, rec["token_ids"])) / rec["wall_s"], "steps": rec["num_steps"]}
                if name == "ss":
                    spec = ss.llm.metrics()["speculation"]
                    line["trace"], line["decisions"], line["n0"] = spec["trace"][n0:], spec["decisions"][d0:], n0
                    line["spec_steps"] = rec["num_speculative_steps"]
                print(json.dumps({k: v for k, v in line.items() if k not in ("trace", "decisions")}), flush=True)
                out.append(line)
    json.dump(out, open(f"trace_{batch}.json", "w"))
