"""GPU time of each CUDA-graph replay in a served model: what a decode step costs on the GPU alone,
without the host's share (scheduling, HTTP, sampling) that moves more than the router does.

vLLM imports this module in each worker when it is named as the worker extension
(``--worker-extension-cls vllm_router_ext.workers.step_timer.StepTimer``). While on, every
``torch.cuda.CUDAGraph.replay`` is bracketed by two timing events on the stream it is launched on
(events come from a pool made at start, so the hot path allocates nothing). A FULL graph is a
whole forward pass: vLLM replays one per uniform decode batch. ``router_steps_start`` /
``router_steps_stop`` are worker methods, reached with ``POST /collective_rpc`` when the server
runs with ``VLLM_SERVER_DEV_MODE=1``. The end-to-end benchmark and the GPU suite use it.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch

POOL = 16384  # replays timed per window; later ones are counted, not timed

_state: dict[str, Any] = {"on": False, "events": [], "graphs": [], "untimed": 0}
_replay = torch.cuda.CUDAGraph.replay


def _timed_replay(self: torch.cuda.CUDAGraph) -> None:
    if not _state["on"]:
        return _replay(self)
    graphs = _state["graphs"]
    if len(graphs) >= POOL:
        _state["untimed"] += 1
        return _replay(self)
    start, end = _state["events"][len(graphs)]
    graphs.append(id(self))
    start.record()
    _replay(self)
    end.record()


torch.cuda.CUDAGraph.replay = _timed_replay


def _labels(worker: Any) -> dict[int, str]:
    """``id(graph)`` -> ``MODE:TOKENS`` for the graphs vLLM's model runner holds (both runners)."""
    runner = worker.model_runner
    labels: dict[int, str] = {}
    manager = getattr(runner, "cudagraph_manager", None)  # the V2 runner
    for desc, graph in getattr(manager, "graphs", {}).items():
        labels[id(graph)] = f"{desc.cg_mode.name}:{desc.num_tokens}"
    entries = getattr(getattr(runner, "model", None), "concrete_cudagraph_entries", {})  # V1, FULL
    for key, entry in entries.items():
        if entry.cudagraph is not None:
            labels[id(entry.cudagraph)] = f"FULL:{key.num_tokens}"
    return labels


class StepTimer:
    """Worker methods (vLLM mixes this class into its worker)."""

    def router_steps_start(self) -> dict:
        torch.cuda.synchronize()
        if not _state["events"]:
            _state["events"] = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(POOL)
            ]
        _state.update(on=True, graphs=[], untimed=0)
        return {"pool": POOL}

    def router_steps_stop(self) -> dict:
        """Per graph replayed since the start: its label, replays, and the median / minimum GPU
        time of one replay in microseconds; the most replayed first."""
        _state["on"] = False
        torch.cuda.synchronize()
        labels = _labels(self)
        times: dict[int, list[float]] = {}
        for (start, end), graph in zip(_state["events"], _state["graphs"], strict=False):
            times.setdefault(graph, []).append(start.elapsed_time(end) * 1e3)
        order = sorted(times, key=lambda g: -len(times[g]))
        return {
            "graphs": [
                {
                    "graph": labels.get(g, f"unlabelled-{i}"),
                    "replays": len(times[g]),
                    "median_us": statistics.median(times[g]),
                    "min_us": min(times[g]),
                }
                for i, g in enumerate(order)
            ],
            "untimed": _state["untimed"],
        }
