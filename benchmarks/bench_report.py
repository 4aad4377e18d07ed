"""Turn ``bench_speculative`` results into markdown tables, PNG plots and ``results.json``.

The break-even rule it prints: speculation with a remote draft beats target-only while
the round trip per step (RTT) is shorter than the time speculation saves per step, and it
beats a colocated draft only while RTT < the drafting time saved by the draft's own
hardware. Knows nothing of specserve or Ray; plain dicts in, files out.
"""

from __future__ import annotations

import json
from pathlib import Path


def markdown_table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if isinstance(v, bool):
            return "yes" if v else "**NO**"
        if isinstance(v, float):
            return f"{v:.2f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def spread(run: dict) -> str:
    """Range of the repeats relative to the median, e.g. '12%' (shared machines are noisy)."""
    t = run["tokens_per_s"]
    return f"{100 * (max(t) - min(t)) / run['median_tokens_per_s']:.0f}%"


def draft_step_ms(results: dict) -> dict[int, float]:
    """Batch size -> ms for one draft-model decode step (drafting one token per sequence)."""
    return {d["batch_size"]: d["step_ms"] for d in results.get("local", {}).get("draft_decode", [])}


def local_section(local: dict, draft_ms: dict[int, float]) -> str:
    rows = [[r["batch_size"], r["k"], r["median_tokens_per_s"], spread(r), r["speedup"], r["acceptance_rate"] if r["k"] else "-",
             r["mean_acceptance_length"] if r["k"] else "-", r["step_ms"],
             r["k"] * draft_ms[r["batch_size"]] if r["k"] and r["batch_size"] in draft_ms else "-",
             r["rtt_budget_ms"] if r["k"] else "-", r["greedy_equals_target_only"]] for r in local["runs"]]
    out = ["## In-process: target-only (k=0) vs speculative",
           markdown_table(["batch", "k", "tokens/s", "spread", "speedup", "acceptance rate", "mean acceptance length", "step ms",
                           "drafting ms/step", "RTT budget ms", "greedy == target-only"], rows)]
    if local["draft_decode"]:
        target_ms = {r["batch_size"]: r["step_ms"] for r in local["runs"] if r["k"] == 0}
        rows = [[d["batch_size"], target_ms[d["batch_size"]], d["step_ms"], d["step_ms"] / target_ms[d["batch_size"]]]
                for d in local["draft_decode"]]
        out += ["", "Decode step of each model alone (one token per sequence):",
                markdown_table(["batch", "target step ms", "draft step ms", "draft / target cost"], rows)]
    return "\n".join(out)


def crossing(delays: list[float], speedups: list[float]) -> str:
    """Observed one-way delay where speedup falls through 1 (linear interpolation)."""
    if speedups[0] < 1:
        return f"never (x{speedups[0]:.2f} at {delays[0]:g} ms)"
    for (d0, s0), (d1, s1) in zip(zip(delays, speedups), zip(delays[1:], speedups[1:])):
        if s1 < 1:
            return f"{d0 + (s0 - 1) / (s0 - s1) * (d1 - d0):.1f}"
    return f"> {delays[-1]:g}"


def delay_for_rtt(rtt: list[dict], target_ms: float) -> float:
    """One-way delay at which the measured round trip reaches ``target_ms`` (2 ms per ms past the last point)."""
    points = sorted((r["delay_ms"], r["rtt_ms_median"]) for r in rtt)
    for (d0, r0), (d1, r1) in zip(points, points[1:]):
        if r0 <= target_ms <= r1 and r1 > r0:
            return d0 + (target_ms - r0) / (r1 - r0) * (d1 - d0)
    d_last, r_last = points[-1]
    return d_last + (target_ms - r_last) / 2.0


