"""One vLLM engine behind a JSON-lines pipe, so the benchmark can interleave it with the other systems.

Runs under a Python that has vLLM (``$SPECSERVE_VLLM_PYTHON benchmarks/vllm_worker.py``);
imports neither specserve nor the benchmark. Data flow: one JSON command per stdin line ->
one reply per stdout line prefixed with ``@@bench `` (vLLM's own logging may share stdout):

    {"cmd": "load", "model": dir, "draft": dir | null, "k": 4, "dtype": "float32", "max_model_len": 512, "eager": true}
    {"cmd": "run", "prompts": [[ids], ...], "batch": 8, "max_tokens": 64, "sustained": true}
        (sustained: `batch` requests in flight, a new one as each finishes; else waves of `batch`)
    {"cmd": "quit"}

A run replies with wall seconds, the token ids and the spec-decode counters it added
(``vllm:spec_decode_*``, read from ``llm.get_metrics()``). The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with one torch thread.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("VLLM_CPU_KVCACHE_SPACE", "1"), ("OMP_NUM_THREADS", "1"),
                   ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(key, value)

PREFIX = "@@bench "
COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def reply(out, **payload) -> None:
    out.write(PREFIX + json.dumps(payload) + "\n")
    out.flush()


def counters(llm) -> dict:
    values = {name: 0 for name in COUNTERS}
    values[PER_POS] = []
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            values[m.name] += m.value
        elif m.name == PER_POS:
            values[PER_POS] = list(m.values)
    return values


def load(cmd: dict):
    import torch

    torch.set_num_threads(1)
    from vllm import LLM

    kwargs = dict(model=cmd["model"], max_model_len=cmd.get("max_model_len", 512), dtype=cmd.get("dtype", "auto"), seed=0,
                  enforce_eager=cmd.get("eager", True), disable_log_stats=False)
    if cmd.get("draft"):
        kwargs["speculative_config"] = {"method": "draft_model", "model": cmd["draft"], "num_speculative_tokens": cmd["k"]}
    return LLM(**kwargs)


def run(llm, cmd: dict) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=cmd["max_tokens"], ignore_eos=True)
    prompts, batch = cmd["prompts"], cmd["batch"]
    before = counters(llm)
    start = time.perf_counter()
    token_ids = []
    if cmd.get("sustained"):
        engine, done, added = llm.llm_engine, {}, 0
        run = cmd.setdefault("run_id", str(time.monotonic_ns()))
        while len(done) < len(prompts):
            while added < len(prompts) and added - len(done) < batch:
                engine.add_request(f"{run}-{added}", TokensPrompt(prompt_token_ids=prompts[added]), params)
                added += 1
            for o in engine.step():
                if o.finished:
                    done[int(o.request_id.rsplit("-", 1)[1])] = list(o.outputs[0].token_ids)
        token_ids = [done[i] for i in range(len(prompts))]
    else:
        for i in range(0, len(prompts), batch):
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[i : i + batch]], params, use_tqdm=False)
            token_ids += [list(o.outputs[0].token_ids) for o in outs]
    wall = time.perf_counter() - start
    after = counters(llm)
    per_pos = [a - (before[PER_POS][j] if j < len(before[PER_POS]) else 0) for j, a in enumerate(after[PER_POS])]
    return {"wall_s": wall, "token_ids": token_ids,
            "num_drafts": after[COUNTERS[0]] - before[COUNTERS[0]], "num_draft_tokens": after[COUNTERS[1]] - before[COUNTERS[1]],
            "num_accepted_tokens": after[COUNTERS[2]] - before[COUNTERS[2]], "num_accepted_tokens_per_pos": per_pos}


def main() -> None:
    out = sys.stdout
    llm = None
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "load":
                start = time.perf_counter()
                llm = load(cmd)
                import vllm

                reply(out, ok=True, load_s=time.perf_counter() - start, version=vllm.__version__)
            elif cmd["cmd"] == "run":
                reply(out, ok=True, **run(llm, cmd))
            elif cmd["cmd"] == "quit":
                reply(out, ok=True)
                return
        except Exception as exc:  # reported to the benchmark, which marks the system as failed
            reply(out, ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()[-2000:])


if __name__ == "__main__":
    main()
