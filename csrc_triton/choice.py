"""The one place that decides what runs: a typed :class:`Problem` in, a typed launch out.

:func:`choose` is what the CUDA dispatch launches, the start-up line describes and the tuner times:
the GPU's tuned table where it has the shape and mode (``csrc_triton/tables.py``), else the
heuristic here; then what this GPU and these operands allow (a ``wgmma_ws`` launch that cannot run
becomes the fastest Triton one, a genuinely fp32 weight's tiles are capped). :func:`shrink` gives
the same sums in less on-chip memory when a GPU cannot hold a launch.

Invariant of every choice: the order of each logit's sum is fixed by the mode's K structure, so a
launch's tiles, pipelining or kernel may change with M and the GPU, its numbers per mode may not;
with batch invariance the K structure is one for every M. Measurements behind the thresholds:
``docs/kernels.md`` and ``benchmarks/NOTES.md``.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from csrc_triton import cdiv
from csrc_triton import tables as T
from csrc_triton.launches import (
    WGMMA_WS_BLOCK_M,
    CublasLaunch,
    Fp32WeightTermsLaunch,
    GemvLaunch,
    KernelLaunch,
    Launch,
    SplitKLaunch,
    TiledLaunch,
    VllmGateLaunch,
    WgmmaWsLaunch,
    describe,
    from_bucket,
)
from csrc_triton.problem import Precision, Problem

# Under "vllm." so that, inside vLLM, its handlers and format apply (no vLLM import here).
logger = logging.getLogger(f"vllm.{__name__}")

FP32 = Precision.FP32


#: Up to this many tokens vLLM's own gate kernel runs the ``bf16-fp32out`` mode where it can
#: (vLLM's ``GateLinear.LL_BF16_MAX_TOKENS``): faster than our GEMV at every M measured (1-16).
VLLM_GATE_TO_M = 16


def choose(p: Problem, allow_vllm_gate: bool = True) -> Launch:
    """What runs for ``p``. ``allow_vllm_gate=False``: never vLLM's own gate kernel (the fused
    router runs its routing inside our GEMV)."""
    if (
        allow_vllm_gate
        and p.m <= VLLM_GATE_TO_M
        and p.precision is Precision.BF16_FP32OUT  # asked first: no message built for the other modes
        and vllm_gate_problem(p) is None
    ):
        return VllmGateLaunch(p.m)
    if (
        p.weight_terms
        and p.fp32
        and not p.batch_invariant  # one kernel for every M there: no switch by M
        and p.x_dtype == torch.bfloat16
        and p.fp32_weight
        and p.m >= FP32_WEIGHT_TERMS_FROM_M
    ):
        terms = replace(p, n=3 * p.n, weight_dtype=torch.bfloat16, weight_terms=False)
        return Fp32WeightTermsLaunch(choose(terms))
    return resolve(selected(p), p)


def vllm_gate_problem(p: Problem) -> str | None:
    """Why vLLM's own gate kernel (:class:`VllmGateLaunch`) cannot run ``p`` (None: it can): it
    multiplies bf16 by bf16 into fp32 logits (the ``bf16-fp32out`` mode), its sum's order changes
    with M (never batch-invariant), it reads dense rows of K a multiple of 8, and it needs the GPUs
    vLLM runs it on and a vLLM in this process that has it. The cheap facts are asked first: this is
    asked on every call."""
    if p.precision is not Precision.BF16_FP32OUT or p.batch_invariant:
        return f"{p.precision.value}{', batch-invariant' if p.batch_invariant else ''} (needs bf16-fp32out)"
    if p.x_dtype != torch.bfloat16 or p.weight_dtype != torch.bfloat16:
        return f"operands {p.x_dtype} x {p.weight_dtype} (needs bfloat16 x bfloat16)"
    if not p.contiguous or p.k % 8:
        return f"K={p.k}, contiguous={p.contiguous} (needs dense rows, K a multiple of 8)"
    if p.interpreting:
        return "TRITON_INTERPRET=1"
    if (unmet := VllmGateLaunch.needs.unmet(p.device.capability)) is not None:
        return unmet
    if not p.device.has_vllm_gate:
        return "no vLLM with its cuteDSL ll_bf16 kernel in this process"
    return None


def selected(p: Problem, allow_wgmma_ws: bool = True) -> KernelLaunch:
    """The table's launch for ``p`` if it has the shape and mode, else the heuristic's, before
    :func:`resolve`. ``allow_wgmma_ws=False``: the table's fastest Triton launch where it chose
    ``wgmma_ws`` (its ``fp32/triton`` buckets)."""
    dev = p.device
    bucket = T.bucket_for(T.table_buckets(dev.name, p.k, p.n, table_key(p.precision, p.batch_invariant)), p.m)
    if not allow_wgmma_ws and bucket is not None and bucket["kernel"] == "wgmma_ws":
        bucket = T.bucket_for(
            T.table_buckets(dev.name, p.k, p.n, table_key(p.precision, False, "triton")), p.m
        )
    if bucket is not None and not (bucket["kernel"] == "cublas" and not p.cublas):
        return from_bucket(bucket, f"tuned {T.table_label(dev.name)}")
    return heuristic(p, allow_wgmma_ws)


def table_key(precision: Precision, batch_invariant: bool, variant: str = "") -> str:
    """A mode's key in a tuned table (the two 16-bit modes share their launches)."""
    key = ("fp32" if precision is FP32 else "bf16-fp32out") + ("/batch_invariant" if batch_invariant else "")
    return key + (f"/{variant}" if variant else "")


