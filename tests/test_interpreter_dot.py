"""The interpreter's ``tl.dot`` is host-independent: every bitwise kernel test leans on it (CPU)."""

from __future__ import annotations

import interpreter_dot
import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from interpreter_dot import fixed_order_dot

from csrc_triton.environment import interpreting

pytestmark = pytest.mark.skipif(not interpreting(), reason="about Triton's interpreter (CPU runs)")


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr):
    rm, rk, rn = tl.arange(0, BM), tl.arange(0, BK), tl.arange(0, BN)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rk[:, None] * BN + rn[None, :])
    acc = tl.dot(a, b, tl.zeros((BM, BN), dtype=tl.float32), input_precision="ieee")
    tl.store(out_ptr + rm[:, None] * BN + rn[None, :], acc)


def _tl_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.full((a.shape[0], b.shape[1]), float("nan"))
    _dot_kernel[(1,)](a, b, out, BM=a.shape[0], BK=a.shape[1], BN=b.shape[1])
    return out


def test_kernels_dots_go_through_the_fixed_order(dot_order):
    """Sums whose result tells who added them. 2^25 + 1 + 1 - 2^25 is 0 accumulated in fp32 (a
    host BLAS's sgemm), 2 in fp64. 2^60 - 2^60 + 1 is 1 added K ascending, 0 K descending. Through
    a Triton kernel each is exactly what the installed evaluation gives."""
    a = torch.tensor([[2.0**25, 1.0, 1.0, -(2.0**25)], [2.0**60, -(2.0**60), 1.0, 0.0]]).repeat(8, 1)
    b = torch.ones(4, 16)
    got = _tl_dot(a, b)
    assert interpreter_dot.installed_order() == dot_order
    expected = fixed_order_dot(
        a.double().numpy(), b.double().numpy(), np.zeros((16, 16), np.float32), dot_order
    )
    assert torch.equal(got, torch.from_numpy(expected))
    assert (got[0::2] == 2.0).all()
    assert (got[1::2] == (1.0 if dot_order == "ascending" else 0.0)).all()


@pytest.mark.parametrize("bk, bn", [(32, 16), (64, 32)])
def test_a_rows_dot_does_not_depend_on_the_rows_beside_it(gen, dot_order, bk, bn):
    """The property the bitwise tests need (host BLAS breaks it: its bits for a row change with the
    number of rows in the call): a row's dot is the same alone, in 16 rows and in 64."""
    a = torch.randn(64, bk, generator=gen)
    b = torch.randn(bk, bn, generator=gen)
    full = _tl_dot(a, b)
    for rows in (1, 16):
        part = torch.cat([_tl_dot(a[i : i + rows], b) for i in range(0, 64, rows)])
        assert torch.equal(part, full), rows
    ref = a.double() @ b.double()
    assert ((full.double() - ref).abs() <= 2.0**-24 * ref.abs() + 1e-30).all()  # rounded once


def test_bf16_operands_are_read_as_their_values(gen):
    """The interpreter keeps bf16 as raw 16-bit patterns; the evaluator reads their values."""
    from triton.runtime.interpreter import TensorHandle

    a = torch.randn(8, 32, generator=gen).to(torch.bfloat16)
    b = torch.randn(32, 8, generator=gen).to(torch.bfloat16)
    bits = lambda t: TensorHandle(t.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    acc = TensorHandle(np.zeros((8, 8), np.float32), tl.float32)
    out = triton.runtime.interpreter.InterpreterBuilder().create_dot(bits(a), bits(b), acc, "ieee", 0)
    ref = a.double() @ b.double()
    assert torch.allclose(torch.from_numpy(out.data).double(), ref, rtol=2.0**-23, atol=1e-30)


def test_an_unknown_order_is_refused():
    with pytest.raises(ValueError, match="'sideways': expected one of ascending, descending"):
        interpreter_dot.install("sideways")  # type: ignore[arg-type]
