"""Split-K router GEMM: decode sizes, the fp32 mode at mid M, and batch-invariant routing.

Invariant: every output element is reduced over K in one order fixed by (K_PER_SPLIT, BLOCK_K,
PROMOTE_CHUNKS) alone: split s covers K[s*K_PER_SPLIT, (s+1)*K_PER_SPLIT) in BLOCK_K chunks, each
split's fp32 partial is written to a workspace, and the partials are added in split order
0, 1, ..., S-1 (with FIXED_POINT: summed exactly as integers, so in no order at all). Rows never
interact, so with one K split for every M the result of a row does not
depend on the batch it is in (the batch-invariant path relies on exactly that).

Why split-K: at decode sizes the GEMM is bound by reading the [N, K] weight once. Splitting N *and*
K gives enough programs to fill every SM, and each program loads its whole weight slice in
unrolled chunks, so many bytes are in flight per SM. With large tiles (num_stages > 1) the K loop
of a split is software-pipelined instead; it issues the same MMAs and additions in the same order,
so both forms give bitwise the same result for the same K structure.

Why one launch: on the H200 each dependent kernel in a CUDA graph costs ~2.5 µs of launch and
drain, more than reading the weight (~0.9 µs). So by default (TICKET) the program that finishes a
tile last does the reduction: each program stores its partial, then takes an integer ticket for
its tile; the one that draws S-1 adds all S partials in split order and resets the ticket to 0
for the next call. The ticket is the only atomic; the floating-point order never depends on which
program came last. ``ticket=False`` keeps the two-launch form (partials, then a reduce kernel);
with ``pdl`` on Hopper+ the reduce kernel is a programmatic dependent launch (``csrc_triton/pdl.py``):
launched while the partials are computed, it hides that launch, and the H200 table takes it over
the ticket on most buckets from 32 tokens (``split_sum_variants`` in ``csrc_triton/configs.py``).

Fixed-point split sum (``fixed_point``: a batch-invariant K structure a tuned table may select;
the H200 table does not): instead of adding the S fp32 partials in split order, each partial is
truncated to a multiple of 2^-32 and the integers are added exactly, then rounded to fp32 once.
Integer addition does not depend on order, so the S split programs can add their partials straight
into one 64-bit word per logit with a relaxed atomic add (one memory round trip, no fence, no
second read), and the add that completes the count writes the logit: on the H200 at M=1 that costs
0.3-0.7 µs where the ticket costs 1.4-3 µs, but the per-split 64-bit conversions make large M
slower (docs/benchmarks.md). One program that runs all splits (``splits_in_program``) adds the
same integers in registers, and ``fixed_ticket`` stores them as int64 partials for the ticket:
bitwise the same logits. The word holds a 5-bit arrival count (bits 59-63, so S <= 31) and the
biased sum of the partials; a partial outside +-2^16 (or inf / NaN) adds a poison value instead,
and its logit comes out NaN.
Truncation costs < 2^-32 per split: <= 28 * 2.3e-10 absolute on DeepSeek-V3's 28 splits of 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from csrc_triton import cdiv
from csrc_triton.dot import load_chunk, mma, promoted_group
from csrc_triton.environment import interpreting
from csrc_triton.pdl import launch_dependents, launch_options, pdl_enabled, wait_for_primary

#: Fixed-point split sum: a 64-bit word per logit = (arrival count << 59) + sum of biased partials.
FIXED_MAX_SPLITS = 31  # the count's 5 bits
_FIX_ONE = tl.constexpr(1 << 59)  # one arrival
_FIX_VALUE_MASK = tl.constexpr((1 << 59) - 1)
_FIX_BIAS = tl.constexpr(1 << 48)  # |partial| * 2^32 < 2^48, so partial + bias lies in [0, 2^49)
_FIX_POISON = tl.constexpr(1 << 54)  # > 31 * 2^49; 31 poisons + valid parts stay < 2^59
_FIX_SCALE = tl.constexpr(4294967296.0)  # 2^32
_FIX_UNSCALE = tl.constexpr(2.3283064365386963e-10)  # 2^-32, exact


@triton.jit
def fixed_increment(partial):
    """One split's fp32 partial as its addend to the fixed-point word: one arrival plus the
    partial truncated to a multiple of 2^-32 and biased to be non-negative (or the poison)."""
    v = partial * _FIX_SCALE  # exact: a power-of-two scale (inf if huge: then poisoned)
    ok = tl.abs(v) < _FIX_BIAS  # False for NaN and inf too
    q = tl.where(ok, v, 0.0).to(tl.int64)  # truncation toward zero: exact below 2^48
    return tl.where(ok, q + _FIX_BIAS, _FIX_POISON) + _FIX_ONE


@triton.jit
def fixed_to_float(word, SPLIT_K: tl.constexpr):
    """The logit from a word that holds all SPLIT_K increments: one rounding to fp32, or NaN."""
    value = word & _FIX_VALUE_MASK
    exact = (value - SPLIT_K * _FIX_BIAS).to(tl.float32) * _FIX_UNSCALE  # cvt.rn, then exact scale
    return tl.where(value < _FIX_POISON, exact, float("nan"))


@triton.jit
def finish_split_fixed(acc, fix_ptr, out_ptr, offs_m, offs_n, mask, N, stride_om, SPLIT_K: tl.constexpr):
    """Add split ``acc`` into the per-logit fixed-point words (relaxed: the word is the data);
    the add that completes the count writes the logit and zeroes the word for the next call."""
    word = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    inc = fixed_increment(acc)
    old = tl.atomic_add(fix_ptr + word, inc, mask=mask, sem="relaxed", scope="gpu")
    last = mask & (((old >> 59) & 31) == SPLIT_K - 1)
    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, fixed_to_float(old + inc, SPLIT_K).to(out_ptr.dtype.element_ty), mask=last)
    tl.store(fix_ptr + word, tl.zeros_like(old), mask=last)


@triton.jit
def finish_split(
    acc,
    part_ptr,
    out_ptr,
    ticket_ptr,
    ticket_idx,
    pid_s,
    offs_m,
    offs_n,
    mask,
    stride_ps,
    stride_pm,
    stride_om,
    SPLIT_K: tl.constexpr,
    TICKET: tl.constexpr,
    FIXED_POINT: tl.constexpr,
):
    """Store split ``pid_s``'s fp32 tile ``acc`` (FIXED_POINT: its fixed-point increment); with
    TICKET the last split of the tile to finish adds all partials in split order 0..S-1 (or their
    integers, exactly) and writes ``out`` (shared by the split-K kernels)."""
    tile = offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if SPLIT_K == 1 and not FIXED_POINT:
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        if FIXED_POINT:
            tl.store(part_ptr + pid_s * stride_ps + tile, fixed_increment(acc), mask=mask)
        else:
            tl.store(part_ptr + pid_s * stride_ps + tile, acc, mask=mask)
        if TICKET:
            tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
            ticket = tl.atomic_add(ticket_ptr + ticket_idx, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                if FIXED_POINT:
                    words = tl.zeros(acc.shape, dtype=tl.int64)
                    for s in tl.static_range(SPLIT_K):
                        words += tl.load(
                            part_ptr + s * stride_ps + tile, mask=mask, other=0, cache_modifier=".cg"
                        )
                    total = fixed_to_float(words, SPLIT_K)
                else:
                    total = tl.zeros(acc.shape, dtype=tl.float32)
                    for s in tl.static_range(SPLIT_K):  # fixed order: split 0, 1, ..., S-1
                        # .cg: read from L2, never from a stale L1 line of an earlier call
                        total += tl.load(
                            part_ptr + s * stride_ps + tile, mask=mask, other=0.0, cache_modifier=".cg"
                        )
                tl.store(o, total.to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(ticket_ptr + ticket_idx, 0, sem="relaxed", scope="gpu")


@triton.jit
def _all_splits_in_program(
    x_rows,
    w_cols,
    out_ptr,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    K,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PROMOTE_CHUNKS: tl.constexpr,
    DOT_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
    FIXED_POINT: tl.constexpr,
):
    """One program runs every split of its tile, in split order, and keeps the partials in
    registers: the same MMA chains, the same promotions (``acc + part``) and the same additions
    ``total + partial_s`` as the split programs plus :func:`finish_split` (or the same integer
    sum as :func:`finish_split_fixed`), so bitwise the same logits, without S partials per logit
    going through L2 (what large M pays for).
    One flat, software-pipelined loop over all chunks; the chains restart at the boundaries."""
    CHUNKS: tl.constexpr = K_PER_SPLIT // BLOCK_K
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = tl.zeros_like(total)
    part = tl.zeros_like(total)
    words = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int64)
    for c in range(SPLIT_K * CHUNKS):
        # Split s = c // CHUNKS covers [s * K_PER_SPLIT, ...): chunk c starts at c * BLOCK_K.
        a, b = load_chunk(x_rows, w_cols, mask_m, mask_n, c * BLOCK_K, K, BLOCK_K)
        part = mma(a, b, part, DOT_MODE, UPCAST)
        if PROMOTE_CHUNKS == CHUNKS:
            # One chain per split: the split's partial is 0 + part; neither it nor ``total``
            # (which starts at +0) can be -0, so adding ``part`` directly is bitwise the same
            # and saves a third accumulator tile.
            if (c + 1) % CHUNKS == 0:
                if FIXED_POINT:
                    words += fixed_increment(part)
                else:
                    total += part
                part = tl.zeros_like(total)
        else:
            if (c + 1) % PROMOTE_CHUNKS == 0:
                acc = acc + part
                part = tl.zeros_like(total)
            if (c + 1) % CHUNKS == 0:
                if FIXED_POINT:
                    words += fixed_increment(acc)
                else:
                    total += acc
                acc = tl.zeros_like(total)
    if FIXED_POINT:
        total = fixed_to_float(words, SPLIT_K)
    o = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o, total.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _splitk_partials_kernel(
    x_ptr,
    w_ptr,
    part_ptr,
    out_ptr,
    ticket_ptr,
    fix_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ps,
    stride_pm,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    SPLIT_K: tl.constexpr,
    PROMOTE_CHUNKS: tl.constexpr,
    DOT_MODE: tl.constexpr,
    UPCAST: tl.constexpr,
    TICKET: tl.constexpr,
    UNROLL: tl.constexpr,
    SPLITS_IN_PROGRAM: tl.constexpr,
    FIXED_POINT: tl.constexpr,
    PDL: tl.constexpr,
    FLAT_CHAIN: tl.constexpr,
):
    launch_dependents(PDL)  # the two-launch form's split sum may launch now (it waits for us)
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

    if SPLITS_IN_PROGRAM:
        _all_splits_in_program(
            x_rows, w_cols, out_ptr, offs_m, offs_n, mask_m, mask_n, K, stride_om,
            BLOCK_M, BLOCK_N, BLOCK_K, K_PER_SPLIT, SPLIT_K, PROMOTE_CHUNKS, DOT_MODE, UPCAST, FIXED_POINT,
        )  # fmt: skip
    else:
        # Promotion: each group of PROMOTE_CHUNKS chunks is one short MMA chain added into the fp32
        # register accumulator. Unrolled (num_stages=1, small M: every load in flight at once) or a
        # software-pipelined loop (large tiles): the same operations in the same order either way.
        n_groups: tl.constexpr = K_PER_SPLIT // (BLOCK_K * PROMOTE_CHUNKS)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if UNROLL:
            for c in tl.static_range(n_groups):
                k0 = k_begin + c * BLOCK_K * PROMOTE_CHUNKS
                acc = promoted_group(
                    x_rows, w_cols, mask_m, mask_n, k0, K, acc, BLOCK_K, PROMOTE_CHUNKS, DOT_MODE, UPCAST
                )
        elif FLAT_CHAIN and n_groups == 1:
            # One chain per split (bf16-fp32out, or an fp32 split one promoted chain long): a
            # flat loop over its chunks, which the compiler pipelines (one group of unrolled
            # chunks leaves nothing to pipeline). The same MMAs
            # into one accumulator as the unrolled group; acc starts at +0, so 0 + chain is
            # bitwise the chain (it cannot be -0). A config's choice: on the H200 it made long
            # splits (4-8 chunks, 128-512 tokens) beat cuBLAS, and short batch-invariant split
            # tiles (2-4 chunks) slower (benchmarks/NOTES.md).
            for c in range(K_PER_SPLIT // BLOCK_K):
                a, b = load_chunk(x_rows, w_cols, mask_m, mask_n, k_begin + c * BLOCK_K, K, BLOCK_K)
                acc = mma(a, b, acc, DOT_MODE, UPCAST)
        else:
            for c in range(n_groups):
                k0 = k_begin + c * BLOCK_K * PROMOTE_CHUNKS
                acc = promoted_group(
                    x_rows, w_cols, mask_m, mask_n, k0, K, acc, BLOCK_K, PROMOTE_CHUNKS, DOT_MODE, UPCAST
                )

        if FIXED_POINT and not TICKET:
            mask = mask_m[:, None] & mask_n[None, :]
            finish_split_fixed(acc, fix_ptr, out_ptr, offs_m, offs_n, mask, N, stride_om, SPLIT_K)
        else:
            finish_split(
                acc,
                part_ptr,
                out_ptr,
                ticket_ptr,
                pid_m * tl.num_programs(0) + pid_n,
                pid_s,
                offs_m,
                offs_n,
                mask_m[:, None] & mask_n[None, :],
                stride_ps,
                stride_pm,
                stride_om,
                SPLIT_K,
                TICKET,
                FIXED_POINT,
            )


@triton.jit
def _splitk_reduce_kernel(
    part_ptr,
    out_ptr,
    M,
    N,
    stride_ps,
    stride_om,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
    PDL: tl.constexpr,
):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    wait_for_primary(PDL)  # launched early (PDL): the partials are complete only past this
    mask = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: split 0, 1, ..., S-1
        acc += tl.load(part_ptr + s * stride_ps + offs, mask=mask, other=0.0)
    if CONTIGUOUS:  # out rows back to back (stride N): the partials' flat offsets, 16-byte stores
        dst = out_ptr + offs
    else:
        dst = out_ptr + (offs // N).to(tl.int64) * stride_om + offs % N
    tl.store(dst, acc.to(out_ptr.dtype.element_ty), mask=mask)


#: Logits per program of the split sum, and its warps. With 6 or more partials, programs of 512
#: (twice as many programs: more loads in flight) measured faster on the H200
#: (14 partials of Kimi-K2 at 256 tokens 7.9 -> 5.2 µs alone,
#: the fp32 op 11.3 -> 10.4 µs); with fewer, 512 and 1024 timed the same.
_REDUCE_BLOCK = 1024
_REDUCE_BLOCK_MANY = 512
_REDUCE_MANY_FROM = 6
_REDUCE_WARPS = 4
_TICKETS: dict[tuple[int, int], torch.Tensor] = {}
_FIXED_WORDS: dict[tuple[int, int], torch.Tensor] = {}


def _zeroed_per_stream(cache: dict, device: torch.device, numel: int, dtype: torch.dtype, least: int):
    """A zeroed buffer per (device, stream): calls that may run concurrently on different streams
    never share it, and every call leaves it at zero. Sized generously up front, so CUDA-graph
    captures rarely allocate."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device.index or 0, stream)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, least), dtype=dtype, device=device)
        cache[key] = buf
    return buf