#: Reasons already logged for running a ``wgmma_ws`` launch on another kernel (once each).
_FALLBACKS_LOGGED: set[str] = set()


def resolve(launch: KernelLaunch, p: Problem) -> KernelLaunch:
    """The launch that runs for a chosen (or a tuner's, a test's) ``launch``: a ``wgmma_ws``
    launch that cannot run here becomes :func:`wgmma_ws_fallback`'s; a genuinely fp32 weight's
    tiles are capped (held in fp32 and as three bf16 terms), its multi-token GEMV programs run 8
    warps without a register cap; split-K's promotion defaults to one chain per split. Under batch
    invariance (never a GEMV) none of this depends on M, so batch invariance holds."""
    if isinstance(launch, WgmmaWsLaunch) and (problem := wgmma_ws_problem(p)) is not None:
        fallback = wgmma_ws_fallback(p)
        if problem not in _FALLBACKS_LOGGED:
            _FALLBACKS_LOGGED.add(problem)
            logger.info(
                "vllm-router-ext: %s cannot run (%s); running %s",
                describe(launch),
                problem,
                describe(fallback),
            )
        launch = fallback
    if isinstance(launch, SplitKLaunch):
        block_k, bm, bn, stages = launch.block_k, launch.block_m, launch.block_n, launch.num_stages
        if p.fp32_weight:
            block_k = min(block_k, fp32_weight_max_block_k(p.device.capability))
            if stages > 1:
                bm, bn, stages = min(bm, 64), min(bn, 64), 2
        promote = launch.promote_chunks or launch.k_per_split // block_k
        now = (bm, bn, block_k, stages, promote)
        if now == (launch.block_m, launch.block_n, launch.block_k, launch.num_stages, launch.promote_chunks):
            return launch
        return _with(
            launch, block_m=bm, block_n=bn, block_k=block_k, num_stages=stages, promote_chunks=promote
        )
    if isinstance(launch, GemvLaunch) and p.fp32_weight and p.m > 4 and launch.block_m > 1:
        # several tokens a program on fp32 weight rows: with 4 warps or maxnreg the loads in flight
        # overflow the registers at large K (H200, GLM-5 at 16 tokens: 107 -> 12.6 µs)
        if p.n < 64:
            return _with(launch, block_m=1, block_n=1, num_warps=8, maxnreg=255)
        if (launch.num_warps, launch.maxnreg) != (8, 0):
            return _with(launch, num_warps=8, maxnreg=0)
        return launch
    if isinstance(launch, TiledLaunch) and p.fp32_weight:
        return replace(
            launch,
            promote_chunks=4 if launch.promote_chunks else 0,  # chains of 128 in 32-wide chunks
            block_m=min(launch.block_m, 64),
            block_n=min(launch.block_n, 64),
            block_k=32,
            num_stages=2,
        )
    return launch


