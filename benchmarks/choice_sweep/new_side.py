"""New decision over the same sweep, normalised like old_side.py."""
import json, sys, dataclasses
import torch
import csrc_triton.capability as capmod
from csrc_triton.launches import Fp32WeightTermsLaunch, CublasLaunch, fields
from csrc_triton.dot import DotMode
from vllm_router_ext.precision import RouterPrecision as P
from vllm_router_ext.ops import choice as Ch, startup as S
from sweep_cases import cases, devices, startup_cases

def set_gluon(on):
    capmod.gluon_available.cache_clear()
    capmod.gluon_available = (lambda: on)
    capmod.gluon_available.cache_clear = lambda: None

def norm(l, xd, wd):
    if isinstance(l, CublasLaunch):
        return {"kernel": "cublas"}
    d = {"kernel": l.kernel, "source": l.source, **{k: (int(v) if isinstance(v, bool) else v) for k, v in fields(l).items()}}
    if l.kernel in ("splitk", "tiled"):
        d["dot_mode"] = int(DotMode.of(xd, wd))
    return d

def launch(m, k, n, prec, bi, xd, wd, dev, terms):
    p = Ch.Problem(m, k, n, prec, bi, xd, wd, Ch.Device(*dev), terms)
    l = Ch.choose(p)
    if isinstance(l, Fp32WeightTermsLaunch):
        pt = dataclasses.replace(p, n=3 * n, weight_dtype=torch.bfloat16, weight_terms=False)
        return {"terms": {"launch": norm(l.terms, xd, torch.bfloat16), "shrink": chain(l.terms, pt, xd, torch.bfloat16)}}
    if isinstance(l, CublasLaunch):
        return {"kernel": "cublas"}
    return {"launch": norm(l, xd, wd), "shrink": chain(l, p, xd, wd)}

def chain(l, p, xd, wd):
    out = []
    for _ in range(16):
        l = Ch.shrink(l, p)
        if l is None:
            break
        out.append(norm(l, xd, wd))
    return out

if __name__ == "__main__":
    res = {}
    for gluon in (True, False):
        set_gluon(gluon)
        for c in cases():
            m, k, n, prec, bi, xd, wd, dev, terms = c
            key = f"{gluon}|{m}|{k}|{n}|{prec.value}|{bi}|{xd}|{wd}|{dev[0]}|{terms}"
            try:
                res[key] = launch(*c)
            except Exception as e:
                res[key] = {"error": f"{type(e).__name__}: {e}"}
        for dev in devices():
            Ch.cuda_device = lambda i, dev=dev: Ch.Device(*dev)
            torch.cuda.current_device = lambda: 0
            for prec, bi, wd, k, n in startup_cases():
                key = f"{gluon}|startup|{dev[0]}|{prec.value}|{bi}|{wd}|{k}|{n}"
                try:
                    pr = Ch.Problem(1, k, n, prec, bi, torch.bfloat16, wd, Ch.Device(*dev))
                    res[key] = {"line": S.describe_cuda_dispatch(prec, bi, wd, k, n),
                                "buckets": [m for m, _ in Ch.batch_invariant_buckets(pr)] if bi else []}
                except Exception as e:
                    res[key] = {"error": f"{type(e).__name__}: {e}"}
    json.dump(res, open(sys.argv[1], "w"), indent=0, sort_keys=True)
    print(len(res), "cases")
