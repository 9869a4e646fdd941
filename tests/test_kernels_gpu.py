"""GPU checks of the router GEMM (``gpu`` marker; run on the device machine, skipped on CPU)."""

from __future__ import annotations

import pytest
import torch

from csrc_triton.configs import KernelConfig
from vllm_router_ext.benchmarking import SHAPES
from vllm_router_ext.ops import router_gemm
from vllm_router_ext.ops.dispatch import config_for, dot_mode_for, run_config
from vllm_router_ext.ops.reference import changed_expert_sets, select_experts
from vllm_router_ext.ops.router_gemm import fp32_weight_terms
from vllm_router_ext.precision import RouterPrecision

pytestmark = pytest.mark.gpu

MS = [0, 1, 3, 17, 255, 4097]
NEEDLE_MS = [1, 2, 3, 8, 16, 17, 64, 255, 256, 1024, 4096, 16384]


def _rel(out, x, w):
    ref = x.double() @ w.double().T
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _xw(m, shape, w_dtype=torch.bfloat16, row_stride=None):
    k = shape.k
    xs = torch.randn(m, row_stride or k, device="cuda").to(torch.bfloat16)
    w = (torch.randn(shape.n, k, device="cuda") / k**0.5).to(w_dtype)
    return xs[:, :k], w


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32", "bf16"])
def test_every_shape_and_m_poisoned_and_accurate(shape, mode):
    prec = RouterPrecision(mode)
    for m in MS:
        x, w = _xw(m, shape, row_stride=shape.k + 64)  # non-contiguous rows
        cfg = config_for(x, w, prec, False)
        out_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
        out = torch.full((m, shape.n), float("nan"), dtype=out_dtype, device="cuda")
        res = run_config(
            cfg, x.contiguous() if cfg.kernel == "cublas" else x, w, out, dot_mode_for(x.dtype, w.dtype)
        )
        assert not res.isnan().any(), (m, cfg.describe())
        via_op = router_gemm(x, w, mode)
        assert via_op.dtype == out_dtype and via_op.shape == (m, shape.n)
        if m:
            tol = {"fp32": 1e-6, "bf16-fp32out": 1e-5, "bf16": 8e-3}[mode]
            assert _rel(via_op, x, w) <= tol, (m, cfg.describe())


def _table_buckets_at_both_ends():
    """(shape, table key, config, M) for every bucket of the shipped H200 table, non-invariant and
    the ``/triton`` fallbacks, at its first and its last M (capped at 8192)."""
    from csrc_triton.configs import PARAM_KEYS, table_buckets, table_override

    cases = []
    with table_override("nvidia_h200"):
        for shape in SHAPES:
            for mode, variant in (("bf16-fp32out", ""), ("fp32", ""), ("fp32", "triton")):
                key, low = f"{mode}/{variant}" if variant else mode, 1
                for bucket in table_buckets("NVIDIA H200", shape.k, shape.n, mode, variant=variant):
                    high = min(bucket["max_m"] or 16384, 8192)
                    cfg = KernelConfig(bucket["kernel"], {p: v for p, v in bucket.items() if p in PARAM_KEYS})
                    cases += [(shape, key, cfg, m) for m in sorted({low, high}) if m >= low]
                    low = (bucket["max_m"] or 16384) + 1
    return cases


