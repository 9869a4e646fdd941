"""Triton kernels against an fp64 reference. On CPU they run under TRITON_INTERPRET=1 (conftest)
on small shapes, through the same launchers, masks and dispatch as on the GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from csrc_triton import choice
from csrc_triton.dispatch import launch_into, router_gemm_cuda
from csrc_triton.dot import DotMode
from csrc_triton.launches import GemvLaunch, SplitKLaunch, TiledLaunch, describe
from csrc_triton.problem import Precision, Problem
from vllm_router_ext.ops.router_gemm import check_weight_terms, fp32_weight_terms
from vllm_router_ext.ops.routing_fp64 import reference_logits, relative_error

DEV = "cuda" if torch.cuda.is_available() else "cpu"

SPLITK = SplitKLaunch(block_m=16, block_n=16, block_k=32, k_per_split=128)
SPLITK_PROMOTED = replace(SPLITK, promote_chunks=2)
TILED = TiledLaunch(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=2)
TILED_PROMOTED = replace(TILED, promote_chunks=2)
# the same arithmetic as SPLITK_PROMOTED, as a pipelined loop
SPLITK_PIPELINED = replace(SPLITK_PROMOTED, block_m=32, num_stages=2)
# SPLITK_PROMOTED's splits summed inside one program, larger tiles
SPLITK_IN_PROGRAM = replace(SPLITK_PIPELINED, block_m=64, block_n=32, splits_in_program=True)
# Under the interpreter num_warps=1 gives BLOCK_K = 8 * 32 = 256 (bf16): K=300 takes two chunks.
GEMV = GemvLaunch(block_m=2, block_n=4, num_warps=1)
LAUNCHES = {
    "gemv": GEMV,
    "splitk": SPLITK,
    "splitk-pipelined": SPLITK_PIPELINED,
    "splitk-promoted": SPLITK_PROMOTED,
    "splitk-in-program": SPLITK_IN_PROGRAM,
    "tiled": TILED,
    "tiled-promoted": TILED_PROMOTED,
}


def _inputs(gen, m, k, n, w_dtype=torch.bfloat16, row_stride=None):
    row_stride = row_stride or k
    xs = torch.randn(m, row_stride, generator=gen).to(torch.bfloat16)
    x = xs[:, :k]  # non-contiguous when row_stride > k
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(w_dtype)
    return x.to(DEV), w.to(DEV)


def _poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), dtype=dtype, device=DEV)


@pytest.mark.parametrize("name", list(LAUNCHES))
@pytest.mark.parametrize("m", [0, 1, 3, 17, 33])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fp64_and_writes_every_element(gen, name, m, out_dtype):
    k, n = 300, 40  # neither a multiple of the block sizes
    x, w = _inputs(gen, m, k, n, row_stride=320)
    out = _poisoned(m, n, out_dtype)
    launch_into(LAUNCHES[name], x, w, out)
    assert not out.isnan().any(), "an output element was not written"
    tol = 1e-5 if out_dtype == torch.float32 else 8e-3
    if m:
        assert relative_error(out, reference_logits(x, w)) <= tol


@pytest.mark.parametrize("name", list(LAUNCHES))
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32], ids=["split3", "ieee"])
def test_genuinely_fp32_weight_is_exact(gen, name, x_dtype):
    x, w = _inputs(gen, 9, 256, 48, w_dtype=torch.float32)
    x = x.to(x_dtype)
    assert not torch.equal(w.to(torch.bfloat16).float(), w)
    out = _poisoned(9, 48, torch.float32)
    launch_into(LAUNCHES[name], x, w, out)
    assert relative_error(out, reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize("name", [n for n in LAUNCHES if LAUNCHES[n].kernel != "gemv"])
def test_split3_keeps_the_largest_fp32_weights_finite(gen, name):
    """The in-kernel three-term split truncates: rounding 3.4e38 to bf16 would give inf."""
    x, w = _inputs(gen, 3, 256, 16, w_dtype=torch.float32)
    w[5, ::16] = 3.4e38 * torch.sign(torch.randn(16, generator=gen))
    x = (x.float() * 1e-3).to(torch.bfloat16)  # keeps the huge row's logits finite
    out = _poisoned(3, 16, torch.float32)
    launch_into(LAUNCHES[name], x, w, out)
    ref = reference_logits(x, w)
    # 2e-6 on the huge column: the GPU's tensor cores accumulate its three terms' products (1.4e-6
    # measured on the H200 with the tiled kernel); the interpreter's dot adds them in fp64.
    assert relative_error(out[:, 5], ref[:, 5]) <= 2e-6
    assert relative_error(out[:, :5], ref[:, :5]) <= 1e-6


@pytest.mark.parametrize("options", [dict(copy_stages=2), dict(copy_stages=8), dict(maxnreg=255)], ids=str)
def test_gemv_launch_options_keep_the_sums(gen, options):
    """``copy_stages`` (chunks copied ahead through shared memory) and ``maxnreg`` (ptxas's
    register budget) change when the loads are issued, never what is added: bitwise the plain
    GEMV's logits (8 stages: more than the chunks, capped)."""
    x, w = _inputs(gen, 5, 700, 24)
    for base in (GEMV, replace(GEMV, block_m=4, block_n=8)):
        plain = launch_into(base, x, w, _poisoned(5, 24, torch.float32))
        other = launch_into(replace(base, **options), x, w, _poisoned(5, 24, torch.float32))
        assert torch.equal(plain, other), describe(base)
        assert relative_error(other, reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize("promote_chunks", [2, 4, 0], ids=["two-chains-a-split", "one-chain", "unpromoted"])
def test_pipelined_split_k_is_bitwise_the_unrolled_one(dot_order, gen, promote_chunks):
    """Batch-invariant tables may mix unrolled (small M) and pipelined (large M) split-K launches
    of one K structure: they must compute the same sums in the same order. With one chain per
    split (4 chunks of 32 in 128, or no promotion) ``flat_chain`` loops over the chunks (where
    the launch asks; it is ignored where a split holds several chains)."""
    x, w = _inputs(gen, 37, 300, 40)
    unrolled = launch_into(
        replace(SPLITK_PROMOTED, promote_chunks=promote_chunks), x, w, _poisoned(37, 40, torch.float32)
    )
    assert relative_error(unrolled, reference_logits(x, w)) <= 1e-6
    for flat_chain in (False, True):
        pipelined = replace(SPLITK_PIPELINED, promote_chunks=promote_chunks, flat_chain=flat_chain)
        assert torch.equal(unrolled, launch_into(pipelined, x, w, _poisoned(37, 40, torch.float32))), (
            flat_chain
        )


@pytest.mark.parametrize("promote_chunks", [0, 2])
@pytest.mark.parametrize("k", [300, 512])
def test_split_sum_forms_are_bitwise_equal(dot_order, gen, promote_chunks, k):
    """Batch-invariant tables sum a tile's splits across programs at small M (a ticket, or a second
    launch) and inside one program at large M: for one K structure the logits must be bitwise the
    same, whatever the tiles, with one MMA chain per split (0) or promoted chains (2)."""
    x, w = _inputs(gen, 70, k, 40)
    base = replace(SPLITK_PROMOTED, promote_chunks=promote_chunks)
    first = launch_into(base, x, w, _poisoned(70, 40, torch.float32))
    forms = [dict(splits_in_program=True), dict(ticket=False, pdl=True)]  # PDL on a GPU
    for block_m, block_n, stages in ((16, 16, 1), (64, 32, 2), (32, 64, 3)):
        tiles = replace(base, block_m=block_m, block_n=block_n, num_stages=stages)
        for form in forms:
            out = launch_into(replace(tiles, **form), x, w, _poisoned(70, 40, torch.float32))
            assert torch.equal(out, first), (block_m, block_n, stages, form)
    assert relative_error(first, reference_logits(x, w)) <= 1e-6


def test_dot_mode_follows_the_operands():
    assert DotMode.of(torch.bfloat16, torch.bfloat16) is DotMode.NATIVE
    assert DotMode.of(torch.float16, torch.float16) is DotMode.NATIVE
    assert DotMode.of(torch.bfloat16, torch.float32) is DotMode.SPLIT3
    assert DotMode.of(torch.float32, torch.float32) is DotMode.IEEE
    assert DotMode.of(torch.float16, torch.float32) is DotMode.IEEE


@pytest.mark.parametrize("mode", ["fp32", "bf16-fp32out", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_dispatch_end_to_end(gen, mode, m):
    """The op's CUDA dispatch (heuristic configs here) on every mode, M below/above buckets."""
    x, w = _inputs(gen, m, 512, 48)
    out = router_gemm_cuda(x, w, Precision(mode), batch_invariant=False)
    assert out.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
    assert relative_error(out, reference_logits(x, w)) <= (8e-3 if mode == "bf16" else 1e-5)


def test_fp32_weight_terms_are_exact_and_checked(gen):
    w = torch.randn(24, 256, generator=gen) / 7.7  # fp32 values bf16 cannot hold
    w[0, :4] = torch.tensor([1e-30, -3.4e38, 0.0, 2.0**-126])  # tiny, huge, zero, smallest normal
    terms = fp32_weight_terms(w)
    assert terms.dtype == torch.bfloat16 and terms.shape == (72, 256)
    assert torch.equal(terms.double().view(3, 24, 256).sum(0), w.double())
    assert not torch.equal(terms[24:48], torch.zeros_like(terms[24:48]))  # the mid term is used
    with pytest.raises(ValueError, match=r"bfloat16 \[72, 256\].*got torch.bfloat16 \[24, 256\]"):
        check_weight_terms(w, terms[:24])
    with pytest.raises(ValueError, match="for an fp32 weight; weight has dtype torch.bfloat16"):
        check_weight_terms(w.to(torch.bfloat16), terms)


@pytest.mark.parametrize("m,n", [(5, 40), (64, 40), (65, 40), (130, 40), (130, 8)])
def test_fp32_weight_large_m_runs_on_its_terms(gen, monkeypatch, m, n):
    """From FP32_WEIGHT_TERMS_FROM_M tokens, whatever the experts (not batch-invariant), the
    dispatch runs an fp32 weight as one promoted GEMM on its bf16 terms; below, on the weight
    itself. Both fp32-accurate. (Threshold scaled down here.)"""
    import csrc_triton.dispatch as d

    assert choice.FP32_WEIGHT_TERMS_FROM_M == 1024  # H200-measured
    monkeypatch.setattr(choice, "FP32_WEIGHT_TERMS_FROM_M", 65)
    calls = []
    real = d._by_terms
    monkeypatch.setattr(d, "_by_terms", lambda *a: calls.append(1) or real(*a))
    x, _ = _inputs(gen, m, 512, n)
    w = (torch.randn(n, 512, generator=gen) / 22.6).to(DEV)  # genuinely fp32
    terms = fp32_weight_terms(w)
    out = router_gemm_cuda(x, w, Precision.FP32, False, terms)
    assert bool(calls) == (m >= 65)
    assert relative_error(out, reference_logits(x, w)) <= 1e-6
    calls.clear()
    router_gemm_cuda(x, w, Precision.FP32, True, terms)  # batch-invariant: one path for all M
    assert not calls


def test_fp32_weight_terms_launch_is_resolved_against_the_terms(gen):
    """The terms' launch is resolved for the terms tensor itself: a ``wgmma_ws`` choice that the
    terms cannot take (here: the interpreter) runs the Triton fallback, same accuracy."""
    import csrc_triton.dispatch as d
    from csrc_triton.launches import Fp32WeightTermsLaunch

    x, _ = _inputs(gen, 40, 512, 48)
    w = (torch.randn(48, 512, generator=gen) / 22.6).to(DEV)  # genuinely fp32
    out = _poisoned(40, 48, torch.float32)
    d._by_terms(Fp32WeightTermsLaunch(choice.wgmma_ws(128, 0)), x.contiguous(), fp32_weight_terms(w), out)
    assert relative_error(out, reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize("mode", ["fp32", "bf16-fp32out"])
def test_batch_invariant_needle_through_dispatch(dot_order, gen, mode):
    k, n = 512, 48
    needle, w = _inputs(gen, 1, k, n)
    alone = router_gemm_cuda(needle, w, Precision(mode), batch_invariant=True)
    for m in (1, 2, 3, 17, 65, 300):  # 300: the heuristic sums the splits in one program there
        for pos in sorted({0, 1, m // 2, m - 1} & set(range(m))):
            x, _ = _inputs(gen, m, k, n)
            x[pos] = needle[0]
            out = router_gemm_cuda(x, w, Precision(mode), batch_invariant=True)
            assert torch.equal(out[pos : pos + 1], alone), (m, pos)


def _small_gpu(monkeypatch):
    """Emulate a GPU with little shared memory: any pipelined launch or tile wider than 32 rows
    raises Triton's OutOfResources before it launches, as a real one would at load time."""
    from triton.runtime.errors import OutOfResources

    import csrc_triton.dispatch as d

    real = d.launch_exactly
    tried: list = []

    def launch_exactly(launch, *args):
        tried.append(launch)
        if getattr(launch, "num_stages", 1) > 1 or getattr(launch, "block_m", 0) > 32:
            raise OutOfResources(200_000, 101_376, "shared memory")
        return real(launch, *args)

    monkeypatch.setattr(d, "launch_exactly", launch_exactly)
    monkeypatch.setattr(d, "_FITTED", {})
    return tried


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_launch_this_gpu_cannot_hold_is_shrunk_not_fatal(
    dot_order, gen, monkeypatch, caplog, batch_invariant
):
    """A table (or the heuristic) made on a GPU with more shared memory than this one: the op runs
    the same sums in a smaller footprint, warns once, and remembers the shrink."""
    import csrc_triton.dispatch as d
    import csrc_triton.tables as t

    k, n = 512, 48
    big = dict(kernel="splitk", block_m=64, block_n=32, block_k=32, k_per_split=128, promote_chunks=2)
    big.update(num_warps=4, num_stages=3)
    key = "fp32/batch_invariant" if batch_invariant else "fp32"
    table = {"shapes": {f"{k}x{n}": {key: [{"max_m": None, **big}]}}}
    monkeypatch.setattr(t, "load_table", lambda name: table)
    x, w = _inputs(gen, 40, k, n)
    original = SplitKLaunch(**{p: v for p, v in big.items() if p != "kernel"})
    expected = launch_into(original, x, w, _poisoned(40, n, torch.float32))
    tried = _small_gpu(monkeypatch)
    with caplog.at_level("WARNING", logger=d.logger.name):
        out = router_gemm_cuda(x, w, Precision.FP32, batch_invariant=batch_invariant)
    assert torch.equal(out, expected)  # same BLOCK_K, K split, promotion: the same sums
    assert relative_error(out, reference_logits(x, w)) <= 1e-6
    # stages 3 -> 2 -> 1, then BLOCK_M 64 -> 32: four tries, three warnings naming both launches
    assert [(t.num_stages, t.block_m) for t in tried] == [(3, 64), (2, 64), (1, 64), (1, 32)]
    warnings = [r.getMessage() for r in caplog.records if "does not fit this GPU" in r.getMessage()]
    assert len(warnings) == 3 and "num_stages=3" in warnings[0]
    assert "out of resource: shared memory" in warnings[0]
    caplog.clear()
    tried.clear()
    with caplog.at_level("WARNING", logger=d.logger.name):
        again = router_gemm_cuda(x, w, Precision.FP32, batch_invariant=batch_invariant)
    assert torch.equal(again, expected) and len(tried) == 1 and not caplog.records


def test_shrinking_stops_where_nothing_is_left_to_shrink(gen, monkeypatch):
    from triton.runtime.errors import OutOfResources

    import csrc_triton.dispatch as d

    problem = Problem(3, 512, 48, Precision.FP32)
    launch = replace(TILED_PROMOTED, block_m=32, block_n=64)
    chain = [launch]
    while (smaller := choice.shrink(chain[-1], problem)) is not None:
        chain.append(smaller)
    assert [(c.num_stages, c.block_m, c.block_n) for c in chain] == [
        (2, 32, 64), (1, 32, 64), (1, 32, 32), (1, 16, 32), (1, 16, 16),
    ]  # fmt: skip
    assert all(c.block_k == 32 and c.promote_chunks == 2 for c in chain)
    assert chain[-1].source == "heuristic, shrunk to fit this GPU"

    def never_fits(launch, *args):
        raise OutOfResources(1, 0, "shared memory")

    monkeypatch.setattr(d, "launch_exactly", never_fits)
    monkeypatch.setattr(d, "_FITTED", {})
    x, w = _inputs(gen, 3, 512, 48)
    with pytest.raises(OutOfResources):  # a GPU that holds not even the smallest tile: say so
        router_gemm_cuda(x, w, Precision.FP32, batch_invariant=False)


def test_a_wgmma_ws_launch_that_never_fits_runs_the_triton_fallback(gen, monkeypatch):
    """A wgmma_ws launch the GPU cannot hold (fewer registers or less shared memory than the
    H200): fewer stages, then plain 128-wide tiles, then the Triton kernels' same fp32-mode sums;
    never a failed serving step."""
    from triton.runtime.errors import OutOfResources

    import csrc_triton.dispatch as d

    x, w = _inputs(gen, 40, 512, 48)
    problem = Problem.of(x, w, Precision.FP32)
    launch = choice.wgmma_ws(128, 0, num_stages=2, block_n_tail=32)
    chain = [launch]
    while (smaller := choice.shrink(chain[-1], problem)) is not None and smaller.kernel == "wgmma_ws":
        chain.append(smaller)
    assert [(c.num_stages, c.block_n_tail) for c in chain] == [(2, 32), (1, 32), (1, 0)]
    assert smaller == choice.wgmma_ws_fallback(problem) and smaller.kernel != "wgmma_ws"
    tried = []
    real = d.launch_exactly

    def no_wgmma_ws(launch, *args):
        tried.append(launch.kernel)
        if launch.kernel == "wgmma_ws":
            raise OutOfResources(384 * 200, 65536, "threads")
        return real(launch, *args)

    monkeypatch.setattr(d, "launch_exactly", no_wgmma_ws)
    monkeypatch.setattr(d, "_FITTED", {})
    out = d._run_fitting(launch, problem, x, w, _poisoned(40, 48, torch.float32))
    assert tried[:3] == ["wgmma_ws"] * 3 and tried[3] != "wgmma_ws"
    assert relative_error(out, reference_logits(x, w)) <= 1e-6


def test_a_wgmma_ws_launch_falls_back_to_triton_where_it_cannot_run(gen, caplog):
    """Under the interpreter (as for an fp32 weight, unaligned rows or a Triton without Gluon on a
    GPU) a wgmma_ws launch runs the fallback's Triton kernel: same accuracy, one log line."""
    x, w = _inputs(gen, 40, 300, 24, row_stride=320)
    problem = Problem.of(x, w, Precision.FP32)
    assert "TRITON_INTERPRET" in choice.wgmma_ws_problem(problem) or DEV == "cuda"
    out = _poisoned(40, 24, torch.float32)
    choice._FALLBACKS_LOGGED.clear()
    with caplog.at_level("INFO", logger=choice.logger.name):
        launch_into(choice.wgmma_ws(128, 0), x, w, out)
    assert relative_error(out, reference_logits(x, w)) <= 1e-6
    if DEV == "cpu":
        assert "cannot run (TRITON_INTERPRET=1" in caplog.text


def test_wgmma_ws_launcher_refuses_what_it_cannot_run():
    from csrc_triton.router_gemm_wgmma_ws import wgmma_ws_launch

    x = torch.zeros(4, 7168, dtype=torch.bfloat16)
    w = torch.zeros(256, 7168, dtype=torch.bfloat16)
    out = torch.empty(4, 256)
    base = choice.wgmma_ws(128, 0)
    with pytest.raises(ValueError, match="promote_chunks=1 with block_k=64"):
        wgmma_ws_launch(x, w, out, replace(base, promote_chunks=1))
    with pytest.raises(ValueError, match="promote_chunks=8 with block_k=64"):
        wgmma_ws_launch(x, w, out, replace(base, promote_chunks=8))
    with pytest.raises(ValueError, match="fp32 logits"):
        wgmma_ws_launch(x, w, out.bfloat16(), base)
    with pytest.raises(ValueError, match="block_n_tail=128; allowed: 0, 16, 32, 64"):
        wgmma_ws_launch(x, w, out, replace(base, block_n_tail=128))
    with pytest.raises(ValueError, match=r"pdl=3; allowed: 0 \(off\), 1 \(early\), 2 \(late\)"):
        wgmma_ws_launch(x, w, out, replace(base, pdl=3))
    with pytest.raises(ValueError, match=r"block_m=96; allowed: 128, 64"):
        wgmma_ws_launch(x, w, out, replace(base, block_m=96))
    with pytest.raises(ValueError, match=r"block_m=64; allowed: 128, 64 \(a tail needs 128 rows\)"):
        wgmma_ws_launch(x, w, out, replace(base, block_m=64, block_n_tail=32))
    with pytest.raises(ValueError, match="k_per_split=96 must hold whole promotions"):
        from csrc_triton.router_gemm_splitk import splitk_launch

        splitk_launch(x, w, out, replace(SPLITK, k_per_split=96, promote_chunks=2, block_k=64))


@pytest.mark.parametrize("splits", [2, 7, 14])
@pytest.mark.parametrize("contiguous", [True, False], ids=["flat", "strided-out"])
def test_split_order_sum_adds_partials_in_split_order(splits, contiguous):
    """The K-split configs' second launch: ``out = ((0 + p0) + p1) + ... + p[S-1]`` in fp32, bitwise
    (each split count's program size: 1024 logits below 6 partials, 512 from 6), into contiguous
    logits (flat stores) and into a strided ``out``; a poisoned ``out`` fully written."""
    from csrc_triton.router_gemm_splitk import reduce_partials

    g = torch.Generator().manual_seed(splits)
    part = (torch.randn(splits, 37, 96, generator=g) * torch.logspace(-3, 3, 96)).to(DEV)
    expected = torch.zeros(37, 96, device=DEV)
    for s in range(splits):
        expected = expected + part[s]
    base = torch.full((37, 96 if contiguous else 128), float("nan"), device=DEV)
    out = base[:, :96]
    reduce_partials(part, out)
    assert torch.equal(out, expected)
    if not contiguous:
        assert base[:, 96:].isnan().all()  # nothing written past the logits


def test_pdl_only_where_the_gpu_and_triton_have_it(monkeypatch):
    """Programmatic dependent launch: sm_90+ CUDA devices, never under the interpreter or on CPU,
    off with VLLM_ROUTER_EXT_PDL=0; ``forced`` (the sm_90 compile check) overrides the device."""
    import csrc_triton.pdl as pdl
    from csrc_triton import environment

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(pdl, "_capability_major", lambda index: 9)
    assert not pdl.pdl_enabled(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.pdl_enabled(cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert pdl.pdl_enabled(cuda) == pdl.TRITON_PDL
    monkeypatch.setenv(pdl.ENV_VAR, "0")
    environment.reread()  # read once per process otherwise
    assert not pdl.pdl_enabled(cuda)
    monkeypatch.delenv(pdl.ENV_VAR)
    environment.reread()
    monkeypatch.setattr(pdl, "_capability_major", lambda index: 8)
    assert not pdl.pdl_enabled(cuda)
    with pdl.forced(True):
        assert pdl.pdl_enabled(torch.device("cpu")) == pdl.TRITON_PDL
        with pdl.forced(False):
            assert not pdl.pdl_enabled(cuda)
    assert not pdl.pdl_enabled(torch.device("cpu"))
    assert pdl.launch_options(True) == {"launch_pdl": True} and pdl.launch_options(False) == {}
