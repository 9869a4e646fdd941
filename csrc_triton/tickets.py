"""Tickets for kernels whose last program to finish a tile does the tile's epilogue (the split-K
sum, the fused router's routing): int32 counters that every launch leaves at zero."""

from __future__ import annotations

import torch


def zeroed_per_stream(cache: dict, device: torch.device, numel: int, dtype: torch.dtype, least: int):
    """A zeroed buffer per (device, stream) in ``cache`` (one cache per kernel): calls that may run
    concurrently on different streams never share it, and every call leaves it at zero. Sized
    generously up front, so CUDA-graph captures rarely allocate."""
    stream = torch.cuda.current_stream(device).stream_id if device.type == "cuda" else 0
    key = (device.index or 0, stream)
    buf = cache.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.zeros(max(numel, least), dtype=dtype, device=device)
        cache[key] = buf
    return buf
