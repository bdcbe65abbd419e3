import sys, re, collections
from parse import load, opcode
# usage: cnt2.py file fidx label lo-hi[,lo-hi...]
fn,fidx,label,rngs=sys.argv[1],int(sys.argv[2]),sys.argv[3],sys.argv[4]
R=[tuple(int(x,16) for x in r.split('-')) for r in rngs.split(',')]
f=list(load(fn).values())[fidx]
ins=[(a,t) for a,t in f if any(lo<=a<=hi for lo,hi in R)]
c=collections.Counter(opcode(t) for a,t in ins)
def g(*ps): return sum(n for k,n in c.items() if any(k==p or k.startswith(p+'.') for p in ps))
hg64=g('HGMMA.64x64x16'); hg256=sum(n for k,n in c.items() if k.startswith('HGMMA.64x256'))
row=dict(total=len(ins),HGMMA64x64=hg64,HGMMA64x256=hg256,EX2=c['MUFU.EX2'],FMUL=g('FMUL'),FFMA=g('FFMA'),FADD=g('FADD'),FMNMX=g('FMNMX'),FSEL=g('FSEL'),F2FP=g('F2FP'),
 SHFL=g('SHFL'),BARSYNC=g('BAR.SYNC'),BARARV=g('BAR.ARV'),SYNCS_wait=g('SYNCS.PHASECHK'),SYNCS_arr=g('SYNCS.ARRIVE'),ARRIVES=g('ARRIVES'),MEMBAR=g('MEMBAR'),FENCE=g('FENCE'),
 WG_ARR=g('WARPGROUP.ARRIVE'),WG_DEP=g('WARPGROUP.DEPBAR'),LDGSTS=g('LDGSTS'),LDG=g('LDG'),STS=g('STS'),STSM=g('STSM'),LDS=g('LDS')-sum(1 for a,t in ins if '@!PT LDS' in t),dummyLDS=sum(1 for a,t in ins if '@!PT LDS' in t),
 uniform=sum(n for k,n in c.items() if k.startswith('U') and not k.startswith('UTMA')),ISETP=g('ISETP'))
print(label, row)
print("   ", {k:n for k,n in c.items() if k.startswith(('LDGSTS','LDG','HGMMA','STS','LDS','MUFU','SYNCS','BAR','FMUL','FADD','FFMA'))})
