import time, torch, sys
torch.set_num_threads(1)
from specserve.backends.hf import HFBackend
from specserve.config import resolve_model
b = HFBackend(resolve_model("demo:draft"), dtype="float32")
b.compile()
ids=[f"s{i}" for i in range(8)]
for s in ids: b.add(s)
b.forward(ids, [[1]*48]*8, [1]*8)
open("/tmp/exp/dloop.ready","w").write("1")
end = time.time() + float(sys.argv[1])
while time.time() < end:
    for s in ids: b.truncate(s, 48)
    b.forward_branches(ids, [[1]*4]*8, [[48]*4]*8, 0, 4)
