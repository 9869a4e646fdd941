import sys, torch
from dataclasses import replace
from vllm_router_ext.testing import aot
from vllm_router_ext.benchmarking import SHAPES, FAMILY_SHAPES
from vllm_router_ext.ops import choice
from vllm_router_ext.ops.dispatch import launch_exactly
from vllm_router_ext.precision import RouterPrecision as R
from csrc_triton import pdl
from csrc_triton.launches import SplitKLaunch, describe
bm, bn, bk = (int(v) for v in sys.argv[1].split(','))
shapes=list({(s.k,s.n):s for s in SHAPES+FAMILY_SHAPES}.values())
dev=choice.Device('NVIDIA X90',132,90)
done={}
for s in shapes:
    for m in (65,256,512,1000):
        p=choice.Problem(m,s.k,s.n,R.FP32,False,torch.bfloat16,torch.float32,dev)
        l=choice.choose(p)
        if not isinstance(l,SplitKLaunch) or l.num_stages<2: continue
        l=replace(l,block_m=min(l.block_m,bm),block_n=min(l.block_n,bn),block_k=min(l.block_k,bk))
        l=replace(l,promote_chunks=choice.fp32_promote_chunks(l.block_k))
        x=torch.zeros(m,s.k,dtype=torch.bfloat16); w=torch.zeros(s.n,s.k); out=torch.empty(m,s.n)
        with aot._captured_launches() as ls, pdl.forced(True):
            launch_exactly(l,x,w,out)
        for fn,args,kw in ls:
            key=(fn.__name__,repr(sorted(kw.items())),tuple(aot._arg_key(a) for a in args))
            if key in done: continue
            regs,spill=aot._resources(aot._compile(fn,args,kw,90))
            done[key]=(describe(l),regs,spill)
            if spill>8: print(s.name,m,describe(l),regs,spill,flush=True)
print(sys.argv[1], len(done),"kernels;", sum(1 for v in done.values() if v[2]>8),"spill")