def break_even(ray: dict, local: dict | None, draft_ms: dict[int, float]) -> list[dict]:
    """Per (k, batch): what speculation saves per step in-process and on Ray, and the break-even delay."""
    local_budget = {(r["k"], r["batch_size"]): r["rtt_budget_ms"] for r in (local or {}).get("runs", [])}
    rows = []
    spec = [r for r in ray["runs"] if r["k"] > 0]
    for k, b in sorted({(r["k"], r["batch_size"]) for r in spec}):
        series = sorted((r for r in spec if r["k"] == k and r["batch_size"] == b), key=lambda r: r["delay_ms"])
        first = series[0]
        # Break-even where the measured round trip has grown by the budget left at the first delay.
        budget = first["rtt_budget_ms"]
        predicted = delay_for_rtt(ray["rtt"], first["rtt_ms_median"] + budget) if budget > 0 else None
        rows.append({
            "k": k, "batch_size": b, "mean_acceptance_length": first["mean_acceptance_length"],
            "drafting_ms": k * draft_ms[b] if b in draft_ms else None,
            "local_rtt_budget_ms": local_budget.get((k, b)), "rtt_ms": first["rtt_ms_median"],
            "rtt_budget_ms": budget, "predicted_break_even_delay_ms": predicted,
            "observed_break_even_delay_ms": crossing([r["delay_ms"] for r in series], [r["speedup"] for r in series]),
        })
    return rows


def ray_section(ray: dict, local: dict | None, draft_ms: dict[int, float]) -> str:
    base = {r["batch_size"]: r for r in ray["runs"] if r["k"] == 0}
    out = ["## Two Ray nodes: bare channel round trip (target node -> draft node -> back)",
           markdown_table(["one-way delay ms", "RTT median ms", "RTT p90 ms", "RTT min ms"],
                          [[r["delay_ms"], r["rtt_ms_median"], r["rtt_ms_p90"], r["rtt_ms_min"]] for r in ray["rtt"]]),
           "", "## Two Ray nodes: target-only vs speculative with the draft on the other node",
           f"Target-only has no channel, so it is measured once per batch size. Sides reserve {ray['side_cpus']:g} CPU "
           f"each; torch threads per actor: {ray['actor_torch_threads']}."]
    rows = [[r["delay_ms"], r["batch_size"], r["k"], base[r["batch_size"]]["median_tokens_per_s"], r["median_tokens_per_s"],
             spread(r), r["speedup"], r["acceptance_rate"], r["mean_acceptance_length"], r["rtt_ms_median"], r["step_ms"],
             r["greedy_equals_target_only"]] for r in ray["runs"] if r["k"] > 0]
    out.append(markdown_table(["one-way delay ms", "batch", "k", "target-only tok/s", "speculative tok/s", "spread", "speedup",
                               "acceptance rate", "mean acceptance length", "RTT ms", "step ms", "greedy == target-only"], rows))
    ray["break_even"] = rows = break_even(ray, local, draft_ms)
    fmt = lambda v: "-" if v is None else v  # noqa: E731
    out += ["", "## Break-even: RTT < time saved per step",
            "RTT budget = round trip a step could add and still match target-only: in-process (draft colocated, no "
            "link) and on Ray at the first delay (its round trip and actor overheads already paid).",
            markdown_table(["batch", "k", "mean acceptance length", "drafting ms/step", "in-process RTT budget ms",
                            "bare RTT ms", "Ray RTT budget ms", "predicted break-even one-way delay ms", "observed ms"],
                           [[r["batch_size"], r["k"], r["mean_acceptance_length"], fmt(r["drafting_ms"]),
                             fmt(r["local_rtt_budget_ms"]), r["rtt_ms"], r["rtt_budget_ms"],
                             fmt(r["predicted_break_even_delay_ms"]), r["observed_break_even_delay_ms"]] for r in rows])]
    return "\n".join(out)


RULE = """Break-even rule (per target step, one draft round trip per step):
  remote draft beats target-only    while  RTT < time saved per step = L * t_target_step - t_spec_step  ("RTT budget")
  remote draft beats colocated one  while  RTT < drafting time saved = k * (t_draft on the target's hardware - t_draft on the draft's)
where L = tokens per step (mean acceptance length). The RTT budget is measured, not modelled: the wall-time
difference to target-only divided by the number of speculative steps. Here every "node" shares the same CPU,
so the drafting time saved by moving the draft is ~0: a colocated draft wins at any RTT, and a remote one only
pays while its round trip fits in the budget."""


