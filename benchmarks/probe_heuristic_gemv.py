"""Probe: the heuristic's GEMV range (to 4 vs to 16 tokens, maxnreg 255 or not), same run, taking turns."""
import contextlib, json, sys
from dataclasses import replace
import torch
from csrc_triton.tables import table_override
from csrc_triton.launches import GemvLaunch
from vllm_router_ext.benchmarking import make_inputs, rotation_copies, time_graph, SHAPES, FAMILY_SHAPES
from vllm_router_ext.ops import choice, router_gemm
GATES = list({(s.k, s.n): s for s in SHAPES + FAMILY_SHAPES}.values())
VARIANTS = ("to4", "to16", "to16r")
@contextlib.contextmanager
def rules(v):
    to, g = choice.GEMV_TO_M, choice._gemv
    choice.GEMV_TO_M = 4 if v == "to4" else 16
    if v == "to16r":
        choice._gemv = lambda *a: replace(g(*a), maxnreg=255)
    try:
        with table_override("none"):
            yield
    finally:
        choice.GEMV_TO_M, choice._gemv = to, g
rows = []
for s in GATES:
    for m in (4, 5, 8, 12, 16):
        xs, ws = make_inputs(m, s.k, s.n, rotation_copies(m, s.k, s.n))
        r = {"shape": s.name, "m": m}
        for rnd in range(2):
            for v in (VARIANTS if rnd == 0 else VARIANTS[::-1]):
                with rules(v):
                    t = time_graph([lambda x=x, w=w: router_gemm(x, w, "bf16-fp32out") for x, w in zip(xs, ws)])
                r[v] = min(r.get(v, 1e9), t)
        rows.append(r)
        print(f"{s.name:20s} M={m:3d} " + " ".join(f"{v} {r[v]:6.2f}" for v in VARIANTS), flush=True)
        json.dump(rows, open(sys.argv[1], "w"), indent=1)
