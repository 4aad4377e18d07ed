"""Cycles by arm in trace_b1.json.gz (the last two thirds, prefill cycles and switches left out): tokens per cycle, time, rate."""
import collections, gzip, json, statistics as st, sys
d = json.load(gzip.open(sys.argv[1] if len(sys.argv) > 1 else "trace_b1.json.gz"))
tr = d["spec"]["trace"]
by = collections.defaultdict(list)
for b, nt, ms, arm, pure, pf in tr[len(tr) // 3:]:
    if not pf and pure:
        by[tuple(arm) if arm else None].append((nt, ms))
for a, v in sorted(by.items(), key=lambda x: str(x[0])):
    print(a, len(v), "tokens/cycle %.2f" % (sum(x[0] for x in v) / len(v)), "median ms %.2f" % st.median(x[1] for x in v),
          "tokens/s %.0f" % (sum(x[0] for x in v) / sum(x[1] for x in v) * 1e3), dict(sorted(collections.Counter(x[0] for x in v).items())))
print({k: v for k, v in d["spec"].items() if k not in ("trace", "decisions")})
