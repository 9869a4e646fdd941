"""Triton kernels of vllm-router-ext (pure Triton + torch; no vLLM)."""
