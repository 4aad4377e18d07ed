import os, sys, time, statistics, torch
torch.set_num_threads(1)
if os.environ.get("FREEZE"):
    import torch._inductor.config as ic; ic.freezing = True
from specserve.backends.hf import HFBackend
from specserve.config import resolve_model
b = HFBackend(resolve_model("demo:draft"), dtype="float32")
if os.environ.get("COMPILE", "1") == "1":
    t=time.time(); b.compile(); print("compile", round(time.time()-t,1))
ids=["a"]
b.add("a"); b.forward(ids, [[1]*48], [1])
def call():
    b.truncate("a", 48)
    return b.forward(ids, [[1]], [1])
for _ in range(50): call()
ts=[]
for _ in range(300):
    t=time.perf_counter(); call(); ts.append(time.perf_counter()-t)
print("one token b1 median ms", round(statistics.median(ts)*1e3,3))
# time just the model call
b.truncate("a",48)
if os.environ.get("PROF"):
    from torch.profiler import profile
    with profile() as p:
        for _ in range(100): call()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
