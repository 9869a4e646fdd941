"""Design probe (one device call): the K-split sum by the split programs themselves, all resident.

    python benchmarks/probe_resident_sum.py [--out DIR]

#4's open points are where the `fp32` mode splits K across programs and adds the fp32 partials in
split order in a second (PDL) kernel: DeepSeek-V2 / GLM-5 at 256 tokens (pipelined split-K, 120 /
96 programs; 5x torch's upcast needs 6.18 / 7.64 µs, we take 6.64 / 7.79) and Kimi-K2 at 2048
(``wgmma_ws``, 128 programs, 4 partials of 2048 x 384; <= 1.25x bf16-fp32out needs ~25.6 µs, we
take 25.5-26.2). Session 16 removed the second kernel by launching a tile's split programs as one
thread-block cluster and lost: clusters need free SMs in one GPC, so 128 CTAs no longer fit one
wave. Here the grid is launched plainly and fits one wave (<= one CTA per SM, or a cooperative
launch, which guarantees residency): each split program stores its partial, adds 1 to its tile's
int64 counter (release), spins until the counter holds all S arrivals of this call (acquire; the
counter only grows, one buffer per S so it stays a multiple of S), then adds a share of the tile's
rows from the S partials in split order 0 + p0 + p1 + ... -- the second kernel's order, so the
logits must be bitwise the table's. A spin that exceeds SPIN_LIMIT polls writes NaN (no hang).

Prints µs per call (CUDA graph, rotated weights): our bf16-fp32out and `fp32` ops (the table),
the same config run through the shipped launcher (second kernel), the resident form (plain and
cooperative launch) and the partials alone (no sum: a floor), with ratios to bf16-fp32out, the
5x-upcast limit and whether the logits are bitwise the table's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from probe_cluster import h200_buckets  # noqa: E402  (benchmarks/ is on sys.path)

from csrc_triton import cdiv  # noqa: E402
from csrc_triton.dot import DOT_NATIVE, load_chunk, mma, promoted_group  # noqa: E402
from csrc_triton.router_gemm_splitk import splitk_launch  # noqa: E402
from vllm_router_ext.benchmarking import (  # noqa: E402
    SHAPE_BY_NAME,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)
from vllm_router_ext.ops import router_gemm  # noqa: E402

SPIN_LIMIT = 1 << 20  # polls (~0.5-1 s): a grid that is not resident writes NaN instead of hanging


@triton.jit
def _resident_splitk_kernel(
    x_ptr, w_ptr, part_ptr, out_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn, stride_ps, stride_pm, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr, PROMOTE_CHUNKS: tl.constexpr, FLAT_CHAIN: tl.constexpr, SUM: tl.constexpr,
    SHARE: tl.constexpr, SPIN_LIMIT: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_begin = pid_s * K_PER_SPLIT
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_groups: tl.constexpr = K_PER_SPLIT // (BLOCK_K * PROMOTE_CHUNKS)
    if FLAT_CHAIN and n_groups == 1:  # as router_gemm_splitk's flat one-chain split
        for c in range(K_PER_SPLIT // BLOCK_K):
            a, b = load_chunk(x_rows, w_cols, mask_m, mask_n, k_begin + c * BLOCK_K, K, BLOCK_K)
            acc = mma(a, b, acc, 0, False)  # DOT_NATIVE
    else:
        for c in range(n_groups):
            k0 = k_begin + c * BLOCK_K * PROMOTE_CHUNKS
            acc = promoted_group(
                x_rows, w_cols, mask_m, mask_n, k0, K, acc, BLOCK_K, PROMOTE_CHUNKS, 0, False
            )
    tile = offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    tl.store(part_ptr + pid_s * stride_ps + tile, acc, mask=mask_m[:, None] & mask_n[None, :])
    if SUM:
        tl.debug_barrier()  # every thread's partial is stored before the arrival
        counter = cnt_ptr + pid_m * tl.num_programs(0) + pid_n
        old = tl.atomic_add(counter, 1, sem="release", scope="gpu")
        target = old - old % SPLIT_K + SPLIT_K
        cur = old + 1
        polls = 0
        while (cur < target) & (polls < SPIN_LIMIT):
            cur = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
            polls += 1
        ROWS: tl.constexpr = (BLOCK_M + SPLIT_K - 1) // SPLIT_K
        r = tl.arange(0, SHARE)
        rows = pid_m * BLOCK_M + pid_s * ROWS + r
        mask = ((r < ROWS) & (pid_s * ROWS + r < BLOCK_M) & (rows < M))[:, None] & mask_n[None, :]
        share = rows[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
        total = tl.zeros((SHARE, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):  # split order, as the second kernel
            total += tl.load(part_ptr + s * stride_ps + share, mask=mask, other=0.0, cache_modifier=".cg")
        total = tl.where(cur >= target, total, float("nan"))
        tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_om + offs_n[None, :], total, mask=mask)


_COUNTERS: dict = {}


def _counters(device, split: int) -> torch.Tensor:
    """int64 arrival counters, one buffer per split count (each call adds S per tile)."""
    key = (device, split)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(1 << 16, dtype=torch.int64, device=device)
    return _COUNTERS[key]


def resident_splitk(x, w, out, *, block_m, block_n, block_k, k_per_split, promote_chunks, num_warps,
                    num_stages, flat_chain=False, cooperative=False, do_sum=True, **_):  # fmt: skip
    """One launch: the bucket's other keys (ticket, pdl: how the shipped launcher sums) do not apply."""
    M, K = x.shape
    N = w.shape[0]
    split = cdiv(K, k_per_split)
    part = torch.empty((split, M, N), dtype=torch.float32, device=x.device)
    rows = cdiv(block_m, split)
    grid = (cdiv(N, block_n), split, cdiv(M, block_m))
    extra = {"launch_cooperative_grid": True} if cooperative else {}
    _resident_splitk_kernel[grid](
        x, w, part, out, _counters(x.device, split), M, N, K, x.stride(0), w.stride(0), part.stride(0),
        part.stride(1), out.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        K_PER_SPLIT=k_per_split, SPLIT_K=split, PROMOTE_CHUNKS=promote_chunks, FLAT_CHAIN=flat_chain,
        SUM=do_sum, SHARE=triton.next_power_of_2(rows), SPIN_LIMIT=SPIN_LIMIT, num_warps=num_warps,
        num_stages=num_stages, **extra,
    )  # fmt: skip
    return out


