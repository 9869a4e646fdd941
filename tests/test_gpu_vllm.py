"""End to end through real CUDA vLLM on a GPU: ``vllm serve`` of tiny checkpoints with DeepSeek's
real MLA head sizes and each release's routing, with vLLM's defaults (torch.compile and CUDA
graphs) unless a case says otherwise. The servers a run needs start together on the one GPU, each
with a small fixed KV cache. Inside each served model a graph-safe tap (``workers.gate_tap``)
records what the gates saw and returned for real prefill and decode batches.

    pytest tests/test_gpu_vllm.py            # on a machine with CUDA vLLM installed (pip install vllm)

``ROUTER_EXT_E2E_LOGS=DIR`` copies every server's log into DIR.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch


def _cuda_vllm() -> str | None:
    """Why these tests cannot run here, or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU and CUDA vLLM (run on a GPU machine with `pip install vllm`)"
    try:
        from vllm.platforms import current_platform
    except Exception as e:  # noqa: BLE001
        return f"needs CUDA vLLM: import vllm failed ({e!r})"
    if not current_platform.is_cuda():
        return f"needs CUDA vLLM; this vLLM runs on {current_platform.device_name}"
    return None


_WHY = _cuda_vllm()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_WHY is not None, reason=_WHY or "")]

from csrc_triton.capability import vllm_gate_available  # noqa: E402
from vllm_router_ext.ops.routing_fp64 import (  # noqa: E402
    RoutingConfig,
    near_tie_mask,
    reference_logits,
    relative_error,
    select_experts,
)
from vllm_router_ext.tools.server import Server, precision_lines, start_server  # noqa: E402
from vllm_router_ext.tools.tiny_checkpoint import (  # noqa: E402
    FAMILY_PRESETS,
    GPU_MLA_SIZES,
    V41_SERVE_ARGS,
    build_tiny_deepseek_v4,
    build_tiny_family,
    build_tiny_model,
)

TAP = "vllm_router_ext.workers.gate_tap.GateTap"
# fp32 logits of exact bf16 products summed in fp32 (~1e-7 relative); bf16: one bf16 rounding.
LOGIT_TOL = {"fp32": 1e-5, "bf16-fp32out": 1e-5, "bf16": 1e-2}
BI_KERNEL = "batch-invariant triton split-K"  # the batch-invariant kernel, one K split
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Path",
    "for i in range(10):",
    "    return self._data[key]",
    "The quick brown fox",
    "SELECT * FROM users WHERE",
    "#include <stdio.h>\nint main",
    "Once upon a time",
]
LONG_PROMPT = " ".join(f"token{i} value{i * 7 % 13}" for i in range(40))


@dataclass(frozen=True)
class Spec:
    model: str  # a key of ROUTING_PRESETS, or of FAMILY_PRESETS (another MoE family)
    args: tuple[str, ...] = ()
    expect: str = "fp32"  # the precision every gate must run
    weight: str = "bfloat16"  # the gate weight's dtype as vLLM builds it
    fp8: bool = False
    mtp: int = 0
    eager: bool = False
    env: dict = field(default_factory=dict)
    draft: str | None = None  # the precision the MTP draft's gates run, where not ``expect``
    dummy: bool = False  # served with ``--load-format dummy`` (a config and tokenizer only)
    config: dict = field(default_factory=dict)  # DeepSeek-V4 config keys beside the tiny sizes

    def expect_of(self, gate: str) -> str:
        """The precision of a tapped gate (``target:...`` / ``draft:...``) or a precision line's model."""
        drafted = any(mark in gate for mark in ("draft", "MTP", "DSpark"))
        return self.draft if self.draft and drafted else self.expect


