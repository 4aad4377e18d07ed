import time, statistics, torch, sys
torch.set_num_threads(1)
from specserve.backends.hf import HFBackend
from specserve.config import resolve_model
def build(opts):
    b = HFBackend(resolve_model("demo:draft"), dtype="float32")
    orig = torch.compile
    if opts: torch.compile = lambda m, **kw: orig(m, options=opts, **kw)
    try: b.compile()
    finally: torch.compile = orig
    b.add("s0"); b.forward(["s0"], [list(range(1, 49))], [1]); return b
variants = {"default": build(None), "nn-guards-off": build({"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}),
            "all-guards-off": build({"guard_filter_fn": lambda e: [False for _ in e]})}
t = {k: [] for k in variants}; tt = {k: [] for k in variants}
for r in range(2000):
    for k, b in variants.items():
        b.truncate("s0", 48); s = time.perf_counter(); b.forward(["s0"], [[1]], [1]); t[k].append(time.perf_counter() - s)
        s = time.perf_counter(); b.forward_branches(["s0"], [[1,2,3,4]], [[48]*4], 0, 4); tt[k].append(time.perf_counter() - s)
for k in variants: print(k, f"one token {statistics.median(t[k][200:])*1e3:.3f} ms, tree4 {statistics.median(tt[k][200:])*1e3:.3f} ms")
