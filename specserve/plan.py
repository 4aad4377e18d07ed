"""``specserve plan``: the tokens/s to expect before deploying, from the controller's own model.

An arm (k, mode) delivers B x E tokens per cycle of T seconds, E from the acceptance as the
controller computes it (``SpeculationController.expected_tokens``). T comes from one of two sources:

- profiles: the simulator's device, model and link YAMLs (``backends/sim_profiles``), per deployment:
  target-only; the draft colocated on the target's device (drafting and verifying in turn); the draft
  remote without drafting ahead (k draft forwards and a round trip per cycle); the draft remote and
  drafting ahead (its tree grown during the verify: a foreseen verdict costs only the round trip);
- measured: a short run of the real pair on the user's prompts, after which the controller's fitted
  cycle model and measured acceptance give every arm's rate (``predicted_tokens_per_s``: its cycles
  with the load's prompts in them, as the controller compares arms), with each request's departure
  added from the same fit, spread over its tokens (a load pays it whatever the arm).

The arm with the most tokens per second is the one the controller runs (measured: the one it settled
on). Both give a load's rate (``load_rate``): each request's own costs spread over its tokens, and
its first two tokens (the prefill's, and its first step's, which goes without drafts) a cycle each.
Knows nothing of Ray.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from .adaptive import HYSTERESIS, TARGET_ONLY, Arm, SpeculationController
from .cycle_model import bucket_of

DEPLOYMENTS = ("target-only", "colocated", "remote", "remote, drafting ahead")
DEFAULT_PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main():\n", "class Stack:\n    def __init__(self):\n",
                   "The quick brown fox", "SELECT name FROM users WHERE", "Once upon a time,")


@dataclass(frozen=True)
class Costs:
    """Seconds of the pieces of a cycle at one batch size, from profiles."""

    verify: dict[int, float]  # k -> the target's forward over k + 1 tokens per sequence
    draft: float  # one draft forward (a token per sequence) on the draft's device
    draft_on_target: float  # the same on the target's device
    tree_depth: float  # one depth of the speculation tree (fanout rows per sequence)
    rtt: float  # the link's round trip for one step's message
    prefill: float = 0.0  # what a prompt's prefill adds to the cycle it joins


def profile_costs(target: str, draft: str, link: str, batch_size: int, k: int, context: int = 512, fanout: int = 4,
                  overhead_s: float = 0.0, time_scale: float = 1.0, prompt_tokens: int = 0) -> Costs:
    """``overhead_s``: the engine's own work per cycle (scheduling, sampling, output handling), on top of
    the forwards; ``time_scale``: every modelled time multiplied by it, as the simulator's option;
    ``prompt_tokens``: a prompt's length, whose prefill joins a cycle (0: none)."""
    from .backends.sim_latency import load_link, load_profile

    t, d, ln = load_profile(target), load_profile(draft), load_link(link)
    on_target = load_profile({"model": _fields(d.model), "hardware": _fields(t.hardware)})
    rows, ctx, s = [1] * batch_size, [context] * batch_size, time_scale
    message = 256 + 16 * batch_size * (k + 2)  # token ids and a sequence's delta, both ways
    prefill = s * (t.forward_s(rows + [prompt_tokens], ctx + [prompt_tokens]) - t.forward_s(rows, ctx)) if prompt_tokens else 0.0
    return Costs({j: s * t.forward_s([j + 1] * batch_size, ctx) + overhead_s for j in range(k + 1)}, s * d.forward_s(rows, ctx),
                 s * on_target.forward_s(rows, ctx), s * d.forward_s([fanout] * batch_size, ctx), 2 * s * ln.one_way_s(message), prefill)


def _fields(spec) -> dict:
    return {k: v for k, v in vars(spec).items() if k != "name"}


def cycle_seconds(c: Costs, deployment: str, arm: Arm, batch_size: int, hit: float) -> float | None:
    """A cycle of ``arm`` in ``deployment``; None where the arm does not exist there. ``hit``: the chance
    the draft foresaw a sequence's verdict (its tree holds the block asked for)."""
    k, cache_only = arm
    if k == 0:
        return c.verify[0]
    if deployment == "target-only" or (cache_only and deployment != "remote, drafting ahead"):
        return None
    if deployment == "colocated":
        return c.verify[k] + k * c.draft_on_target
    if deployment == "remote":
        return c.verify[k] + c.rtt + k * c.draft
    if cache_only:
        return c.verify[k] + c.rtt
    missed = 1.0 - hit ** batch_size  # one miss holds the batch for a block drafted now
    return c.verify[k] + c.rtt + (missed * k + (1 - missed) * max(0, k - tree_depth(c, k))) * c.draft