V4 = "deepseek-v4"  # served from a config alone (build_tiny_deepseek_v4), with dummy weights
V41 = "deepseek-v4.1"  # the same sizes in V4.1's layout (vLLM's ``vllm/models/deepseek_v41``), bf16 experts
MTP = ("--speculative-config", json.dumps({"method": "mtp", "num_speculative_tokens": 1}))
DSPARK = ("--speculative-config", json.dumps({"method": "dspark", "num_speculative_tokens": 4}))
#: A DSpark draft of one stage inside the checkpoint: the target layers it reads, its Markov head,
#: the token its query block is filled with (an unused id of the tiny tokenizer).
DSPARK_CONFIG = {
    "dspark_target_layer_ids": [1, 3], "dspark_markov_rank": 64, "block_size": 4,
    "dspark_noise_token_id": 129270,
}  # fmt: skip
SPECS: dict[str, Spec] = {
    "v3-auto": Spec("deepseek-v3"),
    "v3-fp32": Spec("deepseek-v3", ("--router-precision", "fp32")),
    "v3-bf16-fp32out": Spec("deepseek-v3", ("--router-precision", "bf16-fp32out"), "bf16-fp32out"),
    "v3-bf16": Spec("deepseek-v3", ("--router-precision", "bf16"), "bf16"),
    "v3-fused": Spec("deepseek-v3", ("--router-precision", "fp32", "--router-fused", "on")),
    # The FP8 release's layout; DeepGEMM off: its first start JIT-compiles for minutes.
    "v3-fp8": Spec("deepseek-v3", fp8=True, env={"VLLM_USE_DEEP_GEMM": "0"}),
    "kimi-k2": Spec("kimi-k2"),
    "deepseek-v2": Spec("deepseek-v2"),
    "deepseek-v2-lite": Spec("deepseek-v2-lite"),
    "v3-mtp": Spec("deepseek-v3", MTP, mtp=1),
    # The draft's own precision: the target fp32, the MTP draft's gates bf16-fp32out.
    "v3-mtp-draft": Spec(
        "deepseek-v3",
        (*MTP, "--router-precision", "fp32", "--router-precision-draft", "bf16-fp32out"),
        mtp=1,
        draft="bf16-fp32out",
    ),
    "v3-batch-invariant": Spec(
        "deepseek-v3", ("--router-batch-invariant",), env={"VLLM_BATCH_INVARIANT": "1"}
    ),
    # The router's batch invariance alone (vLLM's own batch-invariant kernels compile per shape).
    "v3-router-batch-invariant": Spec("deepseek-v3", ("--router-batch-invariant",)),
    "v3-capture": Spec("deepseek-v3", eager=True),  # the capture records in eager mode only
    # Other families: Qwen3-MoE's auto keeps vLLM's gate, so the flag asks; gpt-oss has a gate bias.
    "qwen3-moe-fp32": Spec("qwen3-moe", ("--router-precision", "fp32")),
    "gpt-oss-bf16-fp32out": Spec("gpt-oss", ("--router-precision", "bf16-fp32out"), "bf16-fp32out"),
    # MiniMax-M2's gate weight is fp32 (auto: fp32); Qwen3-Next: linear attention, 512-expert release.
    "minimax-m2": Spec("minimax-m2", weight="float32"),
    "qwen3-next-fp32": Spec("qwen3-next", ("--router-precision", "fp32")),
    "deepseek-v3.2": Spec("deepseek-v3.2"),
    "glm-5": Spec("glm-5"),
    # DeepSeek-V4 (V4-Flash's attention and 256-expert gate, tiny otherwise): auto is fp32; the
    # MTP draft keeps vLLM's own routing precision beside an fp32 target when asked.
    "v4-auto": Spec(V4, dummy=True),
    "v4-bf16-fp32out": Spec(V4, ("--router-precision", "bf16-fp32out"), "bf16-fp32out", dummy=True),
    "v4-mtp-draft": Spec(
        V4,
        (*MTP, "--router-precision-draft", "bf16-fp32out"),
        mtp=1,
        draft="bf16-fp32out",
        dummy=True,
    ),
    # The router's batch invariance on V4's gate; the capture of a V4 server (eager: it records there).
    "v4-router-batch-invariant": Spec(V4, ("--router-batch-invariant",), dummy=True),
    "v4-capture": Spec(V4, eager=True, dummy=True),
    # DeepSeek-V4.1: every MoE layer routes by its gate (no hash layers), auto is fp32; text only.
    "v41-auto": Spec(V41, V41_SERVE_ARGS, dummy=True),
    "v41-bf16-fp32out": Spec(
        V41, (*V41_SERVE_ARGS, "--router-precision", "bf16-fp32out"), "bf16-fp32out", dummy=True
    ),
    # V4.1's DSpark draft (its stages' MoE layers) at its own precision beside the fp32 target.
    "v41-dspark-draft": Spec(
        V41,
        (*V41_SERVE_ARGS, *DSPARK, "--router-precision-draft", "bf16-fp32out"),
        mtp=1,
        draft="bf16-fp32out",
        dummy=True,
        config=DSPARK_CONFIG,
    ),
}
#: Served with vLLM's JIT monitor logging every compile after its warm-up (where vLLM has it).
#: Not its error mode: vLLM's own fused-MoE Triton kernel compiles per new batch size on these
#: tiny experts (measured on vLLM 0.34.0), and that would kill the engine before ours are judged.
JIT_CHECKED = ["v3-fp32", "v3-fused", "v3-bf16-fp32out", "v3-router-batch-invariant", "kimi-k2", "minimax-m2",
               "v3-mtp", "v4-auto", "v4-bf16-fp32out", "v41-auto", "v41-bf16-fp32out"]  # fmt: skip
