import json, sys
if __name__ == "__main__":
    from benchmarks.bench_cluster import THREAD_ENV, local_cluster
    from benchmarks.bench_vllm import SpecserveRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    THREAD_ENV["SPECSERVE_TRACE"] = "1"
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    out = []
    with local_cluster(two_device=True):
        ss = SpecserveRunner(target, draft, {"num_speculative_tokens": 4, "draft_min_timeout_s": 5.0}, options)
        for batch in [int(b) for b in sys.argv[1].split(",")]:
            prompts, _ = heldout_prompts(target, max(8, 3 * batch), 32)
            for rep in range(2):
                n0 = len(ss.llm.metrics()["speculation"].get("trace", []))
                rec = ss.run(prompts, batch, 64)
                spec = ss.llm.metrics()["speculation"]
                line = {"batch": batch, "rep": rep, "tok_s": sum(map(len, rec["token_ids"])) / rec["wall_s"], "trace": spec["trace"][n0:],
                        "realized": spec["realized_tokens_per_s"]}
                print(batch, rep, round(line["tok_s"]), flush=True)
                out.append(line)
    json.dump(out, open("warm.json", "w"))
