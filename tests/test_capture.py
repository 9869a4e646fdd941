"""``--router-capture``: settings, bad input, the recorder and the audit reading it (no engine;
vLLM 0.32 and 0.33). Served end to end in test_vllm_serve.py / test_vllm_offline.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_router_ext.capture import (
    BUDGET_REACHED,
    DEFAULT_TOKENS,
    ENGINE_STOPPED,
    STOPPED,
    CaptureError,
    CaptureSettings,
    GateCapture,
    GateShape,
    check_budget,
    describe_capture,
    next_run,
    read_capture,
    resolve_capture,
    trim_unfinished,
)


def test_sources_resolve_in_precedence_order_with_the_default_budget(tmp_path):
    cli, extra, env = tmp_path / "cli", tmp_path / "extra", tmp_path / "env"
    config = {
        "router_capture_dir_cli": str(cli),
        "router_capture_dir": str(extra),
        "router_capture_tokens": 9,
    }
    got = resolve_capture(
        config, env={"VLLM_ROUTER_CAPTURE_DIR": str(env), "VLLM_ROUTER_CAPTURE_TOKENS": "5"}
    )
    expect = CaptureSettings(
        cli, 9, "--router-capture", tokens_source="additional_config['router_capture_tokens']"
    )
    assert got == expect and cli.is_dir()  # each setting: first set
    got = resolve_capture({"router_capture_dir_cli": str(cli)}, env={})
    assert got == CaptureSettings(cli, DEFAULT_TOKENS, "--router-capture")
    got = resolve_capture({"router_capture_dir": str(extra), "router_capture_tokens": "9"}, env={})
    assert got.directory == extra and got.tokens == 9
    got = resolve_capture({}, env={"VLLM_ROUTER_CAPTURE_DIR": str(env), "VLLM_ROUTER_CAPTURE_TOKENS": "5"})
    assert got.tokens == 5 and got.source == "environment variable VLLM_ROUTER_CAPTURE_DIR"
    assert got.tokens_source == "environment variable VLLM_ROUTER_CAPTURE_TOKENS"
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
    from vllm_router_ext.models.override import _capture_settings

    def config(eager: bool):
        extra = {"router_capture_dir": str(tmp_path)}
        return SimpleNamespace(additional_config=extra, model_config=SimpleNamespace(enforce_eager=eager))

    assert _capture_settings(config(True), draft=False).directory == tmp_path
    assert _capture_settings(config(False), draft=True) is None  # drafts are not recorded
    with pytest.raises(CaptureError, match="add --enforce-eager"):
        _capture_settings(config(False), draft=False)


def _recorder(tmp_path: Path, tokens: int, monkeypatch, hidden: int = 8) -> GateCapture:
    import vllm_router_ext.capture as c

    monkeypatch.setattr(c, "_serving_pass", lambda: True)
    settings = CaptureSettings(tmp_path, tokens, "test")
    gates = [GateShape(layer, hidden, 3, torch.bfloat16) for layer in (1, 2)]
    return GateCapture(settings, gates, f"router-capture-{next_run(tmp_path)}-dp0", {"run": 1})


def _pass(rec: GateCapture, x: torch.Tensor, layers=(1, 2)) -> None:
    """One forward pass: every gate (in layer order) sees ``x``."""
    for layer in layers:
        rec.record(layer, x, x.float() @ torch.ones(x.shape[1], 3))


def test_the_recorder_keeps_the_first_rows_of_each_gate_and_trims_at_the_budget(tmp_path, gen, monkeypatch):
    from safetensors.torch import load_file

    rec = _recorder(tmp_path, 10, monkeypatch)
    xs = [torch.randn(m, 8, generator=gen).to(torch.bfloat16) for m in (4, 3, 6, 2)]
    for x in xs:
        _pass(rec, x)
    data = load_file(str(rec.path))
    assert set(data) == {"layers.1", "logits.1", "layers.2", "logits.2"}
    for layer in (1, 2):
        assert torch.equal(data[f"layers.{layer}"], torch.cat(xs)[:10])
        assert torch.equal(data[f"logits.{layer}"], torch.cat(xs)[:10].float() @ torch.ones(8, 3))
    assert data["logits.1"].dtype == torch.float32
    meta = json.loads(rec.path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta == {
        "run": 1,
        "budget_tokens": 10,
        "layers": [1, 2],
        "rows_per_layer": {"1": 10, "2": 10},
        "complete": True,
        "ended": BUDGET_REACHED,
        "trimmed": True,
    }
    _pass(rec, xs[0])  # past the budget: nothing more
    assert torch.equal(load_file(str(rec.path))["layers.1"], data["layers.1"])
    assert next_run(tmp_path) == 2  # the next server numbers its capture after this one


def test_rows_are_on_disk_after_every_pass_and_a_kill_loses_at_most_the_pass_in_flight(
    tmp_path, gen, monkeypatch
):
    """A process killed outright never closes its recorder: what is on disk then is all there is."""
    from vllm_router_ext.audit import load_hidden_states

    rec = _recorder(tmp_path, 1000, monkeypatch)
    xs = [torch.randn(m, 8, generator=gen).to(torch.bfloat16) for m in (5, 1, 1)]
    _pass(rec, xs[0])
    _pass(rec, xs[1])
    _pass(rec, xs[2], layers=(1,))  # killed mid-pass: layer 2 never ran
    read = read_capture(tmp_path, "router-capture-1-dp0")
    for layer in (1, 2):  # the two finished passes
        assert torch.equal(read.tensors[f"layers.{layer}"], torch.cat(xs[:2]))
    assert read.info["complete"] is False and read.info["rows_per_layer"] == {"1": 6, "2": 6}
    assert "interrupted" in read.info["ended"]
    data, info = load_hidden_states(tmp_path, 8)  # what the audit reads: the same rows
    assert torch.equal(data[1], torch.cat(xs[:2])) and info == read.info
    assert "PARTIAL, 6 tokens per layer of a 1000-token budget (interrupted" in describe_capture(info)


def test_close_trims_the_file_to_the_rows_seen_and_says_so(tmp_path, gen, monkeypatch, caplog):
    from safetensors.torch import load_file

    rec = _recorder(tmp_path, 4096, monkeypatch, hidden=64)
    xs = [torch.randn(m, 64, generator=gen).to(torch.bfloat16) for m in (7, 1, 1)]
    for x in xs:
        _pass(rec, x)
    with caplog.at_level("INFO"):
        rec.close()
        rec.close()  # idempotent
    data = load_file(str(rec.path))
    assert torch.equal(data["layers.2"], torch.cat(xs)) and data["logits.2"].shape == (9, 3)
    assert rec.path.stat().st_size < 9 * 2 * (64 * 2 + 12) + 1024  # trimmed, not the 4096-row layout
    meta = json.loads(rec.path.with_suffix(".json").read_text(encoding="utf-8"))
    assert (
        meta["complete"] is False and meta["ended"] == STOPPED and meta["rows_per_layer"] == {"1": 9, "2": 9}
    )
    lines = [r.getMessage() for r in caplog.records if "wrote the router capture" in r.getMessage()]
    assert lines == [
        f"vllm-router-ext: wrote the router capture {rec.path} (9 tokens x 2 layers, partial, budget "
        f"4096: {STOPPED})"
    ]


@pytest.mark.parametrize("passes", [(), ((1,),)], ids=["before-any-pass", "mid-first-pass"])
def test_an_engine_that_dies_before_a_pass_finishes_leaves_a_readable_capture(
    tmp_path, gen, monkeypatch, caplog, passes
):
    """An engine that fails in its first forward (or before it) closes its recorder with a gate that
    has no rows: the file is trimmed to what each gate has, read back, and the log says so."""
    from safetensors.torch import load_file

    rec = _recorder(tmp_path, 64, monkeypatch)
    x = torch.randn(3, 8, generator=gen).to(torch.bfloat16)
    for layers in passes:
        _pass(rec, x, layers=layers)
    with caplog.at_level("INFO"):
        rec.close()
    data = load_file(str(rec.path))
    rows = {1: 3 if passes else 0, 2: 0}
    for layer, n in rows.items():
        assert data[f"layers.{layer}"].shape == (n, 8) and data[f"logits.{layer}"].shape == (n, 3)
    assert torch.equal(data["layers.1"], x[: rows[1]])
    meta = json.loads(rec.path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta["trimmed"] and meta["rows_per_layer"] == {str(k): n for k, n in rows.items()}
    counts = "/".join(str(n) for n in sorted(set(rows.values())))
    assert [r.getMessage() for r in caplog.records if "router capture" in r.getMessage()] == [
        f"vllm-router-ext: wrote the router capture {rec.path} ({counts} tokens x 2 layers, partial, "
        f"budget 64: {STOPPED})"
    ]


def test_a_garbage_collected_model_writes_its_capture(tmp_path, gen, monkeypatch):
    import gc
    from multiprocessing.util import Finalize

    rec = _recorder(tmp_path, 100, monkeypatch)
    model = torch.nn.Module()
    Finalize(model, rec.close, exitpriority=100)  # as the model's capture is attached
    _pass(rec, torch.randn(3, 8, generator=gen).to(torch.bfloat16))
    del model
    gc.collect()
    meta = json.loads(rec.path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta["trimmed"] and meta["rows_per_layer"] == {"1": 3, "2": 3} and meta["ended"] == STOPPED


def test_the_process_that_started_the_engine_finishes_what_workers_left(tmp_path, gen, monkeypatch, caplog):
    """vLLM kills its workers at a stop: the engine's starting process trims their captures at exit,
    those of earlier runs left alone."""
    old = _recorder(tmp_path, 100, monkeypatch)
    _pass(old, torch.randn(2, 8, generator=gen).to(torch.bfloat16))
    rec = _recorder(tmp_path, 100, monkeypatch)
    assert rec.path.name == "router-capture-2-dp0.safetensors"
    _pass(rec, torch.randn(3, 8, generator=gen).to(torch.bfloat16))
    with caplog.at_level("INFO"):
        trim_unfinished(tmp_path, first_run=2)
    meta = json.loads(rec.path.with_suffix(".json").read_text(encoding="utf-8"))
    assert meta["trimmed"] and meta["ended"] == ENGINE_STOPPED and meta["rows_per_layer"]["1"] == 3
    assert f"wrote the router capture {rec.path} (3 tokens x 2 layers, partial" in caplog.text
    assert not json.loads(old.path.with_suffix(".json").read_text(encoding="utf-8"))["trimmed"]


def test_the_budget_is_computed_and_refused_above_the_limit(tmp_path, monkeypatch):
    import vllm_router_ext.capture as c

    # DeepSeek-V3: 58 MoE gates, hidden 7168 (bf16), 256 experts (fp32 logits)
    gates = [GateShape(layer, 7168, 256, torch.bfloat16) for layer in range(3, 61)]
    per_token = 58 * (7168 * 2 + 256 * 4)
    # the disk check reads the host's free space: a roomy disk here, so the memory limit decides
    monkeypatch.setattr(c.shutil, "disk_usage", lambda p: SimpleNamespace(free=1 << 40))
    assert check_budget(CaptureSettings(tmp_path, 4096, "t", memory_limit_gib=64), gates) == 4096 * per_token
    monkeypatch.setattr(c, "host_memory_bytes", lambda: 64 << 30)
    # the budget names where the token count came from, not the directory's flag
    settings = resolve_capture(
        {"router_capture_dir_cli": str(tmp_path), "router_capture_tokens_cli": 2_000_000_000}
    )
    with pytest.raises(CaptureError) as e:
        check_budget(settings, gates)
    message = str(e.value)
    assert "router capture budget 2000000000 tokens (from --router-capture-tokens) needs" in message
    assert f"{per_token} bytes per token" in message and "58 gate(s)" in message
    assert "above the memory limit of 16.00 GiB (25% of this host's 64.00 GiB" in message
    assert "--router-capture-memory-limit GIB" in message
    settings = CaptureSettings(tmp_path, 20_000, "t", memory_limit_gib=32.0, memory_limit_source="flag")
    assert check_budget(settings, gates) == 20_000 * per_token  # 16.5 GiB: allowed by the override
    monkeypatch.setattr(c.shutil, "disk_usage", lambda p: SimpleNamespace(free=1 << 30))
    with pytest.raises(CaptureError, match=r"above the 1.00 GiB free in"):
        check_budget(settings, gates)


def test_the_memory_limit_resolves_from_its_sources_and_bad_values_are_named(tmp_path):
    got = resolve_capture(
        {"router_capture_dir": str(tmp_path), "router_capture_memory_limit_gib": "2.5"}, env={}
    )
    assert (
        got.memory_limit_gib == 2.5
        and got.memory_limit_source == "additional_config['router_capture_memory_limit_gib']"
    )
    got = resolve_capture(
        {}, env={"VLLM_ROUTER_CAPTURE_DIR": str(tmp_path), "VLLM_ROUTER_CAPTURE_MEMORY_LIMIT_GIB": "1"}
    )
    assert got.memory_limit_gib == 1.0 and got.memory_limit_source.startswith("environment variable")
    assert resolve_capture({"router_capture_dir": str(tmp_path)}, env={}).memory_limit_gib is None
    with pytest.raises(
        CaptureError,
        match=r"invalid router capture memory limit '-1' from .*allowed: a positive number of GiB",
    ):
        resolve_capture(
            {"router_capture_dir": str(tmp_path), "router_capture_memory_limit_gib": "-1"}, env={}
        )


def test_a_failed_write_is_logged_and_serving_goes_on(tmp_path, monkeypatch, caplog):
    import vllm_router_ext.capture as c

    rec = _recorder(tmp_path, 2, monkeypatch, hidden=4)

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(c, "trim_capture", disk_full)
    with caplog.at_level("ERROR"):
        _pass(rec, torch.ones(3, 4, dtype=torch.bfloat16))
    assert "could not finish the router capture" in caplog.text and "No space left on device" in caplog.text
    assert "2 tokens per layer kept, untrimmed: vllm-router-audit reads it" in caplog.text
    assert rec.done


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
    with pytest.raises(
        AuditError, match="2 router captures .*router-capture-1-dp0, router-capture-2-dp0.*pass"
    ):
        run_audit(tiny_model, hidden_states=tmp_path, device="cpu", progress=False)
    # as the message says: one file of the two
    one = tmp_path / "router-capture-2-dp0.safetensors"
    result = run_audit(tiny_model, hidden_states=one, device="cpu", progress=False)
    assert result["tokens"] == 12 and list(result["layers"]) == ["1"]


def test_each_data_parallel_engine_core_writes_its_own_numbered_file(vllm_dist, tmp_path, gen, monkeypatch):
    """What an engine core of data-parallel rank 1 attaches (TP rank 0: the one writer), after a
    capture of an earlier run already in the directory: run 2, ``dp1`` in its name."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    import vllm_router_ext.capture as c
    from vllm_router_ext.layers.gate import router_settings_scope
    from vllm_router_ext.models.override import _attach_capture
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
    config.model_config.dtype = torch.bfloat16
    _attach_capture(model, config, settings, CaptureSettings(tmp_path, 2, "t"))
    recorder = model.gate.router_capture
    assert recorder.path == tmp_path / "router-capture-2-dp1.safetensors"
    assert recorder.meta["data_parallel_rank"] == 1 and recorder.meta["run"] == 2
    monkeypatch.setattr(c, "_serving_pass", lambda: True)
    model.gate.weight_loader(model.gate.weight, torch.randn(4, 32, generator=gen).to(torch.bfloat16))
    model.gate(torch.randn(3, 32, generator=gen).to(torch.bfloat16))
    assert recorder.done and json.loads(recorder.path.with_suffix(".json").read_text())["complete"]


