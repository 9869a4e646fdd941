"""The warm-up compiles every kernel variant serving can reach: swept through the real CUDA
dispatch with an H200's facts and table, every Triton launch's compile key (the kernel, Triton's
own specialisation of each argument, the launch options) is recorded instead of run; the keys of
the warm-up's token counts equal those of every token count 1..max."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import csrc_triton.problem as problem_types
from csrc_triton import choice
from csrc_triton.problem import Device, Precision, Problem
from vllm_router_ext.ops.warmup import scan_limit, warmup_sizes
from vllm_router_ext.precision import RouterPrecision, RouterSettings

H200 = Device("NVIDIA H200", 132, 90, cublas=True, gluon=True)
H100 = Device("NVIDIA H100 80GB HBM3", 132, 90, cublas=True, gluon=True)  # no table: heuristic
FP32, BF16_FP32OUT = Precision.FP32, Precision.BF16_FP32OUT


class CompileKeys:
    """Replaces every kernel of the library with a recorder of Triton's compile key for sm_90."""

    KERNELS = (
        ("csrc_triton.router_gemm_gemv", "_gemv_kernel"),
        ("csrc_triton.router_gemm_splitk", "_splitk_partials_kernel"),
        ("csrc_triton.split_sum", "_split_sum_kernel"),
        ("csrc_triton.router_gemm_tiled", "_tiled_kernel"),
        ("csrc_triton.router_gemm_wgmma_ws_gluon", "_wgmma_ws_kernel"),
    )

    def __init__(self, monkeypatch):
        import importlib

        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime.jit import JITFunction, create_function_from_signature

        backend = make_backend(GPUTarget("cuda", 90, 32))
        self.keys: set = set()
        for module_name, name in self.KERNELS:
            module = importlib.import_module(module_name)
            kernel = getattr(module, name)
            fn = getattr(kernel, "fn", kernel)  # the interpreter wraps the Python function
            params = kernel.params if hasattr(kernel, "params") else JITFunction(fn).params
            signature = getattr(kernel, "signature", None) or JITFunction(fn).signature
            binder = create_function_from_signature(signature, params, backend)
            monkeypatch.setattr(module, name, _Recorder(name, binder, self.keys))
        # as on an H200: compiled code (no interpreter upcast) and PDL launches
        for module_name in ("csrc_triton.router_gemm_splitk", "csrc_triton.router_gemm_tiled"):
            monkeypatch.setattr(importlib.import_module(module_name), "interpreting", lambda: False)
        for module_name in ("csrc_triton.router_gemm_splitk", "csrc_triton.router_gemm_wgmma_ws"):
            monkeypatch.setattr(importlib.import_module(module_name), "pdl_enabled", lambda device: True)
        monkeypatch.setattr(problem_types, "interpreting", lambda: False)
        # cuBLAS compiles nothing; on CPU tensors it has no bf16 x bf16 -> fp32 GEMM
        import csrc_triton.dispatch as dispatch

        cublas = lambda x, w, dtype: torch.empty((x.shape[0], w.shape[0]), dtype=dtype)  # noqa: E731
        monkeypatch.setattr(dispatch, "_cublas", cublas)


class _Recorder:
    def __init__(self, name, binder, keys):
        self.name, self.binder, self.keys = name, binder, keys

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            self.keys.add((self.name, tuple(specialization), tuple(sorted(options.items()))))

        return launch


def _keys_of(recorder, sizes, k, n, precision, batch_invariant, weight_dtype) -> set:
    from csrc_triton.dispatch import router_gemm_cuda
    from vllm_router_ext.ops.router_gemm import fp32_weight_terms

    recorder.keys.clear()
    x = torch.zeros((max(sizes), k), dtype=torch.bfloat16)
    w = torch.zeros((n, k), dtype=weight_dtype)
    terms = fp32_weight_terms(w) if weight_dtype == torch.float32 and not batch_invariant else None
    for m in sizes:
        router_gemm_cuda(x[:m], w, precision, batch_invariant, terms)
    return set(recorder.keys)


CASES = [
    # (device, K, N, mode, batch-invariant, weight dtype, largest step)
    (H200, 7168, 256, FP32, False, torch.bfloat16, 8192),  # DeepSeek-V3
    (H200, 7168, 256, BF16_FP32OUT, False, torch.bfloat16, 8192),
    (H200, 7168, 256, FP32, True, torch.bfloat16, 8192),
    (H200, 7168, 384, FP32, False, torch.bfloat16, 4096),  # Kimi-K2
    (H200, 3072, 256, FP32, False, torch.float32, 2048),  # MiniMax-M2: an fp32 weight (its terms from 1024)
    (H100, 4096, 160, FP32, False, torch.bfloat16, 2048),  # no table: the heuristic, a 128 + 32 tile
]


