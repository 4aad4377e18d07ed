"""How close does ``specserve plan`` come to the rate the system then delivers?

For each pair and batch size: the plan's prediction (``--source measured``: ``plan.measure``, a short
run after which the controller's own fit predicts every arm; ``profiles``: the simulator's profiles,
for the ``sim`` pair only, plus the engine's own time per cycle on this host, which no device profile
holds: the run's time outside the forwards and the waits for the draft, per step), then a run of
the system with its defaults on the same prompts, B requests in flight, after one untimed run of
the same load, in the two-device harness (each Ray node on cores of its own). A round is one plan
and the run right after it; the machine's speed moves between rounds, so the table gives each
round's ratio of predicted to delivered tokens/s (median, min-max) beside the medians of both. Greedy
outputs. The rate delivered is the one while B requests were in flight, as a server's steady load
keeps them (the whole load's, which ends on a drain the plan does not price, beside it).

    python -m benchmarks.bench_plan --pairs realistic,sim,demo --batch-sizes 1,8  # ~15 min on 2 cores
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path
from statistics import median

SIM = ("qwen3-8b-h100", "qwen3-0.6b-h100", 0.7)  # target and draft profiles, greedy acceptance
SIM_STEP_MS = 25.0


def pair(name: str):
    """(target, draft, LLM keywords, prompts) for a pair."""
    if name == "sim":
        from specserve.backends.sim_latency import load_profile

        scale = SIM_STEP_MS / 1e3 / load_profile(SIM[0]).decode_step_s(1, 128)
        options = {"time_scale": scale, "vocab_size": 1024}
        kw = dict(target_backend="sim", draft_backend="sim", target_backend_options={**options, "profile": SIM[0]},
                  draft_backend_options={**options, "profile": SIM[1], "acceptance": SIM[2]})
        r = random.Random(0)
        return f"sim:{SIM[0]}", f"sim:{SIM[1]}", kw, [[r.randrange(1024) for _ in range(32)] for _ in range(64)], scale
    from .scenarios import heldout_prompts

    if name == "demo":
        from specserve.demo_models import DRAFT_PATH, TARGET_PATH

        target, draft = str(TARGET_PATH), str(DRAFT_PATH)
    elif name == "realistic":
        from specserve.demo_models.realistic import cached_pair

        target, draft, _ = (str(p) for p in cached_pair())
    else:
        raise ValueError(f"unknown pair {name!r}: demo, realistic or sim")
    prompts, _ = heldout_prompts(target, 64, 32)
    return target, draft, dict(target_backend="hf", dtype="float32"), prompts, None


def delivered(llm, prompts, batch: int, max_tokens: int) -> tuple[float, float, float]:
    """The load's tokens/s, whole and while ``batch`` requests were in flight (``in_flight_rate``), and
    the engine's own seconds per cycle: the run's time outside the target's forwards and the waits for
    the draft, per step (what ``specserve plan --step-overhead-ms`` adds to the profiles' forwards)."""
    from specserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    load = [prompts[i % len(prompts)] for i in range(max(4 * batch, 8))]
    llm.generate(load, params, use_tqdm=False, max_in_flight=batch)  # untimed, as the plan's own run
    before = llm.metrics()
    start, wall = time.perf_counter(), time.time()
    outs = llm.generate(load, params, use_tqdm=False, max_in_flight=batch)
    seconds = time.perf_counter() - start
    after = llm.metrics()
    spent = sum(after["timing"][key] - before["timing"][key] for key in ("target_forward_s", "prefill_s", "draft_wait_s"))
    overhead = (seconds - spent) / max(1, after["num_steps"] - before["num_steps"])
    return sum(len(o.token_ids) for o in outs) / seconds, in_flight_rate(outs, batch, wall), overhead


def in_flight_rate(outs, batch: int, start: float) -> float:
    """Tokens/s from ``start`` (``time.time()``) to the departure after which fewer than ``batch``
    requests were ever in flight again: the rate the plan predicts, of a server whose load keeps the
    batch full, without the drain a finite load ends on. A request running at that moment counts its
    tokens in proportion to its time (tokens come at a steady pace within one request)."""
    if len(outs) <= batch:
        raise ValueError(f"{len(outs)} requests never leave {batch} in flight after the last one starts")
    end = sorted(o.finished_time for o in outs)[len(outs) - batch]
    tokens = 0.0
    for o in outs:
        first, last, n = o.first_token_time, o.finished_time, len(o.token_ids)
        tokens += n if last <= end else n * max(0.0, end - first) / max(last - first, 1e-9)
    return tokens / (end - start)


def summarize(rows: list[dict]) -> list[dict]:
    """Per pair and batch size: the medians over rounds of the rates delivered and predicted, the arms
    the plans chose, and each round's ratio of prediction to delivery (``measured`` and ``profiled``)."""
    out = {}
    for r in rows:
        out.setdefault((r["pair"], r["batch"]), []).append(r)
    table = []
    for (name, batch), group in out.items():
        row = {"pair": name, "batch": batch, "rounds": len(group), "delivered": median(r["delivered"] for r in group),
               "whole_load": median(r["whole_load"] for r in group), "measured_plan": median(r["measured_plan"] for r in group),
               "measured_arms": sorted({r["measured_arm"] for r in group}),
               "measured": sorted(r["measured_plan"] / r["delivered"] for r in group)}
        if all("profiled_plan" in r for r in group):
            row.update(profiled_plan=median(r["profiled_plan"] for r in group), profiled=sorted(r["profiled_plan"] / r["delivered"] for r in group),
                       overhead_ms=median(r["overhead_ms"] for r in group))
        table.append(row)
    return table


def tables(argv, summary: list[dict]) -> str:
    from .cli import header
    from .report import by_round

    lines = [header("benchmarks.bench_plan", argv), "", "| pair | batch | delivered tok/s (whole load) | plan (measured) | its arms | "
             "measured / delivered, by round | plan (profiles) | profiles / delivered, by round |", "|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in summary:
        profiles = "- | -" if "profiled" not in r else f"{r['profiled_plan']:.1f} | {by_round(r['profiled'])}"
        lines.append(f"| {r['pair']} | {r['batch']} | {r['delivered']:.1f} ({r['whole_load']:.1f}) | {r['measured_plan']:.1f} | "
                     f"{'; '.join(r['measured_arms'])} | {by_round(r['measured'])} | {profiles} |")
    rounds = sorted({r["rounds"] for r in summary})
    lines += ["", f"Medians of {'/'.join(map(str, rounds))} rounds, a round being one plan and the run after it; the ratios by round: "
              "median (min-max). delivered: while B requests were in flight (the rate the plan predicts; the whole load's, with its "
              "drain, in brackets); profiles: the simulator's devices plus the engine's own time per cycle on this host as the run "
              "measured it (" + ", ".join(f"{r['pair']} batch {r['batch']}: {r['overhead_ms']:.1f} ms" for r in summary if "profiled" in r)
              + "; `specserve plan --step-overhead-ms`)"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from specserve import LLM, plan

    from .bench_cluster import THREAD_ENV, local_cluster
    from .cli import parser

    p = parser("benchmarks.bench_plan", __doc__)
    p.add_argument("--pairs", default="realistic,sim", help="pairs, comma-separated: demo, realistic, sim")
    p.add_argument("--batch-sizes", default="1,8", help="powers of two, comma-separated")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    p.add_argument("--rounds", type=int, default=3, help="plans, each with the run after it, per pair")
    p.add_argument("--out", default="bench_out/plan", help="folder for tables.md and results.json")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be at least 1, got {a.rounds}")
    batches = [int(b) for b in a.batch_sizes.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with local_cluster() as cluster:
        for name in a.pairs.split(","):
            target, draft, kw, prompts, scale = pair(name)
            kw.update(ray=True, address=cluster.address, num_speculative_tokens=a.k, cpu_threads=1,
                      target_num_cpus=1, draft_num_cpus=1, runtime_env={"env_vars": THREAD_ENV})
            for round_ in range(a.rounds):
                measured = {r["batch_size"]: r for r in plan.measure(target, draft, prompts, batches, a.max_tokens, **kw)}
                with LLM(target, draft=draft, **kw) as llm:
                    for b in batches:
                        whole, full, overhead = delivered(llm, prompts, b, a.max_tokens)
                        row = {"pair": name, "batch": b, "round": round_, "delivered": full, "whole_load": whole,
                               "measured_plan": measured[b]["tokens_per_s"], "measured_arm": plan.arm_text(measured[b]["arm"]),
                               "overhead_ms": overhead * 1e3}
                        if name == "sim":  # the devices from the profiles, the engine's own time per cycle on this host as measured
                            profiled = [r for r in plan.predict(SIM[0], SIM[1], "10gbe", SIM[2], [b], a.k, context=64, overhead_s=overhead,
                                                                time_scale=scale, prompt_tokens=len(prompts[0]), max_tokens=a.max_tokens)
                                        if r["deployment"] == "remote, drafting ahead"][0]
                            row.update(profiled_plan=profiled["tokens_per_s"], profiled_arm=plan.arm_text(profiled["arm"]))
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    table = tables(argv, summarize(rows))
    (out / "tables.md").write_text(table)
    (out / "results.json").write_text(json.dumps({"args": vars(a), "rows": rows}, indent=1))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