def tree_depth(c: Costs, k: int) -> int:
    """Depths of the speculation tree that fit in the time a verify and the link leave the draft."""
    return max(0, math.floor((c.verify[k] + c.rtt - c.draft) / c.tree_depth))


def predict(target: str, draft: str, link: str, acceptance: float | list[float], batch_sizes=(1, 8, 32), k: int = 4,
            hit: float = 0.9, context: int = 512, overhead_s: float = 0.0, time_scale: float = 1.0, prompt_tokens: int = 0,
            max_tokens: int = 64) -> list[dict]:
    """Per batch size and deployment: the best arm and its tokens/s (``rates``: every arm's), from profiles;
    with ``prompt_tokens``, each request's prefill spread over its ``max_tokens``."""
    per_pos = [acceptance] * k if isinstance(acceptance, (int, float)) else list(acceptance)[:k]
    if len(per_pos) < k or not all(0.0 <= a <= 1.0 for a in per_pos):
        raise ValueError(f"acceptance must be a probability (or {k} of them, one per draft position), got {acceptance!r}")
    ctrl = SpeculationController(k)
    ctrl.acceptance = per_pos
    rows = []
    for b in batch_sizes:
        c = profile_costs(target, draft, link, b, k, context, overhead_s=overhead_s, time_scale=time_scale, prompt_tokens=prompt_tokens)
        depth = tree_depth(c, k)
        for asked in range(1, k + 1):
            ctrl.coverage[(round(math.log2(b)), asked)] = [hit if j < depth else 0.0 for j in range(asked)]
        for deployment in DEPLOYMENTS:
            rates = {}
            for arm in ctrl.arms(True):
                seconds = cycle_seconds(c, deployment, arm, b, hit)
                if seconds is not None:
                    e = ctrl.expected_tokens(arm.k, arm.cache_only, b)
                    rates[arm] = load_rate(b * e / seconds, c.prefill, max_tokens, e)
            best = max(rates, key=rates.get)
            rows.append({"batch_size": b, "deployment": deployment, "arm": best, "tokens_per_s": rates[best], "rates": rates,
                         "target_only_tokens_per_s": rates[TARGET_ONLY], "tree_depth": depth, "rtt_ms": c.rtt * 1e3})
    return rows


def load_rate(steady_tokens_per_s: float, request_s: float, max_tokens: int, expected_tokens: float = 1.0,
              prefilled_apart: float = 0.0) -> float:
    """Tokens/s of a load of requests of ``max_tokens`` each, from an arm's steady rate (B x E per
    cycle): a request's row yields one token in the cycle of its prefill and one in its first step,
    which goes without drafts (``step_plan.hold_first_blocks``), then E (``expected_tokens``) a cycle;
    and each request adds ``request_s`` (a prompt's prefill, a departure) whatever the arm.
    ``prefilled_apart``: the share of requests whose prompt a forward of its own prefilled, outside
    any cycle (its time in ``request_s``), so that their first token takes no cycle."""
    e = expected_tokens
    row_cycles = max(0.0, min(max_tokens, 2) - prefilled_apart) + max(0, max_tokens - 2) / e
    return max_tokens / (row_cycles * e / steady_tokens_per_s + request_s)