def test_passes_outside_the_runners_scheduled_step_are_not_recorded(vllm_dist, monkeypatch):
    """vLLM's GPU warm-up and autotune passes carry attention metadata too: only the forward of a
    model runner's ``execute_model`` for a client's requests is recorded, not its dummy runs or
    the steps of its ``_warmup`` requests (V1 runner and, where it imports, V2)."""
    import importlib

    import vllm.forward_context as fc

    import vllm_router_ext.capture as c

    runners = []
    for name in c.RUNNERS:
        try:
            runners.append(importlib.import_module(name).GPUModelRunner)
        except ImportError:
            continue
    assert runners, "no vLLM model runner imports"
    seen = []
    for runner in runners:
        monkeypatch.setattr(runner, "execute_model", lambda self, out, **kw: seen.append(c._serving_pass()))
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: SimpleNamespace(attn_metadata={"layer": 0}))
    assert c._serving_pass()  # untracked: attention metadata decides
    assert c.track_scheduled_steps() and c.track_scheduled_steps()  # idempotent: wrapped once
    assert not c._serving_pass()  # a pass outside any step
    client = SimpleNamespace(num_scheduled_tokens={"cmpl-7f3a-0": 5})
    warmup = SimpleNamespace(num_scheduled_tokens={"_warmup_0_": 1, "_v2_mixed_warmup_decode_": 1})
    for runner in runners:
        seen.clear()
        runner.execute_model(None, client)
        runner.execute_model(None, client, dummy_run=True)
        runner.execute_model(None, warmup)
        runner.execute_model.__wrapped__(None, client)  # the runner's own, unwrapped: not a step
        assert seen == [True, False, False, False], runner
    assert not c._serving_pass()