@pytest.mark.parametrize(
    "shape, key, cfg, m",
    _table_buckets_at_both_ends(),
    ids=lambda v: getattr(v, "name", None) or (v.describe() if isinstance(v, KernelConfig) else str(v)),
)
def test_every_table_bucket_at_both_ends(shape, key, cfg, m):
    """Each bucket of the shipped H200 table, at its first and last M: the dispatch picks it
    (with the table forced, as on an H200), and its logits are all written and accurate."""
    from csrc_triton.configs import table_override

    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the H200 table's wgmma_ws / PDL configs are for Hopper")
    mode = key.split("/")[0]
    x, w = _xw(m, shape, row_stride=shape.k + 64)
    if key == mode:
        with table_override("nvidia_h200"):
            picked = config_for(x, w, RouterPrecision(mode), False)
        assert (picked.kernel, picked.params) == (cfg.kernel, cfg.params), (m, picked.describe())
    out = torch.full((m, shape.n), float("nan"), device="cuda")
    x_in = x.contiguous() if cfg.kernel == "cublas" else x
    res = run_config(cfg, x_in, w, out, dot_mode_for(x.dtype, w.dtype))
    tol = 1e-6 if mode == "fp32" else 1e-5
    assert not res.isnan().any() and _rel(res, x, w) <= tol, (m, cfg.describe())


