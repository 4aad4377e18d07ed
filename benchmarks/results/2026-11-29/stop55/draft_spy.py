"""py-spy (non-blocking, raw) of the draft actor while specserve serves batch B with the defaults (two-device harness).
Usage: python draft_spy.py B OUT.txt"""
import subprocess, sys, time

if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    batch, out = int(sys.argv[1]), sys.argv[2]
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        r = SpecserveRunner(target, draft, {}, options)
        r.run(prompts, batch, 64, True)
        ps = subprocess.run(["ps", "-eo", "pid,psr,pcpu,args"], capture_output=True, text=True).stdout
        pid = [l.split()[0] for l in ps.splitlines() if "ray::" in l and "Draft" in l]
        print("draft pids", pid, [l[:120] for l in ps.splitlines() if "ray::" in l], flush=True)
        spy = subprocess.Popen(["taskset", "-c", "0", "/work/venv/bin/py-spy", "record", "--nonblocking", "-p", pid[0], "-d", "20",
                                "-r", "200", "-f", "raw", "-o", out, "--threads", "--idle"])
        t = time.time()
        while time.time() - t < 21:
            rec = r.run(prompts, batch, 64, True)
            m = rec
            print("tok/s", round(sum(map(len, rec["token_ids"])) / rec["wall_s"]), "hits", rec["num_cache_hits"], "blocks", rec["num_blocks"],
                  "spec steps", rec["num_speculative_steps"], "steps", rec["num_steps"], flush=True)
        spy.wait()
        r.close()