def wgmma_ws_problem(p: Problem) -> str | None:
    """Why the ``wgmma_ws`` kernel cannot run ``p`` (None: it can): it needs Hopper, Gluon, 16-bit
    operands of one dtype that TMA can read, fp32 logits, and a GPU (Gluon has no interpreter)."""
    if p.interpreting:
        return "TRITON_INTERPRET=1 (Gluon kernels have no interpreter)"
    if (unmet := WgmmaWsLaunch.needs.unmet(p.device.capability, p.device.has_gluon)) is not None:
        return unmet
    if p.x_dtype != p.weight_dtype or p.x_dtype not in (torch.bfloat16, torch.float16):
        return f"dtypes {p.x_dtype} x {p.weight_dtype} (needs bf16 x bf16 or fp16 x fp16)"
    if p.layout_problem is not None:
        return p.layout_problem
    if p.logits_dtype != torch.float32:
        return f"{p.logits_dtype} logits (needs float32)"
    return None


def wgmma_ws_fallback(p: Problem) -> KernelLaunch:
    """The Triton launch that runs where a ``wgmma_ws`` one cannot: the table's fastest Triton
    launch for this M (``fp32/triton``), else the heuristic's (also when a hand-edited
    ``fp32/triton`` names ``wgmma_ws`` again: never a loop)."""
    fp32 = replace(p, precision=FP32, batch_invariant=False)
    fallback = selected(fp32, allow_wgmma_ws=False)
    if isinstance(fallback, WgmmaWsLaunch):
        fallback = heuristic(fp32, allow_wgmma_ws=False)
    return resolve(fallback, fp32)