def _mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_capture_is_its_owners_alone_in_progress_complete_and_trimmed(tmp_path, gen, monkeypatch):
    """Captured activations are user traffic: the directory created for them is 0700, and the
    file and its JSON are 0600 while rows arrive, once the budget is reached, and once trimmed."""
    from vllm_router_ext.capture import check_directory

    created = check_directory(tmp_path / "new" / "captures", "--router-capture")
    assert _mode(created) == 0o700
    rec = _recorder(created, 6, monkeypatch)
    _pass(rec, torch.randn(2, 8, generator=gen).to(torch.bfloat16))
    assert _mode(rec.path) == 0o600 and _mode(rec.path.with_suffix(".json")) == 0o600
    rec.close()  # trimmed: a new file replaced the laid-out one
    assert _mode(rec.path) == 0o600 and _mode(rec.path.with_suffix(".json")) == 0o600
    done = _recorder(created, 2, monkeypatch)
    _pass(done, torch.randn(3, 8, generator=gen).to(torch.bfloat16))  # budget reached
    assert done.done and _mode(done.path) == 0o600 and _mode(done.path.with_suffix(".json")) == 0o600
    assert sorted(p.name for p in created.iterdir()) == sorted(
        [
            rec.path.name,
            rec.path.with_suffix(".json").name,
            done.path.name,
            done.path.with_suffix(".json").name,
        ]
    )  # no temporary file left behind


