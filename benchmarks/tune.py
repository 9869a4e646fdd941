"""Tune the router GEMM configs for the GPU this runs on; writes csrc_triton/configs/<gpu>.json.

    python benchmarks/tune.py [--out FILE] [--shapes DeepSeek-V3,...] [--quick]

For every shape, mode (bf16-fp32out, fp32) and M of the benchmark's list, times a pruned set of
split-K and tiled candidates (and cuBLAS for bf16-fp32out) with the benchmark's method (CUDA
graph of R calls over rotated weights, do_bench median) and keeps the fastest; buckets are
looked up by the first ``max_m`` >= M. Batch-invariant: one K structure per shape and mode (the
one whose worst slowdown against the best non-invariant time over a spread of M is smallest), and
per M the fastest tiles among configs bitwise equal to that structure's reference.
Each candidate is checked against an fp64 reference before it is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from csrc_triton.choice import (  # noqa: E402
    FP32_MAX_BLOCK_K,
    fp32_promote_chunks,
    one_chain_split,
    split_sum_variants,
    splitk,
    wgmma_ws,
    wgmma_ws_k_per_split,
    wgmma_ws_tiles,
)
from csrc_triton.dispatch import launch_into  # noqa: E402
from csrc_triton.launches import (  # noqa: E402
    CublasLaunch,
    GemvLaunch,
    KernelLaunch,
    TiledLaunch,
    describe,
    fields,
    from_bucket,
    to_bucket,
)
from csrc_triton.tables import CONFIG_DIR, bucket_for, clear_table_cache, device_key, table_override  # noqa: E402
from vllm_router_ext.bench_harness import (  # noqa: E402
    M_LIST,
    SHAPE_BY_NAME,
    SHAPES,
    make_inputs,
    rotation_copies,
    time_rotated,
    time_rotated_into,
)

#: The M a full tune times: the benchmark's list and, between its 128, 256 and 512 tokens, 192 and
#: 384 (other configs won inside those buckets, e.g. Kimi-K2 bf16-fp32out at 192
#: tokens split-K 8.35 µs where the bucket tuned at 256 called cuBLAS, 9.44).
TUNE_M_LIST = tuple(sorted((*M_LIST, 192, 384)))
GEMV_MAX_M = 16
GEMV_MAXNREG = 255  # the register budget that lets ptxas issue every chunk's loads up front
GEMV_COPY_STAGES = 8  # >= chunks per row at 4 warps (7 for K=7168): every chunk copied ahead
GEMV_SHAPES = [  # (block_n, num_warps) for BLOCK_M in {1, 2, 4} <= M; one K split (the probe's winners)
    (1, 4),
    (1, 8),
    (1, 16),
    (2, 4),
    (2, 8),
    (4, 4),
]
SPLITK_SHAPES = [  # (block_n, k_per_split, block_k, num_warps); unrolled, every one single-launch (ticket)
    (16, 512, 128, 4),
    (16, 512, 256, 4),
    (16, 512, 512, 4),
    (32, 512, 128, 4),
    (32, 512, 256, 4),
    (16, 256, 128, 4),
    (32, 256, 128, 4),
    (32, 1024, 128, 4),
    (64, 512, 128, 4),
    (16, 1024, 256, 8),
]
BIG_SPLITK = [  # (block_m, block_n, k_per_split, num_warps): software-pipelined, 3 stages, BLOCK_K 64
    (64, 64, 1024, 4),
    (64, 64, 2048, 4),
    (64, 128, 2048, 4),
    (128, 64, 2048, 4),
    (128, 128, 1024, 8),
    (128, 128, 3584, 8),
    (128, 128, 7168, 8),
]
#: Pipelined split-K with 128-wide chunks (the fp32 mode's winner at 256 tokens in the promotion
#: probe, below cuBLAS bf16; in bf16-fp32out cuBLAS still won at 128-512 tokens on DeepSeek-V3 and
#: Kimi-K2, benchmarks/NOTES.md); in the fp32 mode two chunks per stage, so only 64x64
#: tiles fit three stages and 128x64 / 64x128 two. (block_m, block_n, k_per_split, num_warps, stages)
BIG_SPLITK_BK128 = [
    (64, 64, 256, 4, 3),
    (64, 64, 512, 4, 3),
    (64, 64, 1024, 4, 3),
    (64, 64, 2048, 4, 3),
    (128, 64, 1024, 4, 2),
    (64, 128, 1024, 4, 2),
    (128, 64, 2048, 4, 2),
]
#: fp32 mode only, from 1024 tokens: one program per tile, flat pipelined loop over K, the promoted
#: chains added per split of 512 (the batch-invariant large-M kernel: at 2048-4096 tokens it beat
#: the non-invariant fp32 configs, and at 16384 the tiled kernel in
#: the benchmark: 129 vs 138 µs). (block_m, block_n, num_warps)
IN_PROGRAM_FP32 = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8)]
TILED = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (64, 128, 64, 4, 3),
    (64, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (128, 64, 64, 4, 4),
    (128, 256, 64, 8, 4),
    (256, 128, 64, 8, 3),
]


def gemv_candidates(m: int) -> list[KernelLaunch]:
    """Each (block_m, block_n, num_warps) plainly, with ptxas given the whole register file (every
    load issued before the first FMA) and, at 4 warps, with every chunk copied ahead through shared
    memory (cp.async)."""
    p2 = 1 << (m - 1).bit_length()
    out = []
    for bm in sorted({min(p2, 4), min(p2, 2), 1}):
        for bn, warps in GEMV_SHAPES:
            if bm * bn > 16 or (warps != 4 and bm * bn > 2):
                continue
            out.append(GemvLaunch(bm, bn, warps))
            if warps <= 8:
                out.append(GemvLaunch(bm, bn, warps, maxnreg=GEMV_MAXNREG))
            if warps == 4:
                out.append(GemvLaunch(bm, bn, warps, copy_stages=GEMV_COPY_STAGES))
    return out


def splitk_candidates(m: int, mode: str) -> list[KernelLaunch]:
    fp32 = mode == "fp32"
    out = []
    if m <= 512:
        block_ms = sorted({min(64, max(16, 1 << (m - 1).bit_length())), 16 if m <= 64 else 64})
        out += [
            splitk(block_m, block_n, block_k, kps, fp32, warps)
            for block_m in block_ms
            for block_n, kps, block_k, warps in SPLITK_SHAPES
        ]
    if m >= 128:
        out += [
            _pipelined(splitk(bm, bn, 64, kps, fp32, warps, num_stages=3))
            for bm, bn, kps, warps in BIG_SPLITK
        ]
        out += [
            _pipelined(splitk(bm, bn, 128, kps, fp32, warps, num_stages=stages))
            for bm, bn, kps, warps, stages in BIG_SPLITK_BK128
        ]
    if mode == "fp32" and m >= 1024:
        out += [
            splitk(bm, bn, 128, 512, fp32, warps, num_stages=3, splits_in_program=True)
            for bm, bn, warps in IN_PROGRAM_FP32
        ]
    return list(dict.fromkeys(out))  # the fp32 mode caps BLOCK_K: some shapes coincide


def _pipelined(cfg: KernelLaunch) -> KernelLaunch:
    """A pipelined split-K candidate as it can win: its split sum a second launch with PDL (with
    the one-launch ticket these tiles measured up to 1.4x slower, 19.3 vs 13.5 µs,
    too slow to reach the :data:`REFINED` few whose launch forms are compared), and a split that
    is one MMA chain (bf16-fp32out, or an fp32 split as long as one promoted chain) looped over
    its chunks (``flat_chain``; unrolled, nothing is left to pipeline). bf16-fp32out's
    128-512-token buckets had kept cuBLAS for both reasons; with them split-K beat it by up to 1.3x."""
    return replace(cfg, ticket=False, pdl=True, flat_chain=one_chain_split(cfg))


def tiled_candidates(m: int, mode: str) -> list[KernelLaunch]:
    out = []
    for block_m, block_n, block_k, warps, stages in TILED:
        if block_m > 64 and m <= 64:
            continue
        promote = fp32_promote_chunks(block_k) if mode == "fp32" else 0
        out.append(TiledLaunch(block_m, block_n, block_k, promote, num_warps=warps, num_stages=stages))
    return out


def _check(cfg: KernelLaunch, x, w, mode: str) -> bool:
    out = torch.full((x.shape[0], w.shape[0]), float("nan"), device="cuda")
    try:
        res = launch_into(cfg, x, w, out)
    except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
        print(f"    skip {describe(cfg)}: {type(e).__name__}: {str(e)[:120]}")
        return False
    ref = x.double() @ w.double().T
    rel = ((res.double() - ref).norm() / ref.norm()).item()
    limit = 1e-6 if mode == "fp32" else 1e-5
    if not rel <= limit:
        print(f"    reject {describe(cfg)}: rel err {rel:.2e} > {limit:.0e}")
        return False
    return True


def time_config(cfg: KernelLaunch, xs, ws, mode: str) -> float:
    return time_rotated_into(lambda x, w, o: launch_into(cfg, x, w, o), xs, ws, warmup=10, rep=40)


#: How many of the fastest candidates at an M get their split-sum launch forms timed: a config
#: that loses with its ticket may win with two launches and PDL.
REFINED = 3


def refine_split_sum(best: tuple[float, KernelLaunch], xs, ws, mode: str) -> tuple[float, KernelLaunch]:
    """Retime ``best`` and its :func:`split_sum_variants` (each bitwise equal to it, checked);
    keep the fastest."""
    variants = split_sum_variants(best[1], xs[0].shape[1])
    if not variants:
        return best

    def logits(c: KernelLaunch) -> torch.Tensor:
        out = torch.full((xs[0].shape[0], ws[0].shape[0]), float("nan"), device="cuda")
        return launch_into(c, xs[0], ws[0], out)

    ref = logits(best[1])
    timed = []
    for c in variants:
        if not torch.equal(logits(c), ref):  # the same adds in the same order: never expected
            print(f"    {describe(c)} differs bitwise from {describe(best[1])}: not used")
            continue
        timed.append((time_config(c, xs, ws, mode), c))
    return min(timed, key=lambda r: r[0]) if timed else best


def fastest_launch_form(
    results: list[tuple[float, KernelLaunch]], xs, ws, mode: str
) -> tuple[float, KernelLaunch]:
    """The fastest of the :data:`REFINED` best sorted ``results``, each in its fastest split-sum
    launch form (:func:`refine_split_sum`)."""
    return min((refine_split_sum(r, xs, ws, mode) for r in results[:REFINED]), key=lambda r: r[0])


#: The fp32 mode's tiled kernel never won below this M on the H200 (benchmarks/NOTES.md, and later
#: tables): not timed there, to keep a retune inside one device call.
FP32_TILED_FROM = 2048


def _fastest_triton(results: list[tuple[float, KernelLaunch]]) -> tuple[float, KernelLaunch] | None:
    """The fastest Triton config of sorted timings: what runs where the ``wgmma_ws`` kernel
    cannot (an fp32 gate weight, rows TMA cannot read); the table keeps it as ``fp32/triton``."""
    return next(((t, c) for t, c in results if c.kernel not in ("wgmma_ws", "cublas")), None)


def _triton_buckets(
    entry: dict, mode: str, previous: list[dict], new: dict[int, tuple[float, KernelLaunch]], ms
) -> None:
    """Store ``<mode>/triton`` (only for a mode whose buckets name ``wgmma_ws``): this run's fastest
    Triton configs merged over the table's earlier ones (its ``/triton`` buckets, else the Triton
    buckets it had before this run)."""
    if not any(b["kernel"] == "wgmma_ws" for b in entry.get(mode, [])):
        entry.pop(f"{mode}/triton", None)
        return
    old = entry.get(f"{mode}/triton") or [b for b in previous if b["kernel"] != "wgmma_ws"]
    if old and old[-1]["max_m"] is None:
        entry[f"{mode}/triton"] = merge_buckets(old, new, ms)
    else:
        entry[f"{mode}/triton"] = merge_buckets([], new, sorted(new))


def full_candidates(shape, mode: str, m: int, invariant: list[dict] | None = None) -> list[KernelLaunch]:
    """Every candidate the full search times for ``shape`` and ``mode`` at M, once each."""
    cands = gemv_candidates(m) if m <= GEMV_MAX_M else []
    if invariant and (bi := bucket_config(invariant, m)) is not None:
        cands.append(bi)
    cands += splitk_candidates(m, mode)
    if mode == "fp32" and m >= FP32_TILED_FROM:
        cands += tiled_candidates(m, mode)
    elif mode != "fp32" and m >= 32:  # it never beat cuBLAS in the 16-bit modes: two for the record
        cands += tiled_candidates(m, mode)[:2]
    if mode == "bf16-fp32out":
        cands.append(CublasLaunch())
    if mode == "fp32":
        cands += wgmma_ws_candidates(m, shape.k, shape.n)
    return list(dict.fromkeys(cands))


def compile_candidates(shape, modes: list[str], ms) -> None:
    """Compile (and check against fp64) every candidate of the full search, timing nothing: run in
    several processes at once before a tune, it fills Triton's cache, so the tune's one process
    spends its time timing instead of compiling."""
    for mode in modes:
        for m in ms:
            xs, ws = make_inputs(m, shape.k, shape.n, 1, seed=m)
            for cfg in full_candidates(shape, mode, m):
                if cfg.kernel != "cublas":
                    _check(cfg, xs[0], ws[0], mode)
        print(f"[tune] {shape.name} {mode} compiled", flush=True)


def tune_shape(
    shape, mode: str, ms, old: list[dict] | None = None, invariant: list[dict] | None = None
) -> tuple[list[dict], dict[int, float], dict[int, tuple[float, KernelLaunch]]]:
    """The fastest candidate per M in ``ms``; with ``old`` (a merged table), every other M of the
    benchmark's list keeps ``old``'s bucket. Also the fastest Triton candidate per M.
    ``invariant``: the mode's batch-invariant buckets, whose config at each M is a candidate too
    (the non-invariant path should never be the slower one: on DeepSeek-V2-Lite at 32-256 tokens
    it was, by up to 13 %)."""
    best_by_m: dict[int, tuple[float, KernelLaunch]] = {}
    triton_by_m: dict[int, tuple[float, KernelLaunch]] = {}
    for m in ms:
        xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
        results = []
        for cfg in full_candidates(shape, mode, m, invariant):
            if cfg.kernel != "cublas" and not _check(cfg, xs[0], ws[0], mode):
                continue
            results.append((time_config(cfg, xs, ws, mode), cfg))
        results.sort(key=lambda r: r[0])
        best_by_m[m] = fastest_launch_form(results, xs, ws, mode)
        if (fastest := _fastest_triton(results)) is not None:
            triton_by_m[m] = fastest
        cub = next((t for t, c in results if c.kernel == "cublas"), None)
        print(
            f"  {shape.name} {mode} M={m}: best {best_by_m[m][0]:.2f} µs {describe(best_by_m[m][1])}"
            + (f"  (cuBLAS {cub:.2f})" if cub else ""),
            flush=True,
        )
    points = sorted(set(ms) | set(M_LIST)) if old else ms
    return merge_buckets(old or [], best_by_m, points), {m: best_by_m[m][0] for m in ms}, triton_by_m


#: K structures a batch-invariant launch may fix: (k_per_split, block_k); promotion follows the
#: mode; the splits are added in split order. The structure kept is the one with the fewest M
#: over the limits (1.5x the fastest non-invariant path up to 256 tokens, 2x above: ``bi_limit``),
#: then the smallest worst ratio to them (``bi_rank``).
BI_K_STRUCTURES = [(256, 128), (512, 128), (1024, 128)]


def bi_limit(m: int) -> float:
    """The batch-invariant cost limit at M: 1.5x the fastest path to 256 tokens, 2x above."""
    return 1.5 if m <= 256 else 2.0


def bi_rank(times: dict[int, float], fastest: dict[int, float]) -> tuple[int, float]:
    """How a K structure's per-M times rank against the issue's limits: first the number of M
    over its limit, then the worst ratio to the limit (lower is better). The count comes first
    because the worst point is often M=1, which no K structure brings under 1.5x on the H200:
    ranked by it alone, DeepSeek-V3's K split 256 tied 512 (1.15) while adding a miss at 1024
    tokens (benchmarks/NOTES.md)."""
    ratios = [times[m] / fastest[m] / bi_limit(m) for m in times]
    return sum(r > 1.0 for r in ratios), max(ratios)


#: (block_m, block_n, num_warps, num_stages, form, block_k or None = the structure's); form:
#: "split" (a program per split, summed by a ticket or a second launch) or "program" (one program
#: runs every split: large M). A tile whose BLOCK_K differs from the structure's is admitted only
#: if bitwise equal to its reference (the first tile).
BI_TILES = [
    (16, 16, 4, 1, "split", None),
    (16, 16, 4, 1, "split", 256),
    (16, 32, 4, 1, "split", 256),
    (32, 32, 4, 1, "split", 256),
    (64, 32, 4, 1, "split", None),
    (64, 64, 4, 1, "split", None),
    (128, 64, 8, 1, "split", None),
    (64, 64, 4, 3, "split", None),
    (128, 64, 4, 3, "split", None),
    (64, 128, 4, 3, "split", None),
    (128, 128, 8, 3, "split", None),
    (128, 64, 4, 2, "split", None),  # fp32 mode: 128-wide chunks fit 128-row tiles in 2 stages only
    (64, 128, 4, 2, "split", None),
    (64, 128, 4, 3, "program", None),
    (128, 64, 4, 3, "program", None),
    (128, 64, 8, 3, "program", None),
    (64, 128, 8, 3, "program", None),
    (128, 128, 8, 3, "program", None),
    (64, 64, 4, 3, "program", None),
    (64, 32, 4, 3, "program", None),
]
BI_M = (1, 16, 64, 256, 512, 1024, 2048, 4096, 16384)


def bi_structures(mode: str, k_splits: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """The K structures (k_per_split, block_k) a batch-invariant retune compares in ``mode``;
    ``k_splits`` (None = all) keeps those K splits."""
    known = sorted({kps for kps, _ in BI_K_STRUCTURES})
    if k_splits is not None and (bad := sorted(set(k_splits) - set(known))):
        raise ValueError(f"K split(s) {bad} not among the batch-invariant structures; allowed: {known}")
    return sorted(
        {
            (kps, min(bk, FP32_MAX_BLOCK_K) if mode == "fp32" else bk)
            for kps, bk in BI_K_STRUCTURES
            if k_splits is None or kps in k_splits
        }
    )


def _bi_fits(cfg: KernelLaunch, m: int) -> bool:
    """Which tiles are worth timing at M: unrolled up to 256 tokens, pipelined with a ticket from
    64 to 4096, one program per tile (no partials in memory) from 256 on."""
    if cfg.splits_in_program:
        return m >= 256
    return m <= 256 if cfg.num_stages == 1 else 64 <= m <= 4096


def _bi_config(structure: tuple, tiles: tuple, mode: str) -> KernelLaunch:
    """The launch of ``tiles`` under a K structure."""
    kps, block_k = structure
    block_m, block_n, warps, stages, form, tile_block_k = tiles
    return splitk(
        block_m,
        block_n,
        tile_block_k or block_k,
        kps,
        mode == "fp32",
        warps,
        num_stages=stages,
        splits_in_program=form == "program",
    )


def _fastest_non_invariant(shape, mode: str, m: int, xs, ws) -> float:
    from vllm_router_ext.ops.router_gemm import router_gemm

    t = time_rotated(lambda x, w: router_gemm(x, w, mode), xs, ws, warmup=10, rep=40)
    if mode == "bf16-fp32out":
        cublas = time_rotated(
            lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32), xs, ws, warmup=10, rep=40
        )
        t = min(t, cublas)
    return t


def tune_batch_invariant(
    shape,
    mode: str,
    old: list[dict] | None = None,
    ms=BI_M,
    k_splits: tuple[int, ...] | None = None,
) -> list[dict]:
    """Per M, the fastest tiles among configs that share one K structure *and* give bitwise the
    same logits as that structure's reference config on the same input (checked here).
    With ``old`` (``--bi-only --m ...`` on a merged table): keep its K structure, retime only
    ``ms`` and merge them into its buckets. ``k_splits``: which K splits to compare (None: all)."""
    inputs = {m: make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m) for m in ms}
    best = {m: _fastest_non_invariant(shape, mode, m, *inputs[m]) for m in ms}
    probe_x = torch.randn(300, shape.k, device="cuda").to(torch.bfloat16)
    probe_w = inputs[ms[0]][1][0]
    choices = []
    structures = bi_structures(mode, k_splits)
    if old:  # keep the table's K split; BLOCK_K is the reference tile's
        structures = [(old[0]["k_per_split"], 128)]
    for structure in structures:
        ref_cfg = _bi_config(structure, BI_TILES[0], mode)
        ref = launch_into(ref_cfg, probe_x, probe_w, torch.empty(300, shape.n, device="cuda"))
        admitted = []
        for tiles in BI_TILES:
            cfg = _bi_config(structure, tiles, mode)
            if cfg in admitted or not any(_bi_fits(cfg, m) for m in ms):
                continue
            try:
                out = launch_into(cfg, probe_x, probe_w, torch.empty(300, shape.n, device="cuda"))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not admitted
                print(f"    skip {describe(cfg)}: {type(e).__name__}: {str(e)[:100]}")
                continue
            if torch.equal(out, ref):
                admitted.append(cfg)
            else:
                print(f"    {describe(cfg)} differs bitwise from {describe(ref_cfg)}: not admitted")
        per_m = {}
        for m in ms:
            fits = [c for c in admitted if _bi_fits(c, m)]
            timed = sorted(((time_config(c, *inputs[m], mode), c) for c in fits), key=lambda r: r[0])
            per_m[m] = fastest_launch_form(timed, *inputs[m], mode)
        rank = bi_rank({m: t for m, (t, _) in per_m.items()}, best)
        choices.append((rank, structure, per_m))
        timings = " ".join(f"M={m}:{t:.2f}/{best[m]:.2f}" for m, (t, _) in per_m.items())
        print(
            f"    K split {structure[0]}: {rank[0]} M over the limit, worst {rank[1]:.2f} of the limit; "
            + timings
        )
    (_, worst), (kps, _), per_m = min(choices, key=lambda c: c[0])
    print(
        f"  {shape.name} {mode} batch-invariant: K split {kps}, "
        f"worst {worst:.2f} of the limit (1.5x to 256 tokens, 2x above) vs fastest "
        + " ".join(f"M={m}:{t:.2f}/{best[m]:.2f}" for m, (t, _) in per_m.items()),
        flush=True,
    )
    buckets = merge_buckets(old or [], per_m, sorted(set(BI_M) | set(M_LIST) | set(ms)) if old else BI_M)
    for b in buckets:  # timing notes: this run's fastest non-invariant time next to ours
        m = b["max_m"] if b["max_m"] is not None else BI_M[-1]
        if m in best:
            b["fastest_us"] = round(best[m], 3)
    return buckets


#: --targeted: the winners of the full search on DeepSeek-V3 and of the GEMV design probe
#: (benchmarks/NOTES.md), timed per shape against the table's current config.
TARGETED_GEMV = {  # M -> (block_m, block_n, num_warps, maxnreg, copy_stages)
    1: [(1, 1, 8, 255, 0), (1, 1, 16, 0, 0), (1, 1, 8, 0, 0)],
    2: [(1, 1, 8, 255, 0), (2, 1, 8, 255, 0), (2, 1, 16, 0, 0)],
    4: [
        (1, 2, 4, 255, 0),
        (2, 2, 8, 255, 0),
        (2, 2, 4, 0, 8),
        (2, 2, 4, 255, 8),
        (2, 1, 8, 0, 0),
        (2, 1, 8, 255, 0),
        (1, 2, 4, 0, 0),
    ],
    # each with and without the whole register file: Triton 3.8 issues fewer of the chunks' loads
    # up front without it than 3.6 did (benchmarks/NOTES.md)
    8: [
        (1, 4, 4, 0, 0),
        (1, 4, 4, 255, 0),
        (4, 2, 4, 0, 0),
        (4, 2, 4, 255, 0),
        (4, 2, 8, 255, 0),
        (4, 2, 4, 0, 4),
        (2, 2, 8, 255, 0),
    ],
    16: [
        (4, 4, 4, 0, 0),
        (4, 4, 4, 255, 0),
        (4, 4, 8, 0, 0),
        (4, 2, 4, 0, 0),
        (4, 2, 4, 255, 0),
        (4, 2, 8, 255, 0),
        (2, 4, 4, 0, 0),
        (2, 4, 4, 255, 0),
        (4, 1, 4, 255, 0),
    ],
}
# a bucket's middle takes both its ends' candidates: the launch chosen at an end can lose mid-way
TARGETED_GEMV[6] = list(dict.fromkeys(TARGETED_GEMV[4] + TARGETED_GEMV[8]))
TARGETED_GEMV[12] = list(dict.fromkeys(TARGETED_GEMV[8] + TARGETED_GEMV[16]))
TARGETED_FP32_MID = [(64, 64, 1024, 4), (64, 64, 2048, 4), (128, 128, 3584, 8)]
#: The fp32 mode's warp-specialised wgmma kernel (Hopper): from this M, K split into these many
#: parts (as long as the 128-row tiles times the splits stay within two per SM), 6 TMA stages
#: (the winner at every M in its design probe, benchmarks/NOTES.md; 5 for 192-wide tiles). Below
#: 512 tokens only a few tiles exist, so the K splits go up to 28 (chains of 256: 7168 / 256).
WGMMA_WS_TUNE_FROM = 128
WGMMA_WS_SPLITS = (1, 2, 3, 4, 6, 8, 12, 16, 22, 28)


def wgmma_ws_candidates(m: int, k: int, n: int) -> list[KernelLaunch]:
    from csrc_triton.capability import gluon_available

    if torch.cuda.get_device_capability()[0] != 9 or not gluon_available() or m < WGMMA_WS_TUNE_FROM:
        return []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = []
    # (block_m, block_n, tail): 128-row tiles of 128 + a tail where that width divides N (160 =
    # 128 + 32; 384 = 2 x 192); 64-wide and 64-row tiles on every N: more programs without
    # partials where 128 x 128 tiles are few (64-row ones: two resident on an SM)
    forms = [(128, 128, 0), (128, 64, 0), (64, 128, 0), (64, 64, 0)]
    forms += [(128, 128, t) for t in (16, 32) if n > 128 and n % (128 + t) == 0]
    forms += [(128, 128, 64)] if n > 128 and n % 192 == 0 else []
    for block_m, block_n, tail in forms:
        tiles = wgmma_ws_tiles(m, n, block_n, tail, block_m)
        resident = 2 * (128 // block_m)  # programs an SM holds at once
        for asked in WGMMA_WS_SPLITS:
            per_split = wgmma_ws_k_per_split(k, asked)
            splits = -(-k // per_split)  # whole chains per split: fewer parts than asked, maybe
            if tiles * splits <= resident * sms and per_split < k or splits == 1:
                kps = 0 if splits == 1 else per_split
                out.append(wgmma_ws(block_n, kps, block_n_tail=tail, block_m=block_m))
    return list(dict.fromkeys(out))


def targeted_candidates(m: int, mode: str, k: int = 0, n: int = 0) -> list[KernelLaunch]:
    cands: list[KernelLaunch] = [
        GemvLaunch(bm, bn, w, maxnreg, stages) for bm, bn, w, maxnreg, stages in TARGETED_GEMV.get(m, [])
    ]
    if mode == "fp32" and 128 <= m <= 8192:
        cands += [splitk(bm, bn, 64, kps, True, w, num_stages=3) for bm, bn, kps, w in TARGETED_FP32_MID]
    if mode == "fp32":
        cands += wgmma_ws_candidates(m, k, n)
    return cands


def bucket_config(buckets: list[dict], m: int) -> KernelLaunch | None:
    """The config a bucket list gives for M (the dispatch's lookup rule)."""
    bucket = bucket_for(buckets, m)
    return None if bucket is None else from_bucket(bucket, "table")


def merge_buckets(old: list[dict], new: dict[int, tuple[float, KernelLaunch]], ms) -> list[dict]:
    """Collapse per-M points over ``ms`` and ``new``'s M into buckets: tuned points from ``new``,
    every other M keeps ``old``'s bucket (its launch parameters and its timing note). ``old``'s own
    bucket ends count as points too, so a bucket tuned at an M off ``ms`` (e.g. 192 or 384 tokens) survives
    a later merge that retunes other M."""
    points = []
    for m in sorted(set(ms) | set(new) | {b["max_m"] for b in old if b["max_m"] is not None}):
        if m in new:
            t, cfg = new[m]
            points.append({"max_m": m, **to_bucket(cfg), "us": round(t, 3)})
        else:
            prior = bucket_for(old, m)
            if prior is None:
                raise SystemExit("--targeted needs --merge with a table that has this shape and mode")
            points.append({**prior, "max_m": m})
    buckets: list[dict] = []
    for entry in points:
        same = buckets and fields(from_bucket(buckets[-1], "")) == fields(from_bucket(entry, ""))
        if same:
            buckets[-1]["max_m"] = entry["max_m"]
        else:
            buckets.append(entry)
    buckets[-1]["max_m"] = None
    return buckets


def tune_targeted(
    shape,
    mode: str,
    old: list[dict],
    ms,
    old_triton: list[dict] | None = None,
    record: list[dict] | None = None,
) -> tuple[list[dict], dict[int, tuple[float, KernelLaunch]]]:
    """Time the targeted candidates and the table's current config at each M; keep the fastest
    (and return the fastest Triton config per M, the table's ``<mode>/triton`` one among them:
    the targeted candidates alone are a subset of the full search that chose it). Every timing
    is appended to ``record`` (for :func:`choose_across`)."""
    new = {}
    triton_by_m = {}
    for m in ms:
        cands = targeted_candidates(m, mode, shape.k, shape.n)
        if not cands:
            continue
        current = bucket_config(old, m)
        if current is not None and current.kernel != "cublas":
            cands.append(current)
        fallback = bucket_config(old_triton, m) if old_triton else None
        if fallback is not None and fallback not in cands:
            cands.append(fallback)
        xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
        if mode == "bf16-fp32out":
            cands.append(CublasLaunch())
        timed = [
            (time_config(c, xs, ws, mode), c)
            for c in cands
            if c.kernel == "cublas" or _check(c, xs[0], ws[0], mode)
        ]
        results = sorted(timed, key=lambda r: r[0])
        if record is not None:
            record += [
                {"shape": shape.name, "mode": mode, "m": m, "launch": to_bucket(c), "us": round(t, 3)}
                for t, c in results
            ]
        new[m] = fastest_launch_form(results, xs, ws, mode)
        if (fastest := _fastest_triton(results)) is not None:
            triton_by_m[m] = fastest
        cur_t = next((t for t, c in results if current is not None and c == current), None)
        print(
            f"  {shape.name} {mode} M={m}: best {new[m][0]:.2f} µs {describe(new[m][1])}"
            + (f"  (table's current {cur_t:.2f})" if cur_t else ""),
            flush=True,
        )
    return merge_buckets(old, new, M_LIST), triton_by_m


def choose_across(table: dict, records: list[dict]) -> list[str]:
    """``--across``: rewrite ``table``'s buckets at the M that every record timed with the launch
    whose worst slowdown against each Triton's fastest is smallest (the records: ``--record``
    files of the same candidates, one per Triton version). Each chosen bucket notes its time under
    each Triton (``us_by_triton``). Returns one line per choice for the log."""
    tritons = [r["triton"] for r in records]
    by_point: dict[tuple, dict[str, dict[str, float]]] = {}  # (shape, mode, m) -> launch -> triton -> µs
    for rec in records:
        for t in rec["timings"]:
            launch = json.dumps(t["launch"], sort_keys=True)
            point = by_point.setdefault((t["shape"], t["mode"], t["m"]), {})
            point.setdefault(launch, {})[rec["triton"]] = t["us"]
    lines = []
    chosen: dict[tuple[str, str], dict[int, tuple[float, KernelLaunch, dict]]] = {}
    for (shape, mode, m), launches in sorted(by_point.items()):
        fastest = {v: min(us[v] for us in launches.values() if v in us) for v in tritons}
        common = {k: us for k, us in launches.items() if len(us) == len(tritons)}
        if not common:
            continue
        launch, us = min(common.items(), key=lambda kv: max(kv[1][v] / fastest[v] for v in tritons))
        worst = max(us[v] / fastest[v] for v in tritons)
        cfg = from_bucket(json.loads(launch), "table")
        chosen.setdefault((shape, mode), {})[m] = (us[tritons[0]], cfg, us)
        lines.append(
            f"{shape} {mode} M={m}: {describe(cfg)} "
            + ", ".join(f"{v} {us[v]:.2f} µs ({us[v] / fastest[v]:.2f}x its fastest)" for v in tritons)
            + f"; worst {worst:.2f}x"
        )
    for (shape_name, mode), points in chosen.items():
        shape = SHAPE_BY_NAME[shape_name]
        buckets = table["shapes"][f"{shape.k}x{shape.n}"][mode]
        buckets[:] = merge_buckets(buckets, {m: (t, c) for m, (t, c, _) in points.items()}, M_LIST)
        for b in buckets:
            point = points.get(b["max_m"]) if b["max_m"] is not None else None
            if point is not None and fields(from_bucket(b, "")) == fields(point[1]):
                b["us_by_triton"] = {v: round(us, 3) for v, us in point[2].items()}
    table["tritons"] = tritons
    return lines


def refine_table_split_sums(shape, key: str, old: list[dict], ms) -> list[dict]:
    """``--refine-split-sum``: at each M, the table's config for ``key`` (a mode, or
    ``<mode>/batch_invariant``) against its :func:`split_sum_variants`; merged back into buckets."""
    mode = key.split("/")[0]
    new = {}
    for m in ms:
        current = bucket_config(old, m)
        if current is None or not split_sum_variants(current, shape.k):
            continue
        xs, ws = make_inputs(m, shape.k, shape.n, rotation_copies(m, shape.k, shape.n), seed=m)
        new[m] = refine_split_sum((time_config(current, xs, ws, mode), current), xs, ws, mode)
        print(f"  {shape.name} {key} M={m}: {new[m][0]:.2f} µs {describe(new[m][1])}", flush=True)
    if not new:
        return old
    return merge_buckets(old, new, sorted(set(ms) | set(M_LIST)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument(
        "--shapes",
        default=",".join(s.name for s in SHAPES),
        help="names of the benchmark's release and family shapes (default: the release shapes)",
    )
    p.add_argument("--m", default=",".join(map(str, TUNE_M_LIST)))
    p.add_argument("--modes", default="bf16-fp32out,fp32")
    p.add_argument("--merge", default=None, help="start from this table; only the listed shapes are retuned")
    p.add_argument(
        "--bi-only",
        action="store_true",
        help="retune only the batch-invariant buckets (with --m: only those M, keeping each K structure)",
    )
    p.add_argument(
        "--targeted",
        action="store_true",
        help="with --merge: time only the targeted candidates at --m and merge them into the table",
    )
    p.add_argument(
        "--refine-split-sum",
        action="store_true",
        help="with --merge: at --m, time each bucket's K-split sum launched each way (ticket, two "
        "launches with PDL) for the listed modes and their batch-invariant buckets; keep the fastest",
    )
    p.add_argument("--no-bi", action="store_true", help="leave the batch-invariant buckets as they are")
    p.add_argument(
        "--record",
        default=None,
        help="with --targeted: also write every candidate's timing here (JSON, with the Triton version)",
    )
    p.add_argument(
        "--across",
        default=None,
        help="with --merge and --out, no GPU: comma-separated --record files of the same candidates "
        "under different Tritons; each of their M takes the launch whose worst slowdown against "
        "each Triton's fastest is smallest",
    )
    p.add_argument(
        "--compile-only",
        action="store_true",
        help="compile and check every candidate of the full search for --shapes, --modes and --m; "
        "time nothing, write nothing (fills Triton's cache for a tune that follows)",
    )
    p.add_argument(
        "--bi-k-splits",
        type=lambda v: tuple(int(k) for k in v.split(",")),
        default=None,
        help="batch-invariant K splits to compare, e.g. 256,512 (default: every structure's)",
    )
    args = p.parse_args(argv)
    unknown = sorted(set(args.shapes.split(",")) - SHAPE_BY_NAME.keys())
    if unknown:
        p.error(f"--shapes: {unknown} unknown; known: {', '.join(SHAPE_BY_NAME)}")
    if (args.targeted or args.refine_split_sum) and not args.merge:
        p.error("--targeted and --refine-split-sum need --merge TABLE")
    ms = [int(m) for m in args.m.split(",")]
    if args.across:
        if not (args.merge and args.out):
            p.error("--across needs --merge TABLE and --out FILE")
        table = json.loads(Path(args.merge).read_text(encoding="utf-8"))
        records = [json.loads(Path(f).read_text(encoding="utf-8")) for f in args.across.split(",")]
        for line in choose_across(table, records):
            print(line)
        Path(args.out).write_text(json.dumps(table, indent=1))
        print(f"[tune] wrote {args.out}")
        return 0
    if args.compile_only:
        for name in args.shapes.split(","):
            compile_candidates(SHAPE_BY_NAME[name], args.modes.split(","), ms)
        return 0
    name = torch.cuda.get_device_name()
    out = Path(args.out) if args.out else CONFIG_DIR / f"{device_key(name)}.json"
    table = {"device": name, "tuned": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "shapes": {}}
    if args.merge:
        merged = json.loads(Path(args.merge).read_text(encoding="utf-8"))
        table["shapes"] = merged["shapes"]
        if "tritons" in merged:  # its buckets chosen across Tritons still carry their times under each
            table["tritons"] = merged["tritons"]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    import triton

    table["triton"] = triton.__version__
    record: list[dict] | None = [] if args.record else None
    # The dispatch reads the table being written, whatever its name or VLLM_ROUTER_EXT_TABLE says.
    with table_override(str(out.resolve())):
        _tune_shapes(args, table, out, ms, bi_default_m=args.m == p.get_default("m"), record=record)
    if args.record:
        rec = {"triton": triton.__version__, "torch": torch.__version__, "device": name, "timings": record}
        Path(args.record).write_text(json.dumps(rec, indent=1))
    print(f"[tune] wrote {out}")
    return 0


def _tune_shapes(
    args: argparse.Namespace, table: dict, out: Path, ms: list[int], bi_default_m: bool, record: list | None
) -> None:
    t0 = time.time()
    for shape in SHAPE_BY_NAME.values():
        if shape.name not in args.shapes.split(","):
            continue
        entry = table["shapes"].setdefault(f"{shape.k}x{shape.n}", {"model": shape.name})
        for mode in args.modes.split(","):
            if args.refine_split_sum:
                keys = [mode] if args.no_bi else [mode, f"{mode}/batch_invariant"]
                for key in keys:
                    entry[key] = refine_table_split_sums(shape, key, entry[key], ms)
                    out.write_text(json.dumps(table, indent=1))
                continue
            if args.targeted:
                previous = entry.get(mode, [])
                entry[mode], triton_by_m = tune_targeted(
                    shape, mode, previous, ms, entry.get(f"{mode}/triton"), record
                )
                _triton_buckets(entry, mode, previous, triton_by_m, M_LIST)
                out.write_text(json.dumps(table, indent=1))
                continue
            if not args.bi_only:
                previous = entry.get(mode, []) if args.merge else []
                entry[mode], _, triton_by_m = tune_shape(
                    shape, mode, ms, previous or None, entry.get(f"{mode}/batch_invariant")
                )
                points = sorted(set(ms) | set(M_LIST)) if args.merge else ms
                _triton_buckets(entry, mode, previous, triton_by_m, points)
                out.write_text(json.dumps(table, indent=1))
            if args.no_bi:
                continue
            clear_table_cache()  # the BI tuning compares against the table being written
            key = f"{mode}/batch_invariant"
            if args.bi_only and not bi_default_m:  # retune these M, keep the K structure
                entry[key] = tune_batch_invariant(shape, mode, entry[key], ms)
            else:
                entry[key] = tune_batch_invariant(shape, mode, k_splits=args.bi_k_splits)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(table, indent=1))  # keep what is done if the run is cut short
        print(f"[tune] {shape.name} done at {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
