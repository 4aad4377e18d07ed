import json, sys, statistics as st
from specserve.adaptive import SpeculationController, _bucket
d = json.load(open(sys.argv[1]))
spec = list(d[int(sys.argv[2])]['spec'].values())[0]
tr = spec['trace']
c = SpeculationController(4)
admitted = {}
orig = c.observe_cycle
for b, nt, ms, arm, pure, pf in tr:
    a = tuple(arm) if arm else None
    st_ = c.buckets.get(_bucket(b))
    before = len(st_.realized.get(a, [])) if st_ and a in st_.realized else 0
    c.observe_cycle(b, nt, ms / 1e3, a, pure, pf)
    st_ = c.buckets.get(_bucket(b))
    after = len(st_.realized.get(a, [])) if st_ and a in st_.realized else 0
    if after > before or (after == before == 32):
        admitted.setdefault((b, a), []).append((ms, nt, pf))
for k, v in sorted(admitted.items(), key=lambda x: str(x[0])):
    if _bucket(k[0]) == int(sys.argv[3]):
        print(k, len(v), "median ms", st.median(x[0] for x in v), "tok", round(sum(x[1] for x in v)/sum(k[0] for _ in v),2), [x[0] for x in v][:30])
print(c.state()['realized_tokens_per_s'])
print('prefill cost', {b: c._prefill_cost(s) for b, s in c.buckets.items()})
