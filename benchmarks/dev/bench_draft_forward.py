"""A draft's forward, eager against compiled (``draft.compile``): what one call of each shape drafting
uses costs, on the cores this process may use.

Both backends load the same model with ``HFBackend`` (the draft's own code path); the compiled one
runs ``HFBackend.compile`` first (its warm-up compiles every shape below). Each shape runs
``--repeats`` times in turn, eager then compiled, and the table shows medians and the ratio:
prompts (a new sequence's feed), one token per sequence (the glue and drafting a miss), and branch
trees (one depth of the speculation cache, sequences x lanes rows). One torch thread, pinned to the
current affinity, as the draft runs in the two-device harness. A draft head (EAGLE, MTP) loads as its
drafter does (``HeadBackend``, beside ``--target``) and gets zero rows in place of the target's.

    taskset -c 1 python -m benchmarks.dev.bench_draft_forward                  # the demo draft
    taskset -c 1 python -m benchmarks.dev.bench_draft_forward --model demo:eagle   # the demo target's EAGLE-3 head
    taskset -c 1 python -m benchmarks.dev.bench_draft_forward --model path/to/draft --out bench_out/x
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.cli import parser

SHAPES = [  # (label, batch, kind, width or lanes)
    ("prompt, 40 tokens", 1, "feed", 40),
    ("one token", 1, "feed", 1),
    ("one token", 8, "feed", 1),
    ("one token", 32, "feed", 1),
    ("tree depth, 4 lanes", 1, "tree", 4),
    ("tree depth, 4 lanes", 8, "tree", 4),
    ("tree depth, 4 lanes", 32, "tree", 4),
    ("tree depth, 12 lanes", 32, "tree", 12),
]
CONTEXT = 48  # tokens each sequence holds before a timed call


def _call(backend, ids: list[str], kind: str, width: int):
    for s in ids:  # every call starts from the same cached length (a feed commits its tokens)
        backend.truncate(s, CONTEXT)
    rows = backend._scratch_rows([width] * len(ids))  # (a head's input rows; None for a causal LM)
    if kind == "feed":
        return backend.forward(ids, [[1] * width] * len(ids), [1] * len(ids), hidden=rows)
    return backend.forward_branches(ids, [[1] * width] * len(ids), [[CONTEXT] * width] * len(ids), 0, width,
                                    hidden=None if rows is None else torch.stack(rows))


def _loader(model: str, target: str):
    """Builds a fresh backend for ``model`` as its drafter would: ``HFBackend``, or a head's ``HeadBackend``."""
    from specserve.backends.hf import HFBackend
    from specserve.eagle import head_spec, load_head, target_info
    from specserve.head_drafter import HeadBackend
    from specserve.models import load_config

    if head_spec(model) is None:
        return lambda: HFBackend(model, dtype="float32")
    layers = target_info(load_config(target, False))["num_hidden_layers"]
    return lambda: HeadBackend(load_head(model, target, layers))


def main(argv=None) -> dict:
    p = parser("benchmarks.dev.bench_draft_forward", __doc__)
    p.add_argument("--model", default="demo:draft", help="draft model directory, or a draft head's")
    p.add_argument("--target", default="demo:target", help="a draft head's target (its shared tensors)")
    p.add_argument("--repeats", type=int, default=200, help="timed calls per shape and backend")
    p.add_argument("--out", default="bench_out/draft_forward", help="folder for tables.md, results.json and the plot")
    args = p.parse_args(argv)

    from specserve.config import resolve_model

    torch.set_num_threads(1)
    model = resolve_model(args.model)
    load = _loader(model, resolve_model(args.target))
    eager, compiled = load(), load()
    started = time.perf_counter()
    if not compiled.compile():
        raise SystemExit("the model did not compile (see the warning above): nothing to compare")
    compile_s = time.perf_counter() - started
    ids = [f"s{i}" for i in range(max(b for _, b, _, _ in SHAPES))]
    rows = []
    with torch.no_grad():
        for backend in (eager, compiled):
            for s in ids:
                backend.add(s)
                backend.forward([s], [list(range(1, CONTEXT + 1))], [1], hidden=backend._scratch_rows([CONTEXT]))
        for label, batch, kind, width in SHAPES:
            times = {"eager": [], "compiled": []}
            for _ in range(args.repeats):
                for name, backend in (("eager", eager), ("compiled", compiled)):
                    start = time.perf_counter()
                    _call(backend, ids[:batch], kind, width)
                    times[name].append(time.perf_counter() - start)
            e, c = (statistics.median(times[n]) * 1e3 for n in ("eager", "compiled"))
            rows.append({"shape": label, "batch": batch, "eager_ms": e, "compiled_ms": c, "speedup": e / c})
    head = (f"Draft forward, eager vs compiled: {model}, one torch thread, medians of {args.repeats} calls each "
            f"(compiled for these shapes at load in {compile_s:.1f} s)\n\n")
    table = "| shape | sequences | eager ms | compiled ms | eager / compiled |\n|---|---:|---:|---:|---:|\n" + "".join(
        f"| {r['shape']} | {r['batch']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['speedup']:.2f}x |\n" for r in rows)
    print(head + table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text(head + table)
    results = {"model": model, "compile_s": compile_s, "repeats": args.repeats, "rows": rows}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    _plot(rows, out / "draft_forward.png")
    print(f"wrote {out / 'tables.md'}, {out / 'results.json'}, {out / 'draft_forward.png'}")
    return results


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['shape']}\nx{r['batch']}" for r in rows]
    x = range(len(rows))
    fig, ax = plt.subplots(figsize=(9, 3.8))
    ax.bar([i - 0.2 for i in x], [r["eager_ms"] for r in rows], width=0.4, label="eager")
    ax.bar([i + 0.2 for i in x], [r["compiled_ms"] for r in rows], width=0.4, label="compiled")
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set(ylabel="ms per call", title="draft forward: eager vs torch.compile")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
