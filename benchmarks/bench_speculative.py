"""Benchmark specserve: a k sweep in-process, then an emulated-delay sweep on two Ray nodes.

Data flow: held-out stdlib snippets -> token ids -> one in-process ``LLM`` per (batch size,
k), k=0 being target-only -> tokens/s (median of repeats), acceptance; then a labelled
two-node Ray cluster -> the bare channel round trip per one-way delay, and one
``LLM.from_config`` per (delay, k, batch size) -> ``bench_report`` prints markdown tables
and writes PNG plots and the raw numbers (``results.json``) into ``--out``.

    python -m benchmarks.bench_speculative                         # demo pair, local + ray
    python -m benchmarks.bench_speculative --quick --mode local    # seconds
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import sysconfig
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `specserve` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# Sizes for a full run and for --quick (a smoke test); any flag given on the command line wins.
FULL = dict(ks="0,1,2,4,8", ray_ks="2,4", delays_ms="0,1,5,20", batch_sizes="1,8", num_prompts=8, max_tokens=64,
            prompt_tokens=64, repeats=3, rtt_samples=50)
QUICK = dict(ks="0,2", ray_ks="2", delays_ms="0,5", batch_sizes="1,2", num_prompts=2, max_tokens=8,
             prompt_tokens=16, repeats=1, rtt_samples=5)
# examples/train_demo_pair.py holds out every 30th stdlib file (offset 15) from training: prompt with those.
HOLDOUT_EVERY = 30
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "encodings", "pydoc_data", "__phello__"}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", help="target model directory (default: the demo target)")
    p.add_argument("--draft", help="draft model directory or 'ngram' (default: the demo draft)")
    p.add_argument("--mode", choices=("local", "ray", "both"), default="both", help="in-process, two Ray nodes, or both [both]")
    p.add_argument("--ks", help=f"num_speculative_tokens to sweep in-process; 0 = target only [{FULL['ks']}]")
    p.add_argument("--ray-ks", help=f"num_speculative_tokens to run on Ray at every delay [{FULL['ray_ks']}]")
    p.add_argument("--delays-ms", help=f"emulated one-way link delays in ms [{FULL['delays_ms']}]")
    p.add_argument("--batch-sizes", help=f"max_num_seqs values (concurrent sequences) [{FULL['batch_sizes']}]")
    p.add_argument("--num-prompts", type=int, help=f"prompts per measurement [{FULL['num_prompts']}]")
    p.add_argument("--max-tokens", type=int, help=f"tokens generated per prompt [{FULL['max_tokens']}]")
    p.add_argument("--prompt-tokens", type=int, help=f"prompt length in tokens [{FULL['prompt_tokens']}]")
    p.add_argument("--repeats", type=int, help=f"timed repeats per measurement; tables show the median [{FULL['repeats']}]")
    p.add_argument("--rtt-samples", type=int, help=f"round trips timed per delay [{FULL['rtt_samples']}]")
    p.add_argument("--threads", type=int, default=1, help="torch threads, here and in every Ray actor [1]")
    p.add_argument("--dtype", default="float32", help="both models' dtype [float32]")
    p.add_argument("--side-cpus", type=float, default=0.5, help="logical CPUs reserved per side on Ray, fractional ok [0.5]")
    p.add_argument("--out", default="bench_out", help="folder for tables.md, results.json and the plots [bench_out]")
    p.add_argument("--quick", action="store_true", help="tiny sizes for a smoke test")
    p.add_argument("--from-json", help="measure nothing: redraw tables and plots from a results.json into --out")
    args = p.parse_args(argv)
    if args.from_json:
        return args
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.ks = sorted(set([0] + int_list(args.ks)))  # k=0 is the baseline every speedup divides by
    args.ray_ks = sorted(set(k for k in int_list(args.ray_ks) if k > 0))
    args.delays_ms = float_list(args.delays_ms)
    args.batch_sizes = int_list(args.batch_sizes)
    if args.target is None or args.draft is None:
        from specserve.demo_models import DRAFT_PATH, TARGET_PATH

        if not (TARGET_PATH / "config.json").exists():
            p.error(f"the demo pair is not at {TARGET_PATH.parent} yet: pass --target and --draft")
        args.target = args.target or str(TARGET_PATH)
        args.draft = args.draft or str(DRAFT_PATH)
    if min(args.batch_sizes + [args.num_prompts, args.max_tokens, args.repeats, args.prompt_tokens]) < 1:
        p.error("batch sizes, --num-prompts, --max-tokens, --prompt-tokens and --repeats must be >= 1")
    return args


# -------------------------------------------------------------------------------- prompts


def heldout_files() -> list[Path]:
    """The stdlib files the demo pair never trained on (same rule as examples/train_demo_pair.py)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not (Path(dirpath) == root and d.startswith("config-"))]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    files = sorted(files)
    return [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2]


