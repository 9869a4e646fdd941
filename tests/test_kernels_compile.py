"""The CUDA kernels compile ahead of time, without a GPU, with the Triton installed here.

The device tests run on an H200 with Triton 3.6; vLLM 0.32's CUDA build brings Triton 3.9 (the
version of the CPU build installed here), and the interpreter tests never compile anything. So
every config the dispatch would launch (``vllm_router_ext.testing.aot``: each mode, bf16 and fp32
gate weights, batch invariance on and off, M from 1 to 16384) is compiled here for the GPUs users
run: the H200 with its tuned table, and H100 / A100 / L40S / B200 with the heuristic configs.
Heuristic configs (never measured on those GPUs) must not spill registers (beyond one parked
8-byte value); tuned entries were timed on their GPU and may (the tuner keeps the fastest).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

GPUS = [
    # (compute capability x10, device name, SMs): the name selects a tuned table if there is one.
    (90, "NVIDIA H200", 132),
    (90, "NVIDIA H100 80GB HBM3", 132),
    (80, "NVIDIA A100-SXM4-80GB", 108),
    (89, "NVIDIA L40S", 142),
    (100, "NVIDIA B200", 148),
]


@pytest.mark.parametrize("arch,name,sms", GPUS, ids=[f"sm{a}-{n.split()[1]}" for a, n, _ in GPUS])
def test_every_dispatched_kernel_compiles(tmp_path, arch, name, sms):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compile for real, every time
    report = tmp_path / "aot.json"
    cmd = [sys.executable, "-m", "vllm_router_ext.testing.aot", "--arch", str(arch)]
    cmd += ["--device-name", name, "--sms", str(sms), "--json", str(report)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    results = json.loads(report.read_text())
    kernels = {r["kernel"] for r in results}
    # every kernel family is reached: the GEMV, split-K (ticket, pipelined, splits in one program)
    # and, for the fp32 mode at the largest M, the tiled kernel
    assert {"_gemv_kernel", "_splitk_partials_kernel", "_tiled_kernel"} <= kernels, kernels
    assert any("splits_in_program" in r["what"] for r in results)
    assert any("fp32 weight" in r["what"] for r in results)
    tuned = name == "NVIDIA H200"
    assert any(r["source"].startswith("tuned") for r in results) == tuned
    # <= 8 bytes: ptxas parks one value around the K loop in some sm_100 compiles (one STL before
    # it, one LDL after, per program), which is not register pressure
    spilled = [r["what"] for r in results if r["spill_bytes"] > 8 and r["source"] == "heuristic"]
    assert not spilled, f"heuristic configs spill registers on sm_{arch}: {spilled}"
