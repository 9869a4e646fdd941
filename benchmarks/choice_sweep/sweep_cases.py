import json, torch
from vllm_router_ext.precision import RouterPrecision as P
SHAPES = [(7168, 256), (7168, 384), (5120, 160), (6144, 256), (2048, 64), (4096, 128), (2880, 128), (3072, 8)]
def devices():
    return [("NVIDIA H200", 132, 90), ("NVIDIA H100 80GB HBM3", 132, 90), ("NVIDIA A100-SXM4-80GB", 108, 80),
            ("NVIDIA L40S", 142, 89), ("NVIDIA B200", 148, 100)]
def ms():
    t = json.load(open("csrc_triton/configs/nvidia_h200.json"))
    ends = {b["max_m"] for s in t["shapes"].values() for v in s.values() if isinstance(v, list) for b in v if b["max_m"]}
    base = set(range(1, 17)) | {1 << i for i in range(15)} | {(1 << i) + 1 for i in range(15)} | {(1 << i) - 1 for i in range(2, 15)}
    base |= {e for e in ends} | {e + 1 for e in ends} | {16384, 16385, 20000}
    return sorted(base)
def cases():
    dts = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
           (torch.float32, torch.float32)]
    for (k, n) in SHAPES:
        for dev in devices():
            for xd, wd in dts:
                for prec in (P.FP32, P.BF16_FP32OUT, P.BF16):
                    if prec is P.BF16_FP32OUT and wd != torch.float32 and xd != wd:
                        continue
                    if prec is not P.FP32 and wd == torch.float32 and xd == torch.float32:
                        pass
                    for bi in (False, True):
                        for terms in ((False, True) if wd == torch.float32 and xd == torch.bfloat16 else (False,)):
                            for m in ms():
                                yield (m, k, n, prec, bi, xd, wd, dev, terms)
def startup_cases():
    for (k, n) in SHAPES:
        for prec in (P.FP32, P.BF16_FP32OUT, P.BF16):
            for bi in (False, True):
                for wd in (torch.bfloat16, torch.float32):
                    yield prec, bi, wd, k, n
