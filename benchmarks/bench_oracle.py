"""How close does the adaptive controller come to the best fixed arm, chosen in hindsight?

For each simulated setting (a target and a draft on devices of their own, a link, an acceptance
rate; ``backend: sim``) and batch size, every fixed arm (k = 0 .. K, drafting misses or answering
cache-only) and the adaptive default run the same load on a two-node Ray cluster whose nodes sit
on separate cores: B requests in flight over ``--prompts-per-slot`` x B prompts, greedy. Each
system runs the load once untimed (as a server meets its first requests), then timed. The table
gives tokens/s per system, the best fixed arm and adaptive / best; every output is checked
token for token against target-only. Each setting's time scale makes the target's decode step
``--target-step-ms`` long, so the simulated time dominates the engine's own overhead while the
ratios of the devices' and the link's times stay the profiles'.

With ``--traces`` the fixed arms' cycles are saved (``traces.json.gz``): ``bench_replay`` runs any
controller over them offline.

    python -m benchmarks.bench_oracle --out bench_out/oracle                    # six settings, batch 1, 8, 32 (~40 min)
    python -m benchmarks.bench_oracle --settings spark-5090 --batch-sizes 1 --systems adaptive
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROLE_OPTIONS = dict(target_num_cpus=0.5, draft_num_cpus=0.5)


@dataclass(frozen=True)
class Setting:
    name: str
    target: str  # sim profile '<model>-<device>'
    draft: str
    link: str  # sim link profile
    acceptance: float  # greedy acceptance per draft position
    about: str


SETTINGS = [
    Setting("spark-5090", "qwen3-32b-dgx-spark", "qwen3-1.7b-rtx5090", "10gbe", 0.8,
            "a 32B target on a DGX Spark, a 1.7B draft on an RTX 5090 over 10 GbE"),
    Setting("h100-pair", "qwen3-8b-h100", "qwen3-0.6b-h100", "10gbe", 0.7, "an 8B target and a 0.6B draft on two H100s"),
    Setting("5090-pair-1gbe", "qwen3-8b-rtx5090", "qwen3-0.6b-rtx5090", "1gbe", 0.6,
            "an 8B target and a 0.6B draft on two RTX 5090s over 1 GbE, lower acceptance"),
    Setting("never-pays", "qwen3-1.7b-h100", "qwen3-1.7b-rtx5090", "1gbe", 0.5,
            "a draft as large as the target on a slower GPU: speculation cannot pay"),
    Setting("slow-link", "qwen3-8b-rtx5090", "qwen3-1.7b-rtx5090", "wan-5ms", 0.85,
            "a round trip about as long as a target step (5 ms one way)"),
    Setting("h100-5090", "qwen3-32b-h100", "qwen3-1.7b-rtx5090", "1gbe", 0.9, "a 32B target on an H100, a 1.7B draft on an RTX 5090"),
]


def arms(k: int) -> list[tuple[int, bool]]:
    return [(0, False)] + [(kk, m) for kk in range(1, k + 1) for m in (False, True)]


def arm_name(arm) -> str:
    return "target-only" if not arm[0] else f"k={arm[0]}{' cache-only' if arm[1] else ''}"


def time_scale(setting: Setting, step_ms: float) -> float:
    from specserve.backends.sim_latency import load_profile

    return step_ms / 1e3 / load_profile(setting.target).decode_step_s(1, 128)


def build(setting: Setting, arm, k: int, scale: float, address: str, trace: bool):
    """An LLM over Ray for one system: a fixed arm, or (arm None) the adaptive default up to k."""
    from specserve import LLM
    from specserve.backends.sim_latency import load_link

    from .bench_cluster import THREAD_ENV

    env = {**THREAD_ENV, **({"SPECSERVE_TRACE": "1"} if trace else {})}
    target = {"profile": setting.target, "time_scale": scale, "vocab_size": 1024}
    kw = dict(ray=True, address=address, target_backend="sim", target_backend_options=target, cpu_threads=1, max_num_seqs=256,
              runtime_env={"env_vars": env}, **ROLE_OPTIONS)
    if arm is not None and not arm[0]:
        return LLM(f"sim:{setting.target}", draft=None, **kw)  # (its cycles are traced with no arm: target-only's)
    delay_ms = load_link(setting.link).one_way_s(64) * 1e3 * scale  # a greedy step's message: token ids only
    draft = {"profile": setting.draft, "time_scale": scale, "vocab_size": 1024, "acceptance": setting.acceptance}
    fixed = {} if arm is None else {"adaptive": False, "cache_only": arm[1]}
    return LLM(f"sim:{setting.target}", draft=f"sim:{setting.draft}", draft_backend="sim", draft_backend_options=draft,
               num_speculative_tokens=k if arm is None else arm[0], channel_delay_ms=delay_ms, **fixed, **kw)


def run_load(llm, prompts, batch: int, max_tokens: int) -> tuple[float, list[list[int]], dict]:
    from specserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, max_in_flight=batch)
    wall = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / wall, [list(o.token_ids) for o in outs], llm.metrics()


def segments(trace: list, batch: int) -> list[dict]:
    """A fixed arm's recorded steps at full batch: what the replay draws from (``bench_replay``). A
    target without a draft records its cycles with no arm: target-only's."""
    out, current = [], None
    for event in trace:
        kind = event[0]
        if kind == "choose":
            current = {"batch": event[1], "acceptance": [], "coverage": []}
        elif current is None:
            continue
        elif kind == "acceptance":
            current["acceptance"].append(list(event[1:]))
        elif kind == "coverage":
            current["coverage"].append(list(event[1:3]))
        elif kind == "cycle":
            _, b, tokens, seconds, arm, pure, prefill, left = event
            if b == batch and pure:
                out.append({**current, "tokens": tokens, "seconds": seconds, "prefill": prefill, "left": left})
            current = None
    return out


