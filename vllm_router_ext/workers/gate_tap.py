"""A tap on the router gates of a served model that survives torch.compile and CUDA graphs.

vLLM imports this module in each worker when it is named as the worker extension
(``vllm serve ... --worker-extension-cls vllm_router_ext.workers.gate_tap.GateTap``). Importing it
makes every gate the plugin owns copy its input and logits into device buffers at device-side
positions, inside one mutating custom op: compile keeps the op, CUDA graphs capture and replay its
kernels, so real decode and prefill batches are recorded as served. The tap is off (records
nothing) until ``router_tap_start``; ``router_tap_dump PATH`` saves what it holds. Both are worker
methods, reached with ``POST /collective_rpc`` when the server runs with ``VLLM_SERVER_DEV_MODE=1``.
The GPU end-to-end tests use it; it ships because vLLM's workers import it by module path.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_router_ext.layers.gate import RouterGateLinear
from vllm_router_ext.layers.router import FusedGateRouter
from vllm_router_ext.workers.step_timer import StepTimer

ROWS = 4096  # rows kept per gate
CALLS = 8192  # batch sizes kept per gate
ID_COLUMNS = 32  # expert ids kept per row where the fused router picks them (top_k <= this)


@torch.library.custom_op("router_ext_gate_tap::tap", mutates_args=("xs", "logits_buf", "state", "sizes"))
def tap(
    x: torch.Tensor,
    logits: torch.Tensor,
    xs: torch.Tensor,
    logits_buf: torch.Tensor,
    state: torch.Tensor,
    sizes: torch.Tensor,
) -> None:
    """Append ``x`` / ``logits`` rows at ``state[1]`` and the batch size at ``state[2]`` while
    ``state[0]`` is 1; rows past the capacity land in the buffers' last (discarded) row."""
    m = x.shape[0]
    on = state[0]
    rows = state[1] + torch.arange(m, device=x.device)
    rows = torch.where((rows < xs.shape[0] - 1) & (on > 0), rows, xs.shape[0] - 1)
    xs.index_copy_(0, rows, x.reshape(m, -1).to(xs.dtype))
    logits_buf.index_copy_(0, rows, logits.reshape(m, -1).to(logits_buf.dtype))
    call = torch.where((state[2] < sizes.shape[0] - 1) & (on > 0), state[2], sizes.shape[0] - 1)
    sizes.index_copy_(0, call.view(1), torch.full((1,), m, dtype=sizes.dtype, device=sizes.device))
    state[1].add_(on * m)
    state[2].add_(on)


@tap.register_fake
def _(x, logits, xs, logits_buf, state, sizes) -> None:
    return None


@torch.library.custom_op("router_ext_gate_tap::tap_ids", mutates_args=("ids_buf",))
def tap_ids(ids: torch.Tensor, ids_buf: torch.Tensor, state: torch.Tensor) -> None:
    """The expert ids of the rows ``tap`` appended last (at ``state[1] - M``), while on."""
    m, k = ids.shape
    rows = state[1] - m + torch.arange(m, device=ids.device)
    last = ids_buf.shape[0] - 1  # the discarded row
    rows = torch.where((rows >= 0) & (rows < last) & (state[0] > 0), rows, last)
    ids_buf[:, :k].index_copy_(0, rows, ids.to(ids_buf.dtype))


@tap_ids.register_fake
def _(ids, ids_buf, state) -> None:
    return None


_init = RouterGateLinear.__init__
_logits_seen = RouterGateLinear.logits_seen
_compute_routing = FusedGateRouter._compute_routing


def _tapped_init(self: RouterGateLinear, *args: Any, **kwargs: Any) -> None:
    _init(self, *args, **kwargs)
    if self.router_settings is None:
        return
    device = self.weight.device
    self.register_buffer(
        "_tap_x", torch.zeros(ROWS + 1, self.input_size, dtype=torch.get_default_dtype(), device=device),
        persistent=False,
    )  # fmt: skip
    self.register_buffer(
        "_tap_logits", torch.zeros(ROWS + 1, self.output_size, dtype=torch.float32, device=device),
        persistent=False,
    )  # fmt: skip
    self.register_buffer("_tap_state", torch.zeros(3, dtype=torch.int64, device=device), persistent=False)
    self.register_buffer(
        "_tap_ids", torch.full((ROWS + 1, ID_COLUMNS), -1, dtype=torch.int32, device=device), persistent=False
    )
    self.register_buffer(
        "_tap_sizes", torch.zeros(CALLS + 1, dtype=torch.int64, device=device), persistent=False
    )


