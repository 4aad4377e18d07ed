"""Where a request's time goes on its way in: the same target, four ways, one request at a time.

Measures time to first token (TTFT) and the median gap between streamed tokens (TPOT) for a
greedy request of ``--max-tokens`` tokens through:

- ``in-process``: ``LLM(target).stream`` (the engine loop in this process);
- ``ray actor``: ``LLM(target, ray=True).stream`` (the target in a Ray actor, a streaming call);
- ``serve handle``: ``specserve.connect(app).stream`` (the app's router deployment, then its target
  replica, no HTTP);
- ``http``: the ``openai`` client with ``stream=True`` against the same app: on the router replica's
  own port (Serve's direct ingress, what ``specserve serve`` sets up), and through Serve's proxy.

The last two run twice: with the router streaming from the target over a direct connection (the
default, ``server.direct_streams``) and through a Serve handle call. Each step down adds one hop,
so the differences between rows are what that hop costs. Target-only
by default (the path's cost, not speculation's); ``--draft`` adds the draft to every row. Prints a
table and writes ``--out``/http_path.json.

    python -m benchmarks.bench_http [--requests 30] [--max-tokens 32] [--draft demo:draft]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

PROMPT = [11, 23, 5, 47, 9, 31, 2, 17]


def _stats(samples: list[tuple[float, list[float]]]) -> dict:
    ttft = [t for t, _ in samples]
    gaps = [g for _, gs in samples for g in gs]
    return {"ttft_ms": statistics.median(ttft) * 1e3, "ttft_p90_ms": sorted(ttft)[int(0.9 * (len(ttft) - 1))] * 1e3,
            "tpot_ms": statistics.median(gaps) * 1e3 if gaps else None, "requests": len(samples)}


async def _timed(stream) -> tuple[float, list[float]]:
    """(seconds to the first chunk with a token, gaps between chunks with tokens) of one async stream of
    (has_token: bool) items."""
    start, stamps = time.perf_counter(), []
    async for has_token in stream:
        if has_token:
            stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def run_llm(llm, params, n: int) -> list:
    async def deltas():
        async for d in llm.stream(PROMPT, params):
            yield bool(d.token_ids)

    async def main():
        return [await _timed(deltas()) for _ in range(n)]

    return asyncio.run(main())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="demo:target")
    parser.add_argument("--draft", default=None, help="a draft for every row (default: target-only)")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--port", type=int, default=8131)
    parser.add_argument("--out", default="bench_out/http")
    args = parser.parse_args(argv)

    import openai
    import ray
    from ray import serve

    import specserve
    from specserve import LLM, SamplingParams
    from specserve.serve import build_app
    from specserve.serve.ingress import direct_ingress_env, start_serve

    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    side = {"num_cpus": 0.25}
    rows = {}
    with LLM(args.target, draft=args.draft) as llm:
        run_llm(llm, params, 3)
        rows["in-process"] = _stats(run_llm(llm, params, args.requests))
    os.environ.update(direct_ingress_env(args.port))  # as `specserve serve` starts its Ray: the router serves --port
    ray.init(num_cpus=4, log_to_driver=False, include_dashboard=False)
    try:
        llm = LLM(args.target, draft=args.draft, ray=True, target_num_cpus=0.25, draft_num_cpus=0.25)
        run_llm(llm, params, 3)
        rows["ray actor"] = _stats(run_llm(llm, params, args.requests))
        llm.shutdown()
        assert start_serve("127.0.0.1", args.port, logging_config={"log_level": "WARNING"})  # Serve's proxy: --port + 1
        for direct in (True, False):  # the router's streams from the target: direct TCP (the default), or Serve's handle
            how = "direct stream" if direct else "Serve handle hop"
            config = {"target": {"model": args.target, **side}, "server": {"direct_streams": direct}}
            if args.draft:
                config["draft"] = {"model": args.draft, **side}
            serve.run(build_app(config), name="bench-http", route_prefix="/")
            client = specserve.connect("bench-http")

            async def handle_stream():
                async for d in client.stream(PROMPT, params):
                    yield bool(d.token_ids)

            async def handle_all(n):
                return [await _timed(handle_stream()) for _ in range(n)]

            asyncio.run(handle_all(3))
            rows[f"serve handle, {how}"] = _stats(asyncio.run(handle_all(args.requests)))

            async def http_stream(http):
                chunks = await http.completions.create(model=client.model, prompt=PROMPT, max_tokens=args.max_tokens,
                                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
                async for c in chunks:
                    yield bool(c.choices and c.choices[0].text)

            async def http_all(n, port):  # (a client per event loop: its connections belong to the loop)
                async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0,
                                              timeout=120) as http:
                    return [await _timed(http_stream(http)) for _ in range(n)]

            for ingress, port in (("router's own port", args.port), ("Serve's proxy", args.port + 1)):
                asyncio.run(http_all(3, port))
                rows[f"http ({ingress}), {how}"] = _stats(asyncio.run(http_all(args.requests, port)))
            serve.delete("bench-http")
    finally:
        serve.shutdown()
        ray.shutdown()
    lines = [f"{args.target}{' + ' + args.draft if args.draft else ''}, {args.requests} requests of {args.max_tokens} tokens, "
             "one at a time (medians)", "", "| path | TTFT ms | TTFT p90 ms | + over in-process | TPOT ms |", "|---|---:|---:|---:|---:|"]
    base = rows["in-process"]["ttft_ms"]
    for name, r in rows.items():
        extra = f"{r['ttft_ms'] - base:+.1f}" if name != "in-process" else "-"
        lines.append(f"| {name} | {r['ttft_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {extra} | {r['tpot_ms']:.2f} |")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http_path.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    (out / "http_path.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
