import os, sys, time, statistics, torch
torch.set_num_threads(1)
from specserve.backends.hf import HFBackend
from specserve.config import resolve_model
dt = sys.argv[1]
b = HFBackend(resolve_model("demo:draft"), dtype=dt)
if len(sys.argv) > 2: b.compile()
ids=["a"]
b.add("a"); b.forward(ids, [[1]*48], [1])
def call():
    b.truncate("a", 48)
    return b.forward(ids, [[1]], [1])
def tree():
    b.truncate("a", 48)
    return b.forward_branches(ids, [[1]*8], [[48]*8], 0, 8)
junk = torch.ones(8 << 20)
for rep in range(2):
  for fn in (call, tree):
    for name, f in (("warm", None), ("touch32MB", lambda: junk.add_(1)), ("sleep2", lambda: time.sleep(0.002))):
      ts=[]
      for i in range(150):
        if f: f()
        t=time.perf_counter(); fn(); ts.append(time.perf_counter()-t)
      print(rep, dt, fn.__name__, name, round(statistics.median(ts[30:])*1e3,3), flush=True)
