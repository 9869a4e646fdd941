"""``VllmConfig`` for tests that build vLLM layers and models without an engine."""

from __future__ import annotations


def engine_free_config(**kwargs):
    """``VllmConfig(**kwargs)``. vLLM 0.34 refuses any config on an x86 CPU without triton-cpu
    (its engine would need it); no engine runs in these tests, so that check is passed over."""
    from vllm.config import VllmConfig

    try:
        return VllmConfig(**kwargs)
    except RuntimeError as e:
        if "triton-cpu" not in str(e):
            raise
    import vllm.triton_utils as triton_utils

    before, triton_utils.HAS_TRITON = triton_utils.HAS_TRITON, True
    try:
        return VllmConfig(**kwargs)
    finally:
        triton_utils.HAS_TRITON = before
