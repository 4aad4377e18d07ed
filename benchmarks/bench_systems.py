"""How close does specserve come to what speculation can give, and how does it compare with other
ways of speculating, on real model pairs and on the simulated DGX Spark + RTX 5090?

Every system side by side, in one run, interleaved, with the same prompts and settings. For each
scenario (``scenarios.py``: the demo pair, the realistic-cost pair, the simulator's Qwen3-32B on a
DGX Spark with a Qwen3-1.7B draft on an RTX 5090, or ``--target``/``--draft``) every system is
loaded once (``systems.py``: target-only; specserve in-process at several k and adaptive; specserve
on two labelled Ray nodes with drafting ahead on and off and emulated link delays or link profiles;
transformers assisted generation; vLLM target-only and colocated draft-model speculation; in the
simulator a draft colocated on the target's device). Then for each batch size every system is
warmed up and the repeats run round-robin, the order rotating each repeat, so a slow moment of the
machine hits all systems alike.

Per row: tokens/s (median, min-max), the speed-up over the system's own target-only run,
acceptance, tokens per step, the per-step split (target forward, draft forwards on the critical
path, link, overhead), greedy exactness against that target-only run, and the analytical bounds
from the same run's measured step times (``report.py``: serial and overlapped), with the fraction
of each reached. Also the adaptive controller's predicted speed-ups beside the fixed-k runs', and
whether a remote draft beats a colocated one (the round trip against the drafting time it saves).
Writes ``--out``/tables.md (also printed), results.json and PNG plots (``plots.py``); Ctrl-C or
SIGTERM stops Ray, the models and vLLM and still writes what was measured.

Two devices are emulated by default on machines with >= 2 cores (``bench_cluster.local_cluster``):
the Ray draft node on its own cores, and everything colocated (in-process specserve, transformers,
vLLM) confined to the target node's cores. vLLM runs under the interpreter ``--vllm-python`` names
(``$SPECSERVE_VLLM_PYTHON``, else this one when it has vLLM), through ``vllm_worker.py``.

    python -m benchmarks.bench_systems                    # demo, realistic and sim; batch 1, 8, 32; 3 repeats (40-60 min on 2 cores)
    python -m benchmarks.bench_systems --quick            # every system, tiny sizes (~5 min on 2 cores)
    python -m benchmarks.bench_systems --scenarios sim --batch-sizes 1,8,32 --requests-per-slot 8 \\
        --no-hf --no-vllm                                 # the simulated Spark + 5090 alone (~25 min)
    python -m benchmarks.bench_systems --from-json bench_out/results.json --out bench_out/redrawn   # redraw only
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `specserve` and `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FULL = dict(scenarios="demo,realistic,sim", batch_sizes="1,8,32", ks="2,4,8", k=4, delays_ms="0,1,5",
            links="same-host,10gbe,1gbe,wan-5ms", num_prompts=4, prompt_tokens=64, max_tokens=64, repeats=3, sim_time_scale=0.2)
QUICK = dict(scenarios="demo,realistic,sim", batch_sizes="1,8", ks="2,4", k=4, delays_ms="0,2", links="10gbe,wan-5ms",
             num_prompts=2, prompt_tokens=32, max_tokens=16, repeats=1, sim_time_scale=0.05)


def _list(text: str, cast=str) -> list:
    return [cast(x) for x in str(text).split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    from benchmarks.cli import parser
    from benchmarks.systems import default_vllm_python

    p = parser("benchmarks.bench_systems", __doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: every system once, to prove the harness end to end")
    p.add_argument("--scenarios", help=f"comma-separated: demo, realistic, sim, custom (--target/--draft); default {FULL['scenarios']}")
    p.add_argument("--batch-sizes", help=f"requests in flight, comma-separated; default {FULL['batch_sizes']} (--quick: {QUICK['batch_sizes']})")
    p.add_argument("--ks", help=f"k of the in-process specserve sweep; default {FULL['ks']} (--quick: {QUICK['ks']})")
    p.add_argument("--k", type=int, help=f"k of the Ray, transformers, vLLM and colocated systems; default {FULL['k']}")
    p.add_argument("--delays-ms", help=f"emulated one-way link delays for Ray on model pairs; default {FULL['delays_ms']} (--quick: {QUICK['delays_ms']})")
    p.add_argument("--links", help=f"link profiles for Ray in the sim scenario (specserve/backends/sim_profiles/links.yaml); "
                                   f"default {FULL['links']} (--quick: {QUICK['links']})")
    p.add_argument("--num-prompts", type=int, help=f"prompts per run at batch 1; default {FULL['num_prompts']} (--quick: {QUICK['num_prompts']})")
    p.add_argument("--prompt-tokens", type=int, help=f"prompt length in tokens; default {FULL['prompt_tokens']} (--quick: {QUICK['prompt_tokens']})")
    p.add_argument("--max-tokens", type=int, help=f"tokens generated per prompt; default {FULL['max_tokens']} (--quick: {QUICK['max_tokens']})")
    p.add_argument("--repeats", type=int, help=f"timed repeats per system and batch size; default {FULL['repeats']} (--quick: {QUICK['repeats']})")
    p.add_argument("--sim-time-scale", type=float, help=f"sim: multiply every modelled time and link delay by this; "
                                                        f"default {FULL['sim_time_scale']} (--quick: {QUICK['sim_time_scale']})")
    p.add_argument("--sim-acceptance", type=float, default=0.8, help="sim: the draft's per-token greedy acceptance")
    p.add_argument("--realistic-pair", help="directory made by examples/make_realistic_pair.py; default: built into --out")
    p.add_argument("--target", help="custom scenario: target model directory")
    p.add_argument("--draft", help="custom scenario: draft model directory")
    p.add_argument("--dtype", default="float32", help="dtype of every real model")
    p.add_argument("--side-cpus", type=float, default=0.25, help="Ray: logical CPUs reserved per side")
    p.add_argument("--no-ray", dest="ray", action="store_false", help="skip the two-node Ray systems")
    p.add_argument("--load", choices=("sustained", "wave"), default="sustained",
                   help="sustained: B requests in flight over max(prompts, R x B) prompts (serving); wave: waves of exactly B (a batch job)")
    p.add_argument("--requests-per-slot", type=int, default=3,
                   help="sustained: R, the prompts per slot of the window; more make the draining tail a smaller share")
    p.add_argument("--shared-cores", action="store_true",
                   help="no device emulation: both Ray nodes and the colocated systems on every core")
    p.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers assisted generation")
    p.add_argument("--no-vllm", dest="vllm", action="store_false", help="skip vLLM")
    p.add_argument("--vllm-python", default=default_vllm_python(),
                   help="a Python with vLLM, for the vLLM rows; default $SPECSERVE_VLLM_PYTHON, else this one if it has vLLM "
                        "(here: %(default)s)")
    p.add_argument("--vllm-eager", action=argparse.BooleanOptionalAction, help="vLLM without torch.compile; default: yes with --quick, else no")
    p.add_argument("--vllm-max-model-len", type=int, default=512, help="vLLM's max_model_len (the demo pair's context)")
    p.add_argument("--out", default="bench_out", help="folder for tables.md, results.json and the plots")
    p.add_argument("--from-json", help="measure nothing: redraw tables and plots from a results.json (or .json.gz) into --out")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.vllm_eager is None:
        args.vllm_eager = args.quick
    args.scenarios, args.batch_sizes, args.ks = _list(args.scenarios), _list(args.batch_sizes, int), _list(args.ks, int)
    args.delays_ms, args.links = _list(args.delays_ms, float), _list(args.links)
    if min(args.batch_sizes + args.ks + [args.k, args.num_prompts, args.max_tokens, args.repeats, args.requests_per_slot]) < 1:
        p.error("batch sizes, k values, --num-prompts, --max-tokens and --repeats must be >= 1")
    if not (args.delays_ms and args.links):
        p.error("--delays-ms and --links need at least one value each")
    return args


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def bench_scenario(scenario, args, cluster_address, bar, results) -> None:
    """Load every system of one scenario, then run all repeats of each batch size round-robin."""
    from benchmarks.systems import Skipped, make_runner

    runners = {}
    try:
        for spec in scenario.systems:
            bar.set_postfix_str(f"{scenario.name}: loading {spec.name}")
            try:
                runners[spec.name] = make_runner(spec, scenario, args, cluster_address)
            except Skipped as exc:
                results["skipped"].append({"scenario": scenario.name, "system": spec.name, "reason": str(exc)})
                bar.write(f"skip {scenario.name} / {spec.name}: {exc}", file=sys.stderr)
            except Exception as exc:  # one broken system must not stop the others; the report lists it
                traceback.print_exc()
                results["skipped"].append({"scenario": scenario.name, "system": spec.name, "reason": f"failed to load: {exc}"})
        specs = [s for s in scenario.systems if s.name in runners]
        for batch in args.batch_sizes:
            prompts = scenario.prompts[: max(batch, args.num_prompts) if args.load == "wave" else max(args.requests_per_slot * batch, args.num_prompts)]
            live = []
            for spec in specs:  # warm-up (also finds the systems that cannot run this batch size)
                bar.set_postfix_str(f"{scenario.name} b={batch}: warm-up {spec.name}")
                try:
                    runners[spec.name].run(prompts[:batch], batch, min(8, args.max_tokens))
                    live.append(spec)
                except Skipped as exc:
                    results["skipped"].append({"scenario": scenario.name, "system": f"{spec.name} (batch {batch})", "reason": str(exc)})
                bar.update(1)
            for repeat in range(args.repeats):
                shift = repeat % max(1, len(live))
                for spec in live[shift:] + live[:shift]:
                    bar.set_postfix_str(f"{scenario.name} b={batch} r={repeat + 1}: {spec.name}")
                    record = runners[spec.name].run(prompts, batch, args.max_tokens)
                    results["records"].append({"scenario": scenario.name, "system": spec.name, "kind": spec.kind, "k": spec.k,
                                               "baseline": spec.baseline, "delay_ms": spec.delay_ms, "link": spec.link,
                                               "batch": batch, "repeat": repeat, **record})
                    n = sum(len(t) for t in record["token_ids"])
                    bar.write(f"{scenario.name:9s} b={batch:<2d} r={repeat + 1} {spec.name:32s} {n / record['wall_s']:8.1f} tok/s",
                              file=sys.stderr)
                    bar.update(1)
            bar.update((len(specs) - len(live)) * args.repeats)
    finally:
        for name, runner in runners.items():
            bar.set_postfix_str(f"{scenario.name}: closing {name}")
            runner.close()


def finish(results: dict, out: Path) -> str:
    from benchmarks.plots import write_plots
    from benchmarks.report import summarize, write_report

    results["summary"] = summarize(results["records"]) if results["records"] else []
    text = write_report(results, out)
    files = write_plots(results, out) if results["summary"] else []
    return text + "\nwrote " + ", ".join(str(p) for p in [out / "tables.md", out / "results.json", *files])


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        from benchmarks.plots import write_plots
        from benchmarks.report import read_results, write_report

        results = read_results(args.from_json)

        text = write_report(results, out)
        write_plots(results, out)
        print(text)
        return results
    import torch
    import transformers
    from tqdm.auto import tqdm

    from benchmarks.bench_cluster import local_cluster, measure_rtt, pinned, split_cores
    from benchmarks.scenarios import make_scenario

    torch.set_num_threads(1)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    num_prompts = max(args.batch_sizes + [args.num_prompts]) * (args.requests_per_slot if args.load == "sustained" else 1)
    from benchmarks.cli import header

    meta = {k: v for k, v in vars(args).items() if k != "from_json"}
    meta["header"] = header("benchmarks.bench_systems", argv)
    meta.update(cpu_count=os.cpu_count(), torch=torch.__version__, transformers=transformers.__version__,
                started=time.strftime("%Y-%m-%d %H:%M:%S"))
    results = {"meta": meta, "scenarios": [], "records": [], "skipped": []}
    previous = signal.signal(signal.SIGTERM, _interrupt)
    start = time.perf_counter()
    try:
        scenarios = []
        for name in args.scenarios:
            print(f"preparing scenario {name} ...", file=sys.stderr)
            scenarios.append(make_scenario(name, args, num_prompts))
            s = scenarios[-1]
            results["scenarios"].append({"name": s.name, "target": s.target, "draft": s.draft, "sim": s.sim,
                                         "time_scale": s.time_scale, "notes": s.notes,
                                         "prompt_sources": s.sources, "systems": [vars(x) for x in s.systems]})
        needs_ray = any(x.kind == "ray" for s in scenarios for x in s.systems)
        total = sum(len(s.systems) * len(args.batch_sizes) * (1 + args.repeats) for s in scenarios)
        cores = None if args.shared_cores else split_cores()
        results["meta"]["cores"] = {"target": sorted(cores[0]), "draft": sorted(cores[1])} if cores else None
        # Colocated systems run in this process (or start from it): confined to the target's cores.
        with (local_cluster(two_device=cores is not None) if needs_ray else pinned(cores[0] if cores else None)) as cluster, \
                tqdm(total=total, desc="bench", unit="run", file=sys.stderr) as bar:
            bar.write(f"two-device emulation: target cores {sorted(cores[0])}, draft cores {sorted(cores[1])}" if cores
                      else "shared cores: no device emulation", file=sys.stderr)
            if cluster is not None:
                results["meta"]["bare_rtt"] = measure_rtt([0.0])
            for s in scenarios:
                bench_scenario(s, args, cluster.address if cluster is not None else None, bar, results)
    except KeyboardInterrupt:
        print("interrupted: Ray, the models and vLLM were shut down; writing what was measured", file=sys.stderr)
        results["meta"]["interrupted"] = True
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
        results["meta"]["wall_s"] = time.perf_counter() - start
        print(finish(results, out))
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