@pytest.mark.parametrize("device,k,n,precision,bi,weight_dtype,max_m", CASES)
def test_the_warm_up_compiles_what_every_step_size_compiles(
    monkeypatch, device, k, n, precision, bi, weight_dtype, max_m
):
    problem = Problem(1, k, n, precision, bi, torch.bfloat16, weight_dtype, device,
                             weight_terms=weight_dtype == torch.float32 and not bi)  # fmt: skip
    sizes = warmup_sizes(problem, max_m)
    assert sizes[0] == 1 and sizes[-1] <= max_m and list(sizes) == sorted(set(sizes))
    recorder = CompileKeys(monkeypatch)
    monkeypatch.setattr(problem_types, "CPU_INTERPRETER", device)  # Problem.of's device for CPU tensors
    every = _keys_of(recorder, range(1, max_m + 1), k, n, precision, bi, weight_dtype)
    warmed = _keys_of(recorder, sizes, k, n, precision, bi, weight_dtype)
    assert warmed == every, sorted(every - warmed)
    kernels = {key[0] for key in every}
    assert "_splitk_partials_kernel" in kernels or "_gemv_kernel" in kernels
    if precision is FP32 and not bi and max_m >= choice.WGMMA_WS_FROM_M:
        assert "_wgmma_ws_kernel" in kernels  # the prefill kernel is in the sweep, so in the warm-up
    # far fewer launches than token counts: one per class, not per M
    assert len(sizes) < max_m // 10


@pytest.mark.parametrize("device,k,n,precision,bi,weight_dtype,max_m", CASES)
def test_nothing_changes_above_the_scan(device, k, n, precision, bi, weight_dtype, max_m):
    """The warm-up scans the choice up to :func:`scan_limit`; above it the launch stays."""
    problem = Problem(1, k, n, precision, bi, torch.bfloat16, weight_dtype, device,
                             weight_terms=weight_dtype == torch.float32 and not bi)  # fmt: skip
    limit = scan_limit(problem)
    at_limit = choice.choose(dataclasses.replace(problem, m=limit))
    for m in (limit + 1, limit + 17, 2 * limit, 65536, 262144):
        assert choice.choose(dataclasses.replace(problem, m=m)) == at_limit, m


def test_a_table_bucket_anywhere_is_warmed(monkeypatch, table_env, tmp_path):
    """A bucket a retune adds at any M (here 3001..3003) gets its own warm-up launches."""
    import json

    from csrc_triton.launches import SplitKLaunch, to_bucket

    odd = SplitKLaunch(32, 32, 64, 1024, promote_chunks=2)
    buckets = [{"max_m": 3000, **to_bucket(SplitKLaunch(16, 32, 128, 512, promote_chunks=2))},
               {"max_m": 3003, **to_bucket(odd)}, {"max_m": None, "kernel": "tiled", "block_m": 64,
               "block_n": 64, "block_k": 64, "promote_chunks": 2}]  # fmt: skip
    table = {"device": "NVIDIA H200", "shapes": {"1024x64": {"fp32": buckets}}}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))
    table_env(str(path))
    problem = Problem(1, 1024, 64, FP32, False, torch.bfloat16, torch.bfloat16, H200)
    sizes = warmup_sizes(problem, 4096)
    assert {3001, 3002, 3003} <= set(sizes)
    assert {choice.choose(dataclasses.replace(problem, m=m)).block_m for m in (3001, 3002, 3003)} == {32}


def test_a_gate_of_ours_warms_its_kernels_once_its_weight_is_final(vllm_dist, monkeypatch, gen):
    """vLLM's loaders (dummy weights too) call the quant method's process_weights_after_loading:
    our gate's warms its kernels there, for the model's activation dtype and the engine's
    largest step."""
    import vllm_router_ext.ops.warmup as warmup
    from vllm_router_ext.layers.gate import router_settings_scope

    calls = []
    monkeypatch.setattr(warmup, "warm_up_gate", lambda *args: calls.append(args) or 0)
    monkeypatch.setattr(vllm_dist.scheduler_config, "max_num_batched_tokens", 3000)
    with router_settings_scope(RouterSettings(RouterPrecision.FP32, "test", batch_invariant=True)):
        gate = _gate()
    gate.weight_loader(gate.weight, (torch.randn(8, 64, generator=gen) / 8).to(torch.bfloat16))
    gate.quant_method.process_weights_after_loading(gate)
    assert len(calls) == 1
    weight, precision, batch_invariant, x_dtype, max_m, terms, routing = calls[0]
    assert weight is gate.weight and precision is RouterPrecision.FP32 and batch_invariant
    assert x_dtype == torch.bfloat16 and max_m >= 3000 and terms is None
    assert routing is None  # no fused router routes this gate's layer
    stock = _gate()  # outside the scope: vLLM's own method, no warm-up of ours
    # vLLM's CPU path packs the weight with a kernel a CUDA wheel lacks on some hosts: not ours.
    cpu_pack = "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm"
    monkeypatch.setattr(cpu_pack, lambda *a, **k: None)
    stock.quant_method.process_weights_after_loading(stock)
    assert len(calls) == 1


