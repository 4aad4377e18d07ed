"""How fast is specserve against vLLM on the same target, with the draft on a device of its own?

vLLM target-only, vLLM's colocated draft model and specserve's remote draft, side by side in the
two-device harness (``bench_cluster.local_cluster``: one local Ray node per emulated device, each on
cores of its own; the target node stands for the big box, the draft node for the small one):

- ``vllm target-only``: ``vllm.LLM`` in an actor on the target node, its engine in the actor's own
  process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as specserve's vLLM target runs it). vLLM's default,
  an engine-core process beside the caller, would hand each step's inputs and outputs between two
  processes on the same core; ``--vllm-multiprocessing`` runs that default for comparison.
- ``vllm colocated k=K``: the same with vLLM's ``draft_model`` speculation, the draft sharing the
  target's cores, as it would speculating on the big box alone: the peer to beat.
- ``specserve d=Xms``: specserve with a vLLM target (``RemoteDraftProposer``) on the target node and
  a transformers draft on the draft node, all defaults (adaptive k <= K, ``draft_ahead`` auto), with
  an emulated one-way link delay of X ms.
- ``specserve own engine``: the same remote draft fed by specserve's own transformers engine.
- ``specserve k=K fixed`` (adaptive off), ``specserve no-ahead`` (drafting ahead off), ``specserve
  eager draft`` (``draft_compile=False``), ``specserve target-only`` (specserve's loop over the same
  vLLM target, no draft: what the loop itself costs), all at 0 ms; left out by ``--quick``.

Load: ``sustained`` (default) keeps B requests in flight over max(prompts, 3 B) prompts, a new one
starting as soon as one finishes: serving at concurrency B. ``wave`` sends waves of exactly B and
waits for each: a batch job, where speculation also pays for the wave waiting on its slowest request.
Every request asks for the same ``--max-tokens`` (``ignore_eos``) unless ``--length-spread`` s draws
each from max-tokens x [1 - s, 1 + s], as a server's requests differ: equal lengths keep
target-only's requests in lock-step (every step full, a wave's prompts prefilled in one step, no
drain), which speculation's varying acceptance breaks. For each batch size every system is warmed
up by one whole untimed run, then the repeats run round-robin with the order rotating, so a slow
moment of the machine hits all systems alike.

Per row: tokens/s (median, min-max); the ratio to vLLM colocated and to vLLM target-only;
acceptance; tokens per step; the per-step split (verify, draft wait, link, specserve's own
overhead); the cache-hit rate; whether every output equals vLLM target-only's token for token; the
ideal two-device ratio, colocated step time / (verify + link), where verify is this system's own
step with the draft's compute taken out (what a draft hidden completely behind verification would
give at the same tokens per step), and the fraction of it reached; and each speculative row's ratio
to the better vLLM row round by round (median, range, rounds at or above 1.0): the runs of a round
are back to back, so the machine's drift moves that ratio less than the medians'. vLLM runs without
stat logging (its offline default, as specserve's vLLM target), so vLLM's colocated row has no
acceptance unless ``--vllm-stats``. Writes ``--out``/tables.md (also printed), results.json and
speedup_vs_batch.png.

    python -m benchmarks.bench_vllm                          # demo and realistic pairs, batch 1, 8, 32 (~1 h on 2 cores)
    python -m benchmarks.bench_vllm --quick                  # tiny sizes, fewer systems (~10 min on 2 cores)
    python -m benchmarks.bench_vllm --pairs demo --batch-sizes 1,8,32 --delays-ms 0 --repeats 5 \\
        --systems "vllm target-only,vllm colocated k=4,specserve d=0ms"     # the headline rows only
    python -m benchmarks.bench_vllm --pairs demo-eagle       # the demo target's EAGLE-3 head against vLLM's colocated EAGLE-3
    python -m benchmarks.bench_vllm --from-json R/results.json --out R2   # R's tables again, measuring nothing
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from pathlib import Path

from .bench_cluster import ROLE, THREAD_ENV, local_cluster
from .cli import header, parser
from .report import by_round
from .scenarios import heldout_prompts, load_example

SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


class PlainVLLM:
    """A ``vllm.LLM`` in an actor; ``run`` returns token ids, wall time, engine steps and spec-decode counts."""

    def __init__(self, multiprocessing: bool = False, **kwargs):
        import os

        # In this process, as specserve's vLLM target (``specserve.vllm.options``), unless asked otherwise.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
        from vllm import LLM

        from specserve.distributed.workers import normal_priority

        normal_priority()  # as specserve's sides do (and its engine process inherits it): same footing
        self.llm = LLM(**kwargs)
        engine, self.steps = self.llm.llm_engine, 0
        step = engine.step

        def counted():
            self.steps += 1
            return step()
        engine.step = counted  # engine steps, counted here: vLLM's own count needs its stat logging on

    def _counters(self) -> dict:
        out = {"steps": self.steps}
        if self.llm.llm_engine.log_stats:  # spec-decode counts exist only with stat logging (--vllm-stats)
            for m in self.llm.get_metrics():
                if m.name in SPEC:
                    out[m.name] = out.get(m.name, 0) + m.value
        return out

    def run(self, prompts, batch: int, max_tokens: list[int], sustained: bool = True) -> dict:
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        torch.get_num_threads()  # this thread's OpenMP count = torch's (specserve.vllm.options.sync_omp_threads)
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        before = self._counters()
        start, token_ids = time.perf_counter(), []
        if sustained:  # B in flight: the engine's own loop, a new request added as soon as one finishes
            engine, done, added = self.llm.llm_engine, {}, 0
            self.runs = getattr(self, "runs", 0) + 1
            while len(done) < len(prompts):
                while added < len(prompts) and added - len(done) < batch:
                    engine.add_request(f"run{self.runs}-{added}", TokensPrompt(prompt_token_ids=prompts[added]), params[added])
                    added += 1
                for o in engine.step():
                    if o.finished:
                        done[int(o.request_id.rsplit("-", 1)[1])] = list(o.outputs[0].token_ids)
            token_ids = [done[i] for i in range(len(prompts))]
        else:
            for i in range(0, len(prompts), batch):
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i:i + batch]], params[i:i + batch], use_tqdm=False)
                token_ids += [list(o.outputs[0].token_ids) for o in outs]
        wall = time.perf_counter() - start
        c = {k: v - before.get(k, 0) for k, v in self._counters().items()}
        return {"wall_s": wall, "token_ids": token_ids, "num_steps": c["steps"], "num_drafts": c.get(SPEC[0], 0),
                "num_draft_tokens": c.get(SPEC[1], 0), "num_accepted_tokens": c.get(SPEC[2], 0)}


class VLLMRunner:
    def __init__(self, kwargs: dict):
        import ray

        self.actor = ray.remote(PlainVLLM).options(num_cpus=0.25, label_selector={ROLE: "target"}).remote(**kwargs)

    def run(self, prompts, batch: int, max_tokens: list[int], sustained: bool = True) -> dict:
        import ray

        return ray.get(self.actor.run.remote(prompts, batch, max_tokens, sustained))

    def close(self) -> None:
        import ray

        ray.kill(self.actor)


class SpecserveRunner:
    """specserve with a vLLM target (or, ``own_engine``, specserve's transformers engine) on the target node and a
    transformers draft (or an EAGLE head, fed the target's hidden states by either engine) on the draft node."""

    def __init__(self, target: str, draft: str, options: dict, vllm_options: dict, own_engine: bool = False):
        from specserve import LLM

        backend = {"dtype": "float32", "target_backend": "hf"} if own_engine else {"target_backend": "vllm", "target_backend_options": vllm_options}
        self.own_engine = own_engine
        self.llm = LLM(target, draft=draft if options.get("num_speculative_tokens", 1) else None, ray=True, **backend,
                       target_num_cpus=0.25, draft_num_cpus=0.25, cpu_threads=1, runtime_env={"env_vars": THREAD_ENV}, **options)

    def run(self, prompts, batch: int, max_tokens: list[int], sustained: bool = True) -> dict:
        from specserve import SamplingParams

        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
        before = self.llm.metrics()
        start, outs = time.perf_counter(), []
        if sustained:  # B in flight, a new request sent as soon as one finishes (RayEngine's window)
            outs = self.llm._engine.generate([None] * len(prompts), prompts, params, False, max_in_flight=batch)
        else:
            for i in range(0, len(prompts), batch):
                outs += self.llm.generate(prompts[i:i + batch], params[i:i + batch], use_tqdm=False)
        wall = time.perf_counter() - start
        after = self.llm.metrics()
        if self.own_engine:  # specserve's engine names its counters otherwise
            for m in (before, after):
                own_engine_timing(m["timing"])
                m["num_proposals"], m["num_verify_steps"] = m["num_speculative_steps"], m["num_steps"]
        for m in (before, after):  # a head's input on the wire (either engine)
            m["hidden_bytes"] = (m.get("drafts") or {}).get("hidden_bytes", 0)
        d = lambda key: after.get(key, 0) - before.get(key, 0)  # noqa: E731  (no draft: no proposer counters)
        t = {key: after["timing"].get(key, 0.0) - before["timing"].get(key, 0.0) for key in after["timing"]}
        steps, spec, verify = max(1, d("num_steps")), max(1, d("num_proposals")), max(1, d("num_verify_steps"))
        return {"wall_s": wall, "token_ids": [list(o.token_ids) for o in outs], "num_steps": d("num_steps"),
                "num_drafts": sum(o.metrics.num_drafts for o in outs), "num_draft_tokens": sum(o.metrics.num_draft_tokens for o in outs),
                "num_accepted_tokens": sum(o.metrics.num_accepted_tokens for o in outs),
                "num_blocks": d("num_blocks"), "num_cache_hits": d("num_cache_hits"), "num_speculative_steps": d("num_proposals"),
                "num_tree_blocks": (after.get("drafts") or {}).get("num_tree_blocks", 0) - (before.get("drafts") or {}).get("num_tree_blocks", 0),
                "verify_ms": t["verify_s"] / verify * 1e3, "draft_wait_ms": t["draft_wait_s"] / spec * 1e3,
                "link_ms": (t["draft_wait_s"] - t["draft_compute_s"]) / spec * 1e3, "overhead_ms": t["specserve_s"] / steps * 1e3,
                "draft_compute_s": t["draft_compute_s"], "hidden_bytes": d("hidden_bytes"),
                "k": after.get("speculation", {}).get("k"), "predicted": after.get("speculation", {}).get("predicted_tokens_per_s"), "draft_ahead": _draft_ahead(after)}

    def close(self) -> None:
        self.llm.shutdown()


def own_engine_timing(tm: dict) -> dict:
    """specserve's own engine's timing (``EngineCore.metrics``) under the vLLM target's names, in place:
    ``verify_s`` its verify forwards, ``specserve_s`` the rest of its wall time that is neither a
    target forward (prefills are forwards too, inside vLLM's step on the vLLM target) nor the wait
    for the draft (its forwards and the link)."""
    tm["verify_s"] = tm["target_forward_s"]
    tm["specserve_s"] = tm["wall_s"] - tm["target_forward_s"] - tm.get("prefill_s", 0.0) - tm["draft_wait_s"]
    return tm


def _draft_ahead(metrics: dict):
    drafts = (metrics.get("drafts") or {}).get("drafts") or {}
    return next((d.get("draft_ahead") for d in drafts.values()), None)


def systems(args, target: str, draft: str, head: bool = False) -> dict[str, callable]:
    """Name -> constructor, in the order they load. ``head``: the draft is an EAGLE head (vLLM's
    colocated row is its EAGLE-3; specserve's rows run specserve's engine, which sends the head the
    target's rows, and the same engine target-only)."""
    options = {"enforce_eager": not args.compiled, "kv_cache_memory_bytes": 1 << 30, "max_model_len": 512}
    # vLLM's offline default: no stat logging, which costs its engine per token; specserve's vLLM target runs
    # without it too. --vllm-stats turns it on in vLLM's rows, for the colocated row's acceptance.
    plain = {"model": target, "dtype": "float32", "seed": 0, "disable_log_stats": not args.vllm_stats, **options}
    k = args.k
    mp = {"multiprocessing": args.vllm_multiprocessing}
    out = {"vllm target-only": lambda: VLLMRunner({**plain, **mp}),
           f"vllm colocated k={k}": lambda: VLLMRunner({**plain, **mp, "speculative_config": {
               "method": "eagle3" if head else "draft_model", "model": draft, "num_speculative_tokens": k}})}
    common = {"num_speculative_tokens": k, "draft_min_timeout_s": 5.0}
    if head:
        for delay in args.delays_ms:
            out[f"specserve head d={delay:g}ms"] = lambda delay=delay: SpecserveRunner(
                target, draft, {**common, "channel_delay_ms": delay}, options, own_engine=True)
        out[f"specserve head k={k} fixed"] = lambda: SpecserveRunner(target, draft, {**common, "adaptive": False}, options, own_engine=True)
        out["specserve head no-ahead"] = lambda: SpecserveRunner(target, draft, {**common, "draft_ahead": False}, options, own_engine=True)
        out["specserve head eager"] = lambda: SpecserveRunner(target, draft, {**common, "draft_compile": False}, options, own_engine=True)
        out["specserve vllm target + head"] = lambda: SpecserveRunner(target, draft, common, options)  # vLLM's runner feeds the head
        # EAGLE-3's fc on the target (head_fc): a third of the bytes on the link, a 3H x H product per row on the target
        out["specserve head fc-on-target"] = lambda: SpecserveRunner(target, draft, {**common, "head_fc": "target"}, options,
                                                                     own_engine=True)
        out["specserve vllm target + head fc-on-target"] = lambda: SpecserveRunner(target, draft, {**common, "head_fc": "target"},
                                                                                   options)
        out["specserve own target-only"] = lambda: SpecserveRunner(target, draft, {"num_speculative_tokens": 0}, options, own_engine=True)
        return out
    for delay in args.delays_ms:
        out[f"specserve d={delay:g}ms"] = lambda delay=delay: SpecserveRunner(target, draft, {**common, "channel_delay_ms": delay}, options)
    # specserve's own transformers engine with the same remote draft (what the first-token and controller changes touch)
    out["specserve own engine"] = lambda: SpecserveRunner(target, draft, common, options, own_engine=True)
    if args.systems and "specserve niceness 15" in args.systems:  # opt-in A/B: the sides as Ray starts its workers
        out["specserve niceness 15"] = lambda: SpecserveRunner(target, draft, {**common, "normal_priority": False}, options)
    for delay in args.delays_ms:  # opt-in A/B: steps take their blocks from the draft's trees (speculation.draft_trees on)
        name = "specserve trees" + (f" d={delay:g}ms" if delay else "")
        if args.systems and name in args.systems:
            out[name] = lambda delay=delay: SpecserveRunner(target, draft, {**common, "draft_trees": True, "channel_delay_ms": delay}, options)
    if not args.quick:
        out[f"specserve k={k} fixed"] = lambda: SpecserveRunner(target, draft, {**common, "adaptive": False}, options)
        out["specserve no-ahead"] = lambda: SpecserveRunner(target, draft, {**common, "draft_ahead": False}, options)
        out["specserve eager draft"] = lambda: SpecserveRunner(target, draft, {**common, "draft_compile": False}, options)
        out["specserve target-only"] = lambda: SpecserveRunner(target, draft, {"num_speculative_tokens": 0}, options)
    return out


def bench_pair(name: str, target: str, draft: str, args, log) -> list[dict]:
    def count(batch: int) -> int:
        return max(batch, args.num_prompts) if args.load == "wave" else max(3 * batch, args.num_prompts)

    prompts, _ = heldout_prompts(target, max(count(b) for b in args.batch_sizes), args.prompt_tokens)
    runners, records = {}, []
    try:
        for sys_name, make in systems(args, target, draft, head=name.endswith("eagle")).items():
            if args.systems and sys_name not in args.systems:
                continue
            log(f"{name}: loading {sys_name}")
            runners[sys_name] = make()
        sustained = args.load == "sustained"
        for batch in args.batch_sizes:
            wave, lengths = prompts[: count(batch)], request_lengths(count(batch), args.max_tokens, args.length_spread)
            for sys_name, r in runners.items():  # warm-up, untimed: one whole run, the same for every system
                r.run(wave, batch, lengths, sustained)  # (shapes, and the adaptive controller's estimates)
            names = list(runners)
            for repeat in range(args.repeats):
                shift = repeat % len(names)
                for sys_name in names[shift:] + names[:shift]:
                    rec = runners[sys_name].run(wave, batch, lengths, sustained)
                    records.append({"pair": name, "system": sys_name, "batch": batch, "repeat": repeat, **rec})
                    log(f"{name:9s} b={batch:<2d} r={repeat + 1} {sys_name:24s} {tok_s(rec):8.1f} tok/s")
    finally:
        for r in runners.values():
            r.close()
    return records


def request_lengths(n: int, max_tokens: int, spread: float) -> list[int]:
    """Each request's max_tokens: ``max_tokens``, or with ``spread`` s uniform in [(1 - s) L, (1 + s) L],
    drawn by the request's index, so every system and round gets the same lengths."""
    return [max(1, round(max_tokens * (1.0 + spread * (2.0 * random.Random(i).random() - 1.0)))) for i in range(n)]


def tok_s(record: dict) -> float:
    """One timed run's generated tokens per second."""
    return sum(map(len, record["token_ids"])) / record["wall_s"]


def summarize(records: list[dict], k: int) -> list[dict]:
    rows = []
    keys = sorted({(r["pair"], r["batch"]) for r in records}, key=lambda x: (x[0], x[1]))
    for pair, batch in keys:
        group = [r for r in records if r["pair"] == pair and r["batch"] == batch]
        by_sys: dict[str, list[dict]] = {}
        for r in group:
            by_sys.setdefault(r["system"], []).append(r)
        tps = {s: statistics.median(map(tok_s, rs)) for s, rs in by_sys.items()}
        base, col = tps.get("vllm target-only"), tps.get(f"vllm colocated k={k}")
        ref = by_sys.get("vllm target-only", [{}])[0].get("token_ids")
        col_recs = by_sys.get(f"vllm colocated k={k}", [])
        col_step_ms = statistics.median(r["wall_s"] / max(1, r["num_steps"]) * 1e3 for r in col_recs) if col_recs else None
        rounds = per_round_ratios(group, k)
        for s, rs in by_sys.items():
            med = lambda key: statistics.median(r[key] for r in rs) if all(r.get(key) is not None for r in rs) else None  # noqa: E731
            drafted, accepted, drafts = (sum(r[key] for r in rs) for key in ("num_draft_tokens", "num_accepted_tokens", "num_drafts"))
            row = {"pair": pair, "batch": batch, "system": s, "tok_s": tps[s],
                   "tok_s_range": [min(map(tok_s, rs)), max(map(tok_s, rs))],
                   "vs_colocated": tps[s] / col if col else None, "vs_target_only": tps[s] / base if base else None,
                   "vs_best_vllm": tps[s] / max(base or 0, col or 0) if (base or col) else None,
                   "acceptance": accepted / drafted if drafted else None, "tokens_per_step": 1 + accepted / drafts if drafts else None,
                   "exact": None if ref is None else all(r["token_ids"] == ref for r in rs), "step_ms": None,
                   "vs_best_vllm_by_round": rounds.get(s)}
            if s.startswith("specserve"):
                blocks = sum(r["num_blocks"] for r in rs)
                row.update({key: med(key) for key in ("verify_ms", "draft_wait_ms", "link_ms", "overhead_ms")})
                row["hit_rate"] = sum(r["num_cache_hits"] for r in rs) / blocks if blocks else None
                row["draft_ahead"], row["k_last"] = rs[-1].get("draft_ahead"), rs[-1].get("k")
                generated = sum(sum(map(len, r["token_ids"])) for r in rs)
                if any(r.get("hidden_bytes") for r in rs):  # a head's input: the target's rows on the wire
                    row["hidden_bytes_per_token"] = sum(r["hidden_bytes"] for r in rs) / generated
                row["step_ms"] = statistics.median(r["wall_s"] / max(1, r["num_steps"]) * 1e3 for r in rs)
                if col_step_ms and sum(r["num_speculative_steps"] for r in rs):
                    # This system's step with the draft's own compute hidden (the link stays): the ideal.
                    hidden = statistics.median((r["wall_s"] - r["draft_compute_s"]) / max(1, r["num_steps"]) * 1e3 for r in rs)
                    row["ideal"] = col_step_ms / hidden
                    row["of_ideal"] = row["vs_colocated"] / row["ideal"] if row["vs_colocated"] else None
            else:
                row["step_ms"] = statistics.median(r["wall_s"] / max(1, r["num_steps"]) * 1e3 for r in rs)
            rows.append(row)
    return rows


def per_round_ratios(group: list[dict], k: int) -> dict[str, list[float]]:
    """Per system, its tok/s over the better vLLM row's in each round (one pair and batch size).

    A round is one repeat: every system once, back to back, so the ratio of a round compares runs
    minutes apart at most, where medians over the whole batch size compare runs the machine's drift
    can separate. Rounds missing a system or both vLLM rows are left out."""
    vllm = ("vllm target-only", f"vllm colocated k={k}")
    tps = {(r["system"], r["repeat"]): tok_s(r) for r in group}
    out: dict[str, list[float]] = {}
    for s in sorted({r["system"] for r in group} - set(vllm)):
        for repeat in sorted({r["repeat"] for r in group}):
            best = max((tps[(v, repeat)] for v in vllm if (v, repeat) in tps), default=None)
            if best and (s, repeat) in tps:
                out.setdefault(s, []).append(tps[(s, repeat)] / best)
    return out


def _rounds(ratios: list[float] | None) -> str:
    """median (min-max), rounds at or above 1.0 of all."""
    return by_round(ratios, "x", count=True) if ratios else "-"


def _fmt(v, spec: str = ".2f") -> str:
    return "-" if v is None else (f"{v:{spec}}" if not isinstance(v, bool) else ("yes" if v else "NO"))


def table(rows: list[dict]) -> str:
    head = ("| pair | batch | system | tok/s (min-max) | vs colocated | vs target-only | acceptance | tokens/step | "
            "ms/step: step / verify / draft wait / link / overhead | hits | ahead | ideal | of ideal | exact | hidden B/token | "
            "vs the better vLLM by round: median (min-max), rounds >= 1 |")
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---|---:|---|"]
    for r in rows:
        split = (f"{_fmt(r['step_ms'], '.1f')} / {_fmt(r.get('verify_ms'), '.1f')} / {_fmt(r.get('draft_wait_ms'), '.1f')} / "
                 f"{_fmt(r.get('link_ms'), '.2f')} / {_fmt(r.get('overhead_ms'), '.2f')}")
        lines.append(f"| {r['pair']} | {r['batch']} | {r['system']} | {r['tok_s']:.1f} ({r['tok_s_range'][0]:.0f}-{r['tok_s_range'][1]:.0f}) | "
                     f"{_fmt(r['vs_colocated'])}x | {_fmt(r['vs_target_only'])}x | {_fmt(r['acceptance'])} | "
                     f"{_fmt(r['tokens_per_step'])} | {split} | {_fmt(r.get('hit_rate'))} | {_fmt(r.get('draft_ahead'))} | "
                     f"{_fmt(r.get('ideal'))}x | {_fmt(r.get('of_ideal'), '.0%')} | {_fmt(r['exact'])} | "
                     f"{_fmt(r.get('hidden_bytes_per_token'), '.0f')} | {_rounds(r.get('vs_best_vllm_by_round'))} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = sorted({r["pair"] for r in rows})
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.2 * len(pairs), 4), squeeze=False)
    for ax, pair in zip(axes[0], pairs):
        prow = [r for r in rows if r["pair"] == pair]
        for s in dict.fromkeys(r["system"] for r in prow):
            pts = sorted((r["batch"], r["vs_colocated"]) for r in prow if r["system"] == s and r["vs_colocated"])
            if pts:
                ax.plot(*zip(*pts), "o-" if s.startswith("specserve") else "s--", label=s)
        ax.axhline(1.0, color="gray", lw=1, ls=":")
        ax.set(title=pair, xscale="log", xlabel="batch size", ylabel="tok/s vs vLLM colocated")
        ax.set_xticks(sorted({r["batch"] for r in prow}), [str(b) for b in sorted({r["batch"] for r in prow})])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _report(out: Path, text: str, rows: list[dict]) -> None:
    """The tables to stdout and ``out``/tables.md, the plot beside them."""
    print(text)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.md").write_text(text + "\n")
    plot(rows, out / "speedup_vs_batch.png")


def _from_json(path: Path, out: Path) -> dict:
    from .report import read_results

    data = read_results(path)
    rows = summarize(data["records"], data["args"]["k"])
    title = (data["header"] + "\n\n") if data.get("header") else ""
    _report(out, title + f"vLLM side by side, summarized again from {path} (its run's settings: {data['args']})\n\n" + table(rows), rows)
    return {"summary": rows, "records": data["records"]}


def main(argv=None) -> dict:
    p = parser("benchmarks.bench_vllm", __doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes: the demo pair, batch 1 and 8, 24 tokens, one repeat, fewer systems")
    p.add_argument("--pairs", default=None, help="comma-separated: demo, realistic (a target step ~22x a draft step), demo-eagle "
                                                 "(the demo target and its EAGLE-3 head); default demo,realistic (--quick: demo)")
    p.add_argument("--realistic-pair", help="directory made by examples/make_realistic_pair.py; default: built into --out")
    p.add_argument("--batch-sizes", default=None, help="requests in flight, comma-separated; default 1,8,32 (--quick: 1,8)")
    p.add_argument("--delays-ms", default=None, help="emulated one-way link delays for specserve, comma-separated; default 0,1,5 (--quick: 0)")
    p.add_argument("--num-prompts", type=int, default=8, help="prompts per run at batch 1 (batch B runs max(3 B, this))")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length in tokens (held-out text the demo pair never saw)")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens generated per prompt; default 64 (--quick: 24)")
    p.add_argument("--length-spread", type=float, default=0.0,
                   help="requests' lengths uniform in max-tokens x [1 - s, 1 + s] (as a server sees them) instead of all "
                        "max-tokens, which keeps target-only's requests in lock-step; 0 <= s < 1, default 0")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens of every speculative system")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per row, the table gives their median; default 3 (--quick: 1)")
    p.add_argument("--vllm-stats", action="store_true", help="stat logging in vLLM's own rows, for their acceptance "
                   "(by default off: vLLM's offline default, and how specserve's vLLM target runs)")
    p.add_argument("--compiled", action="store_true", help="torch.compile in every vLLM engine (by default eager: faster starts)")
    p.add_argument("--shared-cores", action="store_true", help="no device emulation: both Ray nodes on every core")
    p.add_argument("--head", choices=("target", "draft"), default="target",
                   help="which emulated device is Ray's head node (its control plane, Serve's controller), as in the cluster YAMLs")
    p.add_argument("--vllm-multiprocessing", action="store_true",
                   help="vLLM's own systems with vLLM's default engine-core process (by default in the actor's process, as specserve's target)")
    p.add_argument("--load", choices=("sustained", "wave"), default="sustained",
                   help="sustained: B requests in flight over max(prompts, 3 B) prompts (serving); wave: waves of exactly B (a batch job)")
    p.add_argument("--systems", default=None, help="only these systems, comma-separated, named as the table names them; default: all")
    p.add_argument("--out", default="bench_out/vllm", help="folder for tables.md, results.json and the plot")
    p.add_argument("--from-json", metavar="RESULTS", help="measure nothing: the tables and plot again from an earlier run's "
                   "results.json (or .json.gz), into --out")
    args = p.parse_args(argv)
    if args.from_json:
        try:
            return _from_json(Path(args.from_json), Path(args.out))
        except (OSError, ValueError, KeyError, TypeError) as exc:  # not a bench_vllm results.json
            p.error(f"--from-json {args.from_json}: not a results.json this benchmark wrote ({type(exc).__name__}: {exc})")
    title = header("benchmarks.bench_vllm", argv)
    q = args.quick
    args.pairs = (args.pairs or ("demo" if q else "demo,realistic")).split(",")
    args.batch_sizes = [int(x) for x in (args.batch_sizes or ("1,8" if q else "1,8,32")).split(",")]
    args.delays_ms = [float(x) for x in (args.delays_ms or ("0" if q else "0,1,5")).split(",")]
    args.max_tokens = args.max_tokens or (24 if q else 64)
    if not 0.0 <= args.length_spread < 1.0:
        p.error(f"--length-spread must be in [0, 1), got {args.length_spread}")
    args.systems = [x.strip() for x in args.systems.split(",")] if args.systems else None
    args.repeats = args.repeats or (1 if q else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from specserve.config import resolve_model

    pairs = {}
    for name in args.pairs:
        if name == "demo":
            pairs[name] = (resolve_model("demo:target"), resolve_model("demo:draft"))
        elif name == "demo-eagle":
            pairs[name] = (resolve_model("demo:target"), resolve_model("demo:eagle"))
        elif name == "realistic":
            pair = Path(args.realistic_pair or out / "realistic_pair")
            if not (pair / "target" / "config.json").exists():
                load_example("make_realistic_pair").build_pair(pair)
            pairs[name] = (str(pair / "target"), str(pair / "draft"))
        else:
            p.error(f"unknown pair {name!r}: demo, realistic or demo-eagle")
    if args.systems:  # a misspelt name would otherwise run nothing for it, silently
        known = {"specserve niceness 15", "specserve trees", *(f"specserve trees d={d:g}ms" for d in args.delays_ms)}.union(*(systems(args, *pair, head=name.endswith("eagle")) for name, pair in pairs.items()))
        unknown = [x for x in args.systems if x not in known]
        if unknown:
            p.error(f"unknown system(s) {unknown} for pairs {list(pairs)}: choose from {sorted(known)}")
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    started = time.time()
    records = []
    with local_cluster(two_device=not args.shared_cores, head=args.head) as cluster:
        cores = {"target": sorted(cluster.target_cpus or []), "draft": sorted(cluster.draft_cpus or [])}
        log(f"two-device harness: target node on cores {cores['target'] or 'all'}, draft node on {cores['draft'] or 'all'}")
        for name, (target, draft) in pairs.items():
            records += bench_pair(name, target, draft, args, log)
    rows = summarize(records, args.k)
    text = (title + "\n\n" + f"vLLM side by side, {'shared cores' if args.shared_cores else 'two-device harness'} "
            f"(target cores {cores['target']}, draft cores {cores['draft']}, Ray's head on the {args.head}'s); greedy, k<={args.k}, "
            f"{args.load} load: " + (f"B requests in flight over max({args.num_prompts}, 3 B) prompts" if args.load == "sustained"
                                     else f"waves of B over max(B, {args.num_prompts}) prompts")
            + f" x {args.max_tokens} tokens" + (f" (each within +-{args.length_spread:.0%})" if args.length_spread else "")
            + f", medians of {args.repeats}; vLLM's own systems "
            + ("with vLLM's engine-core process" if args.vllm_multiprocessing else "in their actor's process")
            + (", with stat logging" if args.vllm_stats else ", without stat logging (vLLM's offline default, and specserve's)")
            + "\n\n"
            + table(rows))
    _report(out, text, rows)
    (out / "results.json").write_text(json.dumps({"header": title, "args": vars(args), "cores": cores, "wall_s": time.time() - started,
                                                  "summary": rows, "records": records}, indent=1))
    log(f"wrote {out / 'tables.md'}, {out / 'results.json'}, {out / 'speedup_vs_batch.png'}")
    return {"summary": rows, "records": records}


if __name__ == "__main__":
    main()
