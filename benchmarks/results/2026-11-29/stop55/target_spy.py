"""py-spy (non-blocking, raw, per thread, idle included) of the target actor in the two-device harness, batch B, specserve
with the vLLM target and no draft (VARIANT=none) or with the defaults (VARIANT=defaults); and the vLLM runner's actor
(VARIANT=vllm). Usage: python target_spy.py VARIANT B OUT.txt"""
import subprocess, sys, time

if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    variant, batch, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        if variant == "vllm":
            r = VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options})
            name = "PlainVLLM"
        else:
            r = SpecserveRunner(target, draft, {"num_speculative_tokens": 0} if variant == "none" else {}, options)
            name = "TargetWorker"
        r.run(prompts, batch, 64, True)
        ps = subprocess.run(["ps", "-eo", "pid,psr,pcpu,args"], capture_output=True, text=True).stdout
        pid = [l.split()[0] for l in ps.splitlines() if "ray::" in l and name in l]
        print("pids", pid, flush=True)
        spy = subprocess.Popen(["taskset", "-c", "1", "/work/venv/bin/py-spy", "record", "--nonblocking", "-p", pid[0], "-d", "20",
                                "-r", "200", "-f", "raw", "-o", out, "--threads", "--idle"])
        t = time.time()
        while time.time() - t < 21:
            rec = r.run(prompts, batch, 64, True)
            print("tok/s", round(sum(map(len, rec["token_ids"])) / rec["wall_s"]), flush=True)
        spy.wait()
        r.close()
