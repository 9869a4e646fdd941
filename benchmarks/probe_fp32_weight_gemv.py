"""Probe: GEMV launches on a genuinely fp32 weight (table as is, 8 warps, the heuristic's), taking turns."""
import contextlib, json, sys
from dataclasses import replace
import torch, torch.nn.functional as F
from csrc_triton.launches import GemvLaunch
from vllm_router_ext.benchmarking import make_inputs, rotation_copies, time_graph, SHAPES, FAMILY_SHAPES
from vllm_router_ext.ops import choice, router_gemm
GATES = list({(s.k, s.n): s for s in SHAPES + FAMILY_SHAPES}.values())
VARIANTS = ("table", "warps8", "warps8_nomaxnreg", "heur")
@contextlib.contextmanager
def rules(v):
    orig = choice.resolve
    def resolve(l, p):
        l = orig(l, p)
        if p.fp32_weight and isinstance(l, GemvLaunch):
            if v == "warps8": l = replace(l, num_warps=max(8, l.num_warps))
            if v == "warps8_nomaxnreg": l = replace(l, num_warps=max(8, l.num_warps), maxnreg=0)
            if v == "heur": l = choice._gemv(p.m, p.n, True)
        return l
    choice.resolve = resolve
    try: yield
    finally: choice.resolve = orig
rows = []
for s in GATES:
    for m in (4, 8, 12, 16):
        xs, ws = make_inputs(m, s.k, s.n, rotation_copies(m, s.k, s.n), w_dtype=torch.float32)
        ref = F.linear(xs[0].double(), ws[0].double())
        r = {"shape": s.name, "m": m}
        for rnd in range(2):
            for v in (VARIANTS if rnd == 0 else VARIANTS[::-1]):
                with rules(v):
                    out = router_gemm(xs[0], ws[0], "fp32")
                    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-6
                    t = time_graph([lambda x=x, w=w: router_gemm(x, w, "fp32") for x, w in zip(xs, ws)])
                    r["l_" + v] = str(choice.choose(choice.Problem.of(xs[0], ws[0], choice.FP32)))[11:60]
                r[v] = min(r.get(v, 1e9), t)
        t = time_graph([lambda x=x, w=w: F.linear(x.float(), w) for x, w in zip(xs, ws)])
        r["stock"] = t
        rows.append(r)
        print(f"{s.name:20s} M={m:3d} " + " ".join(f"{v} {r[v]:6.2f}" for v in VARIANTS) + f" stock {t:6.2f} | {r['l_table']}", flush=True)
        json.dump(rows, open(sys.argv[1], "w"), indent=1)