def test_no_capture_write_follows_a_symbolic_link(tmp_path, gen, monkeypatch):
    """Links planted where the capture writes (its files, the old temporary names, the write
    probe's) never carry a write to their targets."""
    import os

    from vllm_router_ext.capture import check_directory

    victim = tmp_path / "victim"
    victim.write_text("precious")
    captures = tmp_path / "captures"
    captures.mkdir()
    for name in (".router-capture-1-dp0.json.tmp", ".router-capture-1-dp0.safetensors.tmp",
                 f".router-capture-write-test-{os.getpid()}"):  # fmt: skip
        (captures / name).symlink_to(victim)
    check_directory(captures, "--router-capture")
    rec = _recorder(captures, 4, monkeypatch)
    _pass(rec, torch.randn(2, 8, generator=gen).to(torch.bfloat16))
    rec.close()
    assert victim.read_text() == "precious"
    # the run's own name taken by a link: refused, not followed
    (captures / "router-capture-9-dp0.safetensors").symlink_to(victim)
    settings = CaptureSettings(captures, 4, "test")
    gates = [GateShape(1, 8, 3, torch.bfloat16)]
    with pytest.raises(FileExistsError):
        GateCapture(settings, gates, "router-capture-9-dp0", {"run": 9})
    assert victim.read_text() == "precious"