def shrink(launch: KernelLaunch, p: Problem) -> KernelLaunch | None:
    """The same sums in a smaller on-chip footprint, or None: one software-pipeline stage fewer,
    else a ``wgmma_ws`` tile's tail dropped, else the larger of BLOCK_M / BLOCK_N halved (to 16);
    a ``wgmma_ws`` launch that cannot shrink further becomes the Triton fallback. BLOCK_K, the K
    split, the promotion and the split sum's order stay."""
    shrunk = ", shrunk to fit this GPU"
    source = launch.source if launch.source.endswith(shrunk) else launch.source + shrunk
    stages = getattr(launch, "num_stages", 1)
    if stages > 1:
        return replace(launch, num_stages=stages - 1, source=source)
    if isinstance(launch, WgmmaWsLaunch):
        if launch.block_n_tail:
            return replace(launch, block_n_tail=0, source=source)
        return wgmma_ws_fallback(p)
    if (
        isinstance(launch, (GemvLaunch, SplitKLaunch, TiledLaunch))
        and max(launch.block_m, launch.block_n) > 16
    ):
        if launch.block_m >= launch.block_n:
            return replace(launch, block_m=launch.block_m // 2, source=source)
        return replace(launch, block_n=launch.block_n // 2, source=source)
    return None


# --- the heuristic: shapes and GPUs without a tuned table (the H200 table's winners, generalised)

#: The fp32 mode's promotion: every 2 chunks of BLOCK_K (<= 128) the MMA chain is added into the
#: fp32 accumulator, so no tensor-core chain is longer than 256 along K (docs/precision.md). Never
#: one chunk per chain: Triton folds ``acc + dot(a, b, 0)`` into ``dot(a, b, acc)``.
FP32_PROMOTE_CHUNKS = 2
FP32_MAX_BLOCK_K = 128

#: Batch invariance: above this M a tile's splits run in one program (same sums), except on
#: Hopper+ while the partials (M x N x splits) stay below BI_SPLIT_PARTIALS_MAX and M within
#: BI_SPLIT_TILES_TO, where pipelined split tiles measured faster.
BI_SPLITS_IN_PROGRAM_FROM = 256
BI_SPLIT_TILES_TO = 2048
BI_SPLIT_PARTIALS_MAX = 6 << 20

#: The ``wgmma_ws`` kernel (Hopper) serves the fp32 mode from this M: 128-row tiles, 64-wide
#: chunks in chains of 4, as many TMA stages as fit, K split so the tiles fill the SMs once.
WGMMA_WS_FROM_M = 1024
WGMMA_WS_MAX_SPLITS = 8
#: From this M, N a multiple of 192 above 256 (Kimi-K2's 384) takes 192-wide tiles (128 + 64).
WGMMA_WS_192_FROM_M = 2048
#: Shared memory one program may use on Hopper (227 KB), less what the kernel keeps beside its ring.
WGMMA_WS_SMEM_BYTES = 227 * 1024 - 1024
WGMMA_WS_MAX_STAGES = 6

#: Not batch-invariant: the GEMV from 5 tokens up to GEMV_TO_M while a call has at most
#: GEMV_MAX_LOGITS logits (16 tokens to 128 experts, 8 to 256; H200: beyond it split-K won).
GEMV_TO_M = 16
GEMV_MAX_LOGITS = 2048

#: Hopper, not batch-invariant, from 65 tokens to MID_M_SPLIT_TO: pipelined 64 x 64 split tiles,
#: K split as finely as keeps the programs within MID_M_PROGRAMS_PER_SM per SM.
MID_M_SPLIT_TO = {"fp32": WGMMA_WS_FROM_M - 1, "16-bit": 512}
MID_M_PROGRAMS_PER_SM = {"fp32": 1, "16-bit": 2}

#: An fp32 gate weight's GEMM runs on its three bf16 terms (one fp32-mode GEMM on [3N, K]) from
#: this M, whatever N (3N rows: 24 for Mixtral's 8 experts); below, the kernels split fp32 weight
#: tiles in every program.
FP32_WEIGHT_TERMS_FROM_M = 1024


def fp32_promote_chunks(block_k: int) -> int:
    """Chunks per promoted MMA chain in the fp32 mode (chains of 2 * BLOCK_K <= 256 along K)."""
    if block_k > FP32_MAX_BLOCK_K:
        raise ValueError(f"fp32 mode: block_k={block_k} makes chains longer than {2 * FP32_MAX_BLOCK_K}")
    return FP32_PROMOTE_CHUNKS


def fp32_weight_max_block_k(capability: int) -> int:
    """BLOCK_K for a genuinely fp32 gate weight (each chunk held in fp32 and as three bf16 terms):
    32 where wider chunks spill registers (before sm_90, and sm_100); no cap on Hopper."""
    return 128 if 90 <= capability < 100 else 32


def splitk(
    block_m: int,
    block_n: int,
    block_k: int,
    k_per_split: int,
    fp32: bool,
    num_warps: int = 4,
    num_stages: int = 1,
    splits_in_program: bool = False,
) -> SplitKLaunch:
    """A split-K launch; the fp32 mode takes BLOCK_K <= 128 and promoted chains of two chunks."""
    if fp32:
        block_k = min(block_k, FP32_MAX_BLOCK_K)
    return SplitKLaunch(
        block_m,
        block_n,
        block_k,
        k_per_split,
        promote_chunks=fp32_promote_chunks(block_k) if fp32 else 0,
        num_warps=num_warps,
        num_stages=num_stages,
        splits_in_program=splits_in_program,
    )


def one_chain_split(launch: SplitKLaunch) -> bool:
    """Every split is one MMA chain (no promotion, or a split one promoted chain long)."""
    return launch.promote_chunks == 0 or launch.k_per_split == launch.block_k * launch.promote_chunks


def wgmma_ws(
    block_n: int,
    k_per_split: int,
    block_k: int = 64,
    num_stages: int = 0,
    block_n_tail: int = 0,
    block_m: int = WGMMA_WS_BLOCK_M,
) -> WgmmaWsLaunch:
    """A ``wgmma_ws`` launch: chains of 256 along K, as many TMA stages as fit (``num_stages`` 0)."""
    return WgmmaWsLaunch(
        block_n,
        block_k,
        k_per_split,
        promote_chunks=2 * FP32_MAX_BLOCK_K // block_k,
        num_stages=num_stages or wgmma_ws_stages(block_n, block_k, block_n_tail, block_m),
        block_n_tail=block_n_tail,
        block_m=block_m,
    )


def wgmma_ws_stages(
    block_n: int, block_k: int = 64, block_n_tail: int = 0, block_m: int = WGMMA_WS_BLOCK_M
) -> int:
    """TMA ring depth: as many stages (<= 6) of [block_m + block_n + tail, block_k] 16-bit blocks as
    fit; a 64-row tile's program takes half the shared memory (two resident on an SM)."""
    stage_bytes = (block_m + block_n + block_n_tail) * block_k * 2
    programs = WGMMA_WS_BLOCK_M // block_m
    return min(WGMMA_WS_MAX_STAGES, WGMMA_WS_SMEM_BYTES // programs // stage_bytes)


def wgmma_ws_tail(n: int, block_n: int = 128) -> int:
    """The tail (0, 16 or 32 columns) whose tiles of block_n + tail pad N least (ties: the
    narrower) where plain tiles would pad more than a quarter of N; else 0 (DeepSeek-V2's 160
    experts: one 128 + 32 tile)."""
    padding = lambda t: -(-n // (block_n + t)) * (block_n + t) - n  # noqa: E731
    if n <= block_n or 4 * padding(0) <= n:
        return 0
    return min((0, 16, 32), key=lambda t: (padding(t), t))


def wgmma_ws_tiles(
    m: int, n: int, block_n: int, block_n_tail: int = 0, block_m: int = WGMMA_WS_BLOCK_M
) -> int:
    """Output tiles (programs per K split) of a ``wgmma_ws`` launch."""
    return cdiv(m, block_m) * cdiv(n, block_n + block_n_tail)


def wgmma_ws_k_per_split(k: int, splits: int) -> int:
    """K per split for ``splits`` parts of K, rounded up to a multiple of 256 (whole chains)."""
    return (cdiv(k, splits) + 255) // 256 * 256


def wgmma_ws_split(m: int, k: int, n: int, block_n: int, sm_count: int, block_n_tail: int = 0) -> int:
    """K per split so the tiles fill the SMs once (<= 8 splits, multiples of 256); 0 = no split."""
    tiles = wgmma_ws_tiles(m, n, block_n, block_n_tail)
    splits = max(1, min(WGMMA_WS_MAX_SPLITS, sm_count // tiles, k // 512))
    return 0 if splits == 1 else wgmma_ws_k_per_split(k, splits)


def split_sum_variants(launch: KernelLaunch, k: int) -> list[KernelLaunch]:
    """``launch`` with each way of launching its cross-program K-split sum (the same partials in
    the same order): split-K's ticket, or a second launch with PDL; ``wgmma_ws``'s sum plain or
    with PDL let go early or late. Empty without such a sum. The tuner times each per M."""
    if isinstance(launch, SplitKLaunch):
        if not _sums_across_programs(launch, k):
            return []
        return [_with(launch, ticket=True, pdl=False), _with(launch, ticket=False, pdl=True)]
    if isinstance(launch, WgmmaWsLaunch) and 0 < launch.k_per_split < k:
        return [replace(launch, pdl=pdl) for pdl in (0, 1, 2)]
    return []


def heuristic(p: Problem, allow_wgmma_ws: bool = True) -> KernelLaunch:
    """The launch for a shape or GPU the table lacks (docs/kernels.md, "The heuristic"). On
    Hopper a split-K sum across programs is a second launch with PDL (``split_sum_variants``)."""
    launch = _heuristic_kernel(p, allow_wgmma_ws)
    if p.hopper and isinstance(launch, SplitKLaunch) and _sums_across_programs(launch, p.k):
        return _with(launch, ticket=False, pdl=True)  # split_sum_variants' last form
    return launch


def _sums_across_programs(launch: SplitKLaunch, k: int) -> bool:
    """A split-K launch whose splits are programs of their own, summed after them."""
    return not launch.splits_in_program and launch.k_per_split < k


def _with(obj, **changes):
    """``dataclasses.replace`` without its per-call field walk: this runs on every eager op call."""
    return type(obj)(**{**vars(obj), **changes})


def _heuristic_kernel(p: Problem, allow_wgmma_ws: bool) -> KernelLaunch:
    m, k, n, fp32, bi, cap = p.m, p.k, p.n, p.fp32, p.batch_invariant, p.device.capability
    sms = p.device.sm_count
    if (
        fp32
        and not bi
        and m >= WGMMA_WS_FROM_M
        and allow_wgmma_ws
        and WgmmaWsLaunch.needs.unmet(cap, p.device.has_gluon) is None  # asked last: on every call
    ):
        block_n = 128 if n > 64 else 64
        tail = wgmma_ws_tail(n, block_n)
        if tail == 0 and n > 256 and n % 192 == 0 and m >= WGMMA_WS_192_FROM_M:
            tail = 64  # 192-wide tiles, the tail split between the two consumers
        return wgmma_ws(block_n, wgmma_ws_split(m, k, n, block_n, sms, tail), block_n_tail=tail)
    if not bi and (m <= 4 or (m <= GEMV_TO_M and m * n <= GEMV_MAX_LOGITS)):
        return _gemv(m, n, p.fp32_weight)
    if not bi and p.hopper and (mid := _mid_m_split(p)) is not None:
        return mid
    if p.cublas and not bi and m > 64:
        return CublasLaunch()
    if bi or m <= 64:
        return _small_or_invariant(p)
    if m <= 512:
        return splitk(64, 64, 64, 1024, fp32, 4, num_stages=3)
    if m <= 2048:
        return splitk(64, 64, 64, 2048, fp32, 4, num_stages=3)
    wide = 64 if fp32 and cap < 90 else 128  # below sm_90 the promoted 128 x 128 tile spills
    if m <= 8192:
        return splitk(128, wide, 64, 3584, fp32, 8, num_stages=3)
    return TiledLaunch(
        128, wide if n >= 128 else 64, 64, promote_chunks=fp32_promote_chunks(64) if fp32 else 0
    )


def _gemv(m: int, n: int, fp32_weight: bool) -> GemvLaunch:
    """The H200 table's GEMV picks on 17 gate shapes, generalised: one expert a program below 64
    experts (their programs are few already; every chunk's loads issued at once: ``maxnreg``),
    more tokens a program as M grows, two experts a program from 5 tokens (and at 3, where two
    tokens a program leave a half-empty one). 8 warps throughout: with 4, sm_89 spills at K=6144; an
    fp32 weight keeps one expert a program (two spill on sm_100)."""
    if n < 64:
        return GemvLaunch(1, 1, num_warps=8, maxnreg=255)
    if fp32_weight:
        return GemvLaunch(min(2, 1 << (m - 1).bit_length()), 1, num_warps=8)
    if m == 3:
        return GemvLaunch(1, 2, num_warps=8, maxnreg=255)
    if m <= 4:  # maxnreg: without it Triton 3.8's schedule holds loads back at large K (as the table's)
        return GemvLaunch(min(2, 1 << (m - 1).bit_length()), 1, num_warps=8, maxnreg=255)
    return GemvLaunch(1 if m <= 8 else 2 if n <= 128 else 4, 2, num_warps=8)


def _small_or_invariant(p: Problem) -> SplitKLaunch:
    """Up to 64 tokens, and batch invariance at every M: one K structure (K split so that N /
    BLOCK_N x splits >= 2 x SMs, in multiples of 256); with batch invariance only tiles, pipelining
    and where the splits are added vary with M."""
    m, k, n, fp32, bi, cap = p.m, p.k, p.n, p.fp32, p.batch_invariant, p.device.capability
    block_m = 64 if bi else 16
    block_n = 32 if n >= 128 else 16
    n_blocks = cdiv(n, block_n)
    splits = max(1, min(k // 256, cdiv(2 * p.device.sm_count, n_blocks)))
    k_per_split = max(256, k // splits // 256 * 256)
    split_k = cdiv(k, k_per_split)
    wide_programs = cdiv(m, 64) * cdiv(n, 64) * split_k  # 64 x 64 split tiles
    mid_m = BI_SPLITS_IN_PROGRAM_FROM < m <= BI_SPLIT_TILES_TO
    few_partials = mid_m and m * n * split_k < BI_SPLIT_PARTIALS_MAX
    enough_programs = 64 < m <= BI_SPLITS_IN_PROGRAM_FROM and 2 * wide_programs >= 3 * p.device.sm_count
    if bi and cap >= 90 and not p.fp32_weight and (few_partials or enough_programs):
        # Hopper+: pipelined 64 x 64 split tiles, their partials added by a second launch.
        return splitk(block_m, 64, 128, k_per_split, fp32, 4, num_stages=3)
    if bi and m > BI_SPLITS_IN_PROGRAM_FROM:
        # Tiles grow with M on Hopper+ (>= 227 KB of shared memory; older GPUs overflow theirs);
        # an fp32 weight keeps 64 x 32 below 128 x 128 (its 64 x 64 tile spills on sm_90).
        warps = 4
        if cap >= 90 and m > 1024:
            if m > 4096 and n > 64:
                block_m, block_n, warps = 128, 128, 8
            elif not p.fp32_weight:
                block_n = 64
        return splitk(block_m, block_n, 128, k_per_split, fp32, warps, num_stages=3, splits_in_program=True)
    return splitk(block_m, block_n, 128, k_per_split, fp32)


def _mid_m_split(p: Problem) -> SplitKLaunch | None:
    """Hopper's pipelined split tiles from 65 tokens: the finest K split whose programs stay
    within MID_M_PROGRAMS_PER_SM per SM; a split that is one MMA chain loops over its chunks
    (``flat_chain``). None: no split fits or M is outside the range."""
    m, k, n, fp32 = p.m, p.k, p.n, p.fp32
    kind = "fp32" if fp32 else "16-bit"
    if not 64 < m <= MID_M_SPLIT_TO[kind]:
        return None
    limit = MID_M_PROGRAMS_PER_SM[kind] * p.device.sm_count
    tiles = cdiv(m, 64) * cdiv(n, 64)
    for k_per_split in ((256,) if k < 4096 else ()) + ((512, 1024) if fp32 else (512,)):
        if tiles * cdiv(k, k_per_split) <= limit:
            if p.fp32_weight:
                launch = _fp32_weight_split_tiles(p, k_per_split)
            else:
                launch = splitk(64, 64, 128, k_per_split, fp32, 4, num_stages=3)
            return _with(launch, flat_chain=True) if one_chain_split(launch) else launch
    return None


def _fp32_weight_split_tiles(p: Problem, k_per_split: int) -> SplitKLaunch:
    """An fp32 weight's split tiles (each chunk held in fp32 and as three bf16 terms): 64 x 64 x 128
    spills on sm_90, so 64 x 32 x 128 while those programs fit one wave, else 64 x 64 x 64."""
    programs = cdiv(p.m, 64) * cdiv(p.n, 32) * cdiv(p.k, k_per_split)
    if programs <= p.device.sm_count:
        return splitk(64, 32, 128, k_per_split, True, 4, num_stages=2)
    return splitk(64, 64, 64, k_per_split, True, 4, num_stages=2)


# --- what the start-up line and the self-check read

#: Batch-invariant launches are looked up for every M to here (the heuristic's largest threshold
#: is 8192), or past the table's largest bucket end if that is higher.
BUCKET_SCAN_TO = 16385


def batch_invariant_buckets(p: Problem) -> list[tuple[int, KernelLaunch]]:
    """``[(first M, launch)]`` of every batch-invariant bucket for ``p``'s gate on its GPU: every M
    is looked up, because a tuned bucket may end at any M; above the scan nothing changes."""
    p = replace(p, batch_invariant=True, weight_terms=False)
    key = table_key(p.precision, True)
    ends = [b["max_m"] for b in T.table_buckets(p.device.name, p.k, p.n, key) if b["max_m"]]
    buckets: list[tuple[int, KernelLaunch]] = []
    for m in range(1, max([BUCKET_SCAN_TO, *(e + 1 for e in ends)]) + 1):
        launch = choose(_with(p, m=m))
        if not buckets or buckets[-1][1] != launch:
            buckets.append((m, launch))
    return buckets
