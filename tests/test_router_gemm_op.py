"""``vllm_router_ext.ops.router_gemm`` on the CPU: plain-torch semantics of every mode (no vLLM)."""

from __future__ import annotations

import pytest
import torch

from vllm_router_ext.ops import router_gemm
from vllm_router_ext.ops.routing_fp64 import reference_logits, relative_error
from vllm_router_ext.precision import RouterPrecision

MODES = ["fp32", "bf16-fp32out", "bf16"]
# fp32 accumulation of exact bf16 products: far below 1e-5; bf16 logits: one bf16 rounding.
TOL = {"fp32": 1e-6, "bf16-fp32out": 1e-6, "bf16": 8e-3}


def _inputs(gen, m, k, n, dtype=torch.bfloat16):
    x = torch.randn(m, k, generator=gen).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("m,k,n", [(1, 64, 16), (7, 200, 24), (33, 512, 160)])
def test_modes_match_fp64(gen, mode, m, k, n):
    x, w = _inputs(gen, m, k, n)
    out = router_gemm(x, w, mode)
    assert out.shape == (m, n)
    assert out.dtype == (torch.bfloat16 if mode == "bf16" else torch.float32)
    assert relative_error(out, reference_logits(x, w)) <= TOL[mode]


def test_precision_enum_and_string_agree(gen):
    x, w = _inputs(gen, 5, 64, 8)
    assert torch.equal(router_gemm(x, w, RouterPrecision.FP32), router_gemm(x, w, "fp32"))


def test_fp32_weight_in_fp32_mode(gen):
    x = torch.randn(9, 128, generator=gen).to(torch.bfloat16)
    w = torch.randn(16, 128, generator=gen) / 11.3  # not representable in bf16
    out = router_gemm(x, w, "fp32")
    assert relative_error(out, reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize("mode", MODES)
def test_zero_tokens(mode):
    w = torch.randn(16, 64).to(torch.bfloat16)
    out = router_gemm(torch.empty(0, 64, dtype=torch.bfloat16), w, mode)
    assert out.shape == (0, 16)


def test_non_contiguous_x(gen):
    big = torch.randn(6, 256, generator=gen).to(torch.bfloat16)
    x = big[:, 64:192]  # row stride 256, K=128
    w = (torch.randn(8, 128, generator=gen) / 11.3).to(torch.bfloat16)
    assert not x.is_contiguous()
    assert relative_error(router_gemm(x, w, "bf16-fp32out"), reference_logits(x, w)) <= 1e-6


@pytest.mark.parametrize(
    "x_shape,w_shape,precision,dtype,match",
    [
        ((4,), (8, 4), "fp32", torch.bfloat16, "x must be 2-D"),
        ((2, 4), (8, 4, 1), "fp32", torch.bfloat16, "weight must be 2-D"),
        ((2, 5), (8, 4), "fp32", torch.bfloat16, "K=5 but weight has K=4"),
        ((2, 4), (8, 4), "fp64", torch.bfloat16, "'fp64'.*allowed values: auto, fp32, bf16-fp32out, bf16"),
        ((2, 4), (8, 4), "auto", torch.bfloat16, "resolved precision, got 'auto'"),
        ((2, 4), (8, 4), "fp32", torch.int32, "dtype torch.int32; allowed: bfloat16, float16, float32"),
    ],
)
def test_bad_input_is_a_clear_value_error(x_shape, w_shape, precision, dtype, match):
    x = torch.ones(x_shape, dtype=dtype)
    w = torch.ones(w_shape, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        router_gemm(x, w, precision)


def test_bf16_fp32out_rejects_mixed_16bit_dtypes():
    with pytest.raises(ValueError, match="one 16-bit dtype"):
        router_gemm(
            torch.ones(2, 4, dtype=torch.float16), torch.ones(8, 4, dtype=torch.bfloat16), "bf16-fp32out"
        )


@pytest.mark.parametrize("mode", MODES)
def test_batch_invariant_needle_plain_torch(gen, mode):
    """A needle row gives bitwise the same logits at any position in batches of any size."""
    k, n = 384, 32
    needle, w = _inputs(gen, 1, k, n)
    alone = router_gemm(needle, w, mode, batch_invariant=True)
    for m in (1, 2, 3, 8, 17, 64):
        for pos in sorted({0, 1, m // 2, m - 1}):
            if pos >= m:
                continue
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            x[pos] = needle[0]
            out = router_gemm(x, w, mode, batch_invariant=True)
            assert torch.equal(out[pos : pos + 1], alone), (m, pos)
    assert relative_error(alone, reference_logits(needle, w)) <= TOL[mode]


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_compiles_through_the_fake_without_freezing_m(gen, mode):
    """torch.compile sees an opaque op: one dynamic graph serves every M, results equal eager."""
    w = _inputs(gen, 1, 64, 16)[1]
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: router_gemm(x, w, mode) * 2, fullgraph=True, dynamic=True)
    for m in (3, 17, 40):
        x = torch.randn(m, 64, generator=gen).to(torch.bfloat16)
        assert torch.equal(compiled(x), router_gemm(x, w, mode) * 2)


def test_fake_impl_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(11, 64, dtype=torch.bfloat16)
        w = torch.empty(16, 64, dtype=torch.bfloat16)
        assert torch.ops.router_ext.router_gemm(x, w, "fp32", False).dtype == torch.float32
        out = torch.ops.router_ext.router_gemm(x, w, "bf16", True)
        assert out.shape == (11, 16) and out.dtype == torch.bfloat16
