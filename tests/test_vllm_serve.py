"""``vllm serve`` with the plugin's flag, on 127.0.0.1 (real vLLM). The argument-parsing tests start
no engine and run on every supported vLLM; the ``vllm``-marked ones serve on the CPU build."""

from __future__ import annotations

import subprocess

import pytest

from vllm_router_ext.testing.server import cpu_env, omp_threads_bind, precision_lines, serve, vllm_command


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


@pytest.mark.vllm
def test_data_parallel_2_with_expert_parallel_every_engine_core_resolves_the_same(tiny_model, tmp_path):
    """How DeepSeek-V3 is usually served (data-parallel attention, expert-parallel MoE), on the CPU
    build: both engine cores build our gates with auto's precision and log it once each. Generation
    is not tested here: vLLM 0.32's CPU build cannot run expert parallelism (its CPU communicator
    raises NotImplementedError in all_gatherv at the first forward; docs/troubleshooting.md)."""
    flags = ("--data-parallel-size", "2", "--enable-expert-parallel")
    server = serve(tiny_model, tmp_path, *flags, env={"VLLM_CPU_OMP_THREADS_BIND": omp_threads_bind(2)})
    server.stop()
    lines = precision_lines(server.log())
    assert len(lines) == 2, lines
    assert {ln.split()[0] for ln in lines} == {"(Worker_DP0_EP0", "(Worker_DP1_EP1"}
    for line in lines:
        assert "router precision fp32 (from auto: architecture DeepseekV3ForCausalLM)" in line
        assert "logits float32" in line


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
