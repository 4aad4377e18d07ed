import os, sys, time, subprocess
os.environ["SPECSERVE_EXPERIMENT_K0"] = "1"
if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    variant, out = sys.argv[1], sys.argv[2]
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, 24, 64)
    with local_cluster(two_device=True, head="target"):
        k = 4 if variant == "k0" else 0
        r = SpecserveRunner(target, draft, {"num_speculative_tokens": k, "draft_min_timeout_s": 5.0}, options)
        r.run(prompts, 8, 64, True)
        ps = subprocess.run(["ps", "-eo", "pid,psr,pcpu,args"], capture_output=True, text=True).stdout
        print("\n".join(l[:160] for l in ps.splitlines() if "ray::" in l or "raylet" in l or "gcs" in l), flush=True)
        pid = [l.split()[0] for l in ps.splitlines() if "ray::" in l and ("Target" in l or "Engine" in l)]
        print("target pids", pid, flush=True)
        spy = subprocess.Popen(["taskset", "-c", "1", "/work/venv/bin/py-spy", "record", "-p", pid[0], "-d", "15", "-r", "100", "-f", "raw", "-o", out, "--threads"])
        t = time.time(); n = 0
        while time.time() - t < 16:
            rec = r.run(prompts, 8, 64, True); n += 1
            print("tok/s", round(sum(map(len, rec["token_ids"])) / rec["wall_s"]), flush=True)
        spy.wait()
        r.close()
