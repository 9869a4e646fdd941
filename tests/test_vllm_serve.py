"""``vllm serve`` with the plugin's flag, on 127.0.0.1 (real vLLM). The argument-parsing tests start
no engine and run on every supported vLLM; the ``vllm``-marked ones serve on the CPU build."""

from __future__ import annotations

import subprocess

import pytest

from vllm_router_ext.testing.server import cpu_env, precision_lines, serve, vllm_command

@pytest.mark.vllm
def test_serve_with_router_precision_answers_completions(tiny_model, tmp_path, monkeypatch):
    # A lower-precedence source that disagrees: the flag wins, with one warning naming both.
    monkeypatch.setenv("VLLM_ROUTER_PRECISION", "fp32")
    server = serve(tiny_model, tmp_path, "--router-precision", "bf16-fp32out")
    try:
        reply = server.complete("def fibonacci(n):", max_tokens=8)
        assert reply["choices"][0]["text"] and reply["usage"]["completion_tokens"] == 8
    finally:
        assert server.stop() is not None
    log = server.log()
    lines = precision_lines(log)
    assert len(lines) == 1
    assert "router precision bf16-fp32out (from --router-precision)" in lines[0]
    assert "logits float32" in lines[0]
    warnings = [ln for ln in log.splitlines() if "overrides fp32 from environment variable" in ln]
    assert len(warnings) == 1 and "bf16-fp32out" in warnings[0]
    assert "'router_precision': 'bf16-fp32out'" in log  # vLLM's logged non-default args


def test_serve_rejects_an_unknown_precision_with_exit_2(tiny_model, tmp_path):
    p = subprocess.run(
        [*vllm_command(), "serve", str(tiny_model), "--router-precision", "nonsense"],
        env=cpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2
    assert "argument --router-precision: invalid choice: 'nonsense'" in p.stderr
    assert "auto" in p.stderr and "bf16-fp32out" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


def test_serve_help_lists_the_flags(tmp_path):
    p = subprocess.run(
        [*vllm_command(), "serve", "--help=vllm-router-ext"],
        env=cpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--router-precision {auto,fp32,bf16-fp32out,bf16}" in p.stdout
    assert "--router-batch-invariant" in p.stdout


@pytest.mark.vllm
def test_demo_main_job(tmp_path):
    """The README's main job (scripts/demo.sh runs exactly this module after the setup)."""
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "vllm_router_ext.testing.demo", "--workdir", str(tmp_path)],
        env=cpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "[demo] completion: " in p.stdout
    assert "router precision bf16-fp32out (from --router-precision)" in p.stdout
    assert "[demo] server stopped (exit code 0)" in p.stdout
