"""py-spy (non-blocking, raw, 250 Hz, run on the draft's core) of the target actor over each round of specserve's
defaults at batch B in the two-device harness: which code grows in the rounds that run slow. Usage:
python spy_rounds.py BATCH ROUNDS OUTDIR"""
import os, subprocess, sys, time
if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    batch, runs, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    os.makedirs(out, exist_ok=True)
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        r = SpecserveRunner(target, draft, {}, options)
        try:
            r.run(prompts, batch, 64, True)
            ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
            pid = [l.split()[0] for l in ps.splitlines() if "ray::TargetWorker" in l][0]
            for i in range(runs):
                path = f"{out}/round{i}.txt"
                spy = subprocess.Popen(["taskset", "-c", "1", "/work/venv/bin/py-spy", "record", "--nonblocking", "-p", pid, "-d", "4",
                                        "-r", "250", "-f", "raw", "-o", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(0.5)
                rec = r.run(prompts, batch, 64, True)
                spy.wait()
                tok_s = sum(map(len, rec["token_ids"])) / rec["wall_s"]
                print(f"round {i}: {tok_s:.0f} tok/s, spec steps {rec['num_speculative_steps']}/{rec['num_steps']}, wall {rec['wall_s']:.2f} s -> {path}", flush=True)
        finally:
            r.close()
