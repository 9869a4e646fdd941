"""GPU checks of the router GEMM (``gpu`` marker; run on the device machine, skipped on CPU)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from csrc_triton import choice
from csrc_triton.dispatch import launch_exactly, launch_into
from csrc_triton.launches import GemvLaunch, SplitKLaunch, WgmmaWsLaunch, describe, fields, from_bucket
from csrc_triton.problem import Device, Precision, Problem
from vllm_router_ext.bench_harness import FAMILY_SHAPES, SHAPES, RouterShape
from vllm_router_ext.ops import router_gemm
from vllm_router_ext.ops.router_gemm import fp32_weight_terms
from vllm_router_ext.ops.routing_fp64 import changed_expert_sets, select_experts
from vllm_router_ext.precision import RouterPrecision

pytestmark = pytest.mark.gpu


def _one_per_gate() -> list[RouterShape]:
    """One shape per distinct gate (GLM-4.5's is DeepSeek-V2's)."""
    gates: dict[tuple[int, int], RouterShape] = {}
    for shape in (*SHAPES, *FAMILY_SHAPES):
        gates.setdefault((shape.k, shape.n), shape)
    return list(gates.values())


GATES = _one_per_gate()
MS = [0, 1, 3, 17, 255, 4097]
NEEDLE_MS = [1, 2, 3, 8, 16, 17, 64, 255, 256, 1024, 4096, 16384]


def _rel(out, x, w):
    ref = x.double() @ w.double().T
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _pick(x, w, mode, batch_invariant=False):
    """What the dispatch launches for these tensors."""
    return choice.choose(Problem.of(x, w, Precision(mode), batch_invariant))


def _run(launch, x, w, out):
    return launch_into(launch, x.contiguous() if launch.kernel == "cublas" else x, w, out)


def _xw(m, shape, w_dtype=torch.bfloat16, row_stride=None):
    k = shape.k
    xs = torch.randn(m, row_stride or k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(shape.n, k, device="cuda") / k**0.5).to(w_dtype)
    return xs[:, :k], w


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32", "bf16"])
def test_every_shape_and_m_poisoned_and_accurate(shape, mode):
    prec = Precision(mode)
    for m in MS:
        x, w = _xw(m, shape, row_stride=shape.k + 64)  # non-contiguous rows
        cfg = _pick(x, w, prec)
        out_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        out = torch.full((m, shape.n), float("nan"), dtype=out_dtype, device="cuda")
        res = _run(cfg, x, w, out)
        assert not res.isnan().any(), (m, describe(cfg))
        via_op = router_gemm(x, w, mode)
        assert via_op.dtype == out_dtype and via_op.shape == (m, shape.n)
        if m:
            tol = {"fp32": 1e-6, "bf16-fp32out": 1e-5, "bf16": 8e-3}[mode]
            assert _rel(via_op, x, w) <= tol, (m, cfg.describe())


@pytest.mark.parametrize("mode", ["bf16-fp32out", "bf16"])
def test_a_16_bit_mode_on_an_fp32_weight_runs_triton_not_cublas(mode):
    """cuBLAS multiplies one dtype: bf16 activations with a genuinely fp32 weight in a 16-bit mode
    run the Triton kernels at every M. bf16-fp32out has no promotion: the weight's three terms'
    products accumulate in one tensor-core chain per split (up to 3584 along K), 1.23e-5 measured
    on the H200 at 4096 tokens, hence 2e-5 (a bf16 weight's bound is 1e-5)."""
    shape = SHAPES[0]
    for m in (1, 65, 300, 4096):
        x, w = _xw(m, shape, w_dtype=torch.float32)
        assert _pick(x, w, mode).kernel != "cublas", m
        out = router_gemm(x, w, mode)
        assert _rel(out, x, w) <= (2e-5 if mode == "bf16-fp32out" else 8e-3), m


def _table_buckets_at_both_ends():
    """(shape, table key, config, M) for every bucket of the shipped H200 table, non-invariant and
    the ``/triton`` fallbacks, at its first and its last M (capped at 8192)."""
    from csrc_triton.tables import table_buckets, table_override

    cases = []
    with table_override("nvidia_h200"):
        for shape in GATES:
            for key in ("bf16-fp32out", "fp32", "fp32/triton"):
                low = 1
                for bucket in table_buckets("NVIDIA H200", shape.k, shape.n, key):
                    high = min(bucket["max_m"] or 16384, 8192)
                    cfg = from_bucket(bucket, "tuned nvidia_h200")
                    cases += [(shape, key, cfg, m) for m in sorted({low, high}) if m >= low]
                    low = (bucket["max_m"] or 16384) + 1
    return cases


@pytest.mark.parametrize(
    "shape, key, cfg, m",
    _table_buckets_at_both_ends(),
    ids=lambda v: getattr(v, "name", None) or (describe(v) if hasattr(v, "kernel") else str(v)),
)
def test_every_table_bucket_at_both_ends(shape, key, cfg, m):
    """Each bucket of the shipped H200 table, at its first and last M: the dispatch picks it
    (with the table forced, as on an H200), and its logits are all written and accurate."""
    from csrc_triton.tables import table_override

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the H200 table's wgmma_ws / PDL configs are for Hopper")
    mode = key.split("/")[0]
    x, w = _xw(m, shape, row_stride=shape.k + 64)
    if key == mode:
        with table_override("nvidia_h200"):
            picked = _pick(x, w, mode)
        resolved = choice.resolve(cfg, Problem.of(x, w, Precision(mode)))
        assert (picked.kernel, fields(picked)) == (resolved.kernel, fields(resolved)), (m, describe(picked))
    out = torch.full((m, shape.n), float("nan"), device="cuda")
    res = _run(cfg, x, w, out)
    tol = 1e-6 if mode == "fp32" else 1e-5
    assert not res.isnan().any() and _rel(res, x, w) <= tol, (m, describe(cfg))


GEMV_LAUNCHES = [  # the tuner's GEMV space at its corners
    GemvLaunch(block_m=1, block_n=1, num_warps=8),
    GemvLaunch(block_m=1, block_n=1, num_warps=16),
    GemvLaunch(block_m=2, block_n=2, num_warps=8),
    GemvLaunch(block_m=4, block_n=4, num_warps=4),
    GemvLaunch(block_m=1, block_n=2, num_warps=4, maxnreg=255),
    GemvLaunch(block_m=2, block_n=2, num_warps=4, copy_stages=7),
    GemvLaunch(block_m=4, block_n=2, num_warps=4, copy_stages=2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("cfg", GEMV_LAUNCHES, ids=describe)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weight", "fp32-weight"])
def test_gemv_kernel_poisoned_and_accurate(shape, cfg, w_dtype):
    """Every GEMV launch shape the tuner may pick, on every shape, with strided activations: all
    of ``out`` written, fp32-upcast accuracy (it is an fp32 FMA kernel)."""
    for m in (1, 2, 3, 5, 16, 17):
        x, w = _xw(m, shape, w_dtype=w_dtype, row_stride=shape.k + 64)
        out = torch.full((m, shape.n), float("nan"), device="cuda")
        _run(cfg, x, w, out)
        assert not out.isnan().any(), (m, describe(cfg))
        assert _rel(out, x, w) <= 1e-6, (m, describe(cfg))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_gemv_launch_options_are_bitwise_the_plain_gemv(shape):
    """On the GPU too, copying chunks ahead (cp.async) or raising ptxas's register budget only
    moves the loads: the same FMAs in the same order, bitwise the same logits."""
    plain = GemvLaunch(block_m=2, block_n=2, num_warps=4)
    for m in (1, 4, 7):
        x, w = _xw(m, shape, w_dtype=torch.bfloat16, row_stride=shape.k + 64)
        outs = []
        for options in ({}, dict(copy_stages=7), dict(maxnreg=255)):
            out = torch.full((m, shape.n), float("nan"), device="cuda")
            _run(replace(plain, **options), x, w, out)
            outs.append(out)
        assert all(torch.equal(outs[0], o) for o in outs[1:]), m


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


def _wgmma_ws_unmet() -> str | None:
    """Why this GPU cannot run the wgmma_ws kernel (what its launch type declares); None: it can."""
    major, minor = torch.cuda.get_device_capability()
    return WgmmaWsLaunch.needs.unmet(10 * major + minor)


WGMMA_WS_SPLITS = [0, 1792, 1024]  # none; whole chains per split; a split that ends mid-chain (K=5120)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("k_per_split", WGMMA_WS_SPLITS, ids=lambda v: f"kps{v}")
@pytest.mark.parametrize("block_n", [128, 64])
def test_wgmma_ws_kernel_poisoned_and_accurate(shape, k_per_split, block_n):
    """The warp-specialised wgmma kernel (Hopper), unsplit and split, both tile widths, on every
    shape, M around its 128-row tiles, strided activations: all of ``out`` written, fp32-mode
    accuracy (<= 1e-6: an unpromoted whole-K chain measures ~8e-6 at K=7168)."""
    if (unmet := _wgmma_ws_unmet()) is not None:
        pytest.skip(f"wgmma_ws cannot run here: {unmet}")
    cfg = choice.wgmma_ws(block_n, k_per_split)
    for m in (1, 3, 127, 128, 129, 1000, 4097):
        x, w = _xw(m, shape, row_stride=shape.k + 64)
        assert choice.wgmma_ws_problem(Problem.of(x, w, Precision.FP32)) is None
        out = torch.full((m, shape.n), float("nan"), device="cuda")
        launch_exactly(cfg, x, w, out)
        assert not out.isnan().any(), (m, describe(cfg))
        assert _rel(out, x, w) <= 1e-6, (m, describe(cfg))


def _written_accurate_and_bitwise(cfg, plain, shape, ms) -> None:
    """``cfg`` writes every logit of a poisoned output within 1e-6 of fp64, bitwise ``plain``'s."""
    for m in ms:
        x, w = _xw(m, shape, row_stride=shape.k + 64)
        out = torch.full((m, shape.n), float("nan"), device="cuda")
        launch_exactly(cfg, x, w, out)
        assert not out.isnan().any(), (m, describe(cfg))
        assert _rel(out, x, w) <= 1e-6, (m, describe(cfg))
        ref = launch_exactly(plain, x, w, torch.empty_like(out))
        assert torch.equal(out, ref), (m, describe(cfg))


#: (tail columns, K per split) of the wider tiles: 16/32-column tails on the first consumer for
#: all 128 rows, a 64-column tail split between the two consumers
WGMMA_WS_FORMS = [(tail, kps) for tail in (16, 32) for kps in (0, 1792)] + [
    (64, kps) for kps in WGMMA_WS_SPLITS
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("tail,k_per_split", WGMMA_WS_FORMS, ids=lambda v: str(v))
def test_wgmma_ws_wide_tiles_equal_to_plain_tiles(shape, tail, k_per_split):
    """Tiles of 128 + tail columns (a second accumulator and TMA block: 160 = 128 + 32 and 192 =
    128 + 64 experts in one tile): every logit written, fp32-mode accuracy, and bitwise the
    128-wide tiles' logits (per element the same chains and adds; a wrong tail offset, or a stage
    released before every wgmma reading it retired, would differ)."""
    if not _hopper():
        pytest.skip("wgmma_ws is a Hopper (sm_90) kernel")
    cfg = choice.wgmma_ws(128, k_per_split, block_n_tail=tail)
    plain = choice.wgmma_ws(128, k_per_split)
    _written_accurate_and_bitwise(cfg, plain, shape, (1, 129, 1000, 4097))


@pytest.mark.parametrize("shape", GATES, ids=lambda s: s.name)
@pytest.mark.parametrize("block_n", [128, 64])
@pytest.mark.parametrize("k_per_split", [0, 1024])
def test_wgmma_ws_64_row_tiles_equal_to_128_row_tiles(shape, block_n, k_per_split):
    """64-row tiles (one consumer warpgroup, two programs an SM): every logit written, fp32-mode
    accuracy, and bitwise the 128-row tiles' logits (per element the same chains and adds), with
    M below, at and across 64-row tile ends, on every gate shape."""
    if not _hopper():
        pytest.skip("wgmma_ws is a Hopper (sm_90) kernel")
    cfg = choice.wgmma_ws(block_n, k_per_split, block_m=64)
    plain = choice.wgmma_ws(block_n, k_per_split)
    _written_accurate_and_bitwise(cfg, plain, shape, (1, 63, 64, 65, 1000, 4097))


def test_wgmma_ws_falls_back_where_tma_cannot_read_the_rows():
    """Rows whose stride is not a multiple of 16 bytes cannot be TMA-loaded: the config runs on
    the heuristic's Triton kernel instead, with the same accuracy."""
    shape = SHAPES[0]
    x, w = _xw(300, shape, row_stride=shape.k + 1)
    assert "16-byte" in choice.wgmma_ws_problem(Problem.of(x, w, Precision.FP32))
    out = torch.full((300, shape.n), float("nan"), device="cuda")
    launch_into(choice.wgmma_ws(128, 1792), x, w, out)
    assert not out.isnan().any() and _rel(out, x, w) <= 1e-6


@pytest.mark.parametrize(
    "k_per_split,tail", [(0, 0), (1792, 0), (0, 32), (1792, 32), (0, 64), (1792, 64)], ids=lambda v: str(v)
)
def test_wgmma_ws_graph_replay_equals_eager(k_per_split, tail):
    if not _hopper():
        pytest.skip("wgmma_ws is a Hopper (sm_90) kernel")
    cfg = choice.wgmma_ws(128, k_per_split, block_n_tail=tail)
    x, w = _xw(2000, SHAPES[1])
    eager = launch_exactly(cfg, x, w, torch.empty(2000, w.shape[0], device="cuda"))
    out = torch.full_like(eager, float("nan"))
    launch_exactly(cfg, x, w, out)  # warm-up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_exactly(cfg, x, w, out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


#: K-split launches whose split sum is launched each way: the split-K kernel's ticket (one
#: launch) and two launches with PDL, fp32 promotion and bf16-fp32out (no promotion); ``wgmma_ws``
#: with the sum plain, PDL let go early and late, with a 64-column split tail.
SPLIT_SUM_FORMS = [
    SplitKLaunch(block_m=64, block_n=64, block_k=128, k_per_split=1024, promote_chunks=2, num_stages=3),
    SplitKLaunch(block_m=16, block_n=16, block_k=128, k_per_split=512, promote_chunks=4, num_stages=1),
    WgmmaWsLaunch(block_n=128, block_k=64, k_per_split=1024, promote_chunks=4, num_stages=6),
    WgmmaWsLaunch(block_n=128, block_n_tail=64, block_k=64, k_per_split=1792, promote_chunks=4, num_stages=5),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("launch", SPLIT_SUM_FORMS, ids=describe)
def test_split_sum_launch_forms_bitwise_equal_eager_and_graphs(shape, launch):
    """The K-split sum's launch forms (``split_sum_variants``, which the tuner times: ticket or
    two launches with the second a programmatic dependent launch; PDL early or late) add the same
    partials in the same order: bitwise the same logits, every one written, in eager mode and in
    CUDA-graph replay. A dependent launch that read the partials before its ``griddepcontrol.wait``
    (or a first kernel that let it go before its stores were ordered) would differ or leave NaN."""
    kernel = launch.kernel
    if kernel == "wgmma_ws" and (unmet := _wgmma_ws_unmet()) is not None:
        pytest.skip(f"wgmma_ws cannot run here: {unmet}")
    if getattr(launch, "block_n_tail", 0) and shape.n % 192:
        pytest.skip("192-wide tiles are for N divisible by 192")
    import os

    from csrc_triton.pdl import ENV_VAR, pdl_enabled

    assert os.environ.get(ENV_VAR, "1") != "0"
    assert pdl_enabled(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    variants = choice.split_sum_variants(launch, shape.k)
    assert len(variants) == (2 if kernel == "splitk" else 3)
    for m in (1, 300, 2000):
        x, w = _xw(m, shape)
        ref = launch_exactly(variants[0], x, w, torch.full((m, shape.n), float("nan"), device="cuda"))
        assert not ref.isnan().any() and _rel(ref, x, w) <= 1e-6, (m, describe(variants[0]))
        for cfg in variants[1:]:
            out = torch.full_like(ref, float("nan"))
            launch_exactly(cfg, x, w, out)
            assert torch.equal(out, ref), (m, describe(cfg))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                launch_exactly(cfg, x, w, out)
            for _ in range(3):
                out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, ref), (m, describe(cfg), "graph replay")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("promote_chunks", [0, 2], ids=["bf16-fp32out", "fp32"])
def test_flat_chain_is_bitwise_the_unrolled_split(shape, promote_chunks):
    """``flat_chain`` (a split that is one MMA chain looped over its chunks, so that the compiler
    pipelines it: the bf16-fp32out buckets at 128-512 tokens) does the same MMAs into the same
    accumulator as the unrolled split: bitwise the same logits, every one written, accurate."""
    kps = 512 if promote_chunks == 0 else 256  # one chain a split: 4 chunks, or fp32's 2
    base = SplitKLaunch(64, 64, 128, kps, promote_chunks=promote_chunks, ticket=False, pdl=True)
    for m in (1, 300, 2000):
        x, w = _xw(m, shape)
        nan = torch.full((m, shape.n), float("nan"), device="cuda")
        unrolled = launch_into(replace(base, num_stages=1), x, w, nan.clone())
        flat = launch_into(replace(base, num_stages=3, flat_chain=True), x, w, nan)
        assert not unrolled.isnan().any() and torch.equal(flat, unrolled), m
        assert _rel(flat, x, w) <= (1e-5 if promote_chunks == 0 else 1e-6), m


@pytest.mark.parametrize("m", [0, 1, 7, 16, 300, 4096, 16384])
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weight", "fp32-weight"])
def test_fp32_mode_accuracy(m, w_dtype):
    x, w = _xw(m, SHAPES[0], w_dtype=w_dtype)
    out = router_gemm(x, w, "fp32")
    assert out.shape == (m, 256)
    if m:
        assert _rel(out, x, w) <= 1e-6


@pytest.mark.parametrize("table", ["nvidia_h200", "none"])
@pytest.mark.parametrize("shape", GATES, ids=lambda s: s.name)
def test_fp32_weight_with_its_terms_accurate_and_graph_safe(shape, table):
    """What the gate layer runs for a genuinely fp32 weight, with the H200 table and with the
    heuristic: the op with the weight's bf16 terms (one promoted GEMM on them from
    FP32_WEIGHT_TERMS_FROM_M tokens, the weight itself below), against fp64."""
    from csrc_triton.tables import table_override

    w = torch.randn(shape.n, shape.k, device="cuda") / shape.k**0.5
    assert not torch.equal(w.to(torch.bfloat16).float(), w)
    terms = fp32_weight_terms(w)
    with table_override(table):
        for m in [0, 1, 7, 12, 65, 300, 1023, 1024, 2048, 4096, 16384]:
            x = torch.randn(m, shape.k, device="cuda").to(torch.bfloat16)
            out = router_gemm(x, w, "fp32", weight_terms=terms)
            assert out.shape == (m, shape.n) and out.dtype == torch.float32
            if m:
                assert _rel(out, x, w) <= 1e-6, m
        x = torch.randn(2048, shape.k, device="cuda").to(torch.bfloat16)
        eager = router_gemm(x, w, "fp32", weight_terms=terms)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            captured = router_gemm(x, w, "fp32", weight_terms=terms)
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(captured, eager)


@pytest.mark.parametrize("use_terms", [False, True])
def test_fp32_weight_near_the_fp32_maximum_stays_finite(use_terms):
    """Rounding 3.4e38 to bf16 gives inf: both three-term splits (in the kernels, and the terms
    made at load) truncate instead."""
    shape = SHAPES[0]
    w = torch.randn(shape.n, shape.k, device="cuda") / shape.k**0.5
    w[3, ::64] = 3.4e38 * torch.sign(torch.randn(shape.k // 64, device="cuda"))
    for m in [1, 17, 300, 2048]:
        x = (torch.randn(m, shape.k, device="cuda") * 1e-3).to(torch.bfloat16)
        terms = fp32_weight_terms(w) if use_terms else None
        out = router_gemm(x, w, "fp32", weight_terms=terms)
        assert torch.isfinite(out).all(), m
        ref = x.double() @ w.double().T
        # the huge column's terms cancel: fp32 sums are bounded against the sum of the terms' sizes
        size = x.double().abs() @ w[3].double().abs()
        assert ((out[:, 3].double() - ref[:, 3]).norm() / size.norm()).item() <= 1e-6, m
        assert _rel(out[:, 4:], x, w[4:]) <= 1e-6, m


def test_fp32_mode_changes_no_expert_set_on_8192_tokens():
    shape = SHAPES[0]
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(8192, shape.k, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(shape.n, shape.k, device="cuda", generator=g) / shape.k**0.5).to(torch.bfloat16)
    bias = torch.randn(shape.n, device="cuda", generator=g) * 0.01
    ref_ids = select_experts(x.double() @ w.double().T, shape.routing, bias.double())[0]
    ids = select_experts(router_gemm(x, w, "fp32").double(), shape.routing, bias.double())[0]
    assert changed_expert_sets(ids, ref_ids).sum().item() == 0


@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32", "bf16"])
def test_cuda_graph_replay_equals_eager(mode):
    shape = SHAPES[0]
    for m in (1, 17, 300, 4097):
        x, w = _xw(m, shape)
        x = x.contiguous()
        eager = router_gemm(x, w, mode)
        static_x = x.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            router_gemm(static_x, w, mode)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = router_gemm(static_x, w, mode)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(static_out, eager), m


def _needle_eager_and_graphs(shape, mode):
    needle, w = _xw(1, shape)
    needle = needle.contiguous()
    alone = router_gemm(needle, w, mode, batch_invariant=True)
    assert _rel(alone, needle, w) <= (1e-6 if mode == "fp32" else 1e-5)
    for m in NEEDLE_MS:
        x = torch.randn(m, shape.k, device="cuda").to(torch.bfloat16)
        positions = sorted({0, 1, m // 2, m - 1} & set(range(m)))
        for pos in positions:
            x[pos] = needle[0]
        out = router_gemm(x, w, mode, batch_invariant=True)
        for pos in positions:
            assert torch.equal(out[pos : pos + 1], alone), (m, pos, "eager")
        graph = torch.cuda.CUDAGraph()
        router_gemm(x, w, mode, batch_invariant=True)
        with torch.cuda.graph(graph):
            g_out = router_gemm(x, w, mode, batch_invariant=True)
        for _ in range(10):
            graph.replay()
            torch.cuda.synchronize()
            for pos in positions:
                assert torch.equal(g_out[pos : pos + 1], alone), (m, pos, "graph")


@pytest.mark.parametrize("shape", GATES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32"])
def test_batch_invariant_needle_eager_and_graphs(shape, mode):
    """What this GPU runs in batch-invariant mode on every gate: one token's logits bitwise the same
    at every M and position, eager and in CUDA graphs."""
    _needle_eager_and_graphs(shape, mode)


#: M at and beside every switch of the heuristic (GEMV, split-K, pipelined split-K / its K split / cuBLAS,
#: wgmma_ws and its 192-wide tiles, tiled; batch invariance: splits summed in one program).
HEURISTIC_MS = [
    1, 4, 5, 8, 9, 16, 17, 64, 65, 128, 129, 256, 257, 512, 513, 1023, 1024, 2048, 2049, 8192, 8193,
]  # fmt: skip


@pytest.mark.parametrize("shape", GATES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32", "bf16"])
def test_heuristic_without_a_table_poisoned_and_accurate(shape, mode):
    """What a GPU without a tuned table runs (``VLLM_ROUTER_EXT_TABLE=none`` here): every
    heuristic config at and beside its switch points, poisoned, against fp64, and through the op."""
    from csrc_triton.tables import table_override

    prec = Precision(mode)
    tol = {"fp32": 1e-6, "bf16-fp32out": 1e-5, "bf16": 8e-3}[mode]
    out_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    with table_override("none"):
        for m in HEURISTIC_MS:
            x, w = _xw(m, shape, row_stride=shape.k + 64)  # non-contiguous rows
            cfg = _pick(x, w, prec)
            assert cfg.source == "heuristic", cfg
            out = torch.full((m, shape.n), float("nan"), dtype=out_dtype, device="cuda")
            res = _run(cfg, x, w, out)
            assert not res.isnan().any() and _rel(res, x, w) <= tol, (m, describe(cfg))
            via_op = router_gemm(x, w, mode)
            assert via_op.dtype == out_dtype and _rel(via_op, x, w) <= tol, (m, describe(cfg))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32"])
def test_heuristic_batch_invariant_needle_eager_and_graphs(shape, mode):
    """The needle test on the heuristic's batch-invariant configs (no tuned table), and the
    start-up self-check's probes for them."""
    from csrc_triton.tables import table_override
    from vllm_router_ext.selfcheck import check_batch_invariance, probe_sizes

    with table_override("none"):
        _needle_eager_and_graphs(shape, mode)
        w = _xw(1, shape)[1]
        sizes = probe_sizes(w, RouterPrecision(mode))
        row = torch.empty(1, shape.k, device="cuda", dtype=torch.bfloat16)
        launches = {m: _pick(row.expand(m, -1), w, mode, True) for m in sizes}
        fused = [m for m in sizes if launches[m].splits_in_program]
        assert fused and fused[0] - 1 in sizes  # the heuristic's switch to splits in one program
        check_batch_invariance(lambda x, w: router_gemm(x, w, mode, batch_invariant=True), w, sizes=sizes)


def test_selfcheck_passes_on_the_invariant_kernel_and_refuses_a_variant_one():
    from vllm_router_ext.selfcheck import BatchInvarianceError, check_batch_invariance

    w = (torch.randn(256, 7168, device="cuda") / 84.7).to(torch.bfloat16)
    check_batch_invariance(lambda x, w: router_gemm(x, w, "fp32", batch_invariant=True), w)
    # The non-invariant dispatch changes kernel and K split with M: the check must see it.
    with pytest.raises(BatchInvarianceError):
        check_batch_invariance(
            lambda x, w: router_gemm(x, w, "bf16-fp32out"), w, sizes=(1, 2, 3, 17, 64, 255, 4096)
        )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32"])
def test_splits_in_program_bitwise_equal_ticket_reduction(shape, mode):
    """The batch-invariant tables sum a tile's splits in one program at large M and across
    programs at small M (a ticket): on the GPU's real MMAs (mma.sync for small tiles, wgmma for
    large ones) the logits must be bitwise the same for one K structure, and so must the
    heuristic's own pair."""
    x, w = _xw(300, shape)
    x = x.contiguous()
    fp32 = mode == "fp32"
    block_k = 128  # the fp32 mode: chains of two 128-wide chunks
    for kps in (512, 1024):
        ref = launch_into(
            choice.splitk(16, 16, block_k, kps, fp32),
            x,
            w,
            torch.full((300, shape.n), float("nan"), device="cuda"),
        )
        assert _rel(ref, x, w) <= (1e-6 if fp32 else 1e-5)
        for block_m, block_n, warps, stages in (
            (64, 32, 4, 3),
            (64, 128, 4, 3),
            (128, 64, 4, 3),
            (128, 128, 8, 3),
        ):
            cfg = choice.splitk(
                block_m, block_n, block_k, kps, fp32, warps, num_stages=stages, splits_in_program=True
            )
            out = launch_into(cfg, x, w, torch.full((300, shape.n), float("nan"), device="cuda"))
            assert torch.equal(out, ref), (kps, describe(cfg))
    h200 = Device("NVIDIA H200", 132, 90)
    small, large = (
        choice.heuristic(Problem(m, shape.k, shape.n, Precision(mode), True, device=h200)) for m in (1, 4096)
    )
    assert large.splits_in_program and not small.splits_in_program
    outs = [launch_into(c, x, w, torch.empty(300, shape.n, device="cuda")) for c in (small, large)]
    assert torch.equal(*outs)


@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32"])
def test_selfcheck_probes_every_batch_invariant_config_on_this_gpu(mode):
    """The start-up self-check runs one M per distinct batch-invariant config the dispatch can pick
    (derived from this GPU's table), and passes."""
    from vllm_router_ext.bench_harness import M_LIST
    from vllm_router_ext.selfcheck import check_batch_invariance, probe_sizes

    prec = RouterPrecision(mode)
    for shape in SHAPES:
        w = (torch.randn(shape.n, shape.k, device="cuda") / shape.k**0.5).to(torch.bfloat16)
        sizes = probe_sizes(w, prec)
        row = torch.empty(1, shape.k, device="cuda", dtype=torch.bfloat16)
        used = {_pick(row.expand(m, -1), w, mode, True) for m in (*M_LIST, 3000, 12000)}
        probed = {_pick(row.expand(m, -1), w, mode, True) for m in sizes}
        assert used <= probed, (shape.name, sizes)
        check_batch_invariance(lambda x, w: router_gemm(x, w, mode, batch_invariant=True), w, sizes=sizes)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_table_entry_too_big_for_this_gpu_is_shrunk_to_the_same_sums(monkeypatch, batch_invariant):
    """A config that needs more shared memory than the H200 has (as an H200 table would on a
    GPU with less): the op shrinks it (stages, then tiles) instead of failing, and the logits are
    bitwise those of a config that fits with the same K structure."""
    import csrc_triton.dispatch as d
    import csrc_triton.tables as t

    shape = SHAPES[0]
    big = dict(block_m=128, block_n=128, block_k=128, k_per_split=512, promote_chunks=2, num_warps=8)
    big["num_stages"] = 4  # fp32 mode: two 128-wide chunks per stage, 4 x 128 KB of shared memory
    key = "fp32/batch_invariant" if batch_invariant else "fp32"
    table = {"shapes": {f"{shape.k}x{shape.n}": {key: [{"max_m": None, "kernel": "splitk", **big}]}}}
    monkeypatch.setattr(t, "load_table", lambda name: table)
    monkeypatch.setattr(d, "_FITTED", {})
    x, w = _xw(300, shape)
    out = router_gemm(x, w, RouterPrecision.FP32, batch_invariant=batch_invariant)
    (fitted,) = d._FITTED.values()
    assert fitted.block_k == 128 and fitted.k_per_split == 512
    fits = SplitKLaunch(**dict(big, block_m=64, block_n=64, num_stages=1))
    ref = launch_into(fits, x, w, torch.full_like(out, float("nan")))
    assert torch.equal(out, ref)
    assert _rel(out, x, w) <= 1e-6


def _vllm_gate_kernel():
    """vLLM's ``ll_bf16_gemm``, or a skip saying why this process has none."""
    try:
        import vllm  # noqa: F401  only a process running vLLM asks for its kernel
    except ImportError:
        pytest.skip("needs vLLM >= 0.34 for its cuteDSL ll_bf16 kernel: vLLM is not installed here")
    from csrc_triton.capability import VLLM_GATE_MODULE, vllm_gate_available

    if not vllm_gate_available():
        pytest.skip("this vLLM's cuteDSL ll_bf16 kernel cannot run here (vLLM < 0.34, no CUTLASS DSL or GPU)")
    import importlib

    return importlib.import_module(VLLM_GATE_MODULE).ll_bf16_gemm


@pytest.mark.parametrize("shape", GATES, ids=lambda s: s.name)
def test_vllm_gate_kernel_runs_bf16_fp32out_at_1_to_16_tokens(shape):
    """Inside vLLM the op runs vLLM's own gate kernel in ``bf16-fp32out`` at 1-16 tokens: its
    logits bitwise, within the mode's 1e-5 of fp64, into a poisoned buffer too, and replayed from
    a CUDA graph with new inputs; from 17 tokens our kernels."""
    from csrc_triton.launches import VllmGateLaunch

    ll_bf16_gemm = _vllm_gate_kernel()
    for m in range(1, choice.VLLM_GATE_TO_M + 2):
        x, w = _xw(m, shape)
        launch = _pick(x, w, "bf16-fp32out")
        if m > choice.VLLM_GATE_TO_M:
            assert not isinstance(launch, VllmGateLaunch)
            continue
        assert launch == VllmGateLaunch(m)
        got = router_gemm(x, w, "bf16-fp32out")
        assert torch.equal(got, ll_bf16_gemm(x, w)), m
        assert _rel(got, x, w) <= 1e-5, m
        out = torch.full((m, shape.n), float("nan"), device="cuda")
        assert torch.equal(launch_exactly(launch, x, w, out), got) and torch.equal(out, got)
        assert not isinstance(_pick(x, w, "bf16-fp32out", batch_invariant=True), VllmGateLaunch)
        assert not isinstance(_pick(x, w, "fp32"), VllmGateLaunch)
    x, w = _xw(choice.VLLM_GATE_TO_M, shape)
    router_gemm(x, w, "bf16-fp32out")  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = router_gemm(x, w, "bf16-fp32out")
    x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))
    logits.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(logits, ll_bf16_gemm(x, w)) and _rel(logits, x, w) <= 1e-5
