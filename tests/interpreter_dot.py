"""A host-independent ``tl.dot`` for Triton's interpreter.

The interpreter evaluates ``tl.dot`` with ``numpy.matmul``, i.e. the host's BLAS, whose summation
order depends on the CPU's kernel set and on the operand shapes (BLOCK_M 64 vs 32, chunk widths).
Our bitwise claims are about *our* order of MMA steps (K chunks, splits, split sums), so under the
interpreter each output element is evaluated here on its own, in one fixed order that no host,
BLAS, core count or block shape can change:

    d[i, j] + sum_k a[i, k] * b[k, j]

with every product exact in fp64 (fp32 x fp32 needs 48 significant bits of 53), added one by one
in K order (``numpy.add.accumulate`` is sequential, not BLAS), then rounded once to fp32.

``order="descending"`` adds the products in the opposite K order: a second, equally fixed
evaluation. A kernel-level bitwise claim that holds under both does not lean on how one ``tl.dot``
sums inside itself, which is what differs between the interpreter, the host BLAS and the GPU's MMA.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

DotOrder = Literal["ascending", "descending"]
ORDERS: tuple[DotOrder, ...] = ("ascending", "descending")

_installed: DotOrder | None = None


def _as_float64(data: np.ndarray, dtype) -> np.ndarray:
    """The exact values of an interpreter tensor. bf16 travels as raw 16-bit patterns there."""
    if dtype.is_bf16():
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return data.astype(np.float64)


def fixed_order_dot(a: np.ndarray, b: np.ndarray, acc: np.ndarray, order: DotOrder) -> np.ndarray:
    """``acc + a @ b`` (a [..., M, K], b [..., K, N], acc fp32) in the fixed order above."""
    with np.errstate(invalid="ignore", over="ignore"):  # inf * 0 is NaN, as on the GPU
        products = a[..., :, :, None] * b[..., None, :, :]  # [..., M, K, N], exact in fp64
        if order == "descending":
            products = products[..., ::-1, :]
        total = np.add.accumulate(products, axis=-2)[..., -1, :] if products.shape[-2] else 0.0
        return (acc.astype(np.float64) + total).astype(np.float32)


def install(order: DotOrder = "ascending") -> None:
    """Route every interpreted ``tl.dot`` with an fp32 accumulator through :func:`fixed_order_dot`.
    Idempotent; a later call switches the order. Dots into other accumulators keep Triton's."""
    global _installed
    if order not in ORDERS:
        raise ValueError(f"dot order {order!r}: expected one of {', '.join(ORDERS)}")
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    triton_dot = getattr(builder, "_triton_create_dot", builder.create_dot)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if d.data.dtype != np.float32 or a.dtype.primitive_bitwidth == 8:
            return triton_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = fixed_order_dot(_as_float64(a.data, a.dtype), _as_float64(b.data, b.dtype), d.data, order)
        return interpreter.TensorHandle(out, d.dtype.scalar)

    builder._triton_create_dot = triton_dot
    builder.create_dot = create_dot
    _installed = order


def installed_order() -> DotOrder | None:
    """The order :func:`install` set, or None where Triton's own ``tl.dot`` runs."""
    return _installed
