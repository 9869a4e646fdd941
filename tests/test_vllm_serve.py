"""``vllm serve`` with the plugin's flag, on 127.0.0.1 (real vLLM). The argument-parsing tests start
no engine and run on every supported vLLM; the ``vllm``-marked ones serve on the CPU build."""

from __future__ import annotations

import subprocess

import pytest
import torch
from cli_log import cli_warnings

from vllm_router_ext.tools.server import cpu_env, omp_threads_bind, precision_lines, serve, vllm_command


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


TAP = ("--worker-extension-cls", "vllm_router_ext.workers.gate_tap.GateTap")  # what each gate saw


def _serve_capturing(tiny_model, tmp_path, budget: int, env: dict | None = None):
    capture = tmp_path / "capture"
    server = serve(
        tiny_model,
        tmp_path,
        "--router-capture",
        str(capture),
        "--router-capture-tokens",
        str(budget),
        *TAP,
        env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})},
    )
    server.rpc("router_tap_start")
    return server, capture / "router-capture-1-dp0.safetensors"


def _tapped(server, tmp_path):
    server.rpc("router_tap_dump", str(tmp_path / "tap.pt"))
    return torch.load(tmp_path / "tap.pt")["target:model.layers.1.mlp.gate"]


def _audit(tiny_model, capture, out):
    import json
    import sys

    cmd = [sys.executable, "-m", "vllm_router_ext.audit", str(tiny_model), "--hidden-states", str(capture)]
    p = subprocess.run(
        [*cmd, "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    return p.stdout, json.loads((out / "audit.json").read_text(encoding="utf-8"))


@pytest.mark.vllm
def test_sigterm_writes_the_capture_the_server_holds_then_the_audit_reads_it(tiny_model, tmp_path):
    """The loop the audit page shows, stopped the usual way: serve with a capture whose budget the
    traffic does not reach, three completions, SIGTERM to ``vllm serve``: the file holds exactly
    the rows the gate saw (a tap inside the served model), one line says what was written where,
    and the audit reads it as a partial capture."""
    import json
    import signal

    from safetensors.torch import load_file

    from vllm_router_ext.ops.routing_fp64 import reference_logits, relative_error

    server, path = _serve_capturing(tiny_model, tmp_path, 4096)
    try:
        for i in range(3):
            server.complete(f"def f{i}(x):\n    return", max_tokens=4)
        seen = _tapped(server, tmp_path)
        server.proc.send_signal(signal.SIGTERM)  # the main process only, as `kill PID` does
        assert server.proc.wait(60) == 0
    finally:
        server.stop()
    log = server.log()
    assert f"capturing 4096 tokens of 1 gate(s) into {path} (from --router-capture)" in log
    rows = seen["rows_seen"]
    wrote = [ln for ln in log.splitlines() if "wrote the router capture" in ln]
    assert len(wrote) == 1 and f"{path} ({rows} tokens x 1 layers, partial, budget 4096" in wrote[0]
    data = load_file(str(path))
    assert set(data) == {"layers.1", "logits.1"} and data["layers.1"].dtype == torch.bfloat16
    assert torch.equal(data["layers.1"], seen["x"]) and torch.equal(data["logits.1"], seen["logits"])
    meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta["rows_per_layer"] == {"1": rows} and meta["complete"] is False and meta["trimmed"]
    assert meta["precision"] == "fp32" and meta["data_parallel_rank"] == 0 and meta["vllm"]
    w = load_file(str(tiny_model / "model.safetensors"))["model.layers.1.mlp.gate.weight"]
    assert relative_error(data["logits.1"], reference_logits(data["layers.1"], w)) <= 1e-6
    stdout, result = _audit(tiny_model, path.parent, tmp_path / "audit")
    assert f"capture router-capture-1-dp0: PARTIAL, {rows} tokens per layer of a 4096-token budget" in stdout
    assert result["tokens"] == rows and result["capture"]["complete"] is False
    assert result["overall"]["fp32"]["rel_err"] <= 1e-6


@pytest.mark.vllm
def test_a_killed_server_keeps_every_finished_pass_of_its_capture(tiny_model, tmp_path):
    """SIGKILL to the whole server (no process gets to clean up) after some passes: what is on
    disk reads back as the rows the gate saw, less at most the pass in flight."""
    import os
    import signal

    from vllm_router_ext.capture import read_capture

    server, path = _serve_capturing(tiny_model, tmp_path, 4096)
    try:
        for i in range(2):
            server.complete(f"class C{i}:", max_tokens=3)
        seen = _tapped(server, tmp_path)
        os.killpg(server.proc.pid, signal.SIGKILL)
        server.proc.wait(30)
    finally:
        server.stop()
    read = read_capture(path.parent, "router-capture-1-dp0")
    rows = read.info["rows_per_layer"]["1"]
    assert rows == seen["rows_seen"] >= 2 * 3  # two prompts' prefill and decode; nothing in flight
    assert torch.equal(read.tensors["layers.1"], seen["x"]) and torch.equal(
        read.tensors["logits.1"], seen["logits"]
    )
    assert read.info["complete"] is False and "interrupted" in read.info["ended"]
    stdout, result = _audit(tiny_model, path.parent, tmp_path / "audit")
    assert "PARTIAL" in stdout and result["tokens"] == rows


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
    ours = " ".join(ours.split())  # as one line: the wrapping follows the terminal's width
    assert "default: None" not in ours  # each flag's help names its real default instead
    assert "auto (default)" in ours and "default 4096" in ours and "Default: off" in ours
    assert "Default: no capture" in ours
    assert "--router-capture-memory-limit GIB" in ours and "Default: 25% of the host's memory" in ours


def test_capture_tokens_without_a_capture_directory_warns_once():
    import argparse

    from vllm_router_ext.cli import add_router_cli_args, apply_router_cli_args

    with cli_warnings() as messages:
        parser = add_router_cli_args(argparse.ArgumentParser())
        engine_args = argparse.Namespace(additional_config={})
        apply_router_cli_args(engine_args, parser.parse_args(["--router-capture-tokens", "64"]))
        assert engine_args.additional_config == {"router_capture_tokens_cli": 64}
        apply_router_cli_args(engine_args, parser.parse_args([]))  # nothing set: no flag, no warning
    assert messages == [
        "vllm-router-ext: --router-capture-tokens 64 does nothing without --router-capture DIR"
    ]


@pytest.mark.vllm
def test_demo_main_job(tmp_path):
    """The README's main job (scripts/demo.sh runs exactly this module after the setup)."""
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "vllm_router_ext.tools.demo", "--workdir", str(tmp_path)],
        env=cpu_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "[demo] completion: " in p.stdout
    assert "router precision bf16-fp32out (from --router-precision)" in p.stdout
    assert "[demo] server stopped (exit code 0)" in p.stdout


#: A bad setting from each source that is not a flag: (environment, additional_config, flags,
#: the one line the start-up stops with).
BAD_SETTINGS = {
    "env precision": (
        {"VLLM_ROUTER_PRECISION": "fp16"}, None, (),
        "invalid router precision 'fp16' from environment variable VLLM_ROUTER_PRECISION; "
        "allowed values: auto, fp32, bf16-fp32out, bf16",
    ),
    "misspelt key": (
        {}, {"router_precison": "fp32"}, (),
        "unknown key additional_config['router_precison']; did you mean 'router_precision'?",
    ),
    "config value": (
        {}, {"router_precision": 5}, (),
        "invalid router precision 5 from additional_config['router_precision']; allowed values:",
    ),
    "batch invariance": (
        {}, {"router_batch_invariant": "maybe"}, (),
        "invalid router batch-invariant value 'maybe' from additional_config['router_batch_invariant']; "
        "allowed: true, false",
    ),
    "draft precision": (
        {}, {"router_precision_draft": "fp16"}, (),
        "invalid draft router precision 'fp16' from additional_config['router_precision_draft']; "
        "allowed values: auto, fp32, bf16-fp32out, bf16, vllm",
    ),
    "capture tokens": (
        {"VLLM_ROUTER_CAPTURE_DIR": "{tmp}/capture", "VLLM_ROUTER_CAPTURE_TOKENS": "abc"}, None,
        ("--enforce-eager",), "from environment variable VLLM_ROUTER_CAPTURE_TOKENS",
    ),
    "capture without eager": (
        {}, {"router_capture_dir": "{tmp}/capture"}, (),
        "add --enforce-eager (enforce_eager=True) to capture",
    ),
    "capture dir a file": (
        {"VLLM_ROUTER_CAPTURE_DIR": "/etc/passwd"}, None, ("--enforce-eager",),
        "router capture directory '/etc/passwd' from environment variable VLLM_ROUTER_CAPTURE_DIR is not "
        "writable",
    ),
    "memory limit": (
        {"VLLM_ROUTER_CAPTURE_DIR": "{tmp}/capture", "VLLM_ROUTER_CAPTURE_MEMORY_LIMIT_GIB": "-1"}, None,
        ("--enforce-eager",), "invalid router capture memory limit '-1' from environment variable",
    ),
    "zero tokens": (
        {}, {"router_capture_dir": "{tmp}/capture", "router_capture_tokens": 0}, ("--enforce-eager",),
        "invalid router capture budget 0 from additional_config['router_capture_tokens']",
    ),
    "huge budget": (
        {}, {"router_capture_dir": "{tmp}/capture", "router_capture_tokens": 10**12}, ("--enforce-eager",),
        "router capture budget 1000000000000 tokens (from additional_config['router_capture_tokens']) "
        "needs at least",
    ),
    "table": (
        {"VLLM_ROUTER_EXT_TABLE": "bogus"}, None, (),
        "VLLM_ROUTER_EXT_TABLE='bogus' is not a tuned table; allowed: none, nvidia_h200",
    ),
    "bf16 where the routing reads fp32": (
        {"VLLM_ROUTER_PRECISION": "bf16"}, None, (),
        "DeepSeek-V4 (DeepseekV4ForCausalLM) routes on fp32 logits (vLLM builds its gates with fp32 "
        "logits), so router precision bf16 (from environment variable VLLM_ROUTER_PRECISION) cannot "
        "apply; allowed for this model: auto, fp32, bf16-fp32out",
    ),
}  # fmt: skip
#: The cases served from a tiny DeepSeek-V4 (a family whose vLLM gates give fp32 logits).
ON_V4 = {"bf16 where the routing reads fp32"}


@pytest.mark.vllm
def test_a_bad_setting_from_any_source_stops_vllm_serve_before_the_engine_with_one_line(tiny_model, tmp_path):
    """Environment variables and ``additional_config`` are checked in the API server before the
    engine starts, as flags are: exit 2, one line naming the source, the value and the allowed
    values, no traceback, no engine process started; in about the time a bad flag takes."""
    import concurrent.futures as cf
    import json
    import time

    from vllm_router_ext.tools.tiny_checkpoint import build_tiny_deepseek_v4

    v4 = build_tiny_deepseek_v4(tmp_path / "tiny-v4")

    def start(case: str):
        env_extra, extra, flags, _ = BAD_SETTINGS[case]
        work = tmp_path / case.replace(" ", "-")
        env = {**cpu_env(work), **{k: v.format(tmp=work) for k, v in env_extra.items()}}
        args = [*vllm_command(), "serve", str(v4 if case in ON_V4 else tiny_model), *flags]
        if extra is not None:
            text = json.dumps({k: v.format(tmp=work) if isinstance(v, str) else v for k, v in extra.items()})
            args += ["--additional-config", text]
        began = time.monotonic()
        p = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
        return p, time.monotonic() - began

    with cf.ThreadPoolExecutor(2) as pool:
        results = dict(zip(BAD_SETTINGS, pool.map(start, BAD_SETTINGS), strict=True))
    for case, (p, seconds) in results.items():
        out = p.stdout + p.stderr
        expected = BAD_SETTINGS[case][3]
        assert p.returncode == 2, (case, out[-3000:])
        lines = [ln for ln in out.splitlines() if expected in ln]
        assert len(lines) == 1 and "vllm-router-ext: " in lines[0], (case, out[-3000:])
        assert "Traceback" not in out and "EngineCore" not in out, (case, out[-3000:])
        assert seconds < 90, (case, seconds)  # ~17 s alone on a 2-core CPU; two run at once here
