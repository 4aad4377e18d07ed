"""What a target replica's death costs under load: the resumed requests' added latency and the throughput dip.

``specserve serve`` with two target replicas and one draft (two logical Ray nodes, labelled target and
draft; Serve's direct ingress, as ``specserve serve`` starts it). At each ``--clients`` level that
many clients each stream greedy completions back to back (``--output-len`` tokens, ``ignore_eos``,
through the HTTP API) for ``--duration-s`` seconds; ``--kill-at-s`` seconds in, one target replica
is killed (``ray.kill``: its process ends at once, as under SIGKILL) and Serve starts a replacement.
Every request still under way on the killed replica is resumed on the other from the output it
had streamed (docs/reliability.md). Per level the table gives:

- requests completed and failed (a failure is a non-200 answer or an in-band error);
- how many were resumed (their last chunk's ``specserve.num_resumes``), and their added latency,
  p50 and p99: a resumed request's latency less the median latency of the requests that finished
  undisturbed before the kill;
- the router's own resume time (``specserve_request_resume_seconds``: the failure noticed to the
  first delta from the other replica), mean;
- output tokens per second before the kill (the ``--kill-at-s`` seconds before it, less the first
  5 s of warm-up), in the 5 s after it, in its slowest second after it, and once the replacement
  serves again (after it announces itself), with the seconds the replacement took.

Writes ``--out``/resume.md (also printed) and resume.json.

    python -m benchmarks.bench_resume                                  # 8 and 32 clients, 40 s each (a few minutes)
    python -m benchmarks.bench_resume --clients 8 --duration-s 20 --kill-at-s 8 --output-len 32   # a quick look
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

from .cli import header, parser

APP = "bench-resume"
PROMPTS = ["def parse(text):\n", "class Stack:\n", "import os\n", "for i in range(10):\n", "while True:\n", "x = "]


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, round(q * (len(values) - 1)))]


async def _client(http, url: str, prompt: str, output_len: int, stop_at: float, log: list, tokens: list) -> None:
    """Back-to-back streamed requests until ``stop_at``: each request's (start, end, resumes, ok) in ``log``,
    each chunk's (arrival, tokens) in ``tokens``."""
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    while time.monotonic() < stop_at:
        start, resumes, ok = time.monotonic(), 0, False
        try:
            async with http.stream("POST", url, json=body) as r:
                ok = r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        ok = False
                        continue
                    for c in chunk.get("choices", []):
                        if c.get("token_ids"):
                            tokens.append((time.monotonic(), len(c["token_ids"])))
                    resumes += (chunk.get("specserve") or {}).get("num_resumes", 0)
        except Exception:  # a broken connection is a failed request
            ok = False
        log.append((start, time.monotonic(), resumes, ok))


