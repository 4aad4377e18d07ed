"""A draft server under a flood of strangers: the legitimate target's tokens/s, undisturbed and not.

One ``DraftServer`` (authenticated, the demo draft) serves one real target (the demo target,
``EngineCore`` over TCP on loopback); in the flooded runs ``--strangers`` connections keep
arriving without the secret and send garbage (an HTTP request, a frame header far over the
limit, half a frame, or nothing), each back half a second after it is dropped. Runs alternate
(quiet, flooded, ...), the strangers in a process of their own, and the table gives medians and the ratio; every run's greedy output is
checked against the first quiet run's.

    python -m benchmarks.dev.bench_draft_flood [--strangers 200] [--repeats 3] [--out bench_out/flood]
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import statistics
import threading
import time

from benchmarks.cli import parser

FLOOD_KINDS = ("http", "huge frame", "half frame", "silent")
RECONNECT_S = 0.5  # a dropped stranger is back this soon: ~200 connections open at any time


def _stranger(address: str, kind: str, stop: threading.Event, sent: list[int]) -> None:
    from specserve.transport import _HEADER

    host, port = address.rsplit(":", 1)
    while not stop.is_set():
        try:
            with socket.create_connection((host, int(port)), timeout=5) as s:
                if kind == "http":
                    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 20)
                elif kind == "huge frame":
                    s.sendall(_HEADER.pack(1 << 30, 0))
                elif kind == "half frame":
                    s.sendall(_HEADER.pack(100, 0) + b"x" * 10)
                sent[0] += 1
                s.settimeout(1.0)
                try:
                    while s.recv(4096) and not stop.is_set():  # until the server drops us
                        pass
                except OSError:
                    pass
        except OSError:
            pass
        stop.wait(RECONNECT_S)


def _flood(address: str, strangers: int, stop, counter) -> None:
    """In its own process (the strangers must not share the target's interpreter lock)."""
    done, sent = threading.Event(), [0]
    threads = [threading.Thread(target=_stranger, args=(address, FLOOD_KINDS[i % 4], done, sent), daemon=True)
               for i in range(strangers)]
    for t in threads:
        t.start()
    stop.wait()
    done.set()
    counter.value = sent[0]


def main(argv=None) -> int:
    p = parser("benchmarks.dev.bench_draft_flood", __doc__)
    p.add_argument("--strangers", type=int, default=200, help="unauthenticated connections kept arriving in the flooded runs")
    p.add_argument("--repeats", type=int, default=3, help="pairs of runs, quiet then flooded")
    p.add_argument("--prompts", type=int, default=8, help="prompts per run")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--out", default="bench_out/flood", help="folder for the results")
    args = p.parse_args(argv)

    import torch

    from specserve import SamplingParams
    from specserve.adaptive import SpeculationController
    from specserve.build import build_draft_service, build_target
    from specserve.config import SpecserveConfig
    from specserve.engine import EngineCore, EngineLoop
    from specserve.messages import Hello
    from specserve.pool import DraftPool
    from specserve.secret import new_token
    from specserve.transport import DraftServer, SocketEndpoint

    torch.set_num_threads(1)
    token = new_token()
    cfg = SpecserveConfig.load(target="demo:target", draft="demo:draft", num_speculative_tokens=4, adaptive=False)
    server = DraftServer(build_draft_service(cfg, "d0"), host="127.0.0.1", advertise_host="127.0.0.1", token=token)
    target = build_target(cfg)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = [[3 + i, 20 + 7 * i, 40 + i, 11, 5 + 3 * i] for i in range(args.prompts)]

    def run() -> tuple[float, list]:
        core = EngineCore(target, None, SpeculationController(4, adaptive=False), 64)
        core.pool = DraftPool(discover=lambda: {"d0": server.address}, connect=lambda n, a: SocketEndpoint(a, token=token),
                              hello=Hello("t0", target.vocab_fingerprint()), reopen=core.reopen, background=False,
                              min_timeout_s=30.0, max_timeout_s=60.0)
        loop = EngineLoop(core)
        outs, done = {}, threading.Event()

        def sink_for(i):
            def sink(item):
                if isinstance(item, Exception):
                    outs[i] = item
                else:
                    outs.setdefault(i, []).extend(item.token_ids)
                if isinstance(item, Exception) or item.finished:
                    if len(outs) == len(prompts) and all(isinstance(o, Exception) or len(o) == args.max_tokens for o in outs.values()):
                        done.set()
            return sink

        start = time.perf_counter()
        loop.submit_many([(f"r{i}", p, params, sink_for(i)) for i, p in enumerate(prompts)])
        if not done.wait(600):
            raise RuntimeError("the run did not finish in 600 s")
        wall = time.perf_counter() - start
        accepted = core.totals.num_accepted_tokens
        loop.shutdown()
        return len(prompts) * args.max_tokens / wall, [outs[i] for i in range(len(prompts))], accepted

    rows = {"quiet": [], "flooded": []}
    reference = None
    sent = [0]
    try:
        run()  # warm-up
        for _ in range(args.repeats):
            for mode in ("quiet", "flooded"):
                ctx = multiprocessing.get_context("spawn")
                stop, counter, flood = ctx.Event(), ctx.Value("i", 0), None
                if mode == "flooded":
                    flood = ctx.Process(target=_flood, args=(server.address, args.strangers, stop, counter), daemon=True)
                    flood.start()
                    time.sleep(3.0)  # the flood is on before the target starts
                tps, outs, accepted = run()
                stop.set()
                if flood is not None:
                    flood.join(30)
                    sent[0] += counter.value
                reference = reference or outs
                rows[mode].append({"tok_s": tps, "exact": outs == reference, "accepted": accepted})
                print(f"{mode:8s} {tps:8.1f} tok/s  exact={outs == reference}  accepted={accepted}", flush=True)
    finally:
        server.close()
    quiet, flooded = (statistics.median(r["tok_s"] for r in rows[m]) for m in ("quiet", "flooded"))
    table = ("| run | tok/s (median) | ratio | greedy exact | accepted tokens |\n|---|---:|---:|---|---:|\n"
             + "".join(f"| {m} | {statistics.median(r['tok_s'] for r in rows[m]):.1f} | "
                       f"{statistics.median(r['tok_s'] for r in rows[m]) / quiet:.2f}x | "
                       f"{all(r['exact'] for r in rows[m])} | {min(r['accepted'] for r in rows[m])} |\n" for m in rows))
    note = (f"{args.strangers} strangers ({', '.join(FLOOD_KINDS)}, back {RECONNECT_S:g} s after each drop; {sent[0]} connections made), "
            f"{args.prompts} prompts x {args.max_tokens} tokens, demo pair, k=4, medians of {args.repeats}")
    print(note + "\n\n" + table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "flood.md"), "w") as f:
        f.write(note + "\n\n" + table)
    with open(os.path.join(args.out, "flood.json"), "w") as f:
        json.dump({"args": vars(args), "rows": rows, "ratio": flooded / quiet}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
