"""CPU time of specserve's target and draft actors while idle (after one run), from /proc, in the two-device harness.
Usage: python idle_actor.py [SECONDS]"""
import os, subprocess, sys, time

def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

if __name__ == "__main__":
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 20
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, 8, 64)
    with local_cluster(two_device=True, head="target"):
        rs = [SpecserveRunner(target, draft, {}, options),
              VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options})]
        for r in rs:
            r.run(prompts, 1, 64, True)
        ps = subprocess.run(["ps", "-eo", "pid,psr,args"], capture_output=True, text=True).stdout
        procs = {l.split()[0]: " ".join(l.split()[2:])[:60] for l in ps.splitlines()[1:] if "ray::" in l or "raylet" in l or "gcs_server" in l}
        time.sleep(3)
        before = {p: cpu(p) for p in procs}
        time.sleep(secs)
        for p, name in sorted(procs.items(), key=lambda x: -(cpu(x[0]) - before[x[0]])):
            print(f"{100 * (cpu(p) - before[p]) / secs:5.1f}% of a core  {name}")
        for r in rs:
            r.close()
