"""The routing audit command, on checkpoints the tests build (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_router_ext.audit import AuditError, Checkpoint, run_audit
from vllm_router_ext.plotting import PLOT_MISSING
from vllm_router_ext.testing.near_tie import build_near_tie_checkpoint

LABELS = ["fp32", "bf16-fp32out", "bf16", "fp32 batch-invariant", "bf16-fp32out batch-invariant"]


def test_cli_on_the_tiny_checkpoint(tiny_model, tmp_path):
    """The command as the docs show it: tables on stdout, audit.json and audit.png written."""
    out = tmp_path / "audit"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_router_ext.audit",
            str(tiny_model),
            "--tokens",
            "512",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "overall (mean over layers)" in p.stdout and "auditing router layers" in p.stderr  # progress bar
    result = json.loads((out / "audit.json").read_text(encoding="utf-8"))
    assert list(result["layers"]) == ["1"] and list(result["overall"]) == LABELS
    assert result["tokens"] == 512
    o = result["overall"]
    for label in ("fp32", "bf16-fp32out", "fp32 batch-invariant", "bf16-fp32out batch-invariant"):
        assert o[label]["rel_err"] <= 1e-6
    assert 1e-4 <= o["bf16"]["rel_err"] <= 1e-2
    if importlib.util.find_spec("matplotlib"):
        assert (out / "audit.png").stat().st_size > 1000
    else:  # an environment without the plot extra
        assert PLOT_MISSING in p.stdout


def test_without_matplotlib_the_tables_and_json_still_come(tiny_model, tmp_path):
    """A plain install (no ``plot`` extra): matplotlib cannot be imported, the audit still prints
    every table and writes its JSON, and one line says how to get the plot."""
    hidden = tmp_path / "hide" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hidden.parent), os.environ.get("PYTHONPATH")])),
    }
    out = tmp_path / "audit"
    cmd = [
        sys.executable,
        "-m",
        "vllm_router_ext.audit",
        str(tiny_model),
        "--tokens",
        "64",
        "--out",
        str(out),
    ]
    p = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "| all | bf16-fp32out batch-invariant |" in p.stdout
    assert json.loads((out / "audit.json").read_text(encoding="utf-8"))["tokens"] == 64
    assert not (out / "audit.png").exists()
    assert p.stdout.rstrip().endswith(PLOT_MISSING)


def test_the_benchmark_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    import vllm_router_ext.bench as bench

    monkeypatch.setattr(bench, "pyplot", lambda: None)
    row = {"shape": "DeepSeek-V3", "K": 7168, "N": 256, "M": 1, "cublas": 7.0, "floor_us": 1.0}
    assert bench.plot([row], ["cublas"], tmp_path / "bench.png") is False
    assert not (tmp_path / "bench.png").exists()


def test_console_script_runs_on_the_tiny_checkpoint(tiny_model, tmp_path):
    exe = Path(sys.executable).parent / "vllm-router-audit"
    p = subprocess.run(
        [str(exe), str(tiny_model), "--tokens", "64", "--out", str(tmp_path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "| all | bf16 |" in p.stdout and (tmp_path / "audit.json").exists()


def test_near_tied_gate_flips_exactly_the_known_tokens_in_bf16_only(tmp_path):
    model, states, expected = build_near_tie_checkpoint(tmp_path)
    result = run_audit(model, hidden_states=states, progress=False)
    layer = result["layers"]["1"]
    assert layer["bf16"]["changed_tokens"] == expected
    for label in ("fp32", "bf16-fp32out", "fp32 batch-invariant", "bf16-fp32out batch-invariant"):
        assert layer[label]["changed_tokens"] == 0, label
        assert layer[label]["dw_mean"] < 1e-6
    assert layer["bf16"]["dw_p99"] > 0.01  # a flipped expert moves its whole routed weight


def test_reads_only_gate_tensors(tiny_model, monkeypatch):
    read = []
    original = Checkpoint.tensor

    def spy(self, name):
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(Checkpoint, "tensor", spy)
    run_audit(tiny_model, tokens=64, progress=False, batch_invariant=False)
    assert read and all(n.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")) for n in read)


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_clear_errors(tiny_model, tmp_path):
    not_ds = _copy_checkpoint(tiny_model, tmp_path / "llama")
    cfg = json.loads((not_ds / "config.json").read_text(encoding="utf-8"))
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (not_ds / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AuditError, match="not a DeepSeek-family checkpoint.*LlamaForCausalLM"):
        run_audit(not_ds, progress=False)

    with pytest.raises(AuditError, match="no config.json"):
        run_audit(tmp_path / "nowhere", progress=False)

    missing = _copy_checkpoint(tiny_model, tmp_path / "missing")
    index = json.loads((missing / "model.safetensors.index.json").read_text(encoding="utf-8"))
    del index["weight_map"]["model.layers.1.mlp.gate.e_score_correction_bias"]
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(AuditError, match="e_score_correction_bias' is not in the checkpoint"):
        run_audit(missing, progress=False)

    wrong = _copy_checkpoint(tiny_model, tmp_path / "wrong")
    cfg = json.loads((wrong / "config.json").read_text(encoding="utf-8"))
    cfg["n_routed_experts"] = 32
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AuditError, match=r"gate weight has shape \(16, 256\), config says \[32, 256\]"):
        run_audit(wrong, progress=False)

    bad_states = tmp_path / "states.pt"
    torch.save(torch.zeros(8, 100), bad_states)
    with pytest.raises(AuditError, match=r"hidden states must be \[T, 256\].*\(8, 100\)"):
        run_audit(tiny_model, hidden_states=bad_states, progress=False)

    with pytest.raises(AuditError, match="unknown mode.*allowed: fp32, bf16-fp32out, bf16"):
        run_audit(tiny_model, modes=("fp16",), progress=False)


def test_cli_error_exit_code_and_message(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "vllm_router_ext.audit", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "vllm-router-audit: error:" in p.stderr and "Traceback" not in p.stderr
