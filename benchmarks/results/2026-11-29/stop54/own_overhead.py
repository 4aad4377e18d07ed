import time, sys, torch, cProfile, pstats
torch.set_num_threads(1)
from specserve import LLM, SamplingParams
draft = None if sys.argv[1] == "none" else sys.argv[1]
llm = LLM("demo:target", draft=draft, target_backend="hf", dtype="float32", draft_compile=False)
import random
r = random.Random(0)
prompts = [[r.randrange(10, 4000) for _ in range(64)] for _ in range(24)]
p = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:8], p, use_tqdm=False)
m0 = llm.metrics()
t = time.perf_counter()
pr = cProfile.Profile() if sys.argv[2:] == ["prof"] else None
if pr: pr.enable()
outs = llm._engine.generate([None]*24, prompts, [p]*24, False, max_in_flight=8)
if pr: pr.disable()
wall = time.perf_counter() - t
m1 = llm.metrics()
tm0, tm1 = m0["timing"], m1["timing"]
steps = m1["num_steps"] - m0["num_steps"]
d = {k: (tm1[k] - tm0.get(k, 0)) / steps * 1e3 for k in tm1 if isinstance(tm1[k], float)}
print(f"steps {steps} wall/step {wall/steps*1e3:.2f} ms", {k: round(v, 2) for k, v in d.items()})
if pr: pstats.Stats(pr).sort_stats("tottime").print_stats(30)
llm.shutdown()
