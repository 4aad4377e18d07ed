"""Two-device harness, specserve defaults (vLLM target, remote draft), controller trace on (SPECSERVE_TRACE=1 in the
target's actor), each core's busy share over each round: per round, the controller's realized rates against what the round delivered, and every traced cycle
(batch, tokens, ms, arm, pure, prompt tokens) saved for analysis. Usage: python trace_b8.py BATCH ROUNDS OUT.json"""
import json, sys


def cpu_times():
    """Per core: (all jiffies, idle + iowait jiffies), from /proc/stat."""
    out = {}
    for line in open("/proc/stat"):
        if line.startswith("cpu") and line[3].isdigit():
            f = line.split()
            v = list(map(int, f[1:]))
            out[f[0]] = (sum(v), v[3] + v[4])
    return out
if __name__ == "__main__":
    from benchmarks.bench_cluster import THREAD_ENV, local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve import LLM
    from specserve.config import resolve_model

    class Runner(SpecserveRunner):
        def __init__(self, target, draft, vllm_options):
            self.own_engine = False
            self.llm = LLM(target, draft=draft, ray=True, target_backend="vllm", target_backend_options=vllm_options,
                           target_num_cpus=0.25, draft_num_cpus=0.25, cpu_threads=1,
                           runtime_env={"env_vars": {**THREAD_ENV, "SPECSERVE_TRACE": "1"}})

    batch, runs, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    rounds = []
    with local_cluster(two_device=True, head="target"):
        v, s = VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options}), Runner(target, draft, options)
        try:
            v.run(prompts, batch, 64, True)
            s.run(prompts, batch, 64, True)
            for i in range(runs):
                rv = v.run(prompts, batch, 64, True)
                before = len(s.llm.metrics()["speculation"]["trace"])
                c0 = cpu_times()
                rs = s.run(prompts, batch, 64, True)
                c1 = cpu_times()
                busy = {c: round(100 * (1 - (c1[c][1] - c0[c][1]) / max(1, c1[c][0] - c0[c][0])), 1) for c in c0}
                tcyc = sorted(x[2] for x in s.llm.metrics()["speculation"]["trace"][before:] if x[3] == [0, False])
                spec = s.llm.metrics()["speculation"]
                tv, ts = [sum(map(len, r["token_ids"])) / r["wall_s"] for r in (rv, rs)]
                print(f"round {i}: vllm {tv:.0f} specserve {ts:.0f} tok/s ({ts / tv:.3f}x), spec steps {rs['num_speculative_steps']}/{rs['num_steps']}; "
                      f"busy % {busy}, target-only cycles {len(tcyc)} median {tcyc[len(tcyc) // 2] if tcyc else None} ms", flush=True)
                rounds.append({"vllm_tok_s": tv, "specserve_tok_s": ts, "wall_s": rs["wall_s"], "trace": spec["trace"][before:],
                               "realized": spec["realized_tokens_per_s"], "decisions": spec["decisions"], "busy": busy})
        finally:
            v.close(); s.close()
    json.dump(rounds, open(out, "w"))