def _replicas() -> list:
    import ray

    return [ray.get_actor(a["name"], namespace=a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == "serve" and a["name"].startswith(f"SERVE_REPLICA::{APP}#Target#")]


def _target_names() -> set[str]:
    """The target replicas the Registry lists (a killed one stays listed for its last announcement's 2 s)."""
    from ray import serve

    return set(serve.get_deployment_handle("Registry", app_name=APP).snapshot.remote().result()["target"])


def _health(base: str) -> dict:
    import httpx

    try:
        return httpx.get(f"{base}/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return {}


def _metric(base: str, name: str) -> float:
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def _wait_targets(base: str, n: int, timeout_s: float = 300) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        h = _health(base)
        if h.get("targets") == n and h.get("status") == "ok":
            return time.monotonic() - start
        time.sleep(0.2)
    raise TimeoutError(f"{n} target replicas not up within {timeout_s:g} s: {_health(base)}")


def run_level(base: str, clients: int, args) -> dict:
    import httpx
    import ray

    _wait_targets(base, 2)
    resumed_before, took_before = _metric(base, "specserve_requests_resumed_total"), _metric(base, "specserve_request_resume_seconds_sum")
    log, tokens, marks = [], [], {}

    async def main():
        limits = httpx.Limits(max_connections=clients + 4)
        async with httpx.AsyncClient(timeout=600, limits=limits) as http:
            t0 = time.monotonic()
            stop_at = t0 + args.duration_s
            tasks = [asyncio.ensure_future(_client(http, f"{base}/v1/completions", PROMPTS[i % len(PROMPTS)], args.output_len, stop_at,
                                                   log, tokens)) for i in range(clients)]
            await asyncio.sleep(args.kill_at_s)
            before = await asyncio.to_thread(_target_names)
            ray.kill(_replicas()[0], no_restart=False)
            marks["kill"] = time.monotonic()
            while time.monotonic() < stop_at:  # when the replacement serves: a new name in the Registry
                if "back" not in marks and await asyncio.to_thread(_target_names) - before:
                    marks["back"] = time.monotonic()
                await asyncio.sleep(0.25)
            await asyncio.gather(*tasks)
            marks["t0"], marks["end"] = t0, time.monotonic()

    asyncio.run(main())
    kill, t0 = marks["kill"], marks["t0"]
    undisturbed = [end - start for start, end, resumes, ok in log if ok and not resumes and end < kill]
    base_latency = statistics.median(undisturbed) if undisturbed else None
    added = [end - start - base_latency for start, end, resumes, ok in log if ok and resumes] if base_latency else []

    def rate(a: float, b: float) -> float | None:
        return sum(n for t, n in tokens if a <= t < b) / (b - a) if b > a else None

    seconds = [rate(kill + i, kill + i + 1) for i in range(max(1, int(min(marks.get("back", marks["end"]), marks["end"]) - kill)))]
    resumed = _metric(base, "specserve_requests_resumed_total") - resumed_before
    took = _metric(base, "specserve_request_resume_seconds_sum") - took_before
    back = marks.get("back")
    return {
        "clients": clients, "completed": sum(1 for *_, ok in log if ok), "failed": sum(1 for *_, ok in log if not ok),
        "resumed": sum(1 for _, _, resumes, ok in log if resumes), "router_resumes": resumed,
        "undisturbed_latency_s": base_latency, "added_p50_s": _percentile(added, 0.5), "added_p99_s": _percentile(added, 0.99),
        "resume_mean_s": took / resumed if resumed else None,
        "tok_s_before": rate(t0 + min(5.0, args.kill_at_s / 2), kill), "tok_s_5s_after": rate(kill, kill + 5),
        "tok_s_slowest_second": min((s for s in seconds if s is not None), default=None),
        "replacement_s": back - kill if back else None, "tok_s_after_replacement": rate(back, marks["end"]) if back else None,
    }


def table(rows: list[dict], title: str) -> str:
    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [title, "", "| clients | completed | failed | resumed | added latency p50 / p99 (s) | resume (s) | tok/s before | "
             "5 s after | slowest s | replacement up (s) | tok/s then |", "|---" * 11 + "|"]
    for r in rows:
        lines.append(f"| {r['clients']} | {r['completed']} | {r['failed']} | {r['resumed']} | {f(r['added_p50_s'], '.2f')} / "
                     f"{f(r['added_p99_s'], '.2f')} | {f(r['resume_mean_s'], '.3f')} | {f(r['tok_s_before'], '.0f')} | "
                     f"{f(r['tok_s_5s_after'], '.0f')} | {f(r['tok_s_slowest_second'], '.0f')} | {f(r['replacement_s'], '.1f')} | "
                     f"{f(r['tok_s_after_replacement'], '.0f')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = parser("benchmarks.bench_resume", __doc__)
    p.add_argument("--clients", default="8,32", help="client counts, comma-separated; one level each")
    p.add_argument("--duration-s", type=float, default=40.0, help="how long the clients send requests at each level")
    p.add_argument("--kill-at-s", type=float, default=15.0, help="when, into each level, one target replica is killed")
    p.add_argument("--output-len", type=int, default=64, help="tokens generated per request (greedy, ignore_eos)")
    p.add_argument("--target", default="demo:target", help="the target model (a directory, a hub id, or demo:target)")
    p.add_argument("--draft", default="demo:draft", help="the draft model ('none': target-only)")
    p.add_argument("--port", type=int, default=8141, help="the router's port; Serve's proxy takes the next")
    p.add_argument("--out", default="bench_out/resume", help="folder for resume.md and resume.json")
    args = p.parse_args(argv)
    if not 0 < args.kill_at_s < args.duration_s:
        p.error("--kill-at-s must be inside the level's --duration-s")
    title = header("benchmarks.bench_resume", argv)

    import os

    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from specserve.serve import build_app
    from specserve.serve.ingress import direct_ingress_env, start_serve

    os.environ.update(direct_ingress_env(args.port))  # as `specserve serve` starts its Ray: the router serves --port
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "labels": {"specserve.io/role": "target"}})
    cluster.add_node(num_cpus=2, labels={"specserve.io/role": "draft"})
    ray.init(address=cluster.address, log_to_driver=False)
    rows = []
    try:
        assert start_serve("127.0.0.1", args.port, logging_config={"log_level": "WARNING"})
        config = {"target": {"model": args.target, "backend": "hf", "num_cpus": 0.25, "num_replicas": 2},
                  "cluster": {"use_role_labels": True}}
        if args.draft != "none":
            config["draft"] = {"model": args.draft, "num_cpus": 0.25}
        serve.run(build_app(config), name=APP, route_prefix="/")
        base = f"http://127.0.0.1:{args.port}"
        for clients in [int(c) for c in args.clients.split(",")]:
            rows.append(run_level(base, clients, args))
            print(table(rows[-1:], f"{clients} clients"), flush=True)
        serve.delete(APP)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    text = table(rows, title)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resume.md").write_text(text)
    (out / "resume.json").write_text(json.dumps({"title": title, "rows": rows}, indent=2))
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
