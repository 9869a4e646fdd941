"""Triton kernels against an fp64 reference. On CPU they run under TRITON_INTERPRET=1 (conftest)
on small shapes, through the same launchers, masks and dispatch as on the GPU."""

from __future__ import annotations

import json
import re

import pytest
import torch

from csrc_triton.configs import KernelConfig, heuristic_config, select_config, shrink_config
from csrc_triton.dot import DOT_IEEE, DOT_NATIVE, DOT_SPLIT3
from vllm_router_ext.ops import startup
from vllm_router_ext.ops.dispatch import dot_mode_for, router_gemm_cuda, run_config
from vllm_router_ext.ops.reference import reference_logits, relative_error
from vllm_router_ext.ops.router_gemm import check_weight_terms, fp32_weight_terms
from vllm_router_ext.precision import RouterPrecision

DEV = "cuda" if torch.cuda.is_available() else "cpu"

SPLITK = KernelConfig("splitk", dict(block_m=16, block_n=16, block_k=32, k_per_split=128, promote_chunks=0))
SPLITK_PROMOTED = KernelConfig(
    "splitk", dict(block_m=16, block_n=16, block_k=32, k_per_split=128, promote_chunks=2)
)
TILED = KernelConfig(
    "tiled", dict(block_m=16, block_n=32, block_k=32, promote_chunks=0, group_m=2, num_warps=4, num_stages=2)
)
TILED_PROMOTED = KernelConfig(
    "tiled", dict(block_m=16, block_n=32, block_k=32, promote_chunks=2, group_m=2, num_warps=4, num_stages=2)
)
SPLITK_PIPELINED = KernelConfig(  # the same arithmetic as SPLITK_PROMOTED, as a pipelined loop
    "splitk",
    dict(block_m=32, block_n=16, block_k=32, k_per_split=128, promote_chunks=2, num_warps=4, num_stages=2),
)
SPLITK_IN_PROGRAM = KernelConfig(  # SPLITK_PROMOTED's splits summed inside one program, larger tiles
    "splitk", {**SPLITK_PIPELINED.params, "block_m": 64, "block_n": 32, "splits_in_program": True}
)
# Under the interpreter num_warps=1 gives BLOCK_K = 8 * 32 = 256 (bf16): K=300 takes two chunks.
GEMV = KernelConfig("gemv", dict(block_m=2, block_n=4, k_per_split=0, num_warps=1))
GEMV_SPLIT = KernelConfig("gemv", dict(block_m=4, block_n=8, k_per_split=256, num_warps=1))
CONFIGS = {
    "gemv": GEMV,
    "gemv-split": GEMV_SPLIT,
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


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("m", [0, 1, 3, 17, 33])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_fp64_and_writes_every_element(gen, name, m, out_dtype):
    k, n = 300, 40  # neither a multiple of the block sizes
    x, w = _inputs(gen, m, k, n, row_stride=320)
    out = _poisoned(m, n, out_dtype)
    run_config(CONFIGS[name], x, w, out, DOT_NATIVE)
    assert not out.isnan().any(), "an output element was not written"
    tol = 1e-5 if out_dtype == torch.float32 else 8e-3
    if m:
        assert relative_error(out, reference_logits(x, w)) <= tol


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("dot_mode", [DOT_SPLIT3, DOT_IEEE])
def test_genuinely_fp32_weight_is_exact(gen, name, dot_mode):
    x, w = _inputs(gen, 9, 256, 48, w_dtype=torch.float32)
    assert not torch.equal(w.to(torch.bfloat16).float(), w)
    out = _poisoned(9, 48, torch.float32)
    run_config(CONFIGS[name], x, w, out, dot_mode)
    assert relative_error(out, reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize("name", [n for n in CONFIGS if CONFIGS[n].kernel != "gemv"])
def test_split3_keeps_the_largest_fp32_weights_finite(gen, name):
    """The in-kernel three-term split truncates: rounding 3.4e38 to bf16 would give inf."""
    x, w = _inputs(gen, 3, 256, 16, w_dtype=torch.float32)
    w[5, ::16] = 3.4e38 * torch.sign(torch.randn(16, generator=gen))
    x = (x.float() * 1e-3).to(torch.bfloat16)  # keeps the huge row's logits finite
    out = _poisoned(3, 16, torch.float32)
    run_config(CONFIGS[name], x, w, out, DOT_SPLIT3)
    ref = reference_logits(x, w)
    # 2e-6 on the huge column: the GPU's tensor cores accumulate its three terms' products (1.4e-6
    # measured on the H200 with the tiled kernel); the interpreter's dot adds them in fp64.
    assert relative_error(out[:, 5], ref[:, 5]) <= 2e-6
    assert relative_error(out[:, :5], ref[:, :5]) <= 1e-6


def test_gemv_two_launch_form_equals_single_launch(gen):
    """``ticket=False`` (partials, then a reduce kernel) adds the same partials in the same order."""
    x, w = _inputs(gen, 5, 700, 24)
    one = run_config(GEMV_SPLIT, x, w, _poisoned(5, 24, torch.float32), DOT_NATIVE)
    two_cfg = KernelConfig("gemv", {**GEMV_SPLIT.params, "ticket": False})
    two = run_config(two_cfg, x, w, _poisoned(5, 24, torch.float32), DOT_NATIVE)
    assert torch.equal(one, two)
    assert relative_error(one, reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize("launch", [dict(copy_stages=2), dict(copy_stages=8), dict(maxnreg=255)], ids=str)
def test_gemv_launch_options_keep_the_sums(gen, launch):
    """``copy_stages`` (chunks copied ahead through shared memory) and ``maxnreg`` (ptxas's
    register budget) change when the loads are issued, never what is added: bitwise the plain
    GEMV's logits, with one split and with several (8 stages: more than the chunks, capped)."""
    x, w = _inputs(gen, 5, 700, 24)
    for base in (GEMV, GEMV_SPLIT):
        plain = run_config(base, x, w, _poisoned(5, 24, torch.float32), DOT_NATIVE)
        cfg = KernelConfig("gemv", {**base.params, **launch})
        other = run_config(cfg, x, w, _poisoned(5, 24, torch.float32), DOT_NATIVE)
        assert torch.equal(plain, other), base.describe()
        assert relative_error(other, reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize("promote_chunks", [2, 4, 0], ids=["two-chains-a-split", "one-chain", "unpromoted"])
def test_pipelined_split_k_is_bitwise_the_unrolled_one(dot_order, gen, promote_chunks):
    """Batch-invariant tables may mix unrolled (small M) and pipelined (large M) split-K configs
    of one K structure: they must compute the same sums in the same order. With one chain per
    split (4 chunks of 32 in 128, or no promotion) ``flat_chain`` loops over the chunks (where
    the config asks; it is ignored where a split holds several chains)."""
    x, w = _inputs(gen, 37, 300, 40)
    unrolled_cfg = KernelConfig("splitk", {**SPLITK_PROMOTED.params, "promote_chunks": promote_chunks})
    unrolled = run_config(unrolled_cfg, x, w, _poisoned(37, 40, torch.float32), DOT_NATIVE)
    assert relative_error(unrolled, reference_logits(x, w)) <= 1e-6
    for flat_chain in (False, True):
        params = {**SPLITK_PIPELINED.params, "promote_chunks": promote_chunks, "flat_chain": flat_chain}
        pipelined = run_config(
            KernelConfig("splitk", params), x, w, _poisoned(37, 40, torch.float32), DOT_NATIVE
        )
        assert torch.equal(unrolled, pipelined), flat_chain


FIXED = KernelConfig(  # SPLITK_PROMOTED's splits, summed exactly in fixed point (atomically)
    "splitk", {**SPLITK_PROMOTED.params, "fixed_point": True}
)


def _fixed_words_left():
    from csrc_triton.router_gemm_splitk import _FIXED_WORDS

    return [int(b.abs().max()) for b in _FIXED_WORDS.values()]


@pytest.mark.parametrize("fixed", [False, True], ids=["split-order", "fixed-point"])
@pytest.mark.parametrize("promote_chunks", [0, 2])
@pytest.mark.parametrize("k", [300, 512])
def test_split_sum_forms_are_bitwise_equal(dot_order, gen, promote_chunks, k, fixed):
    """Batch-invariant tables sum a tile's splits across programs at small M (a ticket, or one
    fixed-point atomic per logit), by integer partials + ticket at mid M (fixed point), and inside
    one program at large M: for one K structure and one kind of sum the logits must be bitwise the
    same, whatever the tiles, with one MMA chain per split (0) or promoted chains (2); fixed-point
    words are left at zero, call after call."""
    x, w = _inputs(gen, 70, k, 40)
    base = {**(FIXED if fixed else SPLITK_PROMOTED).params, "promote_chunks": promote_chunks}
    first = run_config(KernelConfig("splitk", base), x, w, _poisoned(70, 40, torch.float32), DOT_NATIVE)
    if fixed:
        again = run_config(KernelConfig("splitk", base), x, w, _poisoned(70, 40, torch.float32), DOT_NATIVE)
        assert torch.equal(first, again)
        assert set(_fixed_words_left()) == {0}
    two_launch = {"ticket": False, "pdl": True}  # partials, then the split sum (PDL on a GPU)
    forms = [{"splits_in_program": True}] + ([{"fixed_ticket": True}] if fixed else [two_launch])
    for block_m, block_n, stages in ((16, 16, 1), (64, 32, 2), (32, 64, 3)):
        params = {**base, "block_m": block_m, "block_n": block_n, "num_stages": stages}
        for form in forms:
            out = run_config(
                KernelConfig("splitk", {**params, **form}), x, w, _poisoned(70, 40, torch.float32), DOT_NATIVE
            )
            assert torch.equal(out, first), (block_m, block_n, stages, form)
    assert relative_error(first, reference_logits(x, w)) <= 1e-6


def test_fixed_point_sum_is_the_rounded_sum_of_truncated_partials(dot_order, gen):
    """What the fixed-point sum computes, re-derived in torch: each split's fp32 partial (the
    same kernel with one split over that K range) truncated to a multiple of 2^-32, the integers
    added exactly, the sum rounded to fp32 once."""
    x, w = _inputs(gen, 5, 384, 24)
    one_split = {**SPLITK.params, "k_per_split": 128}
    parts = [
        run_config(
            KernelConfig("splitk", one_split),
            x[:, s : s + 128].contiguous(),
            w[:, s : s + 128].contiguous(),
            _poisoned(5, 24, torch.float32),
            DOT_NATIVE,
        )
        for s in (0, 128, 256)
    ]
    ints = sum(torch.trunc(p.double() * 2.0**32).to(torch.int64) for p in parts)
    expected = ints.to(torch.float32) * 2.0**-32
    for form in ({}, {"fixed_ticket": True}, {"splits_in_program": True, "num_stages": 2}):
        cfg = KernelConfig("splitk", {**one_split, "fixed_point": True, **form})
        got = run_config(cfg, x, w, _poisoned(5, 24, torch.float32), DOT_NATIVE)
        assert torch.equal(got, expected), form
        # One split (K <= k_per_split): that partial alone, truncated, in every form too.
        first = run_config(cfg, x[:, :128], w[:, :128], _poisoned(5, 24, torch.float32), DOT_NATIVE)
        assert torch.equal(first, torch.trunc(parts[0].double() * 2.0**32).float() * 2.0**-32), form
    assert set(_fixed_words_left()) == {0}


def test_fixed_point_poisons_what_it_cannot_hold(dot_order, gen):
    """A split partial beyond +-2^16 (or inf / NaN) cannot be summed exactly: that logit is NaN,
    deterministically, in both forms; the other rows are untouched; the words are reset."""
    x, w = _inputs(gen, 6, 512, 40)
    clean = run_config(FIXED, x, w, _poisoned(6, 40, torch.float32), DOT_NATIVE)
    x[1, 3] = float("inf")
    x[4, 200] = 3e38
    x[5, 0] = 2e6  # split 0's partial ~ 2e6 * w[n, 0]: past 2^16 for some logits, not others
    split0 = (x[5, :128].double() @ w[:, :128].double().T).abs()
    assert (split0 > 2**16 + 1).any() and (split0 < 2**16 - 1).any()
    for params in (
        FIXED.params,
        {**FIXED.params, "fixed_ticket": True},
        {**FIXED.params, "splits_in_program": True, "num_stages": 2},
    ):
        out = run_config(KernelConfig("splitk", params), x, w, _poisoned(6, 40, torch.float32), DOT_NATIVE)
        assert out[1].isnan().all() and out[4].isnan().all()
        assert torch.equal(out[[0, 2, 3]], clean[[0, 2, 3]])
        clear = (split0 - 2**16).abs() > 1  # away from the edge, where rounding could decide
        assert torch.equal(out[5].isnan()[clear], (split0 > 2**16)[clear])
    assert set(_fixed_words_left()) == {0}


def test_fixed_point_refuses_more_splits_than_it_counts(gen):
    x, w = _inputs(gen, 2, 32 * 32, 16)
    cfg = KernelConfig("splitk", {**FIXED.params, "k_per_split": 32, "block_k": 32, "promote_chunks": 1})
    with pytest.raises(ValueError, match="32 splits; at most 31 allowed"):
        run_config(cfg, x, w, _poisoned(2, 16, torch.float32), DOT_NATIVE)


def test_dot_mode_selection():
    assert dot_mode_for(torch.bfloat16, torch.bfloat16) == DOT_NATIVE
    assert dot_mode_for(torch.float16, torch.float16) == DOT_NATIVE
    assert dot_mode_for(torch.bfloat16, torch.float32) == DOT_SPLIT3
    assert dot_mode_for(torch.float32, torch.float32) == DOT_IEEE
    assert dot_mode_for(torch.float16, torch.float32) == DOT_IEEE


@pytest.mark.parametrize("mode", ["fp32", "bf16-fp32out", "bf16"])
@pytest.mark.parametrize("m", [1, 5, 70])
def test_dispatch_end_to_end(gen, mode, m):
    """The op's CUDA dispatch (heuristic configs here) on every mode, M below/above buckets."""
    x, w = _inputs(gen, m, 512, 48)
    out = router_gemm_cuda(x, w, RouterPrecision(mode), batch_invariant=False)
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


@pytest.mark.parametrize("m,n", [(5, 40), (64, 40), (65, 40), (130, 40), (130, 24)])
def test_fp32_weight_large_m_runs_on_its_terms(gen, monkeypatch, m, n):
    """From FP32_WEIGHT_TERMS_FROM_M tokens and FP32_WEIGHT_TERMS_MIN_N experts (not
    batch-invariant) the dispatch runs an fp32 weight as one promoted GEMM on its bf16 terms;
    otherwise on the weight itself. Both fp32-accurate. (Thresholds scaled down here.)"""
    import vllm_router_ext.ops.dispatch as d

    assert (d.FP32_WEIGHT_TERMS_FROM_M, d.FP32_WEIGHT_TERMS_MIN_N) == (1024, 128)  # H200-measured
    monkeypatch.setattr(d, "FP32_WEIGHT_TERMS_FROM_M", 65)
    monkeypatch.setattr(d, "FP32_WEIGHT_TERMS_MIN_N", 32)
    calls = []
    real = d._fp32_weight_by_terms
    monkeypatch.setattr(d, "_fp32_weight_by_terms", lambda *a: calls.append(1) or real(*a))
    x, _ = _inputs(gen, m, 512, n)
    w = (torch.randn(n, 512, generator=gen) / 22.6).to(DEV)  # genuinely fp32
    terms = fp32_weight_terms(w)
    out = router_gemm_cuda(x, w, RouterPrecision.FP32, False, terms)
    assert bool(calls) == (m >= 65 and n >= 32)
    assert relative_error(out, reference_logits(x, w)) <= 1e-6
    calls.clear()
    router_gemm_cuda(x, w, RouterPrecision.FP32, True, terms)  # batch-invariant: one path for all M
    assert not calls


@pytest.mark.parametrize("mode", ["fp32", "bf16-fp32out"])
def test_batch_invariant_needle_through_dispatch(dot_order, gen, mode):
    k, n = 512, 48
    needle, w = _inputs(gen, 1, k, n)
    alone = router_gemm_cuda(needle, w, RouterPrecision(mode), batch_invariant=True)
    for m in (1, 2, 3, 17, 65, 300):  # 300: the heuristic sums the splits in one program there
        for pos in sorted({0, 1, m // 2, m - 1} & set(range(m))):
            x, _ = _inputs(gen, m, k, n)
            x[pos] = needle[0]
            out = router_gemm_cuda(x, w, RouterPrecision(mode), batch_invariant=True)
            assert torch.equal(out[pos : pos + 1], alone), (m, pos)


def test_batch_invariant_needle_through_a_fixed_point_table(dot_order, gen, monkeypatch):
    """A tuned table may fix the exact fixed-point split sum: one atomic per logit at small M,
    integer partials + ticket at mid M, one program per tile at large M. Through the dispatch,
    a needle row equals its M=1 logits bitwise at every M, and the log line says so."""
    import csrc_triton.configs as c
    import vllm_router_ext.ops.dispatch as d

    k, n = 512, 48
    base = dict(kernel="splitk", block_k=32, k_per_split=128, promote_chunks=0, fixed_point=True, num_warps=4)
    buckets = [
        {"max_m": 2, **base, "block_m": 16, "block_n": 16, "num_stages": 1},
        {"max_m": 64, **base, "block_m": 32, "block_n": 16, "num_stages": 2, "fixed_ticket": True},
        {"max_m": None, **base, "block_m": 64, "block_n": 32, "num_stages": 2, "splits_in_program": True},
    ]
    table = {"shapes": {f"{k}x{n}": {"bf16-fp32out/batch_invariant": buckets}}}
    monkeypatch.setattr(c, "load_table", lambda name: table)
    needle, w = _inputs(gen, 1, k, n)
    alone = router_gemm_cuda(needle, w, RouterPrecision.BF16_FP32OUT, batch_invariant=True)
    assert relative_error(alone, reference_logits(needle, w)) <= 1e-6
    for m in (1, 2, 3, 64, 65, 130):
        x, _ = _inputs(gen, m, k, n)
        x[m - 1] = needle[0]
        out = router_gemm_cuda(x, w, RouterPrecision.BF16_FP32OUT, batch_invariant=True)
        assert torch.equal(out[m - 1 :], alone), m
    monkeypatch.setattr(d, "_device_info", lambda index: ("GPU", 132, 90))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, True, torch.bfloat16, k, n)
    assert "K split 128" in text and "splits summed exactly in fixed point" in text
    assert "splits summed in one program from M=65 " in text


def _small_gpu(monkeypatch):
    """Emulate a GPU with little shared memory: any pipelined config or tile wider than 32 rows
    raises Triton's OutOfResources before it launches, as a real one would at load time."""
    from triton.runtime.errors import OutOfResources

    import vllm_router_ext.ops.dispatch as d

    real = d.run_config
    tried: list[KernelConfig] = []

    def run_config(cfg, *args):
        tried.append(cfg)
        p = cfg.params
        if p.get("num_stages", 1) > 1 or p.get("block_m", 0) > 32:
            raise OutOfResources(200_000, 101_376, "shared memory")
        return real(cfg, *args)

    monkeypatch.setattr(d, "run_config", run_config)
    monkeypatch.setattr(d, "_FITTED", {})
    return tried


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_config_this_gpu_cannot_hold_is_shrunk_not_fatal(
    dot_order, gen, monkeypatch, caplog, batch_invariant
):
    """A table (or the heuristic) made on a GPU with more shared memory than this one: the op runs
    the same sums in a smaller footprint, warns once, and remembers the shrink."""
    import csrc_triton.configs as c
    import vllm_router_ext.ops.dispatch as d

    k, n = 512, 48
    big = dict(kernel="splitk", block_m=64, block_n=32, block_k=32, k_per_split=128, promote_chunks=2)
    big.update(num_warps=4, num_stages=3)
    key = "fp32/batch_invariant" if batch_invariant else "fp32"
    table = {"shapes": {f"{k}x{n}": {key: [{"max_m": None, **big}]}}}
    monkeypatch.setattr(c, "load_table", lambda name: table)
    x, w = _inputs(gen, 40, k, n)
    original = KernelConfig("splitk", {p: v for p, v in big.items() if p != "kernel"})
    expected = run_config(original, x, w, _poisoned(40, n, torch.float32), DOT_NATIVE)
    tried = _small_gpu(monkeypatch)
    with caplog.at_level("WARNING", logger=d.logger.name):
        out = router_gemm_cuda(x, w, RouterPrecision.FP32, batch_invariant=batch_invariant)
    assert torch.equal(out, expected)  # same BLOCK_K, K split, promotion: the same sums
    assert relative_error(out, reference_logits(x, w)) <= 1e-6
    # stages 3 -> 2 -> 1, then BLOCK_M 64 -> 32: four tries, three warnings naming both configs
    assert [(t.params["num_stages"], t.params["block_m"]) for t in tried] == [
        (3, 64), (2, 64), (1, 64), (1, 32),
    ]  # fmt: skip
    warnings = [r.getMessage() for r in caplog.records if "does not fit this GPU" in r.getMessage()]
    assert len(warnings) == 3 and "num_stages=3" in warnings[0]
    assert "out of resource: shared memory" in warnings[0]
    caplog.clear()
    tried.clear()
    with caplog.at_level("WARNING", logger=d.logger.name):
        again = router_gemm_cuda(x, w, RouterPrecision.FP32, batch_invariant=batch_invariant)
    assert torch.equal(again, expected) and len(tried) == 1 and not caplog.records


def test_shrinking_stops_where_nothing_is_left_to_shrink(gen, monkeypatch):
    from triton.runtime.errors import OutOfResources

    import vllm_router_ext.ops.dispatch as d

    cfg = KernelConfig("tiled", dict(TILED_PROMOTED.params, block_m=32, block_n=64, num_stages=2))
    chain = [cfg]
    while (smaller := shrink_config(chain[-1])) is not None:
        chain.append(smaller)
    assert [(c.params["num_stages"], c.params["block_m"], c.params["block_n"]) for c in chain] == [
        (2, 32, 64), (1, 32, 64), (1, 32, 32), (1, 16, 32), (1, 16, 16),
    ]  # fmt: skip
    assert all(c.params["block_k"] == 32 and c.params["promote_chunks"] == 2 for c in chain)

    def never_fits(cfg, *args):
        raise OutOfResources(1, 0, "shared memory")

    monkeypatch.setattr(d, "run_config", never_fits)
    monkeypatch.setattr(d, "_FITTED", {})
    x, w = _inputs(gen, 3, 512, 48)
    with pytest.raises(OutOfResources):  # a GPU that holds not even the smallest tile: say so
        router_gemm_cuda(x, w, RouterPrecision.FP32, batch_invariant=False)


def test_a_wgmma_ws_config_that_never_fits_runs_the_triton_fallback(gen, monkeypatch):
    """A wgmma_ws config the GPU cannot launch (fewer registers or less shared memory than the
    H200): fewer stages, then plain 128-wide tiles, then the Triton kernels' same fp32-mode sums;
    never a failed serving step."""
    from triton.runtime.errors import OutOfResources

    import vllm_router_ext.ops.dispatch as d
    from csrc_triton.configs import wgmma_ws_config

    cfg = wgmma_ws_config(128, 0, num_stages=2, block_n_tail=32)
    chain = [cfg]
    while (smaller := shrink_config(chain[-1])) is not None:
        chain.append(smaller)
    assert [(c.params["num_stages"], c.params.get("block_n_tail", 0)) for c in chain] == [
        (2, 32),
        (1, 32),
        (1, 0),
    ]
    tried = []
    real = d.run_config

    def no_wgmma_ws(cfg, *args):
        tried.append(cfg.kernel)
        if cfg.kernel == "wgmma_ws":
            raise OutOfResources(384 * 200, 65536, "threads")
        return real(cfg, *args)

    monkeypatch.setattr(d, "run_config", no_wgmma_ws)
    monkeypatch.setattr(d, "_FITTED", {})
    x, w = _inputs(gen, 40, 512, 48)
    out = d.run_fitting_config(cfg, x, w, _poisoned(40, 48, torch.float32), DOT_NATIVE)
    assert tried[:3] == ["wgmma_ws"] * 3 and tried[3] != "wgmma_ws"
    assert relative_error(out, reference_logits(x, w)) <= 1e-6


def test_heuristic_configs_are_well_formed():
    for m in (1, 4, 5, 16, 64, 65, 4096, 16384):
        for bi in (False, True):
            for mode in ("fp32", "bf16-fp32out"):
                cfg = heuristic_config(m, 7168, 256, mode, bi, 132, wgmma_ws=False)
                p = cfg.params
                if cfg.kernel == "splitk":
                    chunks = p["promote_chunks"] or p["k_per_split"] // p["block_k"]
                    assert p["k_per_split"] % (p["block_k"] * chunks) == 0
                    if m <= 64 and not bi:  # small M: enough programs to fill the GPU
                        assert (256 // p["block_n"]) * (7168 // p["k_per_split"]) >= 132
                expected = "splitk" if bi else "gemv" if m <= 4 else "splitk" if m <= 8192 else "tiled"
                assert cfg.kernel == expected, (m, bi, mode, cfg)
                with_cublas = heuristic_config(m, 7168, 256, mode, bi, 132, cublas=True)
                if mode != "fp32" and not bi and m > 64:  # Hopper's split tiles to 512 (below)
                    assert with_cublas.kernel == ("splitk" if m <= 512 else "cublas"), m
    # Batch invariance: one K structure for every M; above 256 tokens the same splits are summed
    # inside one program (software-pipelined), in tiles that grow with M on Hopper and later
    # (64 x 64 above 1024 tokens, 128 x 128 with 8 warps above 4096, 64 x 64 for 64 experts; a
    # genuinely fp32 weight keeps 64 x 32 below 128 x 128) and stay 64 x 32 before sm_90; on
    # Hopper+ pipelined 64 x 64 split tiles run from 65 tokens while they make enough programs and
    # the partials are few (below; not an fp32 weight). On Hopper a split form's sum is a second
    # kernel launched with PDL (same adds).
    structure = ("block_k", "k_per_split", "promote_chunks")
    for mode in ("fp32", "bf16-fp32out"):
        small = {heuristic_config(m, 7168, 256, mode, True, 132) for m in (1, 17, 64)}
        assert len(small) == 1
        (s,) = small
        assert s.params["ticket"] is False and s.params["pdl"] is True
        launch = {k: v for k, v in s.params.items() if k not in ("ticket", "pdl")}
        for m, tile, cap, fp32_weight in (
            (878, (64, 32, 4), 90, False), (1024, (64, 32, 4), 90, False), (1025, (64, 64, 4), 90, False),
            (257, (64, 32, 4), 90, True), (257, (64, 32, 4), 89, False),
            (4096, (64, 64, 4), 90, False), (4096, (64, 32, 4), 90, True), (4097, (128, 128, 8), 90, False),
            (16384, (128, 128, 8), 90, True), (16384, (64, 32, 4), 80, False),
            (16384, (64, 32, 4), 89, False), (16384, (128, 128, 8), 100, False),
        ):  # fmt: skip
            g = heuristic_config(m, 7168, 256, mode, True, 132, capability=cap, fp32_weight=fp32_weight)
            assert (g.params["block_m"], g.params["block_n"], g.params["num_warps"]) == tile, (m, cap)
            assert g.params["splits_in_program"] and g.params["num_stages"] == 3
            assert {p: g.params[p] for p in structure} == {p: launch[p] for p in structure}
        # V2-Lite: 64 x 64 split tiles make too few programs up to 256 tokens, few partials to 2048
        for m, tile in ((256, (64, 16, 1)), (257, (64, 64, 3))):
            lite = heuristic_config(m, 2048, 64, mode, True, 132)
            assert (lite.params["block_m"], lite.params["block_n"], lite.params["num_stages"]) == tile, m
        for m, splits_in_program in ((2048, False), (2049, True)):
            lite = heuristic_config(m, 2048, 64, mode, True, 132)
            assert lite.params.get("splits_in_program", False) == splits_in_program, m
        lite = heuristic_config(16384, 2048, 64, mode, True, 132)
        assert (lite.params["block_m"], lite.params["block_n"], lite.params["num_warps"]) == (64, 64, 4)
        # Hopper+ above 256 tokens: split tiles while M x N x splits < 6 x 2^20 partials (28 splits
        # of 256 here: to 877 tokens), then one program per tile; from 65 tokens where 64 x 64
        # split tiles make >= 1.5 programs per SM (here 2 x 4 x 28 = 224 >= 198).
        for m, cap, fp32_weight, split_tiles in (
            (257, 90, False, True), (512, 90, False, True), (877, 100, False, True), (878, 90, False, False),
            (257, 90, True, False), (512, 89, False, False), (256, 90, False, True), (65, 90, False, True),
            (65, 89, False, False), (65, 90, True, False), (64, 90, False, False),
        ):  # fmt: skip
            g = heuristic_config(m, 7168, 256, mode, True, 132, capability=cap, fp32_weight=fp32_weight)
            assert {p: g.params[p] for p in structure} == {p: launch[p] for p in structure}
            assert (g.params["block_n"] == 64 and g.params["num_stages"] == 3) == split_tiles, (m, cap)
            assert ("splits_in_program" not in g.params) == (split_tiles or m <= 256), (m, cap)
            assert g.params.get("pdl", False) == (cap // 10 == 9 and "splits_in_program" not in g.params)
        ampere = heuristic_config(1, 7168, 256, mode, True, 108, capability=80)
        assert "ticket" not in ampere.params and "pdl" not in ampere.params  # the one-launch ticket
    # PDL only for cross-program split sums: not the GEMV, cuBLAS, one split or the wgmma_ws sum
    assert "pdl" not in heuristic_config(1, 7168, 256, "fp32", False, 132).params
    assert "pdl" not in heuristic_config(2048, 7168, 256, "fp32", False, 132, wgmma_ws=True).params
    assert heuristic_config(64, 7168, 256, "bf16-fp32out", False, 132).params["pdl"] is True


def test_heuristic_mid_m_split_tiles_on_hopper():
    """65-512 tokens, not batch-invariant, Hopper: pipelined 64 x 64 split tiles, 128-wide chunks,
    the finest K split (256 only below K=4096, then 512, in fp32 also 1024) whose programs stay
    within 2 per SM (16-bit modes; else cuBLAS) or 1 per SM (fp32; else the older split of 1024 in
    64-wide chunks); one chain a split loops flat. What measured fastest on the H200, shape by
    shape (benchmarks/NOTES.md)."""

    def split(m, k, n, mode, **kw):
        cfg = heuristic_config(m, k, n, mode, False, 132, cublas=True, **kw)
        if cfg.kernel != "splitk":
            return cfg.kernel
        p = cfg.params
        assert (p["block_m"], p["block_n"], p["num_stages"]) == (64, 64, 3), p
        assert p.get("pdl", False) == (kw.get("capability", 90) // 10 == 9), p  # the sum: PDL on Hopper
        return p["block_k"], p["k_per_split"], p.get("flat_chain", False)

    bf16, fp32 = "bf16-fp32out", "fp32"
    for m, k, n, mode, expected in (
        (65, 7168, 256, bf16, (128, 512, True)), (256, 7168, 256, bf16, (128, 512, True)),
        (257, 7168, 256, bf16, "cublas"), (128, 7168, 384, bf16, (128, 512, True)),
        (192, 7168, 384, bf16, (128, 512, True)), (193, 7168, 384, bf16, "cublas"),
        (512, 5120, 160, bf16, (128, 512, True)),
        (512, 2048, 64, "bf16", (128, 256, True)), (512, 6144, 256, bf16, "cublas"),
        (65, 7168, 256, fp32, (128, 512, False)), (128, 7168, 256, fp32, (128, 512, False)),
        (129, 7168, 256, fp32, (128, 1024, False)), (512, 7168, 256, fp32, (64, 1024, False)),
        (65, 7168, 384, fp32, (128, 1024, False)), (512, 5120, 160, fp32, (128, 1024, False)),
        (256, 2048, 64, fp32, (128, 256, True)),
    ):  # fmt: skip
        assert split(m, k, n, mode) == expected, (m, k, n, mode)
    # Not on Ampere / Ada, not for a genuinely fp32 weight, not above 512 tokens
    assert split(65, 7168, 256, bf16, capability=89) == "cublas"
    assert split(65, 7168, 256, fp32, capability=89) == (64, 1024, False)
    assert split(65, 7168, 256, fp32, fp32_weight=True) == (64, 1024, False)
    assert split(513, 2048, 64, bf16) == "cublas"
    assert heuristic_config(64, 7168, 256, bf16, False, 132, cublas=True).params["num_stages"] == 1


def test_heuristic_takes_the_wgmma_ws_kernel_only_where_it_runs():
    """The fp32 mode on Hopper from WGMMA_WS_FROM_M tokens, with a Triton that has Gluon; never
    under batch invariance (one kernel for every M), in the 16-bit modes, or on other GPUs."""
    from csrc_triton.configs import WGMMA_WS_FROM_M, wgmma_ws_split

    def kernel(m, mode="fp32", bi=False, cap=90, ws=True, n=256):
        return heuristic_config(m, 7168, n, mode, bi, 132, capability=cap, wgmma_ws=ws).kernel

    assert kernel(WGMMA_WS_FROM_M) == kernel(16384) == "wgmma_ws"
    assert kernel(WGMMA_WS_FROM_M - 1) == "splitk"
    assert kernel(4096, bi=True) == kernel(4096, mode="bf16-fp32out") == "splitk"
    assert kernel(16384, cap=80) == kernel(16384, cap=100) == kernel(16384, ws=False) == "tiled"
    cfg = heuristic_config(1024, 7168, 256, "fp32", False, 132, wgmma_ws=True)
    p = cfg.params
    assert p["block_k"] * p["promote_chunks"] == 256 and p["promote_chunks"] >= 2  # fp32-mode chains
    assert heuristic_config(4096, 2048, 64, "fp32", False, 132, wgmma_ws=True).params["block_n"] == 64
    # K split: the 128-row tiles times the splits fill the SMs once, in multiples of 256.
    assert wgmma_ws_split(1024, 7168, 256, 128, 132) == 1024  # 16 tiles x 7 splits
    assert wgmma_ws_split(2048, 7168, 256, 128, 132) == 1792  # 32 tiles x 4
    assert wgmma_ws_split(8192, 7168, 256, 128, 132) == 0  # 128 tiles: no split
    assert wgmma_ws_split(1024, 2048, 64, 64, 132) == 512  # at most K / 512 splits


def test_wgmma_ws_tiles_cover_160_experts_with_a_tail():
    """DeepSeek-V2's 160 experts: one 128 + 32 tile instead of two 128-wide ones (96 padding
    columns); 256 / 384 experts need no tail; the ring as deep as shared memory allows."""
    from csrc_triton.configs import (
        WGMMA_WS_SMEM_BYTES,
        wgmma_ws_split,
        wgmma_ws_stages,
        wgmma_ws_tail,
        wgmma_ws_tiles,
    )

    assert [wgmma_ws_tail(n) for n in (64, 128, 144, 160, 256, 288, 384, 480)] == [0, 0, 16, 32, 0, 16, 0, 0]
    cfg = heuristic_config(8192, 5120, 160, "fp32", False, 132, wgmma_ws=True)
    assert cfg.params["block_n"] == 128 and cfg.params["block_n_tail"] == 32
    assert "block_n_tail=32" in cfg.describe()
    assert "block_n_tail" not in heuristic_config(8192, 7168, 256, "fp32", False, 132, wgmma_ws=True).params
    # Kimi-K2's 384 experts: 192-wide tiles (the 64-column tail split between the consumers) from
    # 2048 tokens, 128-wide below; five stages of 320 rows fit in shared memory, six do not
    kimi = heuristic_config(2048, 7168, 384, "fp32", False, 132, wgmma_ws=True)
    assert kimi.params["block_n_tail"] == 64 and kimi.params["num_stages"] == 5
    assert wgmma_ws_tiles(2048, 384, 128, 64) == 32 and kimi.params["k_per_split"] == 1792
    assert "block_n_tail" not in heuristic_config(1024, 7168, 384, "fp32", False, 132, wgmma_ws=True).params
    assert wgmma_ws_tiles(8192, 160, 128, 32) == 64 and wgmma_ws_tiles(8192, 160, 128) == 128
    assert wgmma_ws_split(8192, 5120, 160, 128, 132, 32) == 2560  # 64 tiles x 2 splits
    assert [wgmma_ws_stages(128, 64, t) for t in (0, 32)] == [6, 6]
    assert wgmma_ws_stages(128, 128, 32) == 3
    for tail in (0, 16, 32, 64):
        assert wgmma_ws_stages(128, 64, tail) * (256 + tail) * 64 * 2 <= WGMMA_WS_SMEM_BYTES


@pytest.mark.parametrize(
    "units,groups,chains", [(64 * 28, 44, 28), (16 * 28, 44, 28), (7, 3, 7), (40, 40, 5)]
)
def test_streamk_schedule_covers_every_chain_once_and_slots_follow_k_order(units, groups, chains):
    """The stream-K groups' shares of the row blocks' chains (the kernels' arithmetic, written
    out): every row block's chains covered once, in group order; the kernels' slot formula
    (g - the row block's first group) is the group's place in that order; the workspace has a
    slot for every one."""
    from csrc_triton.router_gemm_wgmma_ws import streamk_schedule, streamk_slots

    blocks = streamk_schedule(units, groups, chains)
    assert len(blocks) == units // chains
    for t, segments in enumerate(blocks):
        assert sum(n for _, n in segments) == chains
        first = ((t * chains + 1) * groups - 1) // units
        assert [g - first for g, _ in segments] == list(range(len(segments)))
    assert streamk_slots(units, groups, chains) == max(len(s) for s in blocks)


def test_streamk_fixup_adds_shared_tiles_partials_in_slot_order(gen):
    """The stream-K fixup kernel (plain Triton, so under the interpreter here): each shared tile's
    partials added in slot (K) order into its logits; tiles run by one group left as they are."""
    from csrc_triton.router_gemm_wgmma_ws import _streamk_fixup_kernel, streamk_schedule, streamk_slots

    m, n, bm, bn, chains, groups = 300, 96, 128, 32, 5, 7
    tiles_n = -(-n // bn)
    units = -(-m // bm) * chains
    slots = streamk_slots(units, groups, chains)
    ws = torch.randn(slots, m, n, generator=gen).to(DEV)
    out = _poisoned(m, n, torch.float32)
    whole = torch.randn(m, n, generator=gen).to(DEV)
    expected = whole.clone()
    for t, segments in enumerate(streamk_schedule(units, groups, chains)):
        rows = slice(t * bm, (t + 1) * bm)
        if len(segments) == 1:
            out[rows] = whole[rows]  # stored by its one group
        else:
            total = ws[0, rows].clone()
            for j in range(1, len(segments)):
                total += ws[j, rows]
            expected[rows] = total
    _streamk_fixup_kernel[(units // chains * tiles_n * (bm // 32),)](
        ws, out, m, n, ws.stride(0), ws.stride(1), out.stride(0), units, groups, tiles_n,
        CHAINS=chains, BM=bm, BN=bn, SUB_M=32, SLOTS=slots, PDL=False,
    )  # fmt: skip
    assert torch.equal(out, expected)


def test_wgmma_ws_config_falls_back_to_triton_where_it_cannot_run(gen, caplog):
    """Under the interpreter (as for an fp32 weight, unaligned rows or a Triton without Gluon on a
    GPU) a wgmma_ws config runs the heuristic's Triton kernel: same accuracy, one log line."""
    from csrc_triton.configs import wgmma_ws_config
    from csrc_triton.router_gemm_wgmma_ws import unsupported_reason

    x, w = _inputs(gen, 40, 300, 24, row_stride=320)
    assert "TRITON_INTERPRET" in unsupported_reason(x, w, 90) or DEV == "cuda"
    out = _poisoned(40, 24, torch.float32)
    with caplog.at_level("INFO", logger="vllm.vllm_router_ext.ops.dispatch"):
        run_config(wgmma_ws_config(128, 0), x, w, out, DOT_NATIVE)
    assert relative_error(out, reference_logits(x, w)) <= 1e-6
    if DEV == "cpu":
        assert "cannot run (TRITON_INTERPRET=1" in caplog.text


def test_wgmma_ws_requirements_name_the_problem(monkeypatch):
    from csrc_triton.configs import wgmma_ws_config
    from csrc_triton.router_gemm_wgmma_ws import GLUON, unsupported_reason, wgmma_ws_launch

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.zeros(4, 7168, dtype=torch.bfloat16)
    w = torch.zeros(256, 7168, dtype=torch.bfloat16)
    assert "needs 9.x" in unsupported_reason(x, w, 80)
    if GLUON:
        assert unsupported_reason(x, w, 90) is None
        assert "dtypes" in unsupported_reason(x, w.float(), 90)
        odd = torch.zeros(4, 7169, dtype=torch.bfloat16)[:, :7168]
        assert "16-byte" in unsupported_reason(odd, w, 90)
    out = torch.empty(4, 256)
    with pytest.raises(ValueError, match="promote_chunks=1 with block_k=64"):
        wgmma_ws_launch(x, w, out, block_n=128, block_k=64, promote_chunks=1, num_stages=6)
    with pytest.raises(ValueError, match="promote_chunks=8 with block_k=64"):
        wgmma_ws_launch(x, w, out, block_n=128, block_k=64, promote_chunks=8, num_stages=6)
    with pytest.raises(ValueError, match="fp32 logits"):
        wgmma_ws_launch(x, w, out.bfloat16(), block_n=128, block_k=64, promote_chunks=4, num_stages=6)
    with pytest.raises(ValueError, match="stream_k=132 shares whole tiles' chains"):
        wgmma_ws_launch(
            x, w, out, block_n=128, block_k=64, promote_chunks=4, num_stages=6, k_per_split=1024, stream_k=132
        )
    with pytest.raises(ValueError, match="block_n_tail=128; allowed: 0, 16, 32, 64"):
        wgmma_ws_launch(x, w, out, block_n=128, block_k=64, promote_chunks=4, num_stages=6, block_n_tail=128)
    with pytest.raises(ValueError, match="consumers=3; allowed: 1, 2"):
        wgmma_ws_launch(x, w, out, block_n=128, block_k=64, promote_chunks=4, num_stages=6, consumers=3)
    with pytest.raises(ValueError, match="stream_k=132 shares whole tiles' chains"):
        wgmma_ws_launch(
            x, w, out, block_n=128, block_k=64, promote_chunks=4, num_stages=6, stream_k=132, consumers=1
        )
    with pytest.raises(ValueError, match=r"pdl=3; allowed: 0 \(off\), 1 \(early\), 2 \(late\)"):
        wgmma_ws_launch(x, w, out, block_n=128, block_k=64, promote_chunks=4, num_stages=6, pdl=3)
    assert "consumers=1" in wgmma_ws_config(128, 0, consumers=1).describe()
    assert "consumers" not in wgmma_ws_config(128, 0).params  # tables without the key stay valid


def test_tuned_table_lookup(monkeypatch):
    import csrc_triton.configs as c

    table = {
        "shapes": {
            "7168x256": {
                "bf16-fp32out": [
                    {
                        "max_m": 16,
                        "kernel": "splitk",
                        "block_m": 16,
                        "block_n": 16,
                        "block_k": 128,
                        "k_per_split": 512,
                    },
                    {"max_m": 512, "kernel": "cublas"},
                    {"max_m": None, "kernel": "tiled", "block_m": 128, "block_n": 128, "block_k": 64},
                ]
            }
        }
    }
    monkeypatch.setattr(c, "load_table", lambda name: table)
    assert select_config(8, 7168, 256, "bf16-fp32out", False, "GPU", 132).kernel == "splitk"
    assert select_config(100, 7168, 256, "bf16-fp32out", False, "GPU", 132).kernel == "cublas"
    assert select_config(9000, 7168, 256, "bf16-fp32out", False, "GPU", 132).kernel == "tiled"
    # cuBLAS serves the bf16 mode too (bf16 logits), never the fp32 mode, never off-GPU.
    assert select_config(100, 7168, 256, "bf16", False, "GPU", 132).kernel == "cublas"
    assert select_config(100, 7168, 256, "fp32", False, "GPU", 132).source == "heuristic"
    assert select_config(100, 7168, 256, "bf16", False, "GPU", 132, cublas=False).kernel == "splitk"


def test_startup_description_of_the_cuda_dispatch(monkeypatch):
    """The implementation named in the start-up log line, against the shipped H200 table."""
    import vllm_router_ext.ops.dispatch as d

    monkeypatch.setattr(d, "_device_info", lambda index: ("NVIDIA H200", 132, 90))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.bfloat16, 7168, 256)
    assert "promoted fp32 accumulation" in text and "tuned table" in text and "16-bit MMA" in text
    assert text.startswith("by M at run time: triton GEMV (fp32 FMA) M<=16, triton split-K M<=")
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, False, torch.bfloat16, 7168, 256)
    assert text.endswith("cuBLAS above (16-bit MMA; tuned table nvidia_h200)"), text
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.float32, 7168, 256)
    assert "fp32 weight split into 3 bf16 MMAs" in text
    assert text.endswith(
        "; from M=1024: one GEMM on the weight's three bf16 terms (split once at load), "
        "hi + mid + lo added per logit"
    )
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.float32, 2048, 64)
    assert "three bf16 terms" not in text  # DeepSeek-V2-Lite's 64 experts keep the in-kernel split
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, True, torch.bfloat16, 7168, 256)
    assert text.startswith("batch-invariant triton split-K, K split 512 (BLOCK_K 128) fixed for every M")
    assert "splits added in order" in text
    assert "; splits summed in one program from M=" in text
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, True, torch.bfloat16, 1000, 10)
    # the heuristic (no table for this shape): split tiles while the partials are few (to 2048 here)
    assert "splits summed in one program from M=2049 " in text and "heuristic" in text
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, False, torch.bfloat16, 1000, 10)
    assert "heuristic configs" in text


def test_batch_invariant_buckets_start_where_the_table_or_heuristic_changes(table_env, tmp_path):
    """The self-check probes M at and below every start of a batch-invariant bucket: the starts
    must be exact wherever a bucket ends (a table retuned at 768 tokens, the heuristic's switch
    where the split partials outgrow its limit), not only just above powers of two."""
    import csrc_triton.configs as c

    table_env(None)
    table = c.load_table("NVIDIA H200")["shapes"]
    for key, entry in table.items():
        k, n = map(int, key.split("x"))
        for mode in ("bf16-fp32out", "fp32"):
            buckets = entry[f"{mode}/batch_invariant"]
            notes = ("max_m", "us", "fastest_us")
            launch = [{a: b for a, b in bk.items() if a not in notes} for bk in buckets]
            ends = [bk["max_m"] for i, bk in enumerate(buckets[:-1]) if launch[i] != launch[i + 1]]
            expected = [1] + [m + 1 for m in ends]
            buckets_here = startup.batch_invariant_buckets(k, n, RouterPrecision(mode), "NVIDIA H200", 132)
            got = [m for m, _ in buckets_here]
            assert got == expected, (key, mode)
    # the heuristic (an H100): DeepSeek-V3's split tiles end where M x 256 x 28 reaches 6 x 2^20
    h100 = startup.batch_invariant_buckets(7168, 256, RouterPrecision.FP32, "NVIDIA H100 80GB HBM3", 132)
    got = [m for m, _ in h100]
    assert 65 in got and 878 in got and 1025 in got and 257 not in got  # 65-877: the same split tiles
    # a table of one's own (VLLM_ROUTER_EXT_TABLE=path) whose bucket ends above 16384 tokens
    v3 = table["7168x256"]["fp32/batch_invariant"]
    custom = {"shapes": {"7168x256": {"fp32/batch_invariant": [{**v3[-2], "max_m": 20000}, v3[-1]]}}}
    path = tmp_path / "big.json"
    path.write_text(json.dumps(custom))
    table_env(str(path))
    got = [m for m, _ in startup.batch_invariant_buckets(7168, 256, RouterPrecision.FP32, "NVIDIA H200", 132)]
    assert got == [1, 20001]


def test_table_override_picks_a_table_or_the_heuristic(table_env, tmp_path):
    """VLLM_ROUTER_EXT_TABLE: unset = the GPU's own table (none for an H100), a shipped table by
    name, ``none`` = the heuristic, a JSON path; a bad value names itself and the allowed ones;
    ``table_override`` (the benchmark's heuristic columns) wins over the variable."""
    import csrc_triton.configs as c

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    table_env(None)

    def pick(device: str, m: int = 300, mode: str = "fp32", bi: bool = False) -> KernelConfig:
        return select_config(m, 7168, 256, mode, bi, device, 132)

    heuristic = heuristic_config(300, 7168, 256, "fp32", False, 132, cublas=True)
    assert pick(h100) == heuristic and c.table_name(h100) == "nvidia_h100_80gb_hbm3"
    tuned = pick(h200)
    assert tuned.source == "tuned nvidia_h200" and tuned != heuristic
    table_env("nvidia_h200")
    on_h100 = pick(h100)
    assert on_h100.params == tuned.params and on_h100.source == "tuned nvidia_h200 (VLLM_ROUTER_EXT_TABLE)"
    assert pick(h100, 1, bi=True).params == pick(h200, 1, bi=True).params
    table_env("none")
    assert pick(h200) == heuristic and c.load_table(h200) == {}
    assert c.table_label(h200) == "none (heuristic)"
    own = tmp_path / "my_gpu.json"
    bucket = dict(max_m=None, kernel="splitk", block_m=16, block_n=16, block_k=128, k_per_split=1024)
    own.write_text(json.dumps({"shapes": {"7168x256": {"fp32": [bucket]}}}))
    table_env(str(own))
    assert pick(h100).params["k_per_split"] == 1024 and "my_gpu.json" in pick(h100).source
    assert pick(h100, mode="bf16-fp32out").kernel == "cublas"  # no such mode in the file: the heuristic
    with c.table_override("nvidia_h200"):
        assert pick(h100).params == tuned.params
    assert pick(h100).params["k_per_split"] == 1024
    for bad, message in (
        ("nvidia_h100", "'nvidia_h100' is not a tuned table; allowed: none, nvidia_h200, a path"),
        (str(tmp_path / "missing.json"), "no such file"),
    ):
        table_env(bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            pick(h200)
        with pytest.raises(ValueError, match="VLLM_ROUTER_EXT_TABLE"):
            c.table_choice()
    (tmp_path / "list.json").write_text("[]")
    table_env(str(tmp_path / "list.json"))
    with pytest.raises(ValueError, match="not a tuned table"):
        pick(h200)
    table_env(None)
    with pytest.raises(ValueError, match="allowed: none"), c.table_override("h200"):
        pass


def test_startup_description_names_the_table_override(monkeypatch, table_env):
    import vllm_router_ext.ops.dispatch as d

    monkeypatch.setattr(d, "_device_info", lambda index: ("NVIDIA H100 80GB HBM3", 132, 90))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    table_env(None)
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.bfloat16, 7168, 256)
    assert text.endswith("heuristic configs: no 7168x256 entry in table nvidia_h100_80gb_hbm3)"), text
    table_env("nvidia_h200")
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.bfloat16, 7168, 256)
    assert text.endswith("tuned table nvidia_h200 (VLLM_ROUTER_EXT_TABLE))"), text
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, True, torch.bfloat16, 7168, 256)
    assert "tuned nvidia_h200 (VLLM_ROUTER_EXT_TABLE)" in text
    table_env("none")
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, False, torch.bfloat16, 7168, 256)
    assert text.endswith("heuristic configs: VLLM_ROUTER_EXT_TABLE=none)"), text


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


def test_split_sum_variants_launch_one_sum_each_way():
    """What the tuner times per bucket: the split-K kernel's ticket and two launches with PDL, the
    ``wgmma_ws`` sum plain / PDL early / PDL late; nothing for configs without a cross-program sum
    (one split, every split in one program, the fixed-point sum). The other parameters are kept."""
    from csrc_triton.configs import split_sum_variants, splitk_config, wgmma_ws_config

    cfg = splitk_config(64, 64, 128, 1024, "fp32")
    variants = split_sum_variants(KernelConfig("splitk", {**cfg.params, "pdl": True, "ticket": False}), 7168)
    assert [v.params.get("ticket", True) for v in variants] == [True, False]
    assert [bool(v.params.get("pdl")) for v in variants] == [False, True]
    launch_keys = ("ticket", "pdl")
    assert all({k: v for k, v in c.params.items() if k not in launch_keys} == cfg.params for c in variants)
    assert variants[1].describe().endswith(",two_launch,pdl)")
    assert split_sum_variants(cfg, 1024) == []  # one split
    assert split_sum_variants(KernelConfig("splitk", {**cfg.params, "splits_in_program": True}), 7168) == []
    assert split_sum_variants(KernelConfig("splitk", {**cfg.params, "fixed_point": True}), 7168) == []
    ws = split_sum_variants(wgmma_ws_config(128, 1792), 7168)
    assert [v.params.get("pdl", 0) for v in ws] == [0, 1, 2]
    assert ws[1].describe().endswith(",pdl)") and ws[2].describe().endswith(",pdl(late))")
    assert split_sum_variants(wgmma_ws_config(128, 0), 7168) == []
    assert len(split_sum_variants(wgmma_ws_config(128, 0, stream_k=132), 7168)) == 3  # its fixup


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