def test_a_symbolic_link_as_the_capture_directory_is_refused_with_its_target(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(
        CaptureError, match=r"'.*link' from --router-capture is a symbolic link .*real.*pass the real"
    ):
        resolve_capture({"router_capture_dir_cli": str(link)})
    assert resolve_capture({"router_capture_dir_cli": str(real)}).directory == real


@pytest.fixture
def tiny_disk(tmp_path):
    """A 2 MiB tmpfs: a disk that fills (needs the right to mount, as root in a container has)."""
    import subprocess

    where = tmp_path / "tiny-disk"
    where.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(where)],
                       capture_output=True, text=True)  # fmt: skip
    if p.returncode != 0:
        pytest.skip(
            f"cannot mount a 2 MiB tmpfs here ({p.stderr.strip() or p.returncode}): the full-disk case"
        )
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_disk_that_fills_mid_capture_stops_the_capture_not_serving_and_the_audit_says_why(
    tiny_disk, monkeypatch, caplog, gen
):
    """On a 2 MiB tmpfs a 4096-token budget of two 256-wide gates (about 6 MiB) fills the disk after
    a few passes: the write that fails stops the capture with one line (why, what was kept), later
    passes are no-ops, the JSON (rewritten in place) names the disk as the reason, closing and
    trimming never die (no bus error: captures are read without a memory map), and the rows read
    back are exactly the passes finished before the disk filled."""
    import vllm_router_ext.capture as c

    monkeypatch.setattr(c, "_serving_pass", lambda: True)
    settings = CaptureSettings(tiny_disk, 4096, "test")
    gates = [GateShape(layer, 256, 256, torch.bfloat16) for layer in (1, 2)]
    rec = GateCapture(settings, gates, "router-capture-1-dp0", {"run": 1})
    seen = []
    with caplog.at_level("ERROR"):
        for _ in range(40):  # 40 passes of 64 tokens: 2560 tokens, ~3.9 MiB
            x = torch.randn(64, 256, generator=gen).to(torch.bfloat16)
            seen.append(x)
            for layer in (1, 2):
                rec.record(layer, x, x.float())
            if rec.done:
                break
    assert rec.done, "the tiny disk never filled"
    stopped = [r.getMessage() for r in caplog.records if "stopped" in r.getMessage()]
    assert len(stopped) == 1 and "could not write: No space left on device (ENOSPC)" in stopped[0], stopped
    meta = json.loads((tiny_disk / "router-capture-1-dp0.json").read_text(encoding="utf-8"))
    kept = set(meta["rows_per_layer"].values())
    assert meta["ended"].startswith("could not write: No space left on device") and not meta["complete"]
    assert len(kept) == 1 and 0 < (n := kept.pop()) < 64 * len(seen) and n % 64 == 0
    rec.close()  # the stop after the disk filled: nothing more to do, nothing dies
    caplog.clear()
    with caplog.at_level("ERROR"):
        c.trim_unfinished(tiny_disk, 1)  # where the engine started: trimming needs room it lacks
    assert "could not finish the router capture" in caplog.text and "untrimmed" in caplog.text
    read = c.read_capture(tiny_disk, "router-capture-1-dp0")
    assert torch.equal(read.tensors["layers.1"], torch.cat(seen)[:n])
    assert torch.equal(read.tensors["logits.2"], torch.cat(seen)[:n].float())
    assert not read.info["complete"] and "No space left on device" in describe_capture(read.info)


def test_a_capture_file_cut_short_or_not_a_capture_is_named_not_a_crash(tmp_path, monkeypatch, gen):
    import vllm_router_ext.capture as c

    rec = _recorder(tmp_path, 8, monkeypatch)
    _pass(rec, torch.randn(8, 8, generator=gen).to(torch.bfloat16))
    path = rec.path
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    with pytest.raises(CaptureError, match="cut short: logits.2 needs bytes"):
        c.read_tensors(path)
    path.write_bytes(b"\x07" * 100)
    with pytest.raises(CaptureError, match="not a safetensors file"):
        c.read_tensors(path)
    path.with_suffix(".json").write_text("{not json", encoding="utf-8")
    with pytest.raises(CaptureError, match="not a capture's JSON"):
        c.read_capture(tmp_path, path.stem)
