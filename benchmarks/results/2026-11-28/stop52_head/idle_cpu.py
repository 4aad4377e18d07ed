"""Idle CPU per process: the two-device harness with the specserve app up (hf target, demo pair), no requests."""
import os, sys, time
sys.path.insert(0, "/work/main")
from collections import defaultdict
from benchmarks import cpu_share
from benchmarks.bench_cluster import local_cluster
from benchmarks.bench_serve import SpecserveServer
from specserve.serve.ingress import direct_ingress_env, start_serve
from specserve.config import resolve_model

if __name__ == "__main__":
    head = sys.argv[1]
    os.environ.update(direct_ingress_env(8141))
    with local_cluster(two_device=True, head=head) as cluster:
        start_serve("127.0.0.1", 8141, logging_config={"log_level": "WARNING"})
        server = SpecserveServer(resolve_model("demo:target"), resolve_model("demo:draft"), 4, 8141, vllm_target=False)
        time.sleep(10)
        a = cpu_share.snapshot(); t0 = time.time(); time.sleep(20); b = cpu_share.snapshot(); wall = time.time() - t0
        per = defaultdict(float)
        for key, (title, cpu, cores) in b.items():
            before = a.get(key, (title, 0.0, cores))[1]
            d = (cpu - before) / wall
            if d > 0.003:
                per[(title[:90], tuple(sorted(cores)))] += d
        for (title, cores), share in sorted(per.items(), key=lambda x: -x[1]):
            print(f"{share*100:5.1f}%  cores {cores}  {title}")
        print("total", sum(per.values()) * 100)
        server.close()
