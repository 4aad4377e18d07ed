"""Where does a request's time go on its way in, and what does each hop cost: the same target called
in-process, through a Ray actor, through a Serve handle and over HTTP, one request at a time.

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
so the differences between rows are what that hop costs.

An HTTP client has a cost of its own, which any server pays the same (the ``openai`` SDK's request
building and per-chunk parsing, which can take milliseconds on a small CPU). So the HTTP rows are measured with
two clients, the ``openai`` SDK and a minimal one (one HTTP/1.1 request written on an open socket,
the response read up to the first token), and each client is also timed against a null server (a
plain ASGI app in its own process that streams one chunk at once): that floor is the client's own
time, and "server" is a row's time to first token less its client's floor. Target-only
by default (the path's cost, not speculation's); ``--draft`` adds the draft to every row. Writes
``--out``/http_path.md (also printed), http_path.json and http_path.png.

    python -m benchmarks.bench_http                       # the demo target, 30 requests of 32 tokens a row (a few minutes)
    python -m benchmarks.bench_http --draft demo:draft    # with the demo draft in every row
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import time
from pathlib import Path

from .cli import header, parser

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


async def _raw_stream(port: int, body: dict):
    """The minimal client: a POST on a fresh socket (connected before the clock starts), the response
    read as it comes; yields True once per read that holds a data event with text (never the SDK)."""
    data = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer none\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
    try:
        yield False  # connected: the clock starts here
        writer.write(head + data)
        while chunk := await reader.read(1 << 16):
            yield b'"text": "' in chunk and b'"text": "",' not in chunk  # (a chunk with tokens has text)
    finally:
        writer.close()


async def _timed_raw(port: int, body: dict) -> tuple[float, list[float]]:
    stream = _raw_stream(port, body)
    await stream.__anext__()
    return await _timed(stream)


def _null_server(port: int) -> None:
    """An ASGI app that answers any POST with one streamed completion chunk and [DONE] at once: what
    a client alone costs (run in its own process, as a real server is)."""
    import uvicorn

    chunk = json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": "m",
                        "choices": [{"index": 0, "text": "tok", "logprobs": None, "finish_reason": None}]})

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": f"data: {chunk}\n\n".encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def client_floors(n: int, port: int, max_tokens: int) -> dict:
    """Time to first chunk of each client against the null server: (openai SDK, minimal client)."""
    import multiprocessing

    import openai

    proc = multiprocessing.get_context("spawn").Process(target=_null_server, args=(port,), daemon=True)
    proc.start()
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the null server did not start") from None
                time.sleep(0.1)
        body = {"model": "m", "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}

        async def sdk(n):
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0) as http:
                async def one():
                    async for c in await http.completions.create(model="m", prompt=PROMPT, max_tokens=max_tokens, stream=True):
                        yield bool(c.choices and c.choices[0].text)
                return [await _timed(one()) for _ in range(n)]

        async def raw(n):
            return [await _timed_raw(port, body) for _ in range(n)]

        asyncio.run(sdk(3)), asyncio.run(raw(3))
        return {"openai": _stats(asyncio.run(sdk(n)))["ttft_ms"], "minimal": _stats(asyncio.run(raw(n)))["ttft_ms"]}
    finally:
        proc.terminate()
        proc.join(10)


def run_llm(llm, params, n: int) -> list:
    async def deltas():
        async for d in llm.stream(PROMPT, params):
            yield bool(d.token_ids)

    async def main():
        return [await _timed(deltas()) for _ in range(n)]

    return asyncio.run(main())


def main(argv=None) -> int:
    p = parser("benchmarks.bench_http", __doc__)
    p.add_argument("--target", default="demo:target", help="the target model (a directory, a hub id, or demo:target)")
    p.add_argument("--draft", default=None, help="a draft for every row; default: target-only")
    p.add_argument("--requests", type=int, default=30, help="timed requests per row, one at a time (after 3 untimed)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    p.add_argument("--port", type=int, default=8131, help="the router's port; Serve's proxy takes the next, the null server the one after")
    p.add_argument("--out", default="bench_out/http", help="folder for http_path.md, http_path.json and http_path.png")
    args = p.parse_args(argv)
    title = header("benchmarks.bench_http", argv)

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
    with LLM(args.target, draft=args.draft, target_backend="hf") as llm:
        run_llm(llm, params, 3)
        rows["in-process"] = _stats(run_llm(llm, params, args.requests))
    os.environ.update(direct_ingress_env(args.port))  # as `specserve serve` starts its Ray: the router serves --port
    ray.init(num_cpus=4, log_to_driver=False, include_dashboard=False)
    try:
        llm = LLM(args.target, draft=args.draft, ray=True, target_backend="hf", target_num_cpus=0.25, draft_num_cpus=0.25)
        run_llm(llm, params, 3)
        rows["ray actor"] = _stats(run_llm(llm, params, args.requests))
        llm.shutdown()
        assert start_serve("127.0.0.1", args.port, logging_config={"log_level": "WARNING"})  # Serve's proxy: --port + 1
        for direct in (True, False):  # the router's streams from the target: direct TCP (the default), or Serve's handle
            how = "direct stream" if direct else "Serve handle hop"
            config = {"target": {"model": args.target, "backend": "hf", **side}, "server": {"direct_streams": direct}}
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

            async def raw_all(n, port):
                body = {"model": client.model, "prompt": PROMPT, "max_tokens": args.max_tokens, "temperature": 0,
                        "stream": True, "ignore_eos": True}
                return [await _timed_raw(port, body) for _ in range(n)]

            for ingress, port in (("router's own port", args.port), ("Serve's proxy", args.port + 1)):
                asyncio.run(http_all(3, port))
                rows[f"http ({ingress}), {how}"] = {**_stats(asyncio.run(http_all(args.requests, port))), "client": "openai"}
                if ingress == "router's own port":
                    asyncio.run(raw_all(3, port))
                    rows[f"http ({ingress}), {how}, minimal client"] = {**_stats(asyncio.run(raw_all(args.requests, port))),
                                                                          "client": "minimal"}
            serve.delete("bench-http")
    finally:
        serve.shutdown()
        ray.shutdown()
    floors = client_floors(args.requests, args.port + 2, args.max_tokens)
    lines = [title, "", f"{args.target}{' + ' + args.draft if args.draft else ''}, {args.requests} requests of {args.max_tokens} tokens, "
             "one at a time (medians)", "",
             f"Client floors (each client against a null server): openai SDK {floors['openai']:.1f} ms, "
             f"minimal client {floors['minimal']:.1f} ms.", "",
             "| path | TTFT ms | TTFT p90 ms | + over in-process | server: TTFT less the client's floor | + over in-process | TPOT ms |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    base = rows["in-process"]["ttft_ms"]
    for name, r in rows.items():
        extra = f"{r['ttft_ms'] - base:+.1f}" if name != "in-process" else "-"
        server, server_extra = "-", "-"
        if "client" in r:
            r["server_ms"] = r["ttft_ms"] - floors[r["client"]]
            server, server_extra = f"{r['server_ms']:.1f}", f"{r['server_ms'] - base:+.1f}"
        lines.append(f"| {name} | {r['ttft_ms']:.1f} | {r['ttft_p90_ms']:.1f} | {extra} | {server} | {server_extra} | {r['tpot_ms']:.2f} |")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "http_path.json").write_text(json.dumps({"header": title, "args": vars(args), "client_floors_ms": floors, "rows": rows},
                                                   indent=1))
    (out / "http_path.md").write_text("\n".join(lines) + "\n")
    plot(rows, base, out / "http_path.png")
    print(f"wrote {out / 'http_path.md'}, {out / 'http_path.json'}, {out / 'http_path.png'}")
    return 0


def plot(rows: dict, base_ms: float, path: Path) -> None:
    """One bar per path: its median time to first token, the in-process time marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(7, 0.35 * len(names) + 1.2))
    ax.barh(names, [rows[n]["ttft_ms"] for n in names], color="tab:blue")
    ax.axvline(base_ms, color="gray", ls="--", lw=1, label="in-process")
    ax.invert_yaxis()
    ax.set_xlabel("median time to first token, ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
