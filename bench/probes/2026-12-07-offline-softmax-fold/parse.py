import re, sys, collections
def load(fn):
    funcs=collections.OrderedDict(); cur=None
    for line in open(fn):
        m=re.search(r'Function : (\S+)',line)
        if m: cur=m.group(1); funcs[cur]=[]; continue
        m=re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);',line)
        if m and cur: funcs[cur].append((int(m.group(1),16),m.group(2).strip()))
    return funcs
def opcode(t):
    t=re.sub(r'^@!?U?P\w+\s+','',t)
    return t.split()[0]
def loops(ins):
    out=[]
    for a,t in ins:
        m=re.search(r'\bBRA\b.*?(0x[0-9a-f]+)',t)
        if m:
            tg=int(m.group(1),16)
            if tg<=a: out.append((tg,a,t))
    return out
if __name__=="__main__":
    f=load(sys.argv[1])
    for name,ins in f.items():
        print(name[:80], len(ins))
        for tg,a,t in loops(ins):
            n=sum(1 for x,_ in ins if tg<=x<=a)
            print(f"  loop {tg:#x}-{a:#x} n={n}  {t}")
