"""Turn the benchmark's per-repeat records into summary rows, markdown tables and ``results.json``.

Data flow: records (one per system, batch size and repeat) -> ``summarize`` (median tokens/s
with min-max, speed-up over the system's own target-only, acceptance, tokens per step, the
per-step split, the greedy check, the analytical bounds) -> ``markdown`` -> tables.md; the
records (token ids dropped) and the summary -> results.json. Bounds, with E = tokens per step,
k = draft tokens per step, t_target1 the target-only step, t_verify the verify forward,
t_draft one draft forward, RTT the round trip per step (all measured):

    serial      E / ((k t_draft + t_verify + RTT) / t_target1)
    overlapped  E / (max(k t_draft, t_verify + RTT) / t_target1)

Knows nothing of specserve; plain dicts in, text and files out.
"""

from __future__ import annotations

import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

STEP_KEYS = ("step_ms", "target_forward_ms", "draft_forward_ms", "link_ms", "overhead_ms")


def read_results(path: str | Path) -> dict:
    """A results file a benchmark wrote, as written (``results.json``) or gzipped (the runs kept in
    ``benchmarks/results``, ``*.json.gz``): told by the file's first bytes, not its name."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data)


def by_round(ratios: list[float], unit: str = "", count: bool = False) -> str:
    """A ratio paired by round, as a table cell: median (min-max), and with ``count`` the rounds at or
    above 1.0 of all."""
    cell = f"{statistics.median(ratios):.2f}{unit} ({min(ratios):.2f}-{max(ratios):.2f})"
    return f"{cell}, {sum(r >= 1.0 for r in ratios)}/{len(ratios)}" if count else cell


def _median(rs: list[dict], key: str):
    values = [r[key] for r in rs if r.get(key) is not None]
    return statistics.median(values) if values else None


def _draft_step_ms(rs: list[dict]):
    values = [r["draft_step_ms"] if r.get("draft_step_ms") is not None else (r.get("speculation") or {}).get("draft_step_ms")
              for r in rs]
    values = [v for v in values if v]
    return statistics.median(values) if values else None


def _sum_lists(lists: list[list[int]]) -> list[int]:
    width = max((len(x) for x in lists), default=0)
    return [sum(x[j] for x in lists if j < len(x)) for j in range(width)]


def per_token_acceptance(per_pos: list[int], num_drafts: int) -> float | None:
    """P(draft token accepted | the ones before it were): accepted / positions reached."""
    reached = num_drafts + sum(per_pos[:-1])
    return sum(per_pos) / reached if per_pos and reached else None


def summarize(records: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in records:
        groups[(r["scenario"], r["system"], r["batch"])].append(r)
    rows = {}
    for key, rs in groups.items():
        tps = [sum(len(t) for t in r["token_ids"]) / r["wall_s"] for r in rs]
        drafts, draft_tokens = sum(r.get("num_drafts", 0) for r in rs), sum(r.get("num_draft_tokens", 0) for r in rs)
        accepted = sum(r.get("num_accepted_tokens", 0) for r in rs)
        per_pos = _sum_lists([r.get("num_accepted_tokens_per_pos") or [] for r in rs])
        first = rs[0]
        rows[key] = {
            "scenario": key[0], "system": key[1], "batch": key[2], "kind": first["kind"], "k": first["k"], "baseline": first["baseline"],
            "delay_ms": first.get("delay_ms", 0.0), "link": first.get("link", ""), "repeats": len(rs),
            "num_tokens": sum(len(t) for t in first["token_ids"]), "tokens_per_s": statistics.median(tps),
            "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps), "steady_tokens_per_s": _median(rs, "steady_tokens_per_s"),
            "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "per_token_acceptance": per_token_acceptance(per_pos, drafts),
            "tokens_per_step": 1 + accepted / drafts if drafts else (1.0 if first["k"] == 0 else None),
            "draft_tokens_per_step": draft_tokens / drafts if drafts else 0.0,
            "draft_step_ms": _draft_step_ms(rs), "cache_hits": sum(r.get("num_cache_hits", 0) for r in rs),
            **{k: _median(rs, k) for k in STEP_KEYS}, "token_ids": first["token_ids"],
            "speculation": rs[-1].get("speculation"), "predicted": rs[-1].get("predicted"),
            "variable_k": "adaptive" in key[1] or "heuristic" in key[1],
            "all_repeats_equal": all(r["token_ids"] == first["token_ids"] for r in rs),
        }
    for row in rows.values():
        base = rows.get((row["scenario"], row["baseline"], row["batch"]))
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        row["steady_speedup"] = (row["steady_tokens_per_s"] / base["steady_tokens_per_s"]
                                 if base and row["steady_tokens_per_s"] and base["steady_tokens_per_s"] else None)
        row["greedy_exact"] = (base is not None and row["all_repeats_equal"] and base["all_repeats_equal"]
                               and row["token_ids"] == base["token_ids"])
        row.update(bounds(row, base))
    return [{k: v for k, v in row.items() if k != "token_ids"} for row in rows.values()]


def bounds(row: dict, base: dict | None) -> dict:
    """The serial and overlapped speed-up bounds and the fraction of each the system reached."""
    out = {"serial_bound": None, "overlapped_bound": None, "fraction_serial": None, "fraction_overlapped": None,
           "steady_fraction_overlapped": None}
    e, k, t_draft = row["tokens_per_step"], row["draft_tokens_per_step"], row["draft_step_ms"]
    t_verify, rtt = row["target_forward_ms"], row["link_ms"] or 0.0
    t1 = base["target_forward_ms"] if base else None
    if not (row["k"] and e and k and t_draft and t_verify and t1) or row["variable_k"]:
        return out  # the bounds assume one k for every step
    out["serial_bound"] = e * t1 / (k * t_draft + t_verify + rtt)
    out["overlapped_bound"] = e * t1 / max(k * t_draft, t_verify + rtt)
    if row["speedup"]:
        out["fraction_serial"] = row["speedup"] / out["serial_bound"]
        out["fraction_overlapped"] = row["speedup"] / out["overlapped_bound"]
    if row.get("steady_speedup"):
        out["steady_fraction_overlapped"] = row["steady_speedup"] / out["overlapped_bound"]
    return out


# -------------------------------------------------------------------------------- markdown


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, bool):
            return "yes" if v else "**NO**"
        if isinstance(v, float):
            return f"{v:.2f}" if abs(v) < 1000 else f"{v:.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" if i else ":---" for i in range(len(headers))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows])


def main_table(rows: list[dict]) -> str:
    return table(
        ["system", "k", "tok/s", "min-max", "speed-up", "acceptance", "tokens/step", "step ms", "target fwd", "draft fwd",
         "link", "overhead", "greedy exact", "serial bound", "overlapped bound", "% serial", "% overlapped",
         "steady tok/s", "steady speed-up", "steady % overlapped"],
        [[r["system"], r["k"], r["tokens_per_s"], f"{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}", r["speedup"],
          r["acceptance_rate"], r["tokens_per_step"], r["step_ms"], r["target_forward_ms"], r["draft_forward_ms"], r["link_ms"],
          r["overhead_ms"], r["greedy_exact"], r["serial_bound"], r["overlapped_bound"],
          None if r["fraction_serial"] is None else f"{100 * r['fraction_serial']:.0f}%",
          None if r["fraction_overlapped"] is None else f"{100 * r['fraction_overlapped']:.0f}%",
          r.get("steady_tokens_per_s"), r.get("steady_speedup"),
          None if r.get("steady_fraction_overlapped") is None else f"{100 * r['steady_fraction_overlapped']:.0f}%"] for r in rows])


def predicted_section(rows: list[dict]) -> str:
    """The adaptive controller's predicted speed-up per k beside the fixed-k runs' measured speed-up."""
    out = []
    for r in rows:
        if not r.get("predicted"):
            continue
        measured = {x["k"]: x["speedup"] for x in rows if x["kind"] == "specserve" and x["system"].startswith("specserve k=")
                    and x["batch"] == r["batch"]}
        chosen = (r.get("speculation") or {}).get("k")
        out.append(f"Batch {r['batch']}: `{r['system']}` measured x{r['speedup']:.2f}, last chosen k = {chosen}.")
        out.append(table(["k", "expected tokens/step", "predicted step ms", "predicted speed-up", "measured speed-up (fixed k)"],
                         [[p["k"], p["expected_tokens"], None if p["step_s"] is None else 1e3 * p["step_s"], p["speedup"],
                           measured.get(p["k"], 1.0 if p["k"] == 0 else None)] for p in r["predicted"]]))
    return "\n\n".join(out)


def ray_state_section(rows: list[dict]) -> str:
    spec = [r for r in rows if r["kind"] == "ray" and r["k"] and r.get("speculation")]
    return table(["system", "batch", "k", "acceptance per position", "link ms", "draft step ms", "cache hit rate", "speed-up"],
                 [[r["system"], r["batch"], r["speculation"]["k"], " ".join(f"{a:.2f}" for a in r["speculation"]["acceptance_per_pos"]),
                   r["speculation"]["link_ms"], r["speculation"]["draft_step_ms"], r["speculation"]["cache_hit_rate"], r["speedup"]]
                  for r in spec]) if spec else ""


def distance_section(rows: list[dict], sim: bool) -> str:
    """'Speculation at a Distance': a remote draft beats a colocated one while RTT < the drafting time it saves."""
    local_name = "colocated" if sim else "specserve"
    out = []
    for r in rows:
        if r["kind"] != "ray" or not r["k"]:
            continue
        colocated = next((x for x in rows if x["batch"] == r["batch"] and x["kind"] == "specserve"
                          and x["system"] == f"{local_name} k={r['k']}"), None)
        if colocated is None or not (colocated["draft_step_ms"] and r["draft_step_ms"]):
            continue
        saved = r["draft_tokens_per_step"] * (colocated["draft_step_ms"] - r["draft_step_ms"])
        rtt = r["link_ms"] or 0.0
        out.append([r["system"], r["batch"], rtt, colocated["draft_step_ms"], r["draft_step_ms"], saved, rtt < saved,
                    r["speedup"], colocated["speedup"], (r["speedup"] or 0) > (colocated["speedup"] or 0)])
    if not out:
        return ""
    return table(["remote system", "batch", "RTT ms/step", "colocated draft step ms", "remote draft step ms",
                  "drafting time saved ms/step", "RTT < saved (pays in theory)", "remote speed-up", "colocated speed-up",
                  "remote beats colocated (measured)"], out)


def markdown(results: dict) -> str:
    meta, rows = results["meta"], results["summary"]
    parts = [f"# specserve systems benchmark ({meta['started']}{', QUICK: tiny sizes, noisy' if meta['quick'] else ''})",
             *([meta["header"]] if meta.get("header") else []),
             f"{meta['cpu_count']} CPUs, torch threads 1 everywhere, greedy (temperature 0, ignore_eos), prompts of "
             f"{meta['prompt_tokens']} tokens, {meta['max_tokens']} new tokens each, batch B = "
             + ("waves of B concurrent requests; " if meta.get("load", "wave") == "wave" else
                f"B requests in flight (a new one as each finishes) over max({meta.get('requests_per_slot', 3)} B, prompts) prompts; "
                "'steady' is the throughput while the window was full (tokens made from the first admission to the last, over "
                "that time: a finite run's draining tail left out); ")
             + f"median of {meta['repeats']} interleaved repeats (min-max beside it). Speed-up is over the system's own target-only "
             "run; 'greedy exact' compares token ids with that run. Step times are medians per target step, in ms."]
    for s in results["scenarios"]:
        parts.append(f"## Scenario `{s['name']}`: target `{s['target']}`, draft `{s['draft']}`")
        parts += s.get("notes", [])
        srows = [r for r in rows if r["scenario"] == s["name"]]
        for b in sorted({r["batch"] for r in srows}):
            parts += [f"### batch {b}", main_table([r for r in srows if r["batch"] == b])]
        predicted = predicted_section(srows)
        if predicted:
            parts += ["### Adaptive controller: predicted vs measured speed-up", predicted]
        ray = ray_state_section(srows)
        if ray:
            parts += ["### Over Ray: the target's speculation state (metrics()['speculation'])", ray]
        distance = distance_section(srows, s.get("sim", False))
        if distance:
            parts += ["### Does remote drafting pay? (RTT < drafting time saved, arXiv 2606.25091)", distance]
    if results.get("skipped"):
        parts += ["## Skipped", "\n".join(f"- {x['scenario']} / {x['system']}: {x['reason']}" for x in results["skipped"])]
    return "\n\n".join(parts) + "\n"


def write_report(results: dict, out: Path) -> str:
    """tables.md and results.json (every repeat, token ids dropped) into ``out``; returns the markdown."""
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(results)
    (out / "tables.md").write_text(text)
    slim = dict(results, records=[{k: v for k, v in r.items() if k != "token_ids"} for r in results["records"]])
    (out / "results.json").write_text(json.dumps(slim, indent=1, default=str))
    return text