def plot_speedup_vs_k(local: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for b in sorted({r["batch_size"] for r in local["runs"]}):
        runs = sorted((r for r in local["runs"] if r["batch_size"] == b), key=lambda r: r["k"])
        ax1.plot([r["k"] for r in runs], [r["speedup"] for r in runs], "o-", label=f"batch {b}")
        spec = [r for r in runs if r["k"]]
        ax2.plot([r["k"] for r in spec], [r["mean_acceptance_length"] for r in spec], "o-", label=f"batch {b}")
    ax1.axhline(1.0, color="gray", ls="--", lw=1)
    ax1.set(xlabel="num_speculative_tokens k", ylabel="speedup vs target-only (tokens/s)", title="In-process speedup")
    ks = sorted({r["k"] for r in local["runs"]})
    ax2.plot(ks, [k + 1 for k in ks], ":", color="gray", label="k + 1 (all accepted)")
    ax2.set(xlabel="num_speculative_tokens k", ylabel="mean acceptance length", title="Tokens per target step")
    for ax in (ax1, ax2):
        ax.set_xticks(ks)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_speedup_vs_delay(ray: dict, draft_ms: dict[int, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    spec = [r for r in ray["runs"] if r["k"] > 0]
    for k, b in sorted({(r["k"], r["batch_size"]) for r in spec}):
        series = sorted((r for r in spec if r["k"] == k and r["batch_size"] == b), key=lambda r: r["delay_ms"])
        line, = ax1.plot([r["delay_ms"] for r in series], [r["speedup"] for r in series], "o-", label=f"k={k}, batch {b}")
        budget = series[0]["rtt_budget_ms"]
        if budget > 0:  # the budget at the first delay, plus the RTT that run already paid
            ax2.axhline(budget + series[0]["rtt_ms_median"], color=line.get_color(), ls="--", lw=1,
                        label=f"RTT budget, k={k}, batch {b}")
        if b in draft_ms:  # the other side of the rule: what drafting costs per step
            ax2.axhline(k * draft_ms[b], color=line.get_color(), ls=":", lw=1, label=f"drafting time, k={k}, batch {b}")
    ax1.axhline(1.0, color="gray", ls="--", lw=1)
    ax1.set(xlabel="emulated one-way delay (ms)", ylabel="speedup vs target-only on Ray", title="Remote draft: speedup vs link delay")
    if not any(r["rtt_budget_ms"] > 0 for r in spec if r["delay_ms"] == min(x["delay_ms"] for x in spec)):
        ax2.text(0.03, 0.5, "no RTT budget: on Ray, speculation is\nslower than target-only at every delay",
                 transform=ax2.transAxes, ha="left", fontsize=8, color="gray")
    rtt = ray["rtt"]
    ax2.plot([r["delay_ms"] for r in rtt], [r["rtt_ms_median"] for r in rtt], "ko-", label="measured RTT (median)")
    ax2.set(xlabel="emulated one-way delay (ms)", ylabel="ms per step", title="RTT vs the budget and the drafting time")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(results: dict, out: Path) -> str:
    """Write tables.md, results.json and the plots into ``out``; return the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    draft_ms = draft_step_ms(results)
    meta = results["meta"]
    sections = [f"# specserve speculative decoding benchmark ({meta['started']})",
                f"target `{meta['target']}`, draft `{meta['draft']}`, {meta['num_prompts']} prompts x {meta['max_tokens']} "
                f"tokens (greedy, ignore_eos), prompt {meta['prompt_tokens']} tokens, median of {meta['repeats']} repeats, "
                f"torch threads {meta['torch_threads']}, {meta['cpu_count']} CPUs."]
    files = {"results": out / "results.json", "tables": out / "tables.md"}
    if "local" in results:
        sections.append(local_section(results["local"], draft_ms))
        files["speedup_vs_k"] = out / "speedup_vs_k.png"
        plot_speedup_vs_k(results["local"], files["speedup_vs_k"])
    if "ray" in results:
        sections.append(ray_section(results["ray"], results.get("local"), draft_ms))
        files["speedup_vs_delay"] = out / "speedup_vs_delay.png"
        plot_speedup_vs_delay(results["ray"], draft_ms, files["speedup_vs_delay"])
    sections.append(RULE)
    text = "\n\n".join(sections) + "\n"
    files["tables"].write_text(text)
    stripped = json.loads(json.dumps(results, default=str))
    for part in ("local", "ray"):
        for run in stripped.get(part, {}).get("runs", []) + stripped.get(part, {}).get("draft_decode", []):
            run.pop("token_ids", None)  # outputs are checked (greedy == target-only), not stored
    files["results"].write_text(json.dumps(stripped, indent=1))
    return text + "\nwrote " + ", ".join(str(p) for p in files.values())