GEMV_CONFIGS = [  # the tuner's GEMV space at its corners, plus split-K forms of it
    dict(block_m=1, block_n=1, k_per_split=0, num_warps=8),
    dict(block_m=1, block_n=1, k_per_split=0, num_warps=16),
    dict(block_m=2, block_n=2, k_per_split=0, num_warps=8),
    dict(block_m=4, block_n=4, k_per_split=0, num_warps=4),
    dict(block_m=4, block_n=2, k_per_split=2048, num_warps=4),
    dict(block_m=2, block_n=4, k_per_split=1024, num_warps=4, ticket=False),
    dict(block_m=1, block_n=2, k_per_split=0, num_warps=4, maxnreg=255),
    dict(block_m=2, block_n=2, k_per_split=0, num_warps=4, copy_stages=7),
    dict(block_m=4, block_n=2, k_per_split=2048, num_warps=4, copy_stages=2),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("params", GEMV_CONFIGS, ids=lambda p: "-".join(map(str, p.values())))
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weight", "fp32-weight"])
def test_gemv_kernel_poisoned_and_accurate(shape, params, w_dtype):
    """Every GEMV config shape the tuner may pick, on every shape, with strided activations: all
    of ``out`` written, fp32-upcast accuracy (it is an fp32 FMA kernel)."""
    cfg = KernelConfig("gemv", params)
    for m in (1, 2, 3, 5, 16, 17):
        x, w = _xw(m, shape, w_dtype=w_dtype, row_stride=shape.k + 64)
        out = torch.full((m, shape.n), float("nan"), device="cuda")
        run_config(cfg, x, w, out, dot_mode_for(x.dtype, w.dtype))
        assert not out.isnan().any(), (m, cfg.describe())
        assert _rel(out, x, w) <= 1e-6, (m, cfg.describe())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_gemv_launch_options_are_bitwise_the_plain_gemv(shape):
    """On the GPU too, copying chunks ahead (cp.async) or raising ptxas's register budget only
    moves the loads: the same FMAs in the same order, bitwise the same logits."""
    plain = dict(block_m=2, block_n=2, k_per_split=0, num_warps=4)
    for m in (1, 4, 7):
        x, w = _xw(m, shape, w_dtype=torch.bfloat16, row_stride=shape.k + 64)
        outs = []
        for launch in ({}, dict(copy_stages=7), dict(maxnreg=255)):
            out = torch.full((m, shape.n), float("nan"), device="cuda")
            run_config(KernelConfig("gemv", {**plain, **launch}), x, w, out, dot_mode_for(x.dtype, w.dtype))
            outs.append(out)
        assert all(torch.equal(outs[0], o) for o in outs[1:]), m


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


WGMMA_WS_SPLITS = [0, 1792, 1024]  # none; whole chains per split; a split that ends mid-chain (K=5120)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("k_per_split", WGMMA_WS_SPLITS, ids=lambda v: f"kps{v}")
@pytest.mark.parametrize("block_n", [128, 64])
def test_wgmma_ws_kernel_poisoned_and_accurate(shape, k_per_split, block_n):
    """The warp-specialised wgmma kernel (Hopper), unsplit and split, both tile widths, on every
    shape, M around its 128-row tiles, strided activations: all of ``out`` written, fp32-mode
    accuracy (<= 1e-6: an unpromoted whole-K chain measures ~8e-6 at K=7168)."""
    from csrc_triton.configs import wgmma_ws_config
    from csrc_triton.router_gemm_wgmma_ws import unsupported_reason

    if not _hopper():
        pytest.skip("wgmma_ws is a Hopper (sm_90) kernel")
    cfg = wgmma_ws_config(block_n, k_per_split)
    for m in (1, 3, 127, 128, 129, 1000, 4097):
        x, w = _xw(m, shape, row_stride=shape.k + 64)
        assert unsupported_reason(x, w, 90) is None
        out = torch.full((m, shape.n), float("nan"), device="cuda")
        run_config(cfg, x, w, out, dot_mode_for(x.dtype, w.dtype))
        assert not out.isnan().any(), (m, cfg.describe())
        assert _rel(out, x, w) <= 1e-6, (m, cfg.describe())


#: (consumer partitions, tail columns, K per split) of the wider and one-partition tile forms:
#: 16/32-column tails on the first consumer for all 128 rows, a 64-column tail split
#: between the two consumers, and one 8-warp consumer partition with 0-64-column tails
WGMMA_WS_FORMS = [(2, tail, kps) for tail in (16, 32) for kps in (0, 1792)] + [
    (consumers, tail, kps)
    for consumers, tail in ((1, 0), (1, 32), (1, 64), (2, 64))
    for kps in WGMMA_WS_SPLITS
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("consumers,tail,k_per_split", WGMMA_WS_FORMS, ids=lambda v: str(v))
def test_wgmma_ws_wide_and_one_partition_tiles_equal_to_plain_tiles(shape, consumers, tail, k_per_split):
    """Tiles of 128 + tail columns (a second accumulator and TMA block: 160 = 128 + 32 and 192 =
    128 + 64 experts in one tile), and both consumer warpgroups in one 8-warp partition: every
    logit written, fp32-mode accuracy, and bitwise the two-partition 128-wide tiles' logits (per
    element the same chains and adds; a wrong tail offset, or a stage released before every
    wgmma reading it retired, would differ)."""
    from csrc_triton.configs import wgmma_ws_config

    if not _hopper():
        pytest.skip("wgmma_ws is a Hopper (sm_90) kernel")
    cfg = wgmma_ws_config(128, k_per_split, block_n_tail=tail, consumers=consumers)
    plain = wgmma_ws_config(128, k_per_split)
    for m in (1, 129, 1000, 4097):
        x, w = _xw(m, shape, row_stride=shape.k + 64)
        out = torch.full((m, shape.n), float("nan"), device="cuda")
        run_config(cfg, x, w, out, dot_mode_for(x.dtype, w.dtype))
        assert not out.isnan().any(), (m, cfg.describe())
        assert _rel(out, x, w) <= 1e-6, (m, cfg.describe())
        ref = run_config(plain, x, w, torch.empty_like(out), dot_mode_for(x.dtype, w.dtype))
        assert torch.equal(out, ref), (m, cfg.describe())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("programs", [132, 100, 7])
def test_wgmma_ws_stream_k_poisoned_and_accurate(shape, programs):
    """Stream-K: the programs share every tile's chains (a program ends one tile, runs whole ones,
    starts the next; shared tiles' partials added by the fixup): every logit written, fp32-mode
    accuracy, at M from one tile to many waves, 128- and 64-wide tiles."""
    from csrc_triton.configs import wgmma_ws_config

    if not _hopper():
        pytest.skip("wgmma_ws is a Hopper (sm_90) kernel")
    for block_n in (128, 64):
        cfg = wgmma_ws_config(block_n, 0, stream_k=programs)
        for m in (1, 129, 1000, 4097, 8192):
            x, w = _xw(m, shape, row_stride=shape.k + 64)
            out = torch.full((m, shape.n), float("nan"), device="cuda")
            run_config(cfg, x, w, out, dot_mode_for(x.dtype, w.dtype))
            assert not out.isnan().any(), (m, cfg.describe())
            assert _rel(out, x, w) <= 1e-6, (m, cfg.describe())


def test_wgmma_ws_falls_back_where_tma_cannot_read_the_rows():
    """Rows whose stride is not a multiple of 16 bytes cannot be TMA-loaded: the config runs on
    the heuristic's Triton kernel instead, with the same accuracy."""
    from csrc_triton.configs import wgmma_ws_config
    from csrc_triton.router_gemm_wgmma_ws import unsupported_reason

    shape = SHAPES[0]
    x, w = _xw(300, shape, row_stride=shape.k + 1)
    assert unsupported_reason(x, w, 90) is not None
    out = torch.full((300, shape.n), float("nan"), device="cuda")
    run_config(wgmma_ws_config(128, 1792), x, w, out, dot_mode_for(x.dtype, w.dtype))
    assert not out.isnan().any() and _rel(out, x, w) <= 1e-6


@pytest.mark.parametrize(
    "k_per_split,tail,stream_k,consumers",
    [(0, 0, 0, 2), (1792, 0, 0, 2), (0, 32, 0, 2), (1792, 32, 0, 2), (0, 0, 132, 2), (0, 64, 0, 1),
     (1792, 64, 0, 1), (0, 64, 0, 2), (1792, 64, 0, 2)],
    ids=lambda v: str(v),
)  # fmt: skip
def test_wgmma_ws_graph_replay_equals_eager(k_per_split, tail, stream_k, consumers):
    from csrc_triton.configs import wgmma_ws_config

    if not _hopper():
        pytest.skip("wgmma_ws is a Hopper (sm_90) kernel")
    cfg = wgmma_ws_config(128, k_per_split, block_n_tail=tail, stream_k=stream_k, consumers=consumers)
    x, w = _xw(2000, SHAPES[1])
    eager = run_config(cfg, x, w, torch.empty(2000, w.shape[0], device="cuda"), 0)
    out = torch.full_like(eager, float("nan"))
    run_config(cfg, x, w, out, 0)  # warm-up (compile) outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_config(cfg, x, w, out, 0)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)


#: (kernel, params) of K-split configs whose split sum is launched each way: the split-K kernel's
#: ticket (one launch) and two launches with PDL, fp32 promotion and bf16-fp32out (no promotion);
#: ``wgmma_ws`` with the sum plain, PDL let go early and late, with a 64-column split tail; stream-K.
SPLIT_SUM_FORMS = [
    ("splitk", dict(block_m=64, block_n=64, block_k=128, k_per_split=1024, promote_chunks=2, num_stages=3)),
    ("splitk", dict(block_m=16, block_n=16, block_k=128, k_per_split=512, promote_chunks=4, num_stages=1)),
    ("wgmma_ws", dict(block_n=128, block_k=64, k_per_split=1024, promote_chunks=4, num_stages=6)),
    ("wgmma_ws", dict(block_n=128, block_n_tail=64, block_k=64, k_per_split=1792, promote_chunks=4,
                      num_stages=5)),
    ("wgmma_ws", dict(block_n=128, block_k=64, stream_k=132, promote_chunks=4, num_stages=6)),
]  # fmt: skip


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("kernel,params", SPLIT_SUM_FORMS, ids=lambda v: str(v))
def test_split_sum_launch_forms_bitwise_equal_eager_and_graphs(shape, kernel, params):
    """The K-split sum's launch forms (``split_sum_variants``, which the tuner times: ticket or
    two launches with the second a programmatic dependent launch; PDL early or late) add the same
    partials in the same order: bitwise the same logits, every one written, in eager mode and in
    CUDA-graph replay. A dependent launch that read the partials before its ``griddepcontrol.wait``
    (or a first kernel that let it go before its stores were ordered) would differ or leave NaN."""
    if kernel == "wgmma_ws" and not _hopper():
        pytest.skip("wgmma_ws is a Hopper (sm_90) kernel")
    if params.get("block_n_tail") and shape.n % 192:
        pytest.skip("192-wide tiles are for N divisible by 192")
    import os

    from csrc_triton.configs import split_sum_variants
    from csrc_triton.pdl import ENV_VAR, pdl_enabled

    assert os.environ.get(ENV_VAR, "1") != "0"
    assert pdl_enabled(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    variants = split_sum_variants(KernelConfig(kernel, params), shape.k)
    assert len(variants) == (2 if kernel == "splitk" else 3)
    for m in (1, 300, 2000):
        x, w = _xw(m, shape)
        dot = dot_mode_for(x.dtype, w.dtype)
        ref = run_config(variants[0], x, w, torch.full((m, shape.n), float("nan"), device="cuda"), dot)
        assert not ref.isnan().any() and _rel(ref, x, w) <= 1e-6, (m, variants[0].describe())
        for cfg in variants[1:]:
            out = torch.full_like(ref, float("nan"))
            run_config(cfg, x, w, out, dot)
            assert torch.equal(out, ref), (m, cfg.describe())
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                run_config(cfg, x, w, out, dot)
            for _ in range(3):
                out.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(out, ref), (m, cfg.describe(), "graph replay")


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("promote_chunks", [0, 2], ids=["bf16-fp32out", "fp32"])
def test_flat_chain_is_bitwise_the_unrolled_split(shape, promote_chunks):
    """``flat_chain`` (a split that is one MMA chain looped over its chunks, so that the compiler
    pipelines it: the bf16-fp32out buckets at 128-512 tokens) does the same MMAs into the same
    accumulator as the unrolled split: bitwise the same logits, every one written, accurate."""
    kps = 512 if promote_chunks == 0 else 256  # one chain a split: 4 chunks, or fp32's 2
    base = dict(block_m=64, block_n=64, block_k=128, k_per_split=kps, promote_chunks=promote_chunks,
                ticket=False, pdl=True)  # fmt: skip
    for m in (1, 300, 2000):
        x, w = _xw(m, shape)
        dot = dot_mode_for(x.dtype, w.dtype)
        nan = torch.full((m, shape.n), float("nan"), device="cuda")
        unrolled = run_config(KernelConfig("splitk", {**base, "num_stages": 1}), x, w, nan.clone(), dot)
        flat = run_config(
            KernelConfig("splitk", {**base, "num_stages": 3, "flat_chain": True}), x, w, nan, dot
        )
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


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
def test_fp32_weight_with_its_terms_accurate_and_graph_safe(shape):
    """What the gate layer runs for a genuinely fp32 weight: the op with the weight's bf16 terms
    (one promoted GEMM on them from FP32_WEIGHT_TERMS_FROM_M tokens and 128 experts, the weight
    itself otherwise)."""
    w = torch.randn(shape.n, shape.k, device="cuda") / shape.k**0.5
    assert not torch.equal(w.to(torch.bfloat16).float(), w)
    terms = fp32_weight_terms(w)
    for m in [0, 1, 7, 300, 1023, 1024, 2048, 4096, 16384]:
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
        assert ((out[:, 3].double() - ref[:, 3]).norm() / ref[:, 3].norm()).item() <= 1e-6, m
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


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32"])
def test_batch_invariant_needle_eager_and_graphs(shape, mode):
    _needle_eager_and_graphs(shape, mode)


#: M at and beside every switch of the heuristic (GEMV, split-K, pipelined split-K / its K split / cuBLAS,
#: wgmma_ws and its 192-wide tiles, tiled; batch invariance: splits summed in one program).
HEURISTIC_MS = [1, 4, 5, 64, 65, 128, 129, 256, 257, 512, 513, 1023, 1024, 2048, 2049, 8192, 8193]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32", "bf16"])
def test_heuristic_without_a_table_poisoned_and_accurate(shape, mode):
    """What a GPU without a tuned table runs (``VLLM_ROUTER_EXT_TABLE=none`` here): every
    heuristic config at and beside its switch points, poisoned, against fp64, and through the op."""
    from csrc_triton.configs import table_override

    prec = RouterPrecision(mode)
    tol = {"fp32": 1e-6, "bf16-fp32out": 1e-5, "bf16": 8e-3}[mode]
    out_dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    with table_override("none"):
        for m in HEURISTIC_MS:
            x, w = _xw(m, shape, row_stride=shape.k + 64)  # non-contiguous rows
            cfg = config_for(x, w, prec, False)
            assert cfg.source == "heuristic", cfg
            out = torch.full((m, shape.n), float("nan"), dtype=out_dtype, device="cuda")
            res = run_config(
                cfg, x.contiguous() if cfg.kernel == "cublas" else x, w, out, dot_mode_for(x.dtype, w.dtype)
            )
            assert not res.isnan().any() and _rel(res, x, w) <= tol, (m, cfg.describe())
            via_op = router_gemm(x, w, mode)
            assert via_op.dtype == out_dtype and _rel(via_op, x, w) <= tol, (m, cfg.describe())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.name)
@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32"])
def test_heuristic_batch_invariant_needle_eager_and_graphs(shape, mode):
    """The needle test on the heuristic's batch-invariant configs (no tuned table), and the
    start-up self-check's probes for them."""
    from csrc_triton.configs import table_override
    from vllm_router_ext.selfcheck import check_batch_invariance, probe_sizes

    with table_override("none"):
        _needle_eager_and_graphs(shape, mode)
        w = _xw(1, shape)[1]
        sizes = probe_sizes(w, RouterPrecision(mode))
        row = torch.empty(1, shape.k, device="cuda", dtype=torch.bfloat16)
        configs = {m: config_for(row.expand(m, -1), w, RouterPrecision(mode), True) for m in sizes}
        fused = [m for m in sizes if configs[m].params.get("splits_in_program")]
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
    programs at small M (a ticket, or the exact fixed-point sum in memory): on the GPU's real MMAs
    (mma.sync for small tiles, wgmma for large ones) the logits must be bitwise the same for one K
    structure and one kind of sum, and so must the heuristic's own pair."""
    from csrc_triton.configs import heuristic_config, splitk_config
    from csrc_triton.router_gemm_splitk import _FIXED_WORDS

    x, w = _xw(300, shape)
    x = x.contiguous()
    dot = dot_mode_for(x.dtype, w.dtype)
    block_k = 128  # the fp32 mode: chains of two 128-wide chunks
    for kps, fixed in ((256, True), (512, True), (512, False), (1024, False)):
        ref_cfg = splitk_config(16, 16, block_k, kps, mode, fixed_point=fixed)
        ref = run_config(ref_cfg, x, w, torch.full((300, shape.n), float("nan"), device="cuda"), dot)
        assert _rel(ref, x, w) <= (1e-6 if mode == "fp32" else 1e-5)
        tiles = [(64, 32, 4, 3, True), (64, 128, 4, 3, True), (128, 64, 4, 3, True), (128, 128, 8, 3, True)]
        if fixed:  # small-M tiles (one load and one MMA chain per split), mid-M integer tickets
            tiles += [(16, 32, 4, 1, False), (64, 64, 4, 3, False), (64, 32, 4, 1, "ticket")]
            tiles += [(128, 64, 4, 3, "ticket"), (128, 64, 8, 3, True)]
        for block_m, block_n, warps, stages, in_program in tiles:
            bk = 256 if fixed and in_program is False and stages == 1 and mode != "fp32" else block_k
            if mode == "fp32" and in_program is not True and stages > 1 and block_m * block_n > 64 * 64:
                stages = 2  # two 128-wide chunks per pipeline stage: three stages overflow shared memory
            cfg = splitk_config(
                block_m, block_n, bk, kps, mode, warps, num_stages=stages,
                splits_in_program=in_program is True, fixed_point=fixed, fixed_ticket=in_program == "ticket",
            )  # fmt: skip
            out = run_config(cfg, x, w, torch.full((300, shape.n), float("nan"), device="cuda"), dot)
            assert torch.equal(out, ref), (kps, cfg.describe())
    assert all(int(b.abs().max()) == 0 for b in _FIXED_WORDS.values())
    small = heuristic_config(1, shape.k, shape.n, mode, True, 132)
    large = heuristic_config(4096, shape.k, shape.n, mode, True, 132)
    assert large.params.get("splits_in_program") and not small.params.get("splits_in_program")
    outs = [run_config(c, x, w, torch.empty(300, shape.n, device="cuda"), dot) for c in (small, large)]
    assert torch.equal(*outs)


@pytest.mark.parametrize("mode", ["bf16-fp32out", "fp32"])
def test_selfcheck_probes_every_batch_invariant_config_on_this_gpu(mode):
    """The start-up self-check runs one M per distinct batch-invariant config the dispatch can pick
    (derived from this GPU's table), and passes."""
    from vllm_router_ext.benchmarking import M_LIST
    from vllm_router_ext.selfcheck import check_batch_invariance, probe_sizes

    prec = RouterPrecision(mode)
    for shape in SHAPES:
        w = (torch.randn(shape.n, shape.k, device="cuda") / shape.k**0.5).to(torch.bfloat16)
        sizes = probe_sizes(w, prec)
        row = torch.empty(1, shape.k, device="cuda", dtype=torch.bfloat16)
        used = {config_for(row.expand(m, -1), w, prec, True) for m in (*M_LIST, 3000, 12000)}
        probed = {config_for(row.expand(m, -1), w, prec, True) for m in sizes}
        assert used <= probed, (shape.name, sizes)
        check_batch_invariance(lambda x, w: router_gemm(x, w, mode, batch_invariant=True), w, sizes=sizes)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_table_entry_too_big_for_this_gpu_is_shrunk_to_the_same_sums(monkeypatch, batch_invariant):
    """A config that needs more shared memory than the H200 has (as an H200 table would on a
    GPU with less): the op shrinks it (stages, then tiles) instead of failing, and the logits are
    bitwise those of a config that fits with the same K structure."""
    import csrc_triton.configs as c
    import vllm_router_ext.ops.dispatch as d

    shape = SHAPES[0]
    big = dict(block_m=128, block_n=128, block_k=128, k_per_split=512, promote_chunks=2, num_warps=8)
    big["num_stages"] = 4  # fp32 mode: two 128-wide chunks per stage, 4 x 128 KB of shared memory
    key = "fp32/batch_invariant" if batch_invariant else "fp32"
    table = {"shapes": {f"{shape.k}x{shape.n}": {key: [{"max_m": None, "kernel": "splitk", **big}]}}}
    monkeypatch.setattr(c, "load_table", lambda name: table)
    monkeypatch.setattr(d, "_FITTED", {})
    x, w = _xw(300, shape)
    out = router_gemm(x, w, RouterPrecision.FP32, batch_invariant=batch_invariant)
    (fitted,) = d._FITTED.values()
    assert fitted.params["block_k"] == 128 and fitted.params["k_per_split"] == 512
    fits = KernelConfig("splitk", dict(big, block_m=64, block_n=64, num_stages=1))
    ref = run_config(fits, x, w, torch.full_like(out, float("nan")), dot_mode_for(x.dtype, w.dtype))
    assert torch.equal(out, ref)
    assert _rel(out, x, w) <= 1e-6