def _tickets(device: torch.device, tiles: int) -> torch.Tensor:
    """int32 tickets, one per output tile."""
    return _zeroed_per_stream(_TICKETS, device, tiles, torch.int32, 1 << 16)


def _fixed_words(device: torch.device, numel: int) -> torch.Tensor:
    """int64 fixed-point words, one per logit."""
    return _zeroed_per_stream(_FIXED_WORDS, device, numel, torch.int64, 1 << 17)


def split_workspace(
    out: torch.Tensor, split_k: int, tiles: int, ticket: bool
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(fp32 partials [S, M, N] -- or ``out`` itself for one split --, tickets, use_ticket) for a
    launch whose ``tiles`` output tiles are each reduced over ``split_k`` splits."""
    part = out
    if split_k > 1:
        part = torch.empty((split_k, *out.shape), dtype=torch.float32, device=out.device)
    use_ticket = ticket and split_k > 1
    return part, (_tickets(out.device, tiles) if use_ticket else part), use_ticket


def splitk_launch(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    *,
    block_m: int,
    block_n: int,
    block_k: int,
    k_per_split: int,
    promote_chunks: int,
    dot_mode: int,
    ticket: bool = True,
    num_warps: int = 4,
    num_stages: int = 1,
    splits_in_program: bool = False,
    fixed_point: bool = False,
    fixed_ticket: bool = False,
    pdl: bool = False,
    flat_chain: bool = False,
) -> torch.Tensor:
    """Write ``x @ w.T`` into ``out`` [M, N] (any float dtype). x, w: unit stride along K.
    ``ticket=False``: two launches (partials, then :func:`reduce_partials`); with ``pdl`` the
    second one is a programmatic dependent launch where the GPU has it (``csrc_triton/pdl.py``).
    ``splits_in_program``: one program per tile runs all its splits (large M); same result.
    ``fixed_point``: the splits are summed exactly in fixed point (batch-invariant path), with
    one atomic per logit, or (``fixed_ticket``, mid M: fewer atomics) as integer partials that
    the last program of a tile adds; all three forms give bitwise the same logits.
    ``flat_chain``: a pipelined split that is one MMA chain (no promotion inside it) loops over
    its chunks instead of unrolling them; same result."""
    M, K = x.shape
    N = w.shape[0]
    if M == 0:
        return out
    assert k_per_split % (block_k * promote_chunks) == 0, "K_PER_SPLIT must hold whole promotions"
    split_k = cdiv(K, k_per_split)
    if fixed_point and split_k > FIXED_MAX_SPLITS:
        raise ValueError(
            f"fixed-point split sum: K={K} with k_per_split={k_per_split} gives {split_k} splits; "
            f"at most {FIXED_MAX_SPLITS} allowed (raise k_per_split)"
        )
    grid = (cdiv(N, block_n), 1 if splits_in_program else split_k, cdiv(M, block_m))
    words = out
    if splits_in_program:
        part, tickets, use_ticket = out, out, False
    elif fixed_point and not fixed_ticket:
        part, tickets, use_ticket = out, out, False
        words = _fixed_words(out.device, M * N)
    elif fixed_point:  # int64 partials and a ticket, even for one split (its word is converted)
        part = torch.empty((split_k, M, N), dtype=torch.int64, device=out.device)
        tickets, use_ticket = _tickets(out.device, grid[0] * grid[2]), True
    else:
        part, tickets, use_ticket = split_workspace(out, split_k, grid[0] * grid[2], ticket)
    two_launch = not use_ticket and part is not out
    pdl = pdl and two_launch and pdl_enabled(out.device)
    _splitk_partials_kernel[grid](
        x,
        w,
        part,
        out,
        tickets,
        words,
        M,
        N,
        K,
        x.stride(0),
        w.stride(0),
        part.stride(0) if part is not out else 0,
        part.stride(-2),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        K_PER_SPLIT=k_per_split,
        SPLIT_K=split_k,
        PROMOTE_CHUNKS=promote_chunks,
        DOT_MODE=dot_mode,
        UPCAST=interpreting(),
        TICKET=use_ticket,
        UNROLL=num_stages == 1,
        SPLITS_IN_PROGRAM=splits_in_program,
        FIXED_POINT=fixed_point,
        PDL=pdl,
        FLAT_CHAIN=flat_chain,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if two_launch:
        reduce_partials(part, out, pdl)
    return out


def reduce_partials(part: torch.Tensor, out: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """The two-launch form's second kernel: ``out = part[0] + part[1] + ... + part[S-1]``.
    ``pdl``: launched as a programmatic dependent of the kernel that wrote ``part`` (which must
    have called ``launch_dependents``; see ``csrc_triton/pdl.py``): the same adds, launched early."""
    split_k, M, N = part.shape
    block = _REDUCE_BLOCK_MANY if split_k >= _REDUCE_MANY_FROM else _REDUCE_BLOCK
    _splitk_reduce_kernel[(cdiv(M * N, block),)](
        part, out, M, N, part.stride(0), out.stride(0), SPLIT_K=split_k, BLOCK=block,
        CONTIGUOUS=out.stride(0) == N, PDL=pdl, num_warps=_REDUCE_WARPS, **launch_options(pdl),
    )  # fmt: skip
    return out
