"""What a streamed token costs the target replica's process beside the model: ``EngineLoop`` ->
direct stream server (``specserve/serve/streams.py``) -> TCP, with no model.

A stand-in engine core emits one token per running request per step, each step after
``--step-ms`` of sleep (the GIL free, as during a forward); the real ``EngineLoop`` and
``StreamServer`` carry the deltas; a client in a process of its own opens ``--streams``
authenticated streams (the router's ``open_stream``) and reads every delta. Per repeat: the
replica process's CPU seconds (user + system, ``resource.getrusage``) per delta, and the wall
time per step. One table to stdout, results to ``--out``/stream_path.json.

    python -m benchmarks.dev.bench_stream_path [--streams 32] [--tokens 300] [--step-ms 2] [--repeats 3]
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import resource
import statistics
import time
from pathlib import Path

from benchmarks.cli import parser
from specserve.engine import EngineLoop, StepResult
from specserve.outputs import StepDelta
from specserve.serve.streams import StreamServer, open_stream

SECRET = "bench-stream-path-secret"


class TokenPerStepCore:
    """The surface ``EngineLoop`` drives, with a sleep for a forward: one token per request per step."""

    def __init__(self, tokens: int, step_s: float):
        self.tokens, self.step_s = tokens, step_s
        self.on_deltas = None
        self.pool = None
        self.waiting: list = []
        self.running: dict[str, int] = {}
        self.counters = {"num_steps": 0, "num_requests_aborted": 0}

    def validate(self, token_ids, params) -> None:
        pass

    def add_request(self, request_id: str, token_ids, params) -> None:
        self.running[request_id] = 0

    def abort(self, request_id: str) -> bool:
        return self.running.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.running)

    def idle(self) -> None:
        pass

    def step(self) -> StepResult:
        time.sleep(self.step_s)
        out = StepResult()
        for rid in list(self.running):
            n = self.running[rid] = self.running[rid] + 1
            done = n >= self.tokens
            out.deltas.append(StepDelta(rid, [7], "x", done, "length" if done else None))
            if done:
                del self.running[rid]
        self.counters["num_steps"] += 1
        return out


def _client(address: str, streams: int, tokens: int, results) -> None:
    async def one(i: int) -> int:
        stream = await open_stream(address, SECRET, f"r{i}", [1, 2, 3], {"max_tokens": tokens, "temperature": 0.0})
        return sum([len(d["token_ids"]) async for d in stream])

    async def run() -> int:
        return sum(await asyncio.gather(*(one(i) for i in range(streams))))

    results.put(asyncio.run(run()))


def main(argv=None) -> int:
    p = parser("benchmarks.dev.bench_stream_path", __doc__)
    p.add_argument("--streams", type=int, default=32, help="concurrent streams (the router's requests)")
    p.add_argument("--tokens", type=int, default=300, help="tokens per stream")
    p.add_argument("--step-ms", type=float, default=2.0, help="each step's stand-in forward, a sleep")
    p.add_argument("--repeats", type=int, default=3, help="runs, each with a fresh client process")
    p.add_argument("--out", default="bench_out/stream_path", help="folder for stream_path.json")
    args = p.parse_args(argv)

    loop = EngineLoop(TokenPerStepCore(args.tokens, args.step_ms / 1e3))
    server = StreamServer(loop, SECRET, "127.0.0.1", "bench", max_streams=4 * args.streams, max_request_bytes=1 << 20)
    ctx = mp.get_context("spawn")
    rows = []
    try:
        for repeat in range(args.repeats):
            results = ctx.Queue()
            client = ctx.Process(target=_client, args=(server.address, args.streams, args.tokens, results))
            client.start()
            while not loop.core.running:  # the client's imports and connections are not the replica's cost
                if not client.is_alive():
                    raise RuntimeError(f"the client exited (code {client.exitcode}) before its first request")
                time.sleep(0.001)
            before, steps, start = resource.getrusage(resource.RUSAGE_SELF), loop.core.counters["num_steps"], time.perf_counter()
            tokens = results.get(timeout=600)
            wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            client.join()
            cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
            steps = loop.core.counters["num_steps"] - steps
            rows.append({"repeat": repeat, "tokens": tokens, "steps": steps, "cpu_s": cpu, "wall_s": wall,
                         "cpu_us_per_delta": cpu / tokens * 1e6, "step_ms": wall / max(steps, 1) * 1e3})
    finally:
        server.close()
        loop.shutdown()
    print(f"{args.streams} streams x {args.tokens} tokens, stand-in forward {args.step_ms:g} ms a step\n")
    print("| repeat | deltas | steps | replica CPU us / delta | ms / step |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['repeat']} | {r['tokens']} | {r['steps']} | {r['cpu_us_per_delta']:.1f} | {r['step_ms']:.2f} |")
    print(f"\nmedian: {statistics.median(r['cpu_us_per_delta'] for r in rows):.1f} us of the replica's CPU per streamed delta")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stream_path.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
