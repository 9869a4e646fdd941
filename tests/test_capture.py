"""``--router-capture``: settings, bad input, the recorder and the audit reading it (no engine;
vLLM 0.32 and 0.33). Served end to end in test_vllm_serve.py / test_vllm_offline.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_router_ext.capture import (
    DEFAULT_TOKENS,
    CaptureError,
    CaptureSettings,
    GateCapture,
    next_run,
    resolve_capture,
)


def test_sources_resolve_in_precedence_order_with_the_default_budget(tmp_path):
    cli, extra, env = tmp_path / "cli", tmp_path / "extra", tmp_path / "env"
    config = {
        "router_capture_dir_cli": str(cli),
        "router_capture_dir": str(extra),
        "router_capture_tokens": 9,
    }
    got = resolve_capture(config, env={"VLLM_ROUTER_CAPTURE_DIR": str(env)})
    assert got == CaptureSettings(cli, DEFAULT_TOKENS, "--router-capture") and cli.is_dir()
    got = resolve_capture({"router_capture_dir": str(extra), "router_capture_tokens": "9"}, env={})
    assert got.directory == extra and got.tokens == 9
    got = resolve_capture({}, env={"VLLM_ROUTER_CAPTURE_DIR": str(env), "VLLM_ROUTER_CAPTURE_TOKENS": "5"})
    assert got.tokens == 5 and got.source == "environment variable VLLM_ROUTER_CAPTURE_DIR"
    assert resolve_capture({}, env={}) is None


@pytest.mark.parametrize("budget", [0, -3, "many"])
def test_a_bad_budget_is_named_with_what_is_allowed(tmp_path, budget):
    with pytest.raises(CaptureError) as e:
        resolve_capture({"router_capture_dir": str(tmp_path), "router_capture_tokens": budget}, env={})
    assert f"invalid router capture budget {budget!r} from additional_config['router_capture_tokens']" in str(
        e.value
    )
    assert "allowed: a positive integer" in str(e.value)


def test_an_unwritable_directory_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(
        CaptureError, match=r"router capture directory '.*a-file/sub' from .* is not writable"
    ):
        resolve_capture({}, env={"VLLM_ROUTER_CAPTURE_DIR": str(blocker / "sub")})


def test_cli_flags_reach_every_process_and_bad_values_exit_2(vllm_dist, tmp_path, capsys):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_router_ext.cli import add_router_cli_args

    parser = add_router_cli_args(FlexibleArgumentParser())
    parser.add_argument("--model")
    args = parser.parse_args(
        ["--model", "m", "--router-capture", str(tmp_path / "c"), "--router-capture-tokens", "7"]
    )
    extra = AsyncEngineArgs.from_cli_args(args).additional_config
    assert extra["router_capture_dir_cli"] == str(tmp_path / "c") and extra["router_capture_tokens_cli"] == 7
    blocker = tmp_path / "f"
    blocker.write_text("")
    for bad, message in (
        (["--router-capture-tokens", "0"], "invalid router capture budget '0' from --router-capture-tokens"),
        (["--router-capture", str(blocker / "d")], "from --router-capture is not writable"),
    ):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["--model", "m", *bad])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_capture_needs_eager_mode_and_skips_drafts(tmp_path):
    from vllm_router_ext.models.deepseek_v2 import _capture_settings

    def config(eager: bool):
        extra = {"router_capture_dir": str(tmp_path)}
        return SimpleNamespace(additional_config=extra, model_config=SimpleNamespace(enforce_eager=eager))

    assert _capture_settings(config(True), "DeepseekV3ForCausalLM").directory == tmp_path
    assert _capture_settings(config(False), "DeepSeekMTPModel") is None  # drafts are not recorded
    with pytest.raises(CaptureError, match="add --enforce-eager"):
        _capture_settings(config(False), "DeepseekV3ForCausalLM")


def _recorder(tmp_path: Path, tokens: int, monkeypatch) -> GateCapture:
    import vllm_router_ext.capture as c

    monkeypatch.setattr(c, "_serving_pass", lambda: True)
    settings = CaptureSettings(tmp_path, tokens, "test")
    gates = ["model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    return GateCapture(settings, gates, f"router-capture-{next_run(tmp_path)}-dp0", {"run": 1})


def test_the_recorder_keeps_the_first_rows_of_each_gate_and_writes_once(tmp_path, gen, monkeypatch):
    from safetensors.torch import load_file

    rec = _recorder(tmp_path, 10, monkeypatch)
    xs = [torch.randn(m, 8, generator=gen).to(torch.bfloat16) for m in (4, 3, 6, 2)]
    for x in xs:
        rec.record(1, x, x.float() @ torch.ones(8, 3))
    assert not rec.path.exists()  # layer 2 still empty
    rec.record(2, torch.cat(xs), torch.cat(xs).float() @ torch.ones(8, 3))
    data = load_file(str(rec.path))
    assert torch.equal(data["layers.1"], torch.cat(xs)[:10]) and torch.equal(
        data["layers.2"], torch.cat(xs)[:10]
    )
    assert data["logits.1"].dtype == torch.float32 and data["logits.1"].shape == (10, 3)
    meta = json.loads(rec.path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta == {"run": 1, "tokens_per_layer": 10, "layers": [1, 2]}
    rec.record(1, xs[0], xs[0].float() @ torch.ones(8, 3))  # past the budget: nothing more
    assert next_run(tmp_path) == 2  # the next server numbers its capture after this one


def test_a_failed_write_is_logged_and_serving_goes_on(tmp_path, monkeypatch, caplog):
    import safetensors.torch

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    rec = _recorder(tmp_path, 2, monkeypatch)
    with caplog.at_level("ERROR"):
        for layer in (1, 2):
            rec.record(layer, torch.ones(3, 4), torch.ones(3, 2))
    assert "could not write the router capture" in caplog.text and "No space left on device" in caplog.text
    assert rec.done and not rec.path.exists()


def test_a_recorder_that_fails_leaves_the_gate_serving(vllm_dist, gen, caplog):
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    from vllm_router_ext.layers.gate import router_settings_scope
    from vllm_router_ext.precision import RouterPrecision, RouterSettings

    with (
        set_default_torch_dtype(torch.bfloat16),
        router_settings_scope(RouterSettings(RouterPrecision.FP32, "t")),
    ):
        gate = GateLinear(32, 4, prefix="model.layers.7.mlp.gate")
    gate.weight_loader(gate.weight, torch.randn(4, 32, generator=gen).to(torch.bfloat16))

    class Broken:
        def record(self, *args):
            raise RuntimeError("boom")

    gate.attach_capture(Broken())
    with caplog.at_level("ERROR"):
        out, _ = gate(torch.randn(3, 32, generator=gen).to(torch.bfloat16))
    assert out.shape == (3, 4) and gate.router_capture is None
    assert "router capture stopped in model.layers.7.mlp.gate: RuntimeError('boom')" in caplog.text


def test_the_audit_reads_a_capture_directory_and_names_ambiguity(tiny_model, tmp_path, gen):
    from safetensors.torch import save_file

    from vllm_router_ext.audit import AuditError, run_audit

    x = torch.randn(12, 256, generator=gen).to(torch.bfloat16)
    save_file(
        {"layers.1": x, "logits.1": torch.zeros(12, 16)}, str(tmp_path / "router-capture-1-dp0.safetensors")
    )
    result = run_audit(tiny_model, hidden_states=tmp_path, device="cpu", progress=False)
    assert result["tokens"] == 12 and list(result["layers"]) == ["1"]
    save_file({"layers.1": x}, str(tmp_path / "router-capture-2-dp0.safetensors"))
    with pytest.raises(AuditError, match="2 router captures .*router-capture-1-dp0.safetensors.*pass"):
        run_audit(tiny_model, hidden_states=tmp_path, device="cpu", progress=False)


def test_each_data_parallel_engine_core_writes_its_own_numbered_file(vllm_dist, tmp_path, gen, monkeypatch):
    """What an engine core of data-parallel rank 1 attaches (TP rank 0: the one writer), after a
    capture of an earlier run already in the directory: run 2, ``dp1`` in its name."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    import vllm_router_ext.capture as c
    from vllm_router_ext.layers.gate import router_settings_scope
    from vllm_router_ext.models.deepseek_v2 import _attach_capture
    from vllm_router_ext.precision import RouterPrecision, RouterSettings

    (tmp_path / "router-capture-1-dp0.json").write_text("{}")
    settings = RouterSettings(RouterPrecision.FP32, "t")
    model = torch.nn.Module()
    with set_default_torch_dtype(torch.bfloat16), router_settings_scope(settings):
        model.gate = GateLinear(32, 4, prefix="model.layers.3.mlp.gate")
    config = SimpleNamespace(
        model_config=SimpleNamespace(model="m"),
        parallel_config=SimpleNamespace(data_parallel_rank=1, tensor_parallel_size=1),
    )
    _attach_capture(model, config, settings, CaptureSettings(tmp_path, 2, "t"))
    recorder = model.gate.router_capture
    assert recorder.path == tmp_path / "router-capture-2-dp1.safetensors"
    assert recorder.meta["data_parallel_rank"] == 1 and recorder.meta["run"] == 2
    monkeypatch.setattr(c, "_serving_pass", lambda: True)
    model.gate.weight_loader(model.gate.weight, torch.randn(4, 32, generator=gen).to(torch.bfloat16))
    model.gate(torch.randn(3, 32, generator=gen).to(torch.bfloat16))
    assert recorder.path.exists()