def load_prompts(target: str, num_prompts: int, prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """``num_prompts`` token-id prompts: the first lines of held-out files, then their next chunks."""
    from specserve.models import load_config, load_tokenizer, vocab_size_of

    tokenizer = load_tokenizer(target)
    vocab_size = vocab_size_of(load_config(target))
    root = Path(sysconfig.get_paths()["stdlib"])
    encoded = []
    for path in heldout_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:  # a model without a tokenizer (tests): bytes folded into its vocabulary
            ids = [b % vocab_size for b in text.encode()[: 8 * prompt_tokens]]
        encoded.append((str(path.relative_to(root)), ids))
    prompts, sources = [], []
    for chunk in range(8):
        for name, ids in encoded:
            piece = ids[chunk * prompt_tokens : (chunk + 1) * prompt_tokens]
            if len(piece) == prompt_tokens and len(prompts) < num_prompts:
                prompts.append(piece)
                sources.append(f"{name}#{chunk}")
    if len(prompts) < num_prompts:
        raise ValueError(f"only {len(prompts)} held-out snippets of {prompt_tokens} tokens for --num-prompts {num_prompts}")
    return prompts, sources


# -------------------------------------------------------------------------------- timing


def num_engine_steps(outs, batch_size: int) -> int:
    """Target steps of a run: requests are admitted in order, ``batch_size`` at a time (approximate)."""
    steps = [o.metrics.num_steps for o in outs]
    return sum(max(steps[i : i + batch_size]) for i in range(0, len(steps), batch_size))


def warm_up(llm, prompts, params, batch_size: int) -> None:
    from specserve import SamplingParams

    llm.generate(prompts[:batch_size], SamplingParams(temperature=0.0, max_tokens=min(8, params.max_tokens), ignore_eos=True),
                 use_tqdm=False)


def timed_generate(llm, prompts, params) -> tuple[float, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, outs


def summarize(walls: list[float], outs, batch_size: int) -> dict:
    """Throughput of the repeats (all produce the same tokens: greedy) and the speculation metrics."""
    num_tokens = sum(len(o.token_ids) for o in outs)
    drafts = sum(o.metrics.num_drafts for o in outs)
    draft_tokens = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    steps = num_engine_steps(outs, batch_size)
    wall = statistics.median(walls)
    return {
        "wall_s": walls, "num_tokens": num_tokens, "num_engine_steps": steps,
        "tokens_per_s": [num_tokens / w for w in walls], "median_tokens_per_s": num_tokens / wall,
        "step_ms": 1000.0 * wall / steps,
        "num_drafts": drafts, "num_draft_tokens": draft_tokens, "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "token_ids": [o.token_ids for o in outs],
    }


def time_generate(llm, prompts, params, repeats: int, batch_size: int) -> dict:
    """Warm up once, then time ``repeats`` identical ``generate`` calls back to back."""
    warm_up(llm, prompts, params, batch_size)
    walls = []
    for _ in range(repeats):
        wall, outs = timed_generate(llm, prompts, params)
        walls.append(wall)
    return summarize(walls, outs, batch_size)


def with_baseline(run: dict, baseline: dict) -> dict:
    """Speedup and greedy losslessness against the target-only run of the same batch size."""
    run["speedup"] = run["median_tokens_per_s"] / baseline["median_tokens_per_s"]
    run["greedy_equals_target_only"] = run["token_ids"] == baseline["token_ids"]
    # Round trip this run could add per step and still match target-only (wall time is linear in it).
    run["rtt_budget_ms"] = 1000.0 * (statistics.median(baseline["wall_s"]) - statistics.median(run["wall_s"])) / run["num_engine_steps"]
    return run


# -------------------------------------------------------------------------------- sweeps


def bench_local(args, prompts, params, bar) -> dict:
    """Every k (and the draft alone) loaded side by side; repeats interleaved, so a noisy moment
    on a shared machine hits all of them rather than one."""
    from specserve import LLM

    runs, draft_decode = [], []
    for b in args.batch_sizes:
        llms = {k: LLM(target=args.target, draft=args.draft if k else None, num_speculative_tokens=k, dtype=args.dtype,
                       max_num_seqs=b) for k in args.ks}
        if args.draft != "ngram":  # the draft's own decode step: what drafting one token costs
            llms["draft"] = LLM(target=args.draft, draft=None, num_speculative_tokens=0, dtype=args.dtype, max_num_seqs=b)
        walls, outs = {name: [] for name in llms}, {}
        try:
            for name, llm in llms.items():
                warm_up(llm, prompts, params, b)
            for repeat in range(args.repeats):
                for name, llm in llms.items():
                    bar.set_postfix_str(f"local b={b} {'k=' if name != 'draft' else ''}{name} repeat {repeat + 1}")
                    wall, outs[name] = timed_generate(llm, prompts, params)
                    walls[name].append(wall)
                    bar.update()
        finally:
            for llm in llms.values():
                llm.shutdown()
        baseline = summarize(walls[0], outs[0], b)
        for k in args.ks:
            run = with_baseline({"batch_size": b, "k": k, **summarize(walls[k], outs[k], b)}, baseline)
            runs.append(run)
            bar.write(f"local  b={b} k={k}: {run['median_tokens_per_s']:8.1f} tok/s  x{run['speedup']:.2f}  "
                      f"acceptance {run['acceptance_rate']:.2f}", file=sys.stderr)
        if "draft" in llms:
            draft_decode.append({"batch_size": b, **summarize(walls["draft"], outs["draft"], b)})
    return {"runs": runs, "draft_decode": draft_decode}


def bench_ray(args, prompts, params, bar) -> dict:
    import ray

    from specserve import LLM, EngineConfig, SideConfig
    from specserve.distributed import Placement

    from benchmarks.bench_cluster import local_cluster, measure_rtt, start_probes

    def side(path):
        return SideConfig(path, dtype=args.dtype, num_cpus=args.side_cpus)

    def measure(k, b, delay_ms):
        config = EngineConfig(target=side(args.target), draft=side(args.draft) if k else None, num_speculative_tokens=k, max_num_seqs=b)
        llm = LLM.from_config(config, Placement(channel="ray", channel_delay_ms=delay_ms))
        try:
            return {"batch_size": b, "k": k, "delay_ms": delay_ms, **time_generate(llm, prompts, params, args.repeats, b)}
        finally:
            llm.shutdown()

    rtt, runs, baselines = [], [], {}
    with local_cluster(torch_threads=args.threads):
        probe, echo = start_probes()
        actor_threads = ray.get(probe.torch_threads.remote())
        for b in args.batch_sizes:  # target alone on its node: no channel, so no delay to sweep
            bar.set_postfix_str(f"ray b={b} target only")
            baselines[b] = measure(0, b, 0.0)
            runs.append(with_baseline(baselines[b], baselines[b]))
            bar.update()
        for d in args.delays_ms:
            bar.set_postfix_str(f"ray d={d:g}ms round trip")
            rtt.append(measure_rtt(probe, echo, d, args.rtt_samples))
            bar.write(f"ray    d={d:g} ms: bare round trip {rtt[-1]['rtt_ms_median']:.2f} ms (median)", file=sys.stderr)
            for k in args.ray_ks:
                for b in args.batch_sizes:
                    bar.set_postfix_str(f"ray d={d:g}ms b={b} k={k}")
                    run = with_baseline(measure(k, b, d), baselines[b])
                    run["rtt_ms_median"] = rtt[-1]["rtt_ms_median"]
                    runs.append(run)
                    bar.update()
                    bar.write(f"ray    d={d:g} ms b={b} k={k}: {run['median_tokens_per_s']:8.1f} tok/s  x{run['speedup']:.2f}",
                              file=sys.stderr)
    return {"rtt": rtt, "runs": runs, "actor_torch_threads": actor_threads, "side_cpus": args.side_cpus}


# -------------------------------------------------------------------------------- main


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.from_json:
        from benchmarks.bench_report import write_report

        results = json.loads(Path(args.from_json).read_text())
        print(write_report(results, Path(args.out)))
        return results
    import torch
    import transformers
    from tqdm.auto import tqdm

    from specserve import SamplingParams

    from benchmarks.bench_report import write_report

    torch.set_num_threads(args.threads)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    prompts, sources = load_prompts(args.target, args.num_prompts, args.prompt_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    meta = {key: (str(v) if isinstance(v, Path) else v) for key, v in vars(args).items()}
    meta.update(prompt_sources=sources, torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
                torch=torch.__version__, transformers=transformers.__version__, started=time.strftime("%Y-%m-%d %H:%M:%S"))
    results = {"meta": meta}
    num_local = len(args.batch_sizes) * (len(args.ks) + (args.draft != "ngram")) * args.repeats if args.mode != "ray" else 0
    num_ray = len(args.batch_sizes) * (1 + len(args.delays_ms) * len(args.ray_ks)) if args.mode != "local" else 0
    previous = signal.signal(signal.SIGTERM, _interrupt) if _main_thread() else None
    start = time.perf_counter()
    try:
        with tqdm(total=num_local + num_ray, desc="bench", unit="run", file=sys.stderr) as bar:
            if args.mode in ("local", "both"):
                results["local"] = bench_local(args, prompts, params, bar)
            if args.mode in ("ray", "both"):
                results["ray"] = bench_ray(args, prompts, params, bar)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    meta["wall_s"] = time.perf_counter() - start
    report = write_report(results, Path(args.out))
    print(report)
    return results


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted: Ray and the models were shut down", file=sys.stderr)
        sys.exit(130)
