import json,sys
d=json.load(open(sys.argv[1]))
for line in d:
    if line['name']!='ss': continue
    print('rep',line['rep'],'tok_s',round(line['tok_s']))
    decs=list(line['decisions']); 
    tr=line['trace']; n0=line['n0']
    runs=[]
    for i,(b,nt,ms,arm,pure,pf) in enumerate(tr):
        a=tuple(arm) if arm else None
        if runs and runs[-1][0]==a: runs[-1][1].append((b,nt,ms,pure,pf))
        else: runs.append([a,[(b,nt,ms,pure,pf)],n0+i])
    for a,cs,start in runs:
        while decs and decs[0][0] <= start: print('   dec', decs.pop(0))
        ms=[c[2] for c in cs]
        print('  ',a,len(cs),'b',cs[0][0],'-',cs[-1][0],'ms',[round(x,1) for x in ms][:12], 'tok/seq', round(sum(c[1] for c in cs)/sum(c[0] for c in cs),2), 'rate/seq', round(sum(c[1] for c in cs)/sum(c[0] for c in cs)/ (sum(ms)/len(ms))*1e3,1))
    for x in decs: print('   dec', x)
