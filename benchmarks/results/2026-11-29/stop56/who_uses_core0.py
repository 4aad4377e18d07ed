"""Two-device harness at batch B: CPU time of every process (from /proc) over each round of vLLM target-only and of
specserve's defaults, to see what shares the target's core with the engine. Usage: python who_uses_core0.py BATCH ROUNDS"""
import os, sys


def proc_times() -> dict:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:90]
        except OSError:
            continue
        f = stat[stat.rindex(")") + 2:].split()
        out[pid] = (int(f[11]) + int(f[12]), cmd, int(f[36]))  # utime + stime (ticks), cmdline, last cpu
    return out


def report(name, a, b, wall):
    tick = os.sysconf("SC_CLK_TCK")
    rows = sorted(((b[p][0] - a[p][0]) / tick / wall * 100, p, b[p][2], b[p][1]) for p in b if p in a and b[p][0] > a[p][0])
    print(f"--- {name}: wall {wall:.2f} s; % of one core per process (pid, last cpu, cmd)")
    for pct, pid, cpu, cmd in reversed(rows[-10:]):
        if pct >= 0.5:
            print(f"  {pct:5.1f}%  {pid:>7} cpu{cpu}  {cmd}")


if __name__ == "__main__":
    import time
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_vllm import SpecserveRunner, VLLMRunner
    from benchmarks.scenarios import heldout_prompts
    from specserve.config import resolve_model
    batch, runs = int(sys.argv[1]), int(sys.argv[2])
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    options = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    prompts, _ = heldout_prompts(target, max(8, 3 * batch), 64)
    with local_cluster(two_device=True, head="target"):
        rs = {"vllm": VLLMRunner({"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": True, "multiprocessing": False, **options}),
              "defaults": SpecserveRunner(target, draft, {}, options)}
        try:
            for r in rs.values(): r.run(prompts, batch, 64, True)
            for i in range(runs):
                for n, r in rs.items():
                    a, t = proc_times(), time.perf_counter()
                    rec = r.run(prompts, batch, 64, True)
                    wall = time.perf_counter() - t
                    b = proc_times()
                    extra = "" if n == "vllm" else f", spec steps {rec['num_speculative_steps']}/{rec['num_steps']}"
                    report(f"round {i} {n} {sum(map(len, rec['token_ids'])) / rec['wall_s']:.0f} tok/s{extra}", a, b, wall)
        finally:
            for r in rs.values(): r.close()