def programs(cfg: dict, m: int, k: int, n: int) -> int:
    return cdiv(n, cfg["block_n"]) * cdiv(k, cfg["k_per_split"]) * cdiv(m, cfg["block_m"])


def _fmt(t: float, bf: float) -> str:
    return f"{t:.2f} ({t / bf:.3f}x)"


def splitk_cases(name: str, m: int, mode: str, sms: int, rows: list) -> None:
    shape = SHAPE_BY_NAME[name]
    k, n = shape.k, shape.n
    bucket = next(b for b in h200_buckets(k, n, mode) if b["max_m"] is None or m <= b["max_m"])
    if bucket["kernel"] != "splitk" or bucket.get("ticket", True) or bucket.get("splits_in_program"):
        print(
            f"{name} {mode} M={m}: bucket {bucket['kernel']}: not a two-launch split-K, skipped", flush=True
        )
        return
    base = {key: v for key, v in bucket.items() if key not in ("max_m", "kernel", "us")}
    one_chain = not base["promote_chunks"]  # bf16-fp32out: a split is one chain (as the dispatch)
    variants = [("table", base)]
    for kps in (base["k_per_split"] // 2, base["k_per_split"] * 2):
        if (
            kps >= base["block_k"] * base["promote_chunks"]
            and kps % (base["block_k"] * max(1, base["promote_chunks"])) == 0
        ):
            variants.append((f"kps{kps}", {**base, "k_per_split": kps}))
    if one_chain:
        variants = [(lb, {**c, "promote_chunks": c["k_per_split"] // c["block_k"]}) for lb, c in variants]
    xs, ws = make_inputs(m, k, n, rotation_copies(m, k, n), seed=m + 7)
    bf = time_rotated(lambda x, w: router_gemm(x, w, "bf16-fp32out"), xs, ws)
    ours = time_rotated(lambda x, w: router_gemm(x, w, mode), xs, ws)
    upcast = time_rotated(lambda x, w32: F.linear(x.float(), w32), xs, [w.float() for w in ws])
    ref = router_gemm(xs[0], ws[0], mode)
    print(
        f"{name} {mode} M={m}: bf16-fp32out {bf:.2f} | op {_fmt(ours, bf)} | torch upcast {upcast:.2f} "
        f"(5x: {upcast / 5:.2f}) | op / upcast {upcast / ours:.2f}x",
        flush=True,
    )
    for label, cfg in variants:
        p = programs(cfg, m, k, n)
        two = time_rotated_into(
            lambda x, w, o, c=cfg: splitk_launch(x, w, o, dot_mode=DOT_NATIVE, **c), xs, ws
        )
        line = f"  {label} ({p} programs) two-kernel {_fmt(two, bf)}"
        row = dict(shape=name, mode=mode, m=m, variant=label, programs=p, bf16_fp32out=bf, op=ours,
                   upcast=upcast, two_kernel=two, config=cfg)  # fmt: skip
        # A plain launch is resident for sure only with one program per SM; a cooperative one
        # refuses a grid that cannot be (and the spin limit turns a miss into NaN, not a hang).
        for coop in (False, True) if p <= sms else (True,):
            try:
                o = torch.full((m, n), float("nan"), device="cuda")
                resident_splitk(xs[0], ws[0], o, cooperative=coop, **cfg)
                torch.cuda.synchronize()
                same = bool(torch.equal(o, ref)) if label == "table" else None
                err = ((o.double() - ref.double()).abs().max() / ref.double().abs().max()).item()
                t = time_rotated_into(
                    lambda x, w, o, c=cfg, cp=coop: resident_splitk(x, w, o, cooperative=cp, **c), xs, ws
                )
                tag = "coop" if coop else "plain"
                line += f" | resident-{tag} {_fmt(t, bf)} " + (
                    ("bitwise =" if same else "DIFFERS") if same is not None else f"rel {err:.1e}"
                )
                row[f"resident_{tag}"] = t
                row[f"resident_{tag}_bitwise"] = same
            except Exception as e:  # noqa: BLE001 - a probe: record and go on
                line += f" | resident coop={coop}: {type(e).__name__}: {str(e)[:140]}"
                torch.cuda.synchronize()
        floor = time_rotated_into(lambda x, w, o, c=cfg: resident_splitk(x, w, o, do_sum=False, **c), xs, ws)
        # (the partials-alone form writes no logits: a floor for the sum's cost, not a result)
        line += f" | partials alone {floor:.2f}"
        row["partials_alone"] = floor
        rows.append(row)
        print(line, flush=True)


def wgmma_cases(name: str, m: int, sms: int, rows: list) -> None:
    from probe_cluster_wgmma import _cluster_kernel, counters, kernel_args

    import csrc_triton.router_gemm_wgmma_ws as wgmma_ws
    from csrc_triton.router_gemm_wgmma_ws import BLOCK_M, WORKER_REGISTERS

    shape = SHAPE_BY_NAME[name]
    k, n = shape.k, shape.n
    bucket = next(b for b in h200_buckets(k, n, "fp32") if b["max_m"] is None or m <= b["max_m"])
    keys = ("block_n", "block_k", "promote_chunks", "num_stages", "k_per_split", "block_n_tail")
    cfg = {key: bucket[key] for key in keys if key in bucket}
    split = cdiv(k, cfg.get("k_per_split", k) or k)
    width = cfg["block_n"] + cfg.get("block_n_tail", 0)
    ctas = cdiv(n, width) * split * cdiv(m, BLOCK_M)
    if bucket["kernel"] != "wgmma_ws" or split < 2 or BLOCK_M % split or bucket.get("consumers", 2) != 2:
        print(f"{name} fp32 M={m}: {bucket['kernel']} {cfg}: not probed", flush=True)
        return
    if ctas > sms:
        print(f"{name} fp32 M={m}: {ctas} CTAs > {sms} SMs: not one wave, skipped", flush=True)
        return
    xs, ws = make_inputs(m, k, n, rotation_copies(m, k, n), seed=m + 3)
    ref = router_gemm(xs[0], ws[0], "fp32")
    bf = time_rotated(lambda x, w: router_gemm(x, w, "bf16-fp32out"), xs, ws)
    ours = time_rotated(lambda x, w: router_gemm(x, w, "fp32"), xs, ws)
    two = time_rotated_into(lambda x, w, o, c=cfg: wgmma_ws.wgmma_ws_launch(x, w, o, **c), xs, ws)
    line = f"{name} fp32 M={m} {cfg} ({ctas} CTAs): bf16-fp32out {bf:.2f} | op {_fmt(ours, bf)} | "
    line += f"two-kernel {_fmt(two, bf)}"
    row = dict(shape=name, mode="fp32", m=m, variant="wgmma_ws", programs=ctas, bf16_fp32out=bf, op=ours,
               two_kernel=two, config=cfg)  # fmt: skip

    def launch(x, w, out, coop):
        args, _, _ = kernel_args(x, w, out, counters(x.device, split), **cfg)
        extra = {"launch_cooperative_grid": True} if coop else {}
        grid = (cdiv(n, width) * split, cdiv(x.shape[0], BLOCK_M), 1)  # plain: no cluster size set
        _cluster_kernel[grid](*args, num_warps=4, maxnreg=WORKER_REGISTERS, **extra)
        return out

    for coop in (False, True):
        try:
            o = torch.full((m, n), float("nan"), device="cuda")
            launch(xs[0], ws[0], o, coop)
            torch.cuda.synchronize()
            same = bool(torch.equal(o, ref))
            t = time_rotated_into(lambda x, w, o, cp=coop: launch(x, w, o, cp), xs, ws)
            tag = "coop" if coop else "plain"
            line += f" | resident-{tag} {_fmt(t, bf)} {'bitwise =' if same else 'DIFFERS'}"
            row[f"resident_{tag}"] = t
            row[f"resident_{tag}_bitwise"] = same
        except Exception as e:  # noqa: BLE001 - a probe: record and go on
            line += f" | resident coop={coop}: {type(e).__name__}: {str(e)[:160]}"
            torch.cuda.synchronize()
    rows.append(row)
    print(line, flush=True)


SPLITK_CASES = (
    ("DeepSeek-V2", (256, 128, 512)),
    ("GLM-5", (256, 128)),
    ("DeepSeek-V3", (256, 128)),
    ("Kimi-K2", (192, 384)),
    ("DeepSeek-V2-Lite", (256, 512, 1024)),
)
WGMMA_CASES = (("Kimi-K2", (2048, 1024)), ("DeepSeek-V3", (2048, 1024)), ("GLM-5", (2048, 1024)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--only", choices=("splitk", "wgmma"), default=None)
    args = ap.parse_args(argv)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(torch.cuda.get_device_name(), sms, "SMs", "triton", triton.__version__, flush=True)
    rows: list = []
    if args.only != "splitk":
        for name, ms in WGMMA_CASES:
            for m in ms:
                wgmma_cases(name, m, sms, rows)
    if args.only != "wgmma":
        for name, ms in SPLITK_CASES:
            for m in ms:
                for mode in ("fp32", "bf16-fp32out"):
                    splitk_cases(name, m, mode, sms, rows)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "probe-resident-sum.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
