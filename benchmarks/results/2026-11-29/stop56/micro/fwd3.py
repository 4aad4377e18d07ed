import os, sys, time, statistics, torch, select, socket
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
def spin(s):
    end = time.perf_counter() + s
    while time.perf_counter() < end: pass
modes = [("none", None), ("sleep0.1", lambda: time.sleep(0.0001)), ("sleep0.5", lambda: time.sleep(0.0005)), ("sleep1", lambda: time.sleep(0.001)),
         ("sleep2", lambda: time.sleep(0.002)), ("spin2", lambda: spin(0.002)), ("sleep5", lambda: time.sleep(0.005))]
for rep in range(2):
  for name, f in modes:
    ts=[]
    for i in range(250):
        if f: f()
        t=time.perf_counter(); call(); ts.append(time.perf_counter()-t)
    print(rep, name, round(statistics.median(ts[50:])*1e3,3), flush=True)
