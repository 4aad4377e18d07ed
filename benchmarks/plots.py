"""PNG plots of the benchmark summary: speed-up vs k, vs link delay, vs batch size, and the fraction of the bound.

Data flow: ``results["summary"]`` rows (``report.summarize``) -> one figure per question, one
panel per scenario -> ``out/*.png``. matplotlib with the Agg backend; knows nothing of specserve.
"""

from __future__ import annotations

from pathlib import Path


def _figure(scenarios: list[str], width: float = 4.6):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(scenarios), figsize=(width * len(scenarios), 3.8), squeeze=False)
    return plt, fig, dict(zip(scenarios, axes[0]))


def _finish(plt, fig, axes, path: Path, xlabel: str, ylabel: str, titles: dict | None = None) -> None:
    for name, ax in axes.items():
        ax.axhline(1.0, color="gray", ls="--", lw=1)
        ax.set(title=(titles or {}).get(name, name), xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def speedup_vs_k(rows: list[dict], path: Path) -> None:
    scenarios = sorted({r["scenario"] for r in rows})
    plt, fig, axes = _figure(scenarios)
    for name, ax in axes.items():
        srows = [r for r in rows if r["scenario"] == name and r["speedup"] is not None]
        for b in sorted({r["batch"] for r in srows}):
            line = sorted(((r["k"], r["speedup"]) for r in srows if r["batch"] == b and r["system"].startswith("specserve k=")))
            if line:
                ax.plot(*zip(*[(0, 1.0)] + line), "o-", label=f"specserve, batch {b}")
            for kind, marker in (("hf", "s"), ("vllm", "^")):
                pts = [(r["k"], r["speedup"]) for r in srows if r["batch"] == b and r["kind"] == kind and r["k"]
                       and "heuristic" not in r["system"]]
                if pts:
                    ax.plot(*zip(*pts), marker, label=f"{kind}, batch {b}")
    _finish(plt, fig, axes, path, "draft tokens per step k", "speed-up over own target-only")


def speedup_vs_delay(rows: list[dict], path: Path, time_scale: dict[str, float]) -> bool:
    """Ray speed-up per one-way delay (sim: in modelled ms, before time_scale), beside the in-process one."""
    ray = [r for r in rows if r["kind"] == "ray" and r["k"] and "no-ahead" not in r["system"] and r["speedup"] is not None]
    if not ray:
        return False
    scenarios = sorted({r["scenario"] for r in ray})
    plt, fig, axes = _figure(scenarios)
    for name, ax in axes.items():
        scale = time_scale.get(name, 1.0)
        for b in sorted({r["batch"] for r in ray if r["scenario"] == name}):
            series = sorted((r for r in ray if r["scenario"] == name and r["batch"] == b), key=lambda r: r["delay_ms"])
            line, = ax.plot([r["delay_ms"] / scale for r in series], [r["speedup"] for r in series], "o-",
                            label=f"remote draft (Ray), batch {b}")
            for r in series:
                if r["link"]:
                    ax.annotate(r["link"], (r["delay_ms"] / scale, r["speedup"]), fontsize=6)
            local = [r for r in rows if r["scenario"] == name and r["batch"] == b and r["kind"] == "specserve"]
            k = series[0]["k"]
            local = next((r for prefix in ("colocated", "specserve") for r in local if r["system"] == f"{prefix} k={k}"), None)
            if local is not None and local["speedup"] is not None:  # colocated (sim) or in-process (CPU pairs)
                ax.axhline(local["speedup"], color=line.get_color(), ls=":", lw=1, label=f"{local['system']}, batch {b}")
    titles = {n: f"{n} (modelled delay; runs used x{time_scale[n]:g})" for n in scenarios if time_scale.get(n, 1.0) != 1.0}
    _finish(plt, fig, axes, path, "one-way link delay (ms)", "speed-up over own target-only", titles)
    return True


def speedup_vs_batch(rows: list[dict], path: Path) -> None:
    scenarios = sorted({r["scenario"] for r in rows})
    plt, fig, axes = _figure(scenarios)
    for name, ax in axes.items():
        srows = [r for r in rows if r["scenario"] == name and r["k"] and r["speedup"] is not None]
        for system in sorted({r["system"] for r in srows}):
            pts = sorted((r["batch"], r["speedup"]) for r in srows if r["system"] == system)
            if len(pts) > 1 or len({r["batch"] for r in srows}) == 1:
                ax.plot(*zip(*pts), "o-", label=system, lw=1)
        ax.set_xscale("log", base=2)
    _finish(plt, fig, axes, path, "batch size (concurrent requests)", "speed-up over own target-only")


def fraction_of_bound(rows: list[dict], path: Path) -> None:
    scenarios = sorted({r["scenario"] for r in rows})
    plt, fig, axes = _figure(scenarios, width=6.0)
    for name, ax in axes.items():
        srows = [r for r in rows if r["scenario"] == name and r["fraction_serial"] is not None]
        labels = [f"{r['system']} b{r['batch']}" for r in srows]
        x = range(len(srows))
        ax.bar([i - 0.2 for i in x], [r["fraction_serial"] for r in srows], 0.4, label="of serial bound")
        ax.bar([i + 0.2 for i in x], [r["fraction_overlapped"] for r in srows], 0.4, label="of overlapped bound")
        ax.set_xticks(list(x), labels, rotation=75, fontsize=6)
    _finish(plt, fig, axes, path, "", "measured speed-up / bound")


def write_plots(results: dict, out: Path) -> list[Path]:
    rows = results["summary"]
    time_scale = {s["name"]: s.get("time_scale", 1.0) for s in results["scenarios"]}
    files = [out / "speedup_vs_k.png", out / "speedup_vs_batch.png", out / "fraction_of_bound.png"]
    speedup_vs_k(rows, files[0])
    speedup_vs_batch(rows, files[1])
    fraction_of_bound(rows, files[2])
    if speedup_vs_delay(rows, out / "speedup_vs_delay.png", time_scale):
        files.append(out / "speedup_vs_delay.png")
    return files