def _tapped_logits_seen(self: RouterGateLinear, x: torch.Tensor, logits: torch.Tensor) -> None:
    """Every input and logits of an owned gate: its forward's, or the fused router's."""
    _logits_seen(self, x, logits)
    tap_buffers = (self._tap_x, self._tap_logits, self._tap_state, self._tap_sizes)
    torch.ops.router_ext_gate_tap.tap(x, logits, *tap_buffers)


def _tapped_compute_routing(self: FusedGateRouter, hidden_states, router_logits, indices_type, **kwargs):
    """The fused router's experts, beside the rows its gate's logits were tapped at."""
    weights, ids = _compute_routing(self, hidden_states, router_logits, indices_type, **kwargs)
    torch.ops.router_ext_gate_tap.tap_ids(ids, self.gate._tap_ids, self.gate._tap_state)
    return weights, ids


RouterGateLinear.__init__ = _tapped_init
RouterGateLinear.logits_seen = _tapped_logits_seen
FusedGateRouter._compute_routing = _tapped_compute_routing


def _gates(worker: Any) -> dict[str, RouterGateLinear]:
    runner = worker.model_runner
    gates = {f"target:{name}": m for name, m in _owned(runner.model)}
    # The speculative-decoding proposer (its attribute name differs between vLLM's model runners)
    # holds the draft model as ``.model``; a draft's gates are those the target does not have.
    target = {id(m) for m in gates.values()}
    for part in vars(runner).values():
        draft = getattr(part, "model", None)
        if isinstance(draft, torch.nn.Module):
            gates.update({f"draft:{name}": m for name, m in _owned(draft) if id(m) not in target})
    return gates


def _owned(model: torch.nn.Module) -> list[tuple[str, RouterGateLinear]]:
    return [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, RouterGateLinear) and m.router_settings is not None
    ]


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class GateTap(StepTimer):
    """Worker methods (vLLM mixes this class into its worker); the step timer's too."""

    def router_tap_start(self) -> dict:
        gates = _gates(self)
        for gate in gates.values():
            gate._tap_state.copy_(torch.tensor([1, 0, 0], dtype=torch.int64))
            gate._tap_ids.fill_(-1)
        _synchronize()
        return {"gates": sorted(gates)}

    def router_tap_dump(self, path: str) -> dict:
        _synchronize()
        saved, summary = {}, {}
        for name, gate in _gates(self).items():
            on, rows, calls = (int(v) for v in gate._tap_state.cpu())
            kept, kept_calls = min(rows, ROWS), min(calls, CALLS)
            bias = getattr(gate, "e_score_correction_bias", None)
            saved[name] = {
                "x": gate._tap_x[:kept].cpu().clone(),
                "logits": gate._tap_logits[:kept].cpu().clone(),
                # the fused router's picks (-1: vLLM's router picked; it is not tapped)
                "ids": gate._tap_ids[:kept].cpu().clone(),
                "sizes": gate._tap_sizes[:kept_calls].cpu().clone(),
                "rows_seen": rows,
                "weight": gate.weight.detach().float().cpu().clone(),
                "weight_dtype": str(gate.weight.dtype),
                "out_dtype": str(gate.out_dtype),
                "precision": gate.router_settings.precision.value,
                "batch_invariant": gate.router_settings.batch_invariant,
                "bias": None if bias is None else bias.detach().cpu().clone(),
                "hash_routed": getattr(gate, "tid2eid", None) is not None,  # a token-id table routes it
                "linear_bias": None if gate.bias is None else gate.bias.detach().float().cpu().clone(),
            }
            summary[name] = {"rows": rows, "calls": calls}
            gate._tap_state[0] = 0
        torch.save(saved, path)
        return summary
