"""Which arms would a controller run on recorded cycles, and what rate do its choices imply?

The traces ``bench_oracle --traces`` saves hold, per setting and batch size, every fixed arm's
recorded steps (the cycle's seconds and tokens, each block's acceptance, each cache-only block's
coverage). A replay asks the controller for an arm at each step and answers with that arm's next
recorded step, so a controller can be compared with the best fixed arm, and with another
controller, on the same recorded data: offline, in seconds, untouched by the machine's noise.
``--baseline-rev`` loads a second controller (``specserve/adaptive.py``) from a git revision.

    python -m benchmarks.bench_oracle --traces                                   # writes bench_out/oracle/traces.json.gz
    python -m benchmarks.bench_replay --traces bench_out/oracle/traces.json.gz --baseline-rev HEAD~1
"""

from __future__ import annotations

import gzip
import inspect
import json
import statistics
import subprocess
import sys
import types
from pathlib import Path


def load_traces(path: str | Path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def arm_of(name: str) -> tuple[int, bool]:
    if name == "target-only":
        return (0, False)
    k, _, mode = name.removeprefix("k=").partition(" ")
    return (int(k), mode == "cache-only")


def replay(controller, arms: dict, batch: int, tokens: int) -> dict:
    """Drive ``controller`` on the recorded ``arms`` ({arm: [step, ...]}) until they made ``tokens``; what it
    ran and delivered."""
    # (a controller from before departures were a term of its model is not told them)
    takes = "left" in inspect.signature(controller.observe_cycle).parameters
    left = (lambda step: (step.get("left", 0),)) if takes else (lambda step: ())
    cursor = {arm: 0 for arm in arms}
    ran, made, seconds, sequence = {}, 0, 0.0, []
    while made < tokens:
        controller.choose(batch, True, True)
        arm = tuple(controller.arm)
        recorded = arms.get(arm)
        if not recorded:  # never measured here: run the nearest recorded k of the same mode
            arm = min(arms, key=lambda a: (a[1] != arm[1], abs(a[0] - arm[0])))
            recorded = arms[arm]
        step = recorded[cursor[arm] % len(recorded)]
        cursor[arm] += 1
        for drafted, accepted in step["acceptance"]:
            controller.observe_acceptance(drafted, accepted)
        for asked, got in step["coverage"]:
            controller.observe_coverage(asked, got, batch)
        controller.observe_cycle(batch, step["tokens"], step["seconds"], arm, True, step["prefill"], *left(step))
        ran[arm] = ran.get(arm, 0) + 1
        sequence.append(arm)
        made, seconds = made + step["tokens"], seconds + step["seconds"]
    return {"ran": ran, "tokens_per_s": made / seconds if seconds else 0.0, "sequence": sequence}


def decided_after(sequence: list, run: int = 8) -> int | None:
    """Cycles before the first run of ``run`` cycles of the arm run most: how long a batch size the
    controller meets takes to decide (None: it never settled on it)."""
    top = max(set(sequence), key=sequence.count)
    streak = 0
    for i, arm in enumerate(sequence):
        streak = streak + 1 if arm == top else 0
        if streak == run:
            return i + 1 - run
    return None


def fixed_rates(arms: dict) -> dict:
    return {arm: sum(s["tokens"] for s in rec) / sum(s["seconds"] for s in rec) for arm, rec in arms.items() if rec}


def controller_from_rev(rev: str):
    """The SpeculationController class of ``specserve/adaptive.py`` at a git revision, with the pure-Python
    modules of the package it imports (``cycle_model.py``) at that revision too."""
    package = types.ModuleType(f"specserve_{rev}".replace("~", "_").replace("^", "_"))
    package.__path__ = []
    sys.modules[package.__name__] = package
    for name in ("cycle_model", "adaptive"):  # (in import order)
        shown = subprocess.run(["git", "show", f"{rev}:specserve/{name}.py"], capture_output=True, text=True)
        if shown.returncode:
            continue  # (older revisions kept the whole controller in adaptive.py)
        module = types.ModuleType(f"{package.__name__}.{name}")
        module.__package__ = package.__name__
        sys.modules[module.__name__] = module  # (dataclasses and relative imports look the module up)
        exec(compile(shown.stdout, f"{rev}:specserve/{name}.py", "exec"), module.__dict__)
        setattr(package, name, module)
    return package.adaptive.SpeculationController


def run(traces: dict, controllers: dict, loads: int = 3) -> list[dict]:
    """Per setting and batch size: each controller's rate over ``loads`` loads after one untimed load, as
    bench_oracle runs it (the load's token count is in the traces); every batch size in turn, one
    controller per setting, as one server meets them."""
    rows = []
    k = traces["k"]
    for setting, by_batch in traces["settings"].items():
        ctrls = {name: make(k) for name, make in controllers.items()}
        for batch, recorded in by_batch.items():
            b = int(batch)
            arms = {arm_of(name): [s for s in rec if s["batch"] == b] for name, rec in recorded.items() if name != "load_tokens"}
            arms = {a: rec for a, rec in arms.items() if rec}
            rates = fixed_rates(arms)
            best = max(rates, key=rates.get)
            load = recorded.get("load_tokens") or traces.get("max_tokens", 48) * max(4, traces.get("prompts_per_slot", 3) * b)
            row = {"setting": setting, "batch": b, "best": best, "best_tokens_per_s": rates[best]}
            for name, ctrl in ctrls.items():
                first = replay(ctrl, arms, b, load)  # the untimed load
                got = replay(ctrl, arms, b, loads * load)
                row[name] = {"over_best": got["tokens_per_s"] / rates[best], "ran": got["ran"],
                             "decided_after": decided_after(first["sequence"] + got["sequence"])}
            rows.append(row)
    return rows


def markdown(rows: list[dict], names: list[str]) -> str:
    def arm(a) -> str:
        return "target-only" if not a[0] else f"k={a[0]}{'c' if a[1] else ''}"

    lines = ["| setting | batch | best fixed arm | " + " | ".join(f"{n} / best | {n}: most run | {n}: decided after (cycles)"
                                                                for n in names) + " |",
             "|---|---:|---|" + "---:|---|---:|" * len(names)]
    for r in rows:
        cells = []
        for n in names:
            ran = r[n]["ran"]
            top = max(ran, key=ran.get)
            decided = r[n]["decided_after"]
            cells += [f"{r[n]['over_best']:.3f}", f"{arm(top)} ({ran[top] / sum(ran.values()):.0%})", "-" if decided is None else str(decided)]
        lines.append(f"| {r['setting']} | {r['batch']} | {arm(r['best'])} | " + " | ".join(cells) + " |")
    for n in names:
        ratios = [r[n]["over_best"] for r in rows]
        decided = [r[n]["decided_after"] for r in rows if r[n]["decided_after"] is not None]
        lines.append(f"\n{n}: min {min(ratios):.3f}, median {statistics.median(ratios):.3f} of the best fixed arm; a batch size "
                     f"decided after a median of {statistics.median(decided) if decided else '-'} cycles (most {max(decided, default='-')}, "
                     f"{len(rows) - len(decided)} never settled)")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from specserve.adaptive import SpeculationController

    from .cli import header, parser

    p = parser("benchmarks.bench_replay", __doc__)
    p.add_argument("--traces", required=True, help="traces.json(.gz) written by bench_oracle --traces")
    p.add_argument("--loads", type=int, default=3, help="timed loads per batch size (after one untimed), as bench_oracle's rounds")
    p.add_argument("--baseline-rev", default=None, help="also replay the controller of this git revision")
    p.add_argument("--out", default=None, help="write the table to this markdown file too")
    a = p.parse_args(argv)
    controllers = {"adaptive": lambda k: SpeculationController(k, trace=False)}
    if a.baseline_rev:
        old = controller_from_rev(a.baseline_rev)
        controllers[a.baseline_rev] = lambda k: old(k)
    rows = run(load_traces(a.traces), controllers, a.loads)
    table = header("benchmarks.bench_replay", argv) + "\n\n" + markdown(rows, list(controllers))
    print(table)
    if a.out:
        Path(a.out).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
