"""Where one decode step's time goes on a GPU: the model alone, the transformers backend, the engine.

``bench_gpu`` measures throughput; this finds the host-side cost behind it. Builds ``bench_gpu``'s random
Llama target, then at each batch size B, one token per sequence per step:

- ``hf DynamicCache``: the model's own forward with transformers' cache, synchronised every step: the floor
  any backend on this model pays (with the attention kernels specserve allows, and with all of them);
- ``backend``: ``HFBackend.forward`` (slot KV cache, per-row 4-D mask), synchronised every step;
- ``engine``: ``LLM(target)`` target-only, its measured time per step;

the backend and engine rows each with specserve's attention kernels (``hf.CUDA_SDPA_BACKENDS``) and with
every SDPA kernel (cuDNN's included); each as the median ms per step. Then a ``torch.profiler`` table of
the backend's host-side ops (self CPU time, device syncs and copies per step) and py-spy's samples of the
engine's thread (when py-spy is installed). Writes ``--out``/profile.txt. ``--threads`` repeats the
backend rows with that many torch CPU threads; ``--attn sdpa,eager`` compares attention implementations.

    python -m benchmarks.dev.profile_gpu [--batch-sizes 1,32] [--steps 40] [--device cuda]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from benchmarks.bench_gpu import add_pair_args, build_pair
from benchmarks.cli import parser


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_floor(model, batch: int, prompt: int, steps: int, device: str) -> float:
    import torch
    from transformers import DynamicCache

    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), device=device)
    cache = DynamicCache()
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        tok = out.logits[:, -1].argmax(-1, keepdim=True)
        times = []
        for _ in range(steps):
            _sync(device)
            t0 = time.perf_counter()
            out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            tok.tolist()  # the host reads the tokens, as any server does
            times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def backend_steps(backend, batch: int, prompt: int, steps: int, device: str, profile: bool = False):
    import torch

    seqs = [f"s{time.perf_counter_ns()}-{i}" for i in range(batch)]
    for s in seqs:
        backend.add(s)
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, backend.vocab_size, (batch, prompt), generator=gen).tolist()
    logits = backend.forward(seqs, prompts, [1] * batch)
    toks = logits[:, -1].argmax(-1).tolist()
    times = []

    def run(n):
        nonlocal toks, logits
        for _ in range(n):
            _sync(device)
            t0 = time.perf_counter()
            logits = backend.forward(seqs, [[t] for t in toks], [1] * batch)
            toks = logits[:, -1].argmax(-1).tolist()
            times.append(time.perf_counter() - t0)

    run(steps)
    table = None
    if profile:
        table = _profiled(lambda: run(10), 10)
    for s in seqs:
        backend.free(s)
    return statistics.median(times[2:steps]) * 1e3, table


def _profiled(fn, num_steps: int) -> str:
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        fn()
    avg = prof.key_averages()
    lines = [f"per step (of {num_steps}): self CPU ms of the top ops; calls per step"]
    rows = sorted(avg, key=lambda e: -e.self_cpu_time_total)[:22]
    for e in rows:
        lines.append(f"  {e.key[:60]:60s} {e.self_cpu_time_total / 1e3 / num_steps:8.3f} ms  {e.count / num_steps:7.1f}")
    for name in ("cudaStreamSynchronize", "cudaMemcpyAsync", "cudaLaunchKernel", "aten::item", "aten::_local_scalar_dense",
                 "aten::nonzero", "aten::index_put_", "cudaDeviceSynchronize"):
        hits = [e for e in avg if e.key == name]
        if hits:
            lines.append(f"  [{name}] {hits[0].count / num_steps:.1f} per step, {hits[0].self_cpu_time_total / 1e3 / num_steps:.3f} ms")
    total = sum(e.self_cpu_time_total for e in avg) / 1e3 / num_steps
    lines.append(f"  all ops' self CPU: {total:.2f} ms per step")
    return "\n".join(lines)


def _spied(fn) -> str:
    import collections
    import os
    import re
    import shutil
    import subprocess
    import tempfile

    spy = shutil.which("py-spy")
    if spy is None:
        fn()
        return "py-spy not installed: no samples"
    path = os.path.join(tempfile.mkdtemp(), "raw.txt")
    proc = subprocess.Popen([spy, "record", "--pid", str(os.getpid()), "--rate", "500", "--format", "raw", "-o", path,
                             "--nonblocking"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    fn()
    proc.send_signal(2)
    proc.wait(timeout=30)
    own, incl, total = collections.Counter(), collections.Counter(), 0
    if not os.path.exists(path):
        return "py-spy wrote no samples (ptrace refused?)"
    with open(path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            frames = stack.split(";")
            if not any("_run (specserve/engine.py" in fr for fr in frames):
                continue  # only the engine thread's samples
            n = int(n)
            total += n
            own[frames[-1]] += n
            for fr in {re.sub(r":\d+\)$", ")", fr) for fr in frames}:  # by function, not by line
                incl[fr] += n
    lines = [f"engine thread, {total} samples: self share of the top frames"]
    lines += [f"  {100 * c / total:5.1f}%  {fr[:110]}" for fr, c in own.most_common(18)]
    lines.append("inclusive share, specserve frames")
    lines += [f"  {100 * c / total:5.1f}%  {fr[:110]}" for fr, c in incl.most_common(200) if "specserve" in fr][:25]
    return "\n".join(lines)


def engine_step_ms(target: str, batch: int, prompt: int, tokens: int, device: str, dtype: str, profile: bool):
    from specserve import LLM, SamplingParams

    import torch

    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 1000, (batch, prompt), generator=gen).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    table = None
    with LLM(target, target_backend="hf", device=device, dtype=dtype, max_num_seqs=max(32, batch)) as llm:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        before = llm.metrics()
        llm.generate(prompts, params, use_tqdm=False)
        after = llm.metrics()
        if profile:  # the engine steps in its own thread: sample every thread of this process with py-spy
            def twice():  # (long enough for a few hundred samples)
                for _ in range(2):
                    llm.generate(prompts, params, use_tqdm=False)

            table = _spied(twice)
    steps = after["num_steps"] - before["num_steps"]
    step_ms = (after["timing"]["wall_s"] - before["timing"]["wall_s"]) / max(1, steps) * 1e3
    split = {k: (after["timing"][k] - before["timing"][k]) / max(1, steps) * 1e3 for k in after["timing"]}
    return step_ms, split, table


def main(argv=None) -> None:
    p = parser("benchmarks.dev.profile_gpu", __doc__)
    p.add_argument("--batch-sizes", default="1,32", help="sequences per step, comma-separated")
    p.add_argument("--steps", type=int, default=40, help="timed decode steps per row")
    add_pair_args(p)
    p.add_argument("--device", default="cuda", help="torch device")
    p.add_argument("--threads", default="", help="also run the backend rows with these torch thread counts, e.g. 1,4")
    p.add_argument("--attn", default="sdpa", help="attention implementations to compare for the backend rows, e.g. sdpa,eager")
    p.add_argument("--out", default="bench_out/profile_gpu", help="folder for profile.txt")
    args = p.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from torch.nn.attention import sdpa_kernel

    from specserve.backends.hf import HFBackend

    dtype = getattr(torch, args.dtype)
    target, _ = build_pair(Path(args.models or Path(args.out) / "pair"), args.hidden, args.layers, args.vocab, dtype, args.middle_scale)
    lines = [f"device {torch.cuda.get_device_name(0) if args.device.startswith('cuda') else args.device}, torch "
             f"{torch.__version__}, {torch.get_num_threads()} CPU threads; target {args.layers} x {args.hidden}, {args.dtype}"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tables = []
    import specserve.backends.hf as hf

    restricted = hf.CUDA_SDPA_BACKENDS
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(args.device).eval()
        with sdpa_kernel(list(restricted)):
            floor = hf_floor(model, batch, args.prompt_tokens, args.steps, args.device)
        lines.append(f"B={batch:3d} hf DynamicCache, specserve's kernels   {floor:8.2f} ms/step")
        floor = hf_floor(model, batch, args.prompt_tokens, args.steps, args.device)
        lines.append(f"B={batch:3d} hf DynamicCache, all SDPA kernels  {floor:8.2f} ms/step")
        del model
        default_threads = torch.get_num_threads()
        for kernels, label in ((restricted, "specserve's kernels"), ((), "all SDPA kernels ")):
            hf.CUDA_SDPA_BACKENDS = kernels
            for attn in args.attn.split(","):
                backend = HFBackend(target, dtype=args.dtype, device=args.device)
                backend.model.set_attn_implementation(attn)
                ms, table = backend_steps(backend, batch, args.prompt_tokens, args.steps, args.device,
                                          profile=attn == "sdpa" and kernels)
                lines.append(f"B={batch:3d} backend ({attn}), {label}    {ms:8.2f} ms/step")
                if table:
                    tables.append(f"== backend B={batch}\n{table}")
                for n in [int(t) for t in args.threads.split(",") if t]:
                    torch.set_num_threads(n)
                    ms, _ = backend_steps(backend, batch, args.prompt_tokens, args.steps, args.device)
                    lines.append(f"B={batch:3d} backend ({attn}) {n:2d} thr    {ms:8.2f} ms/step")
                    torch.set_num_threads(default_threads)
                del backend
            step, split, table = engine_step_ms(target, batch, args.prompt_tokens, args.steps, args.device, args.dtype,
                                                profile=bool(kernels))
            lines.append(f"B={batch:3d} engine target-only, {label}  {step:8.2f} ms/step  split " +
                         " ".join(f"{k}={v:.2f}" for k, v in split.items() if v > 0.005))
            if table:
                tables.append(f"== engine B={batch}\n{table}")
        hf.CUDA_SDPA_BACKENDS = restricted
        print("\n".join(lines[-6:]), flush=True)
    text = "\n".join(lines) + "\n\n" + "\n\n".join(tables)
    (out / "profile.txt").write_text(text + "\n")
    print("\n".join(tables))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
