import os, sys, time, statistics, torch
torch.set_num_threads(1)
from specserve.backends.hf import HFBackend
from specserve.config import resolve_model
b = HFBackend(resolve_model("demo:draft"), dtype="float32")
b.compile()
ids=["a"]
b.add("a"); b.forward(ids, [[1]*48], [1])
def call(w=1):
    b.truncate("a", 48)
    return b.forward(ids, [[1]*w], [1])
junk = torch.ones(8 << 20)  # 32 MB
junk2 = torch.ones(1 << 20)  # 4 MB
for mode in ["warm", "sleep2ms", "touch4MB", "touch32MB", "warm"]:
    ts=[]
    for i in range(300):
        if mode == "sleep2ms": time.sleep(0.002)
        if mode == "touch4MB": junk2.add_(1)
        if mode == "touch32MB": junk.add_(1)
        t=time.perf_counter(); call(); ts.append(time.perf_counter()-t)
    print(mode, "one token b1 median ms", round(statistics.median(ts[50:])*1e3,3), flush=True)
