"""Command-line tools that need no vLLM engine: checkpoint builder, benchmark, tuner (CPU side)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_tiny_checkpoint_cli(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "vllm_router_ext.testing.tiny_checkpoint", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["topk_method"] == "noaux_tc"
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576  # what vLLM's CPU MLA accepts
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index["weight_map"]
    assert (tmp_path / "ckpt" / "tokenizer.json").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-side message")
def test_bench_cli_without_a_gpu_says_so():
    p = subprocess.run(
        [sys.executable, "-m", "vllm_router_ext.bench", "--out", "unused"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr


def test_bench_and_tune_help():
    for cmd in (
        [sys.executable, "-m", "vllm_router_ext.bench", "--help"],
        [sys.executable, str(REPO / "benchmarks/tune.py"), "--help"],
    ):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "--out" in p.stdout, p.stderr
