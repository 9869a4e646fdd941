"""``vllm serve`` with the plugin's flag, on 127.0.0.1 (real vLLM). The argument-parsing tests start
no engine and run on every supported vLLM; the ``vllm``-marked ones serve on the CPU build."""

from __future__ import annotations

import subprocess

import pytest
import torch

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
def test_serve_with_router_capture_then_audit_the_capture(tiny_model, tmp_path):
    """The loop the audit page shows: serve with a capture, send traffic, audit what was captured."""
    import json
    import sys
    import time

    from safetensors.torch import load_file

    from vllm_router_ext.ops.reference import reference_logits, relative_error

    capture = tmp_path / "capture"
    server = serve(tiny_model, tmp_path, "--router-capture", str(capture), "--router-capture-tokens", "24")
    path = capture / "router-capture-1-dp0.safetensors"
    try:
        for i in range(40):  # bounded: a few prompts suffice
            server.complete(f"def f{i}(x):\n    return", max_tokens=4)
            if path.exists():
                break
        deadline = time.monotonic() + 30
        while not path.with_suffix(".json").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
        server.complete("still serving", max_tokens=2)
    finally:
        server.stop()
    log = server.log()
    assert (
        f"capturing 24 tokens of 1 gate(s) into {path}" in log and f"wrote the router capture {path}" in log
    )
    data = load_file(str(path))
    assert set(data) == {"layers.1", "logits.1"}
    x, logits = data["layers.1"], data["logits.1"]
    assert x.shape == (24, 256) and x.dtype == torch.bfloat16 and logits.shape == (24, 16)
    meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta["precision"] == "fp32" and meta["tokens_per_layer"] == 24 and meta["layers"] == [1]
    assert meta["data_parallel_rank"] == 0 and meta["tensor_parallel_size"] == 1 and meta["vllm"]
    w = load_file(str(tiny_model / "model.safetensors"))["model.layers.1.mlp.gate.weight"]
    assert relative_error(logits, reference_logits(x, w)) <= 1e-6  # what the op returned, vs fp64
    out = tmp_path / "audit"
    cmd = [sys.executable, "-m", "vllm_router_ext.audit", str(tiny_model), "--hidden-states", str(capture)]
    p = subprocess.run(
        [*cmd, "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    result = json.loads((out / "audit.json").read_text(encoding="utf-8"))
    assert result["tokens"] == 24 and result["overall"]["fp32"]["rel_err"] <= 1e-6


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
    assert "--router-capture DIR" in p.stdout and "--router-capture-tokens N" in p.stdout
    ours = p.stdout[p.stdout.index("vllm-router-ext:") :].split("When passing JSON")[0]
    assert "default: None" not in ours  # each flag's help names its real default instead
    assert "auto (default)" in ours and "default 4096" in ours and "Default: off" in ours
    assert "Default: no capture" in ours


def test_capture_tokens_without_a_capture_directory_warns_once():
    import argparse
    import logging

    from vllm_router_ext.cli import add_router_cli_args, apply_router_cli_args

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("vllm.vllm_router_ext.cli")
    logger.addHandler(handler)
    try:
        parser = add_router_cli_args(argparse.ArgumentParser())
        engine_args = argparse.Namespace(additional_config={})
        apply_router_cli_args(engine_args, parser.parse_args(["--router-capture-tokens", "64"]))
        assert engine_args.additional_config == {"router_capture_tokens_cli": 64}
        apply_router_cli_args(engine_args, parser.parse_args([]))  # nothing set: no flag, no warning
    finally:
        logger.removeHandler(handler)
    messages = [r.getMessage() for r in records if r.levelno == logging.WARNING]
    assert messages == [
        "vllm-router-ext: --router-capture-tokens 64 does nothing without --router-capture DIR"
    ]


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
