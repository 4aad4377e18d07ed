import time, torch, sys, statistics
torch.set_num_threads(1)
from specserve.backends.hf import HFBackend
from specserve.config import resolve_model
b = HFBackend(resolve_model("demo:target"), dtype="float32")
ids=[f"s{i}" for i in range(8)]
for s in ids: b.add(s)
b.forward(ids, [[1]*48]*8, [1]*8)
def call(w):
    for s in ids: b.truncate(s, 48)
    b.forward(ids, [[1]*w]*8, [1]*8)
for w in (1, 3):
    ts=[]
    for i in range(60):
        t=time.perf_counter(); call(w); ts.append(time.perf_counter()-t)
    print(sys.argv[1], "width", w, "median ms", round(statistics.median(ts[10:])*1e3,2), flush=True)