def test_a_gate_of_ours_registers_none_of_vllms_gate_warm_ups(vllm_dist):
    """vLLM 0.34's GateLinear registers start-up compiles of its own tiers; ours runs none."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    from vllm_router_ext.layers.gate import router_settings_scope

    hooks = [
        h for h in ("_register_sm90_bf16x3_warmup", "_register_ll_fp32w_warmup") if hasattr(GateLinear, h)
    ]
    if not hooks:
        pytest.skip("this vLLM's GateLinear registers no warm-up of its own (before 0.34)")
    from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry

    with router_settings_scope(RouterSettings(RouterPrecision.FP32, "test")):
        ours = _gate()
    ours.allow_bf16x3_router_gemm = ours.allow_ll_fp32w_gemm = True  # as on a Hopper GPU
    ours.allow_fp32_router_gemm = False
    stock = _gate()
    stock.allow_bf16x3_router_gemm = stock.allow_ll_fp32w_gemm = True
    stock.allow_fp32_router_gemm = False
    for gate, expect in ((ours, 0), (stock, 1)):
        registry = JitWarmupRegistry(vllm_dist)
        with registry.activate():
            for hook in hooks:
                getattr(gate, hook)()
        assert (len(registry) > 0) == bool(expect), (gate, hook)


def _gate(input_size=64, output_size=8):
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(torch.bfloat16):
        return GateLinear(input_size, output_size, prefix="model.layers.3.mlp.gate")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--hidden-size", "7168", "--experts", "256", "--precision", "fp16"], "invalid choice: 'fp16'"),
        (
            ["--hidden-size", "0", "--experts", "256", "--precision", "fp32"],
            "--hidden-size 0: must be at least 1",
        ),
        (["--hidden-size", "7168", "--experts", "256", "--precision", "fp32"], "needs a CUDA GPU"),
    ],
)
def test_the_cache_baking_command_refuses_bad_input_in_one_line(argv, message):
    import subprocess
    import sys

    if message == "needs a CUDA GPU" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would warm it")
    cmd = [sys.executable, "-m", "vllm_router_ext.ops.warmup", *argv]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert message in p.stderr.strip().splitlines()[-1]


def test_the_warm_up_runs_vllms_gate_kernel_at_every_token_count_it_serves(monkeypatch):
    """vLLM's own gate kernel compiles per token count: where the choice runs it (bf16-fp32out,
    1-16 tokens, inside a vLLM that has it) the warm-up runs each of those counts once."""
    import csrc_triton.dispatch as dispatch
    from csrc_triton.dispatch import router_gemm_cuda

    h200 = dataclasses.replace(H200, vllm_gate=True)
    problem = Problem(1, 4096, 256, BF16_FP32OUT, False, torch.bfloat16, torch.bfloat16, h200)
    sizes = warmup_sizes(problem, 8192)
    vllm_sizes = [m for m in sizes if m <= choice.VLLM_GATE_TO_M]
    assert vllm_sizes == list(range(1, choice.VLLM_GATE_TO_M + 1)) and len(sizes) > len(vllm_sizes)
    ran = []

    def vllm_gate(x, w):
        ran.append(x.shape[0])
        return torch.full((x.shape[0], w.shape[0]), float(x.shape[0]))

    monkeypatch.setattr(dispatch, "_vllm_gate", vllm_gate)
    monkeypatch.setattr(problem_types, "CPU_INTERPRETER", h200)
    monkeypatch.setattr(problem_types, "interpreting", lambda: False)
    x, w = torch.zeros((16, 4096), dtype=torch.bfloat16), torch.zeros((256, 4096), dtype=torch.bfloat16)
    for m in vllm_sizes:
        assert torch.equal(router_gemm_cuda(x[:m], w, BF16_FP32OUT, False), torch.full((m, 256), float(m)))
    assert ran == vllm_sizes


def test_a_failing_vllm_gate_kernel_falls_back_to_ours_with_one_warning(monkeypatch):
    """vLLM's gate kernel that cannot run here (a package its compile imports missing: the warm-up
    is its first call) costs one warning, never a serving step: our kernels give the logits, and
    the process stops asking for it."""
    import csrc_triton.dispatch as dispatch
    from csrc_triton import capability
    from csrc_triton.dispatch import router_gemm_cuda
    from vllm_router_ext.ops.routing_fp64 import reference_logits, relative_error

    monkeypatch.setattr(capability, "_vllm_gate", True)  # as inside a vLLM that has it
    tries, warnings = [], []

    def broken(x, w):
        tries.append(x.shape[0])
        raise ModuleNotFoundError("No module named 'quack'")

    monkeypatch.setattr(dispatch, "_vllm_gate", broken)
    monkeypatch.setattr(dispatch.logger, "warning", lambda msg, *args: warnings.append(msg % args))
    monkeypatch.setattr(problem_types, "CPU_INTERPRETER", Device("NVIDIA H200", 132, 90, cublas=False))
    monkeypatch.setattr(problem_types, "interpreting", lambda: False)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = (torch.randn(16, 64, generator=gen) / 8).to(torch.bfloat16)
    first = router_gemm_cuda(x, w, BF16_FP32OUT, False)
    again = router_gemm_cuda(x, w, BF16_FP32OUT, False)
    assert tries == [3] and capability._vllm_gate is False
    assert len(warnings) == 1 and "No module named 'quack'" in warnings[0] and "triton gemv" in warnings[0]
    assert torch.equal(first, again) and relative_error(first, reference_logits(x, w)) <= 1e-6
