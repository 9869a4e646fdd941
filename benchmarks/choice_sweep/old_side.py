"""Old decision, emulated exactly as ops/dispatch.router_gemm_cuda runs it, over the sweep."""
import inspect, json, sys, itertools
import torch
import csrc_triton.capability as capmod
from csrc_triton import configs as C
from vllm_router_ext.precision import RouterPrecision as P
from vllm_router_ext.ops import dispatch as D, startup as S
from csrc_triton.router_gemm_gemv import gemv_launch
from csrc_triton.router_gemm_splitk import splitk_launch
from csrc_triton.router_gemm_tiled import tiled_launch
from csrc_triton.router_gemm_wgmma_ws import wgmma_ws_launch
from sweep_cases import cases, devices, startup_cases

SIG = {"gemv": gemv_launch, "splitk": splitk_launch, "tiled": tiled_launch, "wgmma_ws": wgmma_ws_launch}
DEFAULTS = {k: {p.name: p.default for p in inspect.signature(f).parameters.values()
                if p.default is not inspect.Parameter.empty} for k, f in SIG.items()}

def set_gluon(on):
    capmod.gluon_available.cache_clear()
    capmod.gluon_available = (lambda: on)  # module global lookups
    capmod.gluon_available.cache_clear = lambda: None

def bound(cfg, xd, wd):
    if cfg.kernel == "cublas":
        return {"kernel": "cublas"}
    kw = dict(DEFAULTS[cfg.kernel]); kw.update(cfg.params)
    if cfg.kernel in ("splitk", "tiled"):
        kw["dot_mode"] = D.dot_mode_for(xd, wd)
    kw.pop("dot_mode", None) if cfg.kernel in ("gemv", "wgmma_ws") else None
    return {"kernel": cfg.kernel, "source": cfg.source, **{k: (int(v) if isinstance(v, bool) else v) for k, v in kw.items()}}

def to_run(cfg, m, k, n, dev, xd, wd, out_dtype, problem=None):
    name, sms, cap = dev
    if cfg.kernel == "wgmma_ws" and problem is None:
        problem = capmod.wgmma_ws_problem(cap, xd, wd)
        if problem is None and out_dtype != torch.float32:
            problem = "out"
    return C.config_to_run(cfg, m, k, n, name, sms, cap, wd == torch.float32, problem)

def shrink_chain(cfg, m, k, n, dev, xd, wd, out_dtype):
    chain = []
    for _ in range(16):
        s = C.shrink_config(cfg)
        if s is None and cfg.kernel == "wgmma_ws":
            s = to_run(cfg, m, k, n, dev, xd, wd, out_dtype, "does not fit")
        if s is None:
            break
        chain.append(bound(s, xd, wd)); cfg = s
    return chain

def launch(m, k, n, prec, bi, xd, wd, dev, terms):
    name, sms, cap = dev
    out_dtype = xd if prec is P.BF16 else torch.float32
    if (terms and prec is P.FP32 and not bi and xd == torch.bfloat16 and wd == torch.float32
            and m >= D.FP32_WEIGHT_TERMS_FROM_M and n >= D.FP32_WEIGHT_TERMS_MIN_N):
        inner = launch(m, k, 3 * n, P.FP32, False, torch.bfloat16, torch.bfloat16, dev, False)
        return {"terms": inner}
    cfg = C.select_config(m, k, n, prec.value, bi, name, sms, cublas=True, capability=cap,
                          fp32_weight=wd == torch.float32)
    if cfg.kernel == "cublas":
        return {"kernel": "cublas"}
    ran = to_run(cfg, m, k, n, dev, xd, wd, out_dtype)
    return {"launch": bound(ran, xd, wd), "shrink": shrink_chain(ran, m, k, n, dev, xd, wd, out_dtype)}

if __name__ == "__main__":
    res = {}
    for gluon in (True, False):
        set_gluon(gluon)
        for c in cases():
            m, k, n, prec, bi, xd, wd, dev, terms = c
            key = f"{gluon}|{m}|{k}|{n}|{prec.value}|{bi}|{xd}|{wd}|{dev[0]}|{terms}"
            try:
                res[key] = launch(m, k, n, prec, bi, xd, wd, dev, terms)
            except Exception as e:
                res[key] = {"error": f"{type(e).__name__}: {e}"}
        for dev in devices():
            D._device_info = lambda i, dev=dev: dev
            torch.cuda.current_device = lambda: 0
            for prec, bi, wd, k, n in startup_cases():
                key = f"{gluon}|startup|{dev[0]}|{prec.value}|{bi}|{wd}|{k}|{n}"
                try:
                    res[key] = {"line": S.describe_cuda_dispatch(prec, bi, wd, k, n),
                                "buckets": [m for m, _ in S.batch_invariant_buckets(k, n, prec, *dev)] if bi else []}
                except Exception as e:
                    res[key] = {"error": f"{type(e).__name__}: {e}"}
    json.dump(res, open(sys.argv[1], "w"), indent=0, sort_keys=True)
    print(len(res), "cases")
