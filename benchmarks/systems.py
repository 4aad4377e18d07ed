"""The systems the benchmark compares, each behind ``run(prompts, batch, max_tokens) -> record``.

Data flow: a ``SystemSpec`` (``scenarios.py``) -> a runner that loads once and then runs any
number of timed greedy generations, the prompts in waves of ``batch`` concurrent requests ->
a flat record: wall time, token ids (for the greedy check), speculation counters and, where
the system exposes them, the per-step timing split (forwards vs overhead). Runners:
``SpecserveRunner`` (``LLM`` in-process or on Ray; per-step numbers are differences of
``llm.metrics()`` around the run), ``HFRunner`` (transformers ``generate``, assisted or not;
forwards timed by hooks), ``VLLMRunner`` (``vllm_worker.py`` in vLLM's own venv, over a pipe).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .bench_cluster import THREAD_ENV  # one thread per process; vLLM keeps the inherited cores
COUNTERS = ("num_steps", "num_speculative_steps", "num_cache_hits", "num_blocks")


class Skipped(Exception):
    """A system that cannot run here (say why in one line)."""


def spec_totals(outs) -> dict:
    from specserve import SpecMetrics

    total = SpecMetrics()
    for o in outs:
        total.merge(o.metrics)
    return {"num_drafts": total.num_drafts, "num_draft_tokens": total.num_draft_tokens,
            "num_accepted_tokens": total.num_accepted_tokens, "num_accepted_tokens_per_pos": total.num_accepted_tokens_per_pos}


def per_step(before: dict, after: dict) -> dict:
    """``EngineCore.metrics()["per_step"]`` for the steps between two snapshots (same formulas)."""
    t = {k: after["timing"][k] - before["timing"][k] for k in after["timing"]}
    c = {k: after[k] - before[k] for k in COUNTERS}
    steps, spec = max(1, c["num_steps"]), max(1, c["num_speculative_steps"])
    return {**c, "step_ms": t["wall_s"] / steps * 1e3, "target_forward_ms": t["target_forward_s"] / steps * 1e3,
            "prefill_ms": t["prefill_s"] / steps * 1e3, "draft_wait_ms": t["draft_wait_s"] / spec * 1e3,
            "draft_forward_ms": t["draft_forward_s"] / spec * 1e3, "link_ms": (t["draft_wait_s"] - t["draft_compute_s"]) / spec * 1e3,
            "overhead_ms": (t["wall_s"] - t["target_forward_s"] - t["prefill_s"] - t["draft_forward_s"]) / steps * 1e3}


def steady_tokens_per_s(outs, batch: int) -> float | None:
    """Throughput while the window of ``batch`` requests was full: the tokens made from the first
    admission to the last, over that time. A request still running at the last admission counts the
    share of its tokens its time so far implies (a request's rate is steady under a full window).
    Left out: the end of a finite run, where speculating requests finish at different steps and the
    batch drains; a server under sustained load has none. None: no request waited for a slot."""
    start, last = min(o.arrival_time for o in outs), max(o.arrival_time for o in outs)
    if len(outs) <= batch or last <= start:
        return None
    tokens = sum(len(o.token_ids) * min(1.0, (last - o.arrival_time) / (o.finished_time - o.arrival_time))
                 for o in outs if o.arrival_time < last)
    return tokens / (last - start)


class SpecserveRunner:
    def __init__(self, spec, scenario, args, cluster_address: str | None = None):
        from specserve import LLM

        kw = dict(cpu_threads=1, num_speculative_tokens=spec.k, draft=scenario.draft if spec.k else None, max_num_seqs=256)
        options = {k: v for k, v in spec.options.items() if spec.k or not k.startswith("draft_")}
        if scenario.sim:
            kw["target_backend"] = "sim"
            if spec.k:
                kw["draft_backend"] = "sim"
        else:
            kw.update(dtype=args.dtype, target_backend="hf")  # specserve's own engine (bench_vllm runs the vLLM target)
        if spec.kind == "ray":
            kw.update(ray=True, address=cluster_address, target_num_cpus=args.side_cpus, draft_num_cpus=args.side_cpus,
                      channel_delay_ms=spec.delay_ms, runtime_env={"env_vars": THREAD_ENV})
        self.spec, self.llm = spec, LLM(scenario.target, **kw, **options)
        self.sustained = getattr(args, "load", "wave") == "sustained"

    def run(self, prompts, batch: int, max_tokens: int) -> dict:
        from specserve import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        before = self.llm.metrics()
        start = time.perf_counter()
        outs = []
        if self.sustained:  # B requests in flight, a new one as each finishes
            outs = self.llm.generate(prompts, params, use_tqdm=False, max_in_flight=batch)
        else:
            for i in range(0, len(prompts), batch):
                outs += self.llm.generate(prompts[i : i + batch], params, use_tqdm=False)
        wall = time.perf_counter() - start
        after = self.llm.metrics()
        record = {"wall_s": wall, "token_ids": [list(o.token_ids) for o in outs], **spec_totals(outs),
                  **per_step(before, after), "speculation": after.get("speculation")}
        if self.sustained:
            record["steady_tokens_per_s"] = steady_tokens_per_s(outs, batch)
        if self.spec.kind == "specserve" and self.spec.k and self.spec.options.get("adaptive"):
            # The controller's own prediction (in-process only: over Ray, metrics()["speculation"] has its inputs).
            record["predicted"] = predictions(self.llm._engine.loop.core.controller, batch)
        return record

    def close(self) -> None:
        self.llm.shutdown()


class HFRunner:
    """transformers ``generate`` at batch 1, with ``assistant_model=`` for assisted generation."""

    def __init__(self, spec, scenario, args):
        import torch
        from transformers import AutoModelForCausalLM

        if scenario.sim:
            raise Skipped("transformers cannot run the simulator")
        dtype = getattr(torch, args.dtype)
        self.spec = spec
        self.target = AutoModelForCausalLM.from_pretrained(scenario.target, dtype=dtype).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(scenario.draft, dtype=dtype).eval() if spec.k else None
        self.clock = {}
        for name, model in (("target", self.target), ("draft", self.draft)):
            if model is None:
                continue
            model.generation_config.eos_token_id = None  # ignore EOS, like the other systems (ignore_eos)
            self.clock[name] = c = {"calls": 0, "seconds": 0.0, "prefill_s": 0.0, "first": False, "started": 0.0}
            model.register_forward_pre_hook(lambda *_, c=c: c.__setitem__("started", time.perf_counter()))
            model.register_forward_hook(lambda *_, c=c: self._tick(c))

    @staticmethod
    def _tick(c: dict) -> None:
        """After a forward: count it; the first one of a generate call is the prompt's prefill."""
        elapsed = time.perf_counter() - c["started"]
        if c["first"]:
            c["first"], c["prefill_s"] = False, c["prefill_s"] + elapsed
        else:
            c["calls"], c["seconds"] = c["calls"] + 1, c["seconds"] + elapsed

    def run(self, prompts, batch: int, max_tokens: int) -> dict:
        import torch

        if batch != 1:
            raise Skipped("transformers assisted generation supports batch size 1 only (its target-only baseline runs with it)")
        for c in self.clock.values():
            c.update(calls=0, seconds=0.0, prefill_s=0.0)
        token_ids = []
        start = time.perf_counter()
        with torch.no_grad():
            for p in prompts:
                kw = dict(max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
                if self.draft is not None:
                    g = self.draft.generation_config
                    g.num_assistant_tokens = self.spec.k  # reset: "heuristic" carries it over between calls
                    g.num_assistant_tokens_schedule = self.spec.options["schedule"]
                    g.assistant_confidence_threshold = 0.0 if self.spec.options["schedule"] == "constant" else 0.4
                    kw["assistant_model"] = self.draft
                ids = torch.tensor([p])
                for c in self.clock.values():
                    c["first"] = True
                out = self.target.generate(ids, attention_mask=torch.ones_like(ids), **kw)
                token_ids.append(out[0, len(p):].tolist())  # .tolist(): compared with the other systems' ids
        wall = time.perf_counter() - start
        t, d = self.clock["target"], self.clock.get("draft", {"calls": 0, "seconds": 0.0, "prefill_s": 0.0})
        steps = max(1, t["calls"])  # decode / verify steps (the prefill makes each prompt's first token)
        decoded = sum(len(x) for x in token_ids) - len(prompts)
        record = {"wall_s": wall, "token_ids": token_ids, "num_steps": steps, "step_ms": wall / steps * 1e3,
                  "target_forward_ms": t["seconds"] / steps * 1e3, "prefill_ms": (t["prefill_s"] + d["prefill_s"]) / steps * 1e3,
                  "draft_forward_ms": d["seconds"] / steps * 1e3, "link_ms": 0.0,
                  "overhead_ms": (wall - t["seconds"] - t["prefill_s"] - d["seconds"] - d["prefill_s"]) / steps * 1e3}
        if self.draft is not None:  # one draft forward per draft token (its first per prompt, the prefill, aside)
            record.update(num_drafts=steps, num_draft_tokens=d["calls"], num_accepted_tokens=decoded - steps,
                          num_accepted_tokens_per_pos=[], draft_step_ms=d["seconds"] / max(1, d["calls"]) * 1e3)
        return record

    def close(self) -> None:
        self.target = self.draft = None


def default_vllm_python() -> str | None:
    """``$SPECSERVE_VLLM_PYTHON`` (a virtual environment of vLLM's own, which may pin other torch and
    transformers versions), else this Python if it has vLLM; the worker runs in a process of its own either way."""
    if os.environ.get("SPECSERVE_VLLM_PYTHON"):
        return os.environ["SPECSERVE_VLLM_PYTHON"]
    import importlib.util

    return sys.executable if importlib.util.find_spec("vllm") is not None else None


class VLLMRunner:
    """vLLM in its own interpreter (it may pin other torch/transformers versions), one engine per runner."""

    PREFIX = "@@bench "

    def __init__(self, spec, scenario, args):
        if scenario.sim:
            raise Skipped("vLLM cannot run the simulator")
        python = args.vllm_python
        if not python or not Path(python).exists():
            raise Skipped(f"no Python with vLLM at {python!r} (pass --vllm-python or set SPECSERVE_VLLM_PYTHON)")
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
        if probe.returncode:
            raise Skipped(f"vLLM is not importable by {python}: {probe.stderr.strip().splitlines()[-1:]}")
        worker = Path(__file__).resolve().parent / "vllm_worker.py"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own site-packages only
        self.proc = subprocess.Popen([python, str(worker)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env={**env, **THREAD_ENV})
        reply = self._ask(cmd="load", model=scenario.target, draft=scenario.draft if spec.k else None, k=spec.k,
                          dtype=args.dtype, max_model_len=args.vllm_max_model_len, eager=args.vllm_eager)
        self.sustained = getattr(args, "load", "wave") == "sustained"
        self.version = reply.get("version")

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(self.PREFIX):
                reply = json.loads(line[len(self.PREFIX):])
                if not reply.pop("ok"):
                    raise RuntimeError(f"vLLM worker: {reply['error']}")
                return reply
        raise RuntimeError(f"the vLLM worker exited (code {self.proc.wait()})")

    def run(self, prompts, batch: int, max_tokens: int) -> dict:
        return self._ask(cmd="run", prompts=prompts, batch=batch, max_tokens=max_tokens, sustained=self.sustained)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()  # our own child, by handle
                self.proc.wait()


def make_runner(spec, scenario, args, cluster_address: str | None = None):
    if spec.kind in ("specserve", "ray"):
        return SpecserveRunner(spec, scenario, args, cluster_address)
    if spec.kind == "hf":
        return HFRunner(spec, scenario, args)
    if spec.kind == "vllm":
        return VLLMRunner(spec, scenario, args)
    raise ValueError(f"unknown system kind {spec.kind!r}")


def predictions(controller, batch_size: int) -> list[dict]:
    """Per arm: expected tokens per sequence, predicted seconds per cycle, tokens/s, speed-up over k = 0."""
    from specserve.adaptive import TARGET_ONLY

    rates = controller.rates(batch_size, True)
    base = rates.get(TARGET_ONLY)
    return [{"k": a.k, "cache_only": a.cache_only, "expected_tokens": controller.expected_tokens(a.k, a.cache_only, batch_size),
             "step_s": controller.model.seconds(batch_size, a), "tokens_per_s": rates.get(a),
             "speedup": rates[a] / base if a in rates and base else None} for a in controller.arms(True)]
