"""Probe: an fp32 gate weight on the heuristic's rules, old vs new (H200), same run, taking turns."""
import contextlib, json, sys
import torch, torch.nn.functional as F
from csrc_triton.tables import table_override
from csrc_triton.launches import describe
from vllm_router_ext.benchmarking import make_inputs, rotation_copies, time_graph
from vllm_router_ext.ops import choice, router_gemm
from vllm_router_ext.ops.router_gemm import fp32_weight_terms

SMALL_N = [("Mixtral-8x7B",4096,8),("Mixtral-8x22B",6144,8),("Llama-4-Scout",5120,16),("gpt-oss-20b",2880,32),
           ("DeepSeek-V2-Lite",2048,64),("ERNIE-4.5-300B",8192,64),("ERNIE-4.5-21B",2560,64)]
ALL = SMALL_N + [("Qwen3-235B",4096,128),("Qwen3-30B",2048,128),("Qwen3-Next",2048,512),("gpt-oss-120b",2880,128),
                 ("Maverick",5120,128),("GLM-4.5",5120,160),("MiniMax-M2",3072,256),("DeepSeek-V3",7168,256)]

from dataclasses import replace
from csrc_triton.launches import SplitKLaunch
VARIANTS = ("old", "new", "bn32", "bk64")

@contextlib.contextmanager
def rules(which):
    orig_mid, orig_resolve = choice._mid_m_split, choice.resolve
    if which == "old":
        choice._mid_m_split = lambda p: None if p.fp32_weight else orig_mid(p)
    if which in ("bn32", "bk64"):
        def resolve(l, p):
            l = orig_resolve(l, p)
            if p.fp32_weight and isinstance(l, SplitKLaunch) and l.num_stages > 1:
                if which == "bn32":
                    l = replace(l, block_n=min(l.block_n, 32))
                else:
                    l = replace(l, block_k=64, promote_chunks=2)
            return l
        choice.resolve = resolve
    try:
        with table_override("none"):
            yield
    finally:
        choice._mid_m_split, choice.resolve = orig_mid, orig_resolve

ROWS = []

def run(shapes, ms):
    rows = ROWS
    for name,k,n in shapes:
        for m in ms:
            c = rotation_copies(m,k,n)
            xs, ws = make_inputs(m,k,n,c,w_dtype=torch.float32)
            ts = [fp32_weight_terms(w) for w in ws]
            ref = F.linear(xs[0].double(), ws[0].double())
            r = {"shape":name,"k":k,"n":n,"m":m}
            for rnd in range(2):
                for which in (VARIANTS if rnd == 0 else VARIANTS[::-1]):
                    with rules(which):
                        out = router_gemm(xs[0], ws[0], "fp32", weight_terms=ts[0])
                        err = ((out.double()-ref).abs().max()/ref.abs().max()).item()
                        assert err < 1e-5, (name, m, which, err)
                        t = time_graph([lambda x=x,w=w,tt=tt: router_gemm(x,w,"fp32",weight_terms=tt) for x,w,tt in zip(xs,ws,ts)])
                        r["launch_"+which] = describe(choice.choose(choice.Problem.of(xs[0], ws[0], choice.FP32, weight_terms=True)))
                    r[which] = min(r.get(which, 1e9), t)
                t = time_graph([lambda x=x,w=w: F.linear(x.float(), w) for x,w in zip(xs,ws)])
                r["stock"] = min(r.get("stock",1e9), t)
            print(f"{name:18s} M={m:6d} " + " ".join(f"{v} {r[v]:7.2f}" for v in VARIANTS) + f" stock {r['stock']:7.2f} | {r['launch_new']}", flush=True)
            rows.append(r)
            json.dump(rows, open(sys.argv[1], "w"), indent=1)

if __name__ == "__main__":
    run(ALL, [128, 256, 512, 1000])
