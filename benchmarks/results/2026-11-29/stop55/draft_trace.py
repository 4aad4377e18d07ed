"""The draft's own timeline (propose / prepare events, from a tracing patch on a0e6d2b, draft_trace.patch, not committed) while specserve serves
batch B with the defaults in the two-device harness. Usage: python draft_trace.py B RUNS OUT_PREFIX"""
import os, sys
if __name__ == "__main__":
    batch, runs, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.environ["SPECSERVE_DRAFT_TRACE"] = out
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        r = SpecserveRunner(target, draft, {}, options)
        for i in range(runs):
            rec = r.run(prompts, batch, 64, True)
            print("run", i, "tok/s", round(sum(map(len, rec["token_ids"])) / rec["wall_s"]), "hits", rec["num_cache_hits"],
                  "blocks", rec["num_blocks"], "spec steps", rec["num_speculative_steps"], "steps", rec["num_steps"],
                  "verify", round(rec["verify_ms"], 2), "wait", round(rec["draft_wait_ms"], 2), flush=True)
        r.close()