DSA = ("deepseek-v3.2", "glm-5")  # sparse attention: vLLM's indexer kernels and graph mode differ
CAPTURED = ["v3-capture", "v4-capture"]
SERVED = [s for s in SPECS if s not in CAPTURED]
TAPPED = SERVED


def _has_jit_monitor() -> bool:
    try:
        from vllm.config import ObservabilityConfig
    except ImportError:
        return False
    return "jit_monitor_mode" in getattr(ObservabilityConfig, "__dataclass_fields__", {})


_HAS_JIT_MONITOR = _WHY is None and _has_jit_monitor()
#: bf16-fp32out runs vLLM's own gate kernel at 1-16 tokens where this vLLM and GPU have it.
_VLLM_GATE = _WHY is None and vllm_gate_available()


class Servers:
    """The servers this pytest run needs, started together at first use."""

    def __init__(self, names: list[str], root: Path) -> None:
        self.root = root
        self.servers: dict[str, Server] = {}
        self.errors: dict[str, str] = {}
        self.models: dict[str, Path] = {}
        for name in names:
            spec = SPECS[name]
            if spec.model in (V4, V41):
                extra = {"v41": True, "expert_dtype": "bf16"} if spec.model == V41 else {}
                self.models[name] = build_tiny_deepseek_v4(
                    root / f"ckpt-{name}", mtp_layers=spec.mtp, **extra, **spec.config
                )
                continue
            if spec.model in FAMILY_PRESETS:
                seed = len(self.models)
                self.models[name] = build_tiny_family(root / f"ckpt-{name}", spec.model, seed=seed)
                continue
            overrides = {**GPU_MLA_SIZES, "num_hidden_layers": 3}
            if spec.model in DSA:  # vLLM's GPU indexer kernels take the release sizes only
                overrides.update(index_n_heads=64, index_topk=2048)
            self.models[name] = build_tiny_model(
                root / f"ckpt-{name}", spec.model, seed=len(self.models), fp8=spec.fp8,
                mtp_layers=spec.mtp, config_overrides=overrides,
            )  # fmt: skip
        for name in names:
            spec = SPECS[name]
            work = root / name
            work.mkdir()
            args = [
                "--gpu-memory-utilization", "0.04", "--kv-cache-memory-bytes", str(1 << 30),
                "--max-num-seqs", "64", *spec.args,
            ]  # fmt: skip
            if name in CAPTURED:
                args += ["--router-capture", str(work / "capture"), "--router-capture-tokens", "4096"]
            if spec.dummy:
                args += ["--load-format", "dummy"]
            if name in JIT_CHECKED and _HAS_JIT_MONITOR:
                args += ["--jit-monitor-mode", "warn", "--jit-monitor-verbose"]
            args += ["--worker-extension-cls", TAP]
            env = {"VLLM_SERVER_DEV_MODE": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1", **spec.env}
            self.servers[name] = start_server(self.models[name], work, *args, env=env, eager=spec.eager)
        with cf.ThreadPoolExecutor(len(names) or 1) as pool:
            for name, error in zip(names, pool.map(self._wait, names), strict=True):
                if error:
                    self.errors[name] = error

    def _wait(self, name: str) -> str | None:
        try:
            self.servers[name].wait_healthy(timeout=float(os.environ.get("ROUTER_EXT_E2E_START_S", "480")))
        except (RuntimeError, TimeoutError) as e:
            return str(e)
        return None

    def get(self, name: str) -> Server:
        if name in self.errors:
            pytest.fail(f"{name}: vllm serve did not come up:\n{self.errors[name][-3000:]}")
        return self.servers[name]

    def stop(self) -> None:
        logs = os.environ.get("ROUTER_EXT_E2E_LOGS")
        for name, server in self.servers.items():
            server.stop()
            if logs:
                Path(logs).mkdir(parents=True, exist_ok=True)
                shutil.copy(server.log_path, Path(logs) / f"{name}.log")


@pytest.fixture(scope="session")
def servers(request, tmp_path_factory):
    names = sorted(
        {item.callspec.params["spec"] for item in request.session.items
         if hasattr(item, "callspec") and item.callspec.params.get("spec") in SPECS}
    )  # fmt: skip
    group = Servers(names, tmp_path_factory.mktemp("gpu-e2e"))
    yield group
    group.stop()


def _complete(server: Server, prompt: str, max_tokens: int = 16, **extra) -> dict:
    status, reply = server.post(
        "/v1/completions",
        {"model": server.model_name(), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra},
    )
    assert status == 200, reply
    return reply


def _concurrently(fn, items: list) -> list:
    with cf.ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


@pytest.mark.parametrize("spec", SERVED)
def test_serves_with_defaults_and_names_the_gpu_kernels(servers, spec):
    server = servers.get(spec)
    reply = _complete(server, "def fibonacci(n):", max_tokens=12)
    assert reply["usage"]["completion_tokens"] == 12 and reply["choices"][0]["text"]
    status, _ = server.post(
        "/v1/completions", {"model": server.model_name(), "prompt": "x", "max_tokens": -3}
    )
    assert status == 400
    log = server.log()
    lines = precision_lines(log)
    assert len(lines) == (2 if SPECS[spec].mtp else 1), lines  # the MTP draft's gates log their own line
    for line in lines:
        expect = SPECS[spec].expect_of(line)
        assert f"router precision {expect} " in line, line
        assert ("logits float32" if expect != "bf16" else "logits model dtype") in line
        implementation = line.split("implementation: ", 1)[1]
        if "--router-batch-invariant" in SPECS[spec].args:
            assert implementation.startswith(BI_KERNEL), line
        else:  # the kernel per range of M, and where its configs come from: the tuned table, or why not
            vllm_gate = expect == "bf16-fp32out" and _VLLM_GATE
            first = "vLLM cuteDSL ll_bf16 M<=16, triton " if vllm_gate else "triton "
            assert implementation.startswith(f"by M at run time: {first}"), line
            assert "tuned table " in implementation or "heuristic configs: " in implementation, line
        assert f"weight {SPECS[spec].weight}" in line, line  # FP8 checkpoints too: the gate is not quantized
    assert "is quantized; leaving it" not in log
    assert "Traceback" not in log
    if not SPECS[spec].eager:
        assert "Capturing CUDA graphs" in log or "Graph capturing finished" in log, "no CUDA graphs captured"
        if SPECS[spec].model in (*DSA, V4, V41):  # vLLM's default for sparse attention
            assert "Breakable CUDA graph enabled" in log
        else:
            assert "torch.compile" in log, "the model was not compiled"


def _tap(server: Server, tmp: Path, traffic) -> dict:
    started = server.rpc("router_tap_start")
    assert started and started[0]["gates"], started
    traffic()
    path = tmp / "tap.pt"
    server.rpc("router_tap_dump", str(path))
    return torch.load(path, weights_only=False)


@pytest.mark.parametrize("spec", TAPPED)
def test_gate_logits_inside_the_served_model_match_fp64(servers, spec, tmp_path):
    """Prefill (one long prompt, then 8 prompts at once) and decode: every row each gate saw, under
    compile and CUDA graphs, against fp64 of the same input; fp32 mode: the same experts as fp64."""
    server = servers.get(spec)

    def traffic():
        _complete(server, LONG_PROMPT, max_tokens=4)
        _concurrently(lambda p: _complete(server, p, max_tokens=24), PROMPTS)

    taps = _tap(server, tmp_path, traffic)
    cfg = json.loads((servers.models[spec] / "config.json").read_text(encoding="utf-8"))
    # DeepSeek's routing is replayed from the config; another family's logits are checked alone.
    routing = None if SPECS[spec].model in FAMILY_PRESETS else RoutingConfig.from_hf_config(cfg)
    assert {n.split(":")[0] for n in taps} == ({"target", "draft"} if SPECS[spec].mtp else {"target"})
    fused = any("routing: fused router" in ln for ln in precision_lines(server.log()))
    if SPECS[spec].model == V41:  # vLLM builds V4.1's MoE layers without hash layers
        assert not any(t.get("hash_routed") for t in taps.values()), sorted(taps)
    for name, t in taps.items():
        if fused and name.startswith("target:") and not t.get("hash_routed"):
            assert (t["ids"][:, 0] >= 0).any(), (name, "the fused router's picks were not tapped")
        judge_tapped_gate(name, t, SPECS[spec].expect_of(name), routing)
        if "--router-batch-invariant" in SPECS[spec].args and name.startswith("target:"):
            judge_batch_invariance(name, t, SPECS[spec].expect_of(name))


def _served_weight(t: dict) -> torch.Tensor:
    """The gate weight as the server held it (the tap keeps an fp32 copy and the dtype's name)."""
    return t["weight"].to(getattr(torch, t["weight_dtype"].removeprefix("torch.")))


def judge_batch_invariance(name: str, t: dict, expect: str) -> None:
    """A batch-invariant gate's served logits, bitwise: each row as the op gives it alone, and every
    row as the op gives it inside one batch of all of them (a size no served batch had)."""
    from vllm_router_ext.ops.router_gemm import router_gemm

    if t["rows_seen"] == 0:
        return
    real = torch.isfinite(t["x"]).all(-1)
    x, logits, w = t["x"][real].cuda(), t["logits"][real].cuda(), _served_weight(t).cuda()
    whole = router_gemm(x, w, expect, batch_invariant=True)
    assert torch.equal(whole, logits), (name, f"a batch of {x.shape[0]} rows gives other logits")
    for i in torch.randperm(x.shape[0])[:32].tolist():
        alone = router_gemm(x[i : i + 1], w, expect, batch_invariant=True)
        assert torch.equal(alone[0], logits[i]), (name, f"row {i} alone gives other logits")


def judge_tapped_gate(name: str, t: dict, expect: str, routing: RoutingConfig | None) -> None:
    """One gate's tapped rows against fp64 of the same inputs (and, in fp32 mode with a routing,
    the same experts)."""
    assert t["precision"] == expect, name
    assert t["out_dtype"] == ("None" if expect == "bf16" else "torch.float32"), name
    if t.get("hash_routed"):  # DeepSeek-V4's hash layers: a token-id table picks, not these logits
        routing = None
        if t["rows_seen"] == 0:
            return
    sizes = t["sizes"].tolist()
    assert t["rows_seen"] == sum(sizes) and t["x"].shape[0] > 0, name
    if name.startswith("target:"):
        assert max(sizes) >= 64 and min(sizes) <= 8, (name, sorted(set(sizes)))  # prefill and decode
    # A CUDA graph pads a batch to its captured size with whatever its static buffers held: zeros,
    # stale hidden states, NaN (seen on an H100 and an H200). Every call starts with a token; a
    # finite row is judged whatever it is, and NaN in gives NaN out.
    x, logits = t["x"], t["logits"]
    real = torch.isfinite(x).all(-1)
    starts = [0, *torch.tensor(sizes).cumsum(0).tolist()[:-1]]
    assert real[starts].all(), (name, "a call starting with a non-finite row")
    assert real.float().mean() >= 0.9 and not torch.isfinite(logits[~real]).all(-1).any(), name
    picked = t["ids"][:, : routing.top_k] if routing is not None else t["ids"][:, :0]
    fused = picked.shape[1] > 0 and bool((picked[:, 0] >= 0).any())
    if fused:  # the fused router picked: every row it saw has its experts, distinct and valid
        assert (picked[:, 0] >= 0).all() and (picked < t["weight"].shape[0]).all(), name
        assert (picked.sort(-1).values.diff(dim=-1) > 0).all(), (name, "repeated experts")
    x, logits, picked = x[real], logits[real], picked[real]
    assert torch.isfinite(logits).all(), (name, "non-finite logits of a finite input")
    ref = reference_logits(x, t["weight"])
    if t.get("linear_bias") is not None:
        ref = ref + t["linear_bias"].double()
    err = relative_error(logits, ref)
    assert err <= LOGIT_TOL[expect], (name, err)
    if expect == "fp32" and routing is not None:
        ids, _ = select_experts(logits.double(), routing, t["bias"])
        ref_ids, _ = select_experts(ref, routing, t["bias"])
        # fp32's own error (1e-5 relative) can swap only experts whose fp64 scores tie that closely
        ties = near_tie_mask(ref, routing, t["bias"], 1e-5 * ref.abs().max().item() / 4 + 1e-7)
        same = (ids == ref_ids).all(dim=-1)
        assert same[~ties].all() and ties.float().mean() <= 0.05, (name, int((~same).sum()))
        if fused:  # the experts the fused router handed vLLM's experts: fp64's
            same = (picked.long().sort(-1).values == ref_ids).all(dim=-1)
            assert same[~ties].all(), (name, "fused router", int((~same).sum()))


@pytest.mark.parametrize("spec", ["v3-fp32"])
def test_step_timer_times_the_decode_graph_of_the_batch(servers, spec):
    """The end-to-end benchmark's GPU step time: 8 requests decoding together replay vLLM's FULL
    graph for 8 tokens most; its replays take GPU time, and fewer tokens' graphs take no more."""
    server = servers.get(spec)
    server.rpc("router_steps_start")
    _concurrently(lambda p: _complete(server, p, max_tokens=48), PROMPTS)
    report = server.rpc("router_steps_stop")[0]
    top = report["graphs"][0]
    assert top["graph"] == "FULL:8" and top["replays"] >= 30, report
    assert 0 < top["min_us"] <= top["median_us"] < 50_000, report
    assert report["untimed"] == 0
    server.rpc("router_steps_start")
    _complete(server, PROMPTS[0], max_tokens=48)
    alone = server.rpc("router_steps_stop")[0]["graphs"][0]
    assert alone["graph"] == "FULL:1" and alone["replays"] >= 40, alone
    assert alone["median_us"] <= top["median_us"] * 1.2, (alone, top)


@pytest.mark.parametrize("spec", ["v3-batch-invariant"])
def test_batch_invariant_tokens_equal_alone_and_in_batches(servers, spec):
    server = servers.get(spec)
    probe = "def merge_sorted(a, b):"
    alone = _complete(server, probe, max_tokens=24, logprobs=1)["choices"][0]
    neighbours = [p + f" # {i}" for i, p in enumerate(PROMPTS * 4)]
    for size in (2, 4, 8, 16, 32):
        batch = [probe, *neighbours[: size - 1]]
        got = _concurrently(lambda p: _complete(server, p, max_tokens=24, logprobs=1)["choices"][0], batch)[0]
        assert got["text"] == alone["text"], size
        assert got["logprobs"]["token_logprobs"] == alone["logprobs"]["token_logprobs"], size


@pytest.mark.parametrize("spec", CAPTURED)
def test_capture_on_the_gpu_server_is_kept_at_sigterm_and_the_audit_reads_it(servers, spec, tmp_path):
    """Three completions against a 4096-token budget, then SIGTERM to ``vllm serve``: the capture
    holds exactly the rows the gates saw (the tap), logits match fp64, the audit says partial.
    DeepSeek-V4 is served with dummy weights: its audit reads the gates the server held (the tap's),
    written in the release's names."""
    import re
    import signal

    from safetensors.torch import load_file, save_file

    server = servers.get(spec)
    capture = server.log_path.parent / "capture"
    path = capture / "router-capture-1-dp0.safetensors"
    prompts = [f"def f{i}(x):\n    return" for i in range(3)]
    seen = _tap(server, tmp_path, lambda: [_complete(server, p, 4) for p in prompts])
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(120) == 0
    wrote = [ln for ln in server.log().splitlines() if "wrote the router capture" in ln]
    assert len(wrote) == 1 and "partial, budget 4096" in wrote[0], server.log()[-3000:]
    data = load_file(str(path))
    meta = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))
    dummy = SPECS[spec].dummy
    served = ckpt = servers.models[spec]  # the audit's checkpoint: the served one, or its router (dummy)
    weights = {} if dummy else load_file(str(served / "model.safetensors"))
    gates = {}  # the tapped target gate of each layer
    for gate, t in seen.items():
        if gate.startswith("target:") and (m := re.search(r"\.layers\.(\d+)\.", gate)):
            gates[m.group(1)] = (gate.removeprefix("target:"), t)
    layers = [k.split(".")[1] for k in data if k.startswith("layers.")]
    assert layers and sorted(layers) == sorted(gates) and meta["complete"] is False and meta["trimmed"]
    release = {}  # DeepSeek-V4's router in the release's names, from the gates the server held
    for layer in layers:
        gate, tapped = gates[layer]
        assert meta["rows_per_layer"][layer] == tapped["rows_seen"] > 0
        assert torch.equal(data[f"layers.{layer}"], tapped["x"].to(data[f"layers.{layer}"].dtype))
        assert torch.equal(data[f"logits.{layer}"], tapped["logits"])
        w = _served_weight(tapped) if dummy else weights[f"{gate}.weight"]
        assert relative_error(data[f"logits.{layer}"], reference_logits(data[f"layers.{layer}"], w)) <= 1e-5
        if dummy:
            release[f"layers.{layer}.ffn.gate.weight"] = w.contiguous()
            if tapped["bias"] is not None:
                release[f"layers.{layer}.ffn.gate.bias"] = tapped["bias"].float().contiguous()
    if dummy:
        ckpt = tmp_path / "router-only"
        ckpt.mkdir()
        save_file(release, str(ckpt / "model.safetensors"))
        shutil.copy(served / "config.json", ckpt / "config.json")
    out = server.log_path.parent / "audit"
    cmd = [sys.executable, "-m", "vllm_router_ext.audit", str(ckpt), "--hidden-states", str(capture)]
    cmd += ["--allow-other-model"] if dummy else []  # the capture names the served model's directory
    p = subprocess.run(
        [*cmd, "--out", str(out), "--no-progress"], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "capture router-capture-1-dp0: PARTIAL" in p.stdout
    result = json.loads((out / "audit.json").read_text(encoding="utf-8"))
    assert result["capture"]["complete"] is False and result["overall"]["fp32"]["rel_err"] <= 1e-6
    if SPECS[spec].model == V4:  # the hash layers are reported as routed by their token-id table
        hashed = sorted(int(layer) for layer in layers if gates[layer][1].get("hash_routed"))
        assert hashed and result["table_routed_layers"] == hashed, (hashed, result.get("table_routed_layers"))


def _stream(server: Server, prompt: str) -> int:
    body = {"model": server.model_name(), "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        server.base_url + "/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        chunks = [ln for ln in r.read().decode().splitlines() if ln.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]" and len(chunks) >= 2
        return r.status


@pytest.mark.parametrize("spec", ["v3-bf16-fp32out"])
def test_load_32_clients_with_bad_requests_mixed_in(servers, spec):
    server = servers.get(spec)
    mark = len(server.log())
    name = server.model_name()
    lock = threading.Lock()
    statuses: dict[str, list[int]] = {"good": [], "bad": []}

    def job(i: int) -> None:
        if i % 8 == 7:  # a bad request: negative max_tokens, or an unknown model
            body = {"model": name if i % 16 == 7 else "no-such-model", "prompt": "x", "max_tokens": -1}
            kind, status = "bad", server.post("/v1/completions", body)[0]
        elif i % 2:
            kind, status = "good", _stream(server, f"{PROMPTS[i % 8]} {i}")
        else:
            body = {"model": name, "prompt": f"{PROMPTS[i % 8]} {i}", "max_tokens": 8, "temperature": 0}
            kind, status = "good", server.post("/v1/completions", body)[0]
        with lock:
            statuses[kind].append(status)

    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(32) as pool:
        list(pool.map(job, range(292)))  # every 8th bad: 256 good, 36 bad
    assert len(statuses["good"]) == 256 and set(statuses["good"]) == {200}, statuses["good"]
    assert statuses["bad"] and all(400 <= s < 500 for s in statuses["bad"]), statuses["bad"]
    with urllib.request.urlopen(server.base_url + "/health", timeout=10) as r:
        assert r.status == 200
    # vLLM's API server logs each refused request at ERROR ("Exception caught. Request id: ...").
    errors = [ln for ln in server.log()[mark:].splitlines() if " ERROR " in ln]
    refused = [ln for ln in errors if "Exception caught. Request id" in ln]
    assert errors == refused and len(refused) <= len(statuses["bad"]), errors[:5]
    assert time.monotonic() - t0 < 300


#: Prompt lengths (tokens) sent one at a time, within the servers' 512-token context: every size
#: to 17, every bucket edge of the choice to 513, and a stride through the rest; then batches of
#: prompts make steps of up to ~4000 tokens (prefills side by side, decode beside them).
SWEEP_LENGTHS = sorted(
    {*range(1, 18), *range(18, 500, 23), 31, 32, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 500}
)
BATCHES = [[7 + 7 * i for i in range(n)] for n in (2, 3, 5, 8, 13, 21, 34, 64)] + [
    [480] * n for n in (2, 3, 4, 5, 8)
] + [[450, 300, 3, 5, 400, 2, 250, 17]]  # fmt: skip


@pytest.mark.parametrize("spec", JIT_CHECKED)
def test_no_router_kernel_compiles_after_the_warm_up(servers, spec):
    """With vLLM's JIT monitor on, steps of every size (single prompts of 1..500 tokens, batches
    of 2..64 prompts, up to ~4000 tokens a step, decode beside prefills) all answer 200, and the
    monitor logs no compile of this plugin's kernels after the warm-up; the warm-up's line says
    what it ran."""
    if not _HAS_JIT_MONITOR:
        pytest.skip("this vLLM has no JIT monitor (--jit-monitor-mode: vLLM 0.33 and later)")
    server = servers.get(spec)
    gen = torch.Generator().manual_seed(len(spec))
    name = server.model_name()

    def ids(n: int) -> list[int]:  # fresh token ids: no prefix-cache hit shortens a prefill
        return torch.randint(16, 2000, (n,), generator=gen).tolist()

    def send(prompt: list[int], max_tokens: int = 1) -> int:
        body = {"model": name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return server.post("/v1/completions", body)[0]

    assert max(SWEEP_LENGTHS) + 1 <= 512 and max(map(max, BATCHES)) + 8 <= 512  # the servers' context
    statuses = [send(ids(n)) for n in SWEEP_LENGTHS]
    for batch in BATCHES:
        statuses += _concurrently(lambda n: send(ids(n), 8), batch)
    assert set(statuses) == {200}, sorted(set(statuses))
    with urllib.request.urlopen(server.base_url + "/health", timeout=10) as r:
        assert r.status == 200
    log = server.log()
    compiled = [ln for ln in log.splitlines() if "JIT compilation during inference" in ln]
    # ours, and vLLM's gate kernel (CuTeDSL ``LLBf16*``) where the op runs it at 1-16 tokens
    ours = ("_gemv_kernel", "_splitk_", "_tiled_kernel", "_wgmma_ws_kernel", "_route_logits_kernel",
            "_route_gemv", "LLBf16")  # fmt: skip
    assert "Kernel JIT monitor activated" in log
    assert not [ln for ln in compiled if any(k in ln for k in ours)], compiled[:5]
    warmed = [ln for ln in log.splitlines() if "warmed the router kernels" in ln]
    assert warmed and all(" launches in " in ln for ln in warmed), log[-3000:]
