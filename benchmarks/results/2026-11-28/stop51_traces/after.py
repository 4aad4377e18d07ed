import json, statistics as st, sys
def runs(tr):
    out = []
    for b, nt, ms, arm, pure, pf in tr:
        a = tuple(arm) if arm else None
        if out and out[-1][0] == a: out[-1][1].append((b, ms, pf))
        else: out.append([a, [(b, ms, pf)]])
    return out
def analyse(trs, batch):
    after, steady = {}, []
    for tr in trs:
        rs = runs(tr)
        for i, (a, cs) in enumerate(rs):
            if a != (0, False): continue
            prev_spec = i > 0 and rs[i-1][0] is not None and rs[i-1][0][0] > 0
            for j, (b, ms, pf) in enumerate(cs):
                if b != batch or pf: continue
                if j >= 12: steady.append(ms)
                elif prev_spec: after.setdefault(j, []).append(ms)
    print('steady TO (12+ into a run) median', st.median(steady) if steady else None, len(steady))
    for r in sorted(after): print(' cycle', r, 'after spec: median', round(st.median(after[r]), 1), 'n', len(after[r]))
d = json.load(open(sys.argv[1]))
if 'spec' in d[0]:
    trs = [list(d[-1]['spec'].values())[0]['trace']]
else:
    trs = [l['trace'] for l in d if l['name'] == 'ss']
analyse(trs, int(sys.argv[2]))
