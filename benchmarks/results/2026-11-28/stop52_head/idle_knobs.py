"""Idle CPU of the specserve app (hf target, demo pair, two-device harness), per process, with Serve's periodic
work at its defaults or slowed: python idle_knobs.py default|slow [target|draft (Ray's head; default target)]"""
import os, sys, time
sys.path.insert(0, "/work/main")
KNOBS = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
         "RAY_enable_metrics_collection": "0"}
if __name__ == "__main__":
    if sys.argv[1] == "slow":
        os.environ.update(KNOBS)
    from collections import defaultdict
    from benchmarks import cpu_share
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_serve import SpecserveServer
    from specserve.serve.ingress import direct_ingress_env, start_serve
    from specserve.config import resolve_model
    os.environ.update(direct_ingress_env(8141))
    with local_cluster(two_device=True, head=sys.argv[2] if len(sys.argv) > 2 else "target") as cluster:
        start_serve("127.0.0.1", 8141, logging_config={"log_level": "WARNING"})
        server = SpecserveServer(resolve_model("demo:target"), resolve_model("demo:draft"), 4, 8141, vllm_target=False)
        time.sleep(10)
        a = cpu_share.snapshot(); t0 = time.time(); time.sleep(30); b = cpu_share.snapshot(); wall = time.time() - t0
        per = defaultdict(float)
        for key, (title, cpu, cores) in b.items():
            d = (cpu - a.get(key, (title, 0.0, cores))[1]) / wall
            if d > 0.002:
                per[title.split()[0][:60]] += d
        top = sorted(per.items(), key=lambda x: -x[1])[:8]
        print(sys.argv[1], "total %.1f%%" % (sum(per.values()) * 100), " | ".join(f"{t} {v*100:.1f}" for t, v in top), flush=True)
        server.close()
