"""specserve serve (vLLM target, demo pair) under vLLM's client at one concurrency; the controller's state after each level."""
import argparse, json, os, sys, tempfile
from pathlib import Path
if __name__ == "__main__":
    from benchmarks.bench_cluster import local_cluster
    from benchmarks.bench_serve import SpecserveServer, run_client
    from specserve.config import resolve_model
    from specserve.serve.ingress import direct_ingress_env, start_serve
    from ray import serve
    levels, out = [int(x) for x in sys.argv[1].split(",")], sys.argv[2]
    args = argparse.Namespace(input_len=32, output_len=64, num_prompts=32, requests_per_client=8, warmups_per_client=1)
    target, draft = resolve_model("demo:target"), resolve_model("demo:draft")
    os.environ.update(direct_ingress_env(8141))
    res = []
    with local_cluster(head=os.environ.get("HEAD", "target")) as cluster:  # HEAD=draft: Ray's head on the draft's box (stop 52)
        cores = (set(cluster.target_cpus), set(cluster.draft_cpus))
        start_serve("127.0.0.1", 8141, logging_config={"log_level": "WARNING"})
        server = SpecserveServer(target, draft, 4, 8141, vllm_target=True)
        reg = serve.get_deployment_handle("Registry", app_name="bench-serve")
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for i, c in enumerate(levels):
                    r = run_client(server.base, target, c, args, Path(tmp), cores)
                    snap = reg.snapshot.remote().result()
                    spec = {n: t.get("speculation") for n, t in snap["target"].items()}
                    res.append({"rep": i, "c": c, "tok_s": r["output_tok_s"], "ttft": r["median_ttft_ms"], "spec": spec})
                    print(i, c, round(r["output_tok_s"], 1), json.dumps({n: {k: v for k, v in (s or {}).items() if k not in ("trace", "decisions")} for n, s in spec.items()})[:1500], flush=True)
        finally:
            server.close()
            serve.shutdown()
    Path(out).write_text(json.dumps(res, default=str))