def main(argv=None) -> int:
    from .cli import parser

    p = parser("benchmarks.bench_oracle", __doc__)
    p.add_argument("--settings", default=",".join(s.name for s in SETTINGS), help="settings to run, comma-separated: "
                   + ", ".join(f"{s.name} ({s.about})" for s in SETTINGS))
    p.add_argument("--batch-sizes", default="1,8,32", help="requests in flight, comma-separated")
    p.add_argument("--k", type=int, default=4, help="the largest k (num_speculative_tokens)")
    p.add_argument("--systems", choices=("all", "adaptive", "fixed"), default="all", help="which systems run")
    p.add_argument("--prompts-per-slot", type=int, default=3, help="prompts per request in flight (at least 4 in all)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="tokens per prompt")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens generated per request")
    p.add_argument("--target-step-ms", type=float, default=25.0, help="the target's batch-1 decode step after time scaling")
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each system, one a round, the order rotating")
    p.add_argument("--traces", action="store_true", help="save the fixed arms' cycles for bench_replay")
    p.add_argument("--out", default="bench_out/oracle", help="folder for tables.md, results.json, oracle.png")
    a = p.parse_args(argv)
    wanted = a.settings.split(",")
    unknown = [w for w in wanted if w not in {s.name for s in SETTINGS}]
    if unknown:
        p.error(f"unknown setting(s) {unknown}; known: {[s.name for s in SETTINGS]}")
    settings = [s for s in SETTINGS if s.name in wanted]
    batches = [int(b) for b in a.batch_sizes.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    systems = ([] if a.systems == "adaptive" else arms(a.k)) + ([] if a.systems == "fixed" else [None])
    import random

    from .bench_cluster import local_cluster

    rows, traces = [], {}
    started = time.perf_counter()
    with local_cluster() as cluster:
        for setting in settings:
            scale = time_scale(setting, a.target_step_ms)
            r = random.Random(0)
            loads = {b: [[r.randrange(1024) for _ in range(a.prompt_tokens)] for _ in range(max(4, a.prompts_per_slot * b))]
                     for b in batches}
            names = ["adaptive" if arm is None else arm_name(arm) for arm in systems]
            llms = {}
            try:
                for name, arm in zip(names, systems):
                    llms[name] = build(setting, arm, a.k, scale, cluster.address, a.traces and arm is not None)
                for b in batches:
                    for llm in llms.values():
                        run_load(llm, loads[b], b, a.max_tokens)  # the same load once, untimed
                    rates, exact = {n: [] for n in names}, {n: True for n in names}
                    reference = None
                    for rnd in range(a.repeats):  # every system once a round, the order rotating
                        for name in names[rnd % len(names):] + names[: rnd % len(names)]:
                            rate, tokens, metrics = run_load(llms[name], loads[b], b, a.max_tokens)
                            rates[name].append(rate)
                            reference = tokens if reference is None and name == "target-only" else reference
                            exact[name] = exact[name] and (reference is None or tokens == reference or name == "target-only")
                            print(f"[{time.perf_counter() - started:6.0f}s] {setting.name} batch {b} round {rnd + 1} {name}: "
                                  f"{rate:.1f} tok/s", flush=True)
                    for name in names:
                        metrics = llms[name].metrics()
                        spec = metrics.get("speculation") or {}
                        rows.append({"setting": setting.name, "batch": b, "system": name, "tokens_per_s": statistics.median(rates[name]),
                                     "rounds": rates[name], "exact": exact[name] if "target-only" in names else None,
                                     "arm_by_bucket": spec.get("arm_by_bucket")})
                        if a.traces and name != "adaptive" and spec.get("trace"):
                            by_batch = traces.setdefault(setting.name, {}).setdefault(str(b), {"load_tokens": len(loads[b]) * a.max_tokens})
                            by_batch[name] = segments(spec["trace"], b)
            finally:
                for llm in llms.values():
                    llm.shutdown()
            save(out, a, argv, settings, rows, traces)  # after each setting: a stopped sweep keeps what it measured
    table = save(out, a, argv, settings, rows, traces)
    print(table)
    return 0


def save(out: Path, a, argv, settings, rows: list[dict], traces: dict) -> str:
    """results.json, tables.md, oracle.png (and traces.json.gz) for the rows so far; the table."""
    from .cli import header

    summary = summarize(rows)
    results = {"header": header("benchmarks.bench_oracle", argv), "args": vars(a), "settings": [asdict(s) for s in settings],
               "rows": rows, "summary": summary}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    if traces:
        with gzip.open(out / "traces.json.gz", "wt") as f:
            json.dump({"k": a.k, "max_tokens": a.max_tokens, "prompts_per_slot": a.prompts_per_slot, "settings": traces}, f)
    table = markdown(results)
    (out / "tables.md").write_text(table)
    plot(summary, out / "oracle.png")
    return table


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for key in sorted({(r["setting"], r["batch"]) for r in rows}, key=lambda t: (t[0], t[1])):
        group = [r for r in rows if (r["setting"], r["batch"]) == key]
        fixed = [r for r in group if r["system"] != "adaptive"]
        adaptive = next((r for r in group if r["system"] == "adaptive"), None)
        best = max(fixed, key=lambda r: r["tokens_per_s"], default=None)
        out.append({"setting": key[0], "batch": key[1], "best": best and best["system"], "best_tokens_per_s": best and best["tokens_per_s"],
                    "adaptive_tokens_per_s": adaptive and adaptive["tokens_per_s"],
                    "adaptive_over_best": adaptive["tokens_per_s"] / best["tokens_per_s"] if adaptive and best else None,
                    "adaptive_arm": adaptive and adaptive["arm_by_bucket"],
                    "target_only_tokens_per_s": next((r["tokens_per_s"] for r in fixed if r["system"] == "target-only"), None),
                    "all_exact": all(r["exact"] is not False for r in group)})
    return out


def markdown(results: dict) -> str:
    lines = [results["header"], "", "| setting | batch | target-only tok/s | best fixed arm | its tok/s | adaptive tok/s "
             "| adaptive / best | adaptive's arm by bucket | greedy exact |", "|---|---:|---:|---|---:|---:|---:|---|---|"]
    for s in results["summary"]:
        ratio = s["adaptive_over_best"]
        lines.append(f"| {s['setting']} | {s['batch']} | {_f(s['target_only_tokens_per_s'])} | {s['best'] or '-'} "
                     f"| {_f(s['best_tokens_per_s'])} | {_f(s['adaptive_tokens_per_s'])} | {'-' if ratio is None else f'{ratio:.3f}'} "
                     f"| {s['adaptive_arm'] or '-'} | {'yes' if s['all_exact'] else 'NO'} |")
    ratios = [s["adaptive_over_best"] for s in results["summary"] if s["adaptive_over_best"] is not None]
    if ratios:
        lines += ["", f"adaptive / best fixed arm: min {min(ratios):.3f}, median {statistics.median(ratios):.3f} "
                  f"over {len(ratios)} settings x batch sizes"]
    lines += ["", "Settings:"] + [f"- {s['name']}: {s['about']} (target {s['target']}, draft {s['draft']}, link {s['link']}, "
                                  f"greedy acceptance {s['acceptance']})" for s in results["settings"]]
    return "\n".join(lines) + "\n"


def _f(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def plot(summary: list[dict], path: Path) -> None:
    rows = [s for s in summary if s["adaptive_over_best"] is not None]
    if not rows:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.5 * len(rows)), 3.8))
    ax.bar(range(len(rows)), [s["adaptive_over_best"] for s in rows], color="tab:blue")
    ax.axhline(1.0, color="gray", ls="--", lw=1)
    ax.axhline(0.95, color="tab:red", ls=":", lw=1)
    ax.set_xticks(range(len(rows)), [f"{s['setting']}\nB={s['batch']}" for s in rows], rotation=60, fontsize=7)
    ax.set(ylabel="adaptive / best fixed arm", ylim=(0.5, 1.1), title="The controller against the oracle in hindsight")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