def measure(target: str, draft: str, prompts: list, batch_sizes=(1, 8, 32), max_tokens: int = 64, **llm_kwargs) -> list[dict]:
    """Per batch size (a power of two: the controller's buckets): run the pair on ``prompts`` (B in flight,
    greedy) with the adaptive default, then read the controller's predictions for every arm (its fitted
    cycle model, its measured acceptance, this load's prompts), each with the requests' departures and
    first two tokens added: ``tokens_per_s`` is the load's rate of the arm the controller settled on,
    ``steady_tokens_per_s`` its cycles' (with the prompts they prefilled)."""
    if any(b < 1 or b & (b - 1) for b in batch_sizes):
        raise ValueError(f"measured batch sizes must be powers of two (the controller's buckets), got {list(batch_sizes)}")
    from .llm import LLM
    from .sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    with LLM(target, draft=draft, **llm_kwargs) as llm:
        for b in batch_sizes:
            load = [prompts[i % len(prompts)] for i in range(max(4 * b, 8))]  # enough cycles for a bucket's warm-up
            before = llm.metrics()
            llm.generate(load, params, use_tqdm=False, max_in_flight=b)
            after = llm.metrics()
            spec = after.get("speculation") or {}
            steady = {_arm(key.split("/")[1]): rate for key, rate in (spec.get("predicted_tokens_per_s") or {}).items()
                      if key.split("/")[0] == str(b)}
            if not steady:
                raise ValueError(f"batch {b}: the controller measured no cycles (is the draft connected? k > 0?)")
            line = (spec.get("cycle_model") or {}).get(str(b)) or [0.0] * 8  # [..., per prompt token, per departure, ...]
            # The prompts prefilled in cycles are in the predicted rates (the load's r, ``adaptive``); those a
            # forward of their own prefilled (specserve's transformers target) stop every row for its time.
            apart = (after.get("num_prefills_apart", 0) - before.get("num_prefills_apart", 0)) / len(load)
            prefill_s = (after.get("timing") or {}).get("prefill_s", 0.0) - (before.get("timing") or {}).get("prefill_s", 0.0)
            request_s = max(0.0, line[6]) + prefill_s / len(load)
            ctrl = SpeculationController(max(a.k for a in steady))  # E of each arm, as the controller computed it
            ctrl.acceptance = list(spec.get("acceptance_per_pos") or ctrl.acceptance)
            for key, coverage in (spec.get("coverage_per_pos") or {}).items():
                ctrl.coverage[(bucket_of(int(key.split("/")[0])), int(key.split("/")[1]))] = list(coverage)
            rates = {arm: load_rate(rate, request_s, max_tokens, ctrl.expected_tokens(arm.k, arm.cache_only, b), apart)
                     for arm, rate in steady.items()}
            # The arm the controller runs, not the best prediction: an arm measured for a few cycles only
            # is as likely over- as under-predicted, and the largest of many such predictions is too high.
            chosen = (spec.get("arm_by_bucket") or {}).get(str(b))
            best = _arm(chosen) if chosen is not None and _arm(chosen) in rates else max(rates, key=rates.get)
            rows.append({"batch_size": b, "deployment": "measured", "arm": best, "tokens_per_s": rates[best],
                         "steady_tokens_per_s": steady[best], "target_only_tokens_per_s": rates.get(TARGET_ONLY, 0.0),
                         "acceptance_per_pos": spec.get("acceptance_per_pos")})
    return rows


def _arm(text: str) -> Arm:
    return Arm(int(text.rstrip("c")), text.endswith("c"))


def arm_text(arm: Arm) -> str:
    return "target-only" if not arm.k else f"k={arm.k}{', cache-only' if arm.cache_only else ''}"


def report(rows: list[dict], label: str = "") -> str:
    lines = [f"{label}", "| batch | deployment | the controller runs | tokens/s | vs target-only |", "|---:|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch_size']} | {r['deployment']} | {arm_text(r['arm'])} | {r['tokens_per_s']:.1f} "
                     f"| {r['tokens_per_s'] / r['target_only_tokens_per_s']:.2f}x |")
    return "\n".join(lines)


def recommend(rows: list[dict]) -> list[str]:
    """One line per batch size: disaggregate or not, with which draft and arm, against the alternatives."""
    out = []
    for b in sorted({r["batch_size"] for r in rows}):
        group = [r for r in rows if r["batch_size"] == b]
        best = max(group, key=lambda r: r["tokens_per_s"])
        base = best["target_only_tokens_per_s"]
        colocated = max((r for r in group if r["deployment"].startswith("colocated")), key=lambda r: r["tokens_per_s"], default=None)
        remote = max((r for r in group if r["deployment"].startswith("remote")), key=lambda r: r["tokens_per_s"], default=None)
        if not best["arm"].k or best["tokens_per_s"] < base * (1 + HYSTERESIS):
            out.append(f"batch {b}: speculation does not pay: serve target-only ({base:.1f} tok/s)")
            continue
        verdict = ("disaggregate" if best["deployment"].startswith("remote") else
                   "keep the draft beside the target" if best["deployment"].startswith("colocated") else "speculate")
        other = colocated if best is remote else remote
        versus = f", {best['tokens_per_s'] / other['tokens_per_s']:.2f}x {other['deployment']}" if other is not None else ""
        out.append(f"batch {b}: {verdict}: {best['deployment']}, {arm_text(best['arm'])}: {best['tokens_per_s']:.1f} tok/s "
                   f"({best['tokens_per_s'] / base:.2f}x target-only{versus})")
    return out


def read_prompts(path: str) -> list:
    """Prompts from JSONL: one {"prompt": text} or {"prompt_token_ids": [...]} per line."""
    prompts = []
    with open(path) as f:
        for n, line in enumerate(f):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not ("prompt" in row or "prompt_token_ids" in row):
                raise ValueError(f"{path}:{n + 1}: expected {{\"prompt\": ...}} or {{\"prompt_token_ids\": [...]}}")
            prompts.append(row.get("prompt", row.get("prompt_token_ids")))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts
