"""The graph-safe gate tap the GPU end-to-end tests read: what it records, on and off, and at
capacity, eager and under torch.compile (CPU here; CUDA graphs in test_gpu_vllm.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")
from vllm_router_ext.workers import gate_tap  # noqa: E402, F401 -- registers the op


def _buffers(rows: int, calls: int, k: int = 8, n: int = 4):
    xs = torch.full((rows + 1, k), float("nan"), dtype=torch.bfloat16)
    logits = torch.full((rows + 1, n), float("nan"))
    return xs, logits, torch.zeros(3, dtype=torch.int64), torch.full((calls + 1,), -1, dtype=torch.int64)


@pytest.mark.parametrize("compiled", [False, True])
def test_tap_appends_rows_while_on_and_drops_past_capacity(compiled):
    xs, lbuf, state, sizes = _buffers(rows=10, calls=3)

    def call(x, logits):
        torch.ops.router_ext_gate_tap.tap(x, logits, xs, lbuf, state, sizes)

    fn = torch.compile(call, backend="eager", fullgraph=True) if compiled else call
    batches = [(torch.randn(m, 8).to(torch.bfloat16), torch.randn(m, 4)) for m in (3, 5, 4, 2)]
    fn(*batches[0])  # off: nothing recorded
    assert state.tolist() == [0, 0, 0] and torch.isnan(lbuf[:10]).all()  # row 10: the discard row
    state[0] = 1
    for x, lg in batches[1:]:
        fn(x, lg)
    assert state.tolist() == [1, 11, 3]  # rows seen, calls seen
    assert sizes[:3].tolist() == [5, 4, 2]
    want_x = torch.cat([b[0] for b in batches[1:]])[:10]
    want_l = torch.cat([b[1] for b in batches[1:]])[:10]
    assert torch.equal(xs[:10], want_x) and torch.equal(lbuf[:10], want_l)


@pytest.mark.parametrize("compiled", [False, True])
def test_the_fused_routers_ids_land_beside_their_rows(compiled):
    """``tap_ids`` after ``tap``: each call's expert ids at the rows its logits took, nothing while
    off, nothing past capacity (the discard row), columns past top_k untouched."""
    xs, lbuf, state, sizes = _buffers(rows=10, calls=4)
    ids_buf = torch.full((11, 6), -1, dtype=torch.int32)

    def call(x, logits, ids):
        torch.ops.router_ext_gate_tap.tap(x, logits, xs, lbuf, state, sizes)
        torch.ops.router_ext_gate_tap.tap_ids(ids, ids_buf, state)

    fn = torch.compile(call, backend="eager", fullgraph=True) if compiled else call
    batches = [(torch.randn(m, 8).to(torch.bfloat16), torch.randn(m, 4), torch.randint(0, 64, (m, 4)))
               for m in (3, 5, 4, 2)]  # fmt: skip
    fn(*batches[0])  # off: into the discard row only
    assert (ids_buf[:10] == -1).all()
    state[0] = 1
    for batch in batches[1:]:
        fn(*batch)
    want = torch.cat([b[2] for b in batches[1:]])[:10].int()
    assert torch.equal(ids_buf[:10, :4], want) and (ids_buf[:10, 4:] == -1).all()
