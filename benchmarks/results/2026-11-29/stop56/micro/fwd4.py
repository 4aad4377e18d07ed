import os, sys, time, statistics, torch
torch.set_num_threads(1)
from specserve.backends.hf import HFBackend
from specserve.config import resolve_model
b = HFBackend(resolve_model(sys.argv[1]), dtype="float32")
if sys.argv[2] == "compile": b.compile()
ids=["a"]
b.add("a"); b.forward(ids, [[1]*48], [1])
W = int(sys.argv[3])
def call():
    b.truncate("a", 48)
    return b.forward(ids, [[1]*W], [1])
modes = [("none", None), ("sleep0.5", lambda: time.sleep(0.0005)), ("sleep1", lambda: time.sleep(0.001)), ("sleep2", lambda: time.sleep(0.002))]
for rep in range(2):
  for name, f in modes:
    ts=[]
    for i in range(150):
        if f: f()
        t=time.perf_counter(); call(); ts.append(time.perf_counter()-t)
    print(rep, name, round(statistics.median(ts[30:])*1e3,3), flush=True)
