"""The CUDA kernels compile ahead of time, without a GPU, with the Triton installed here.

The device tests run on an H200 with Triton 3.6; vLLM 0.32's CPU build installed here brings Triton
3.9, and the interpreter tests never compile anything. So
every config the dispatch would launch (``vllm_router_ext.tools.compile_check``: each mode, bf16 and fp32
gate weights, batch invariance on and off, M from 1 to 16384) is compiled here for the GPUs users
run: the H200 with its tuned table, and H100 / A100 / L40S / B200 with the heuristic configs.
On sm_90 this includes the Gluon ``wgmma_ws`` kernel, which has no interpreter form at all.
Heuristic configs (never measured on those GPUs) must not spill registers (beyond one parked
8-byte value); tuned entries were timed on their GPU and may (the tuner keeps the fastest).
The H200 table's 16-bit-weight launches are also compiled with the Triton each CUDA build of
vLLM pins (``TRITON_OF_VLLM``, installed into ``.tritons/`` by ``scripts/setup_cpu_env.sh``):
none may spill there, since a spill under the user's Triton is how a tuned bucket silently slows,
unless its bucket was timed under that very Triton and won there (``us_by_triton``).
The router op's kernels (the routing kernel, the fused router) are compiled for every released
routing on sm_90 and sm_100 and under those Tritons, and must not spill anywhere (one parked
8-byte value aside, as above).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from vllm_router_ext.tools.compile_check import TRITON_OF_VLLM

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USERS_TRITONS = sorted(set(TRITON_OF_VLLM.values()))

GPUS = [
    # (compute capability x10, device name, SMs): the name selects a tuned table if there is one.
    (90, "NVIDIA H200", 132),
    (90, "NVIDIA H100 80GB HBM3", 132),
    (80, "NVIDIA A100-SXM4-80GB", 108),
    (89, "NVIDIA L40S", 142),
    (100, "NVIDIA B200", 148),
]

#: The GPUs whose runs also compile the router op's kernels for every released routing: the tuned
#: table's (sm_90) and the newest architecture (sm_100); the fused router is on by default from sm_90.
ROUTERS_ON = ("NVIDIA H200", "NVIDIA B200")
ROUTER_KERNELS = {"_route_logits_kernel", "_route_gemv_kernel"}


def _nice() -> None:
    os.nice(10)  # the compiles soak up what the rest of the suite leaves of CI's cores


def start_compile_runs(tmp_path_factory) -> dict:
    """One compile run per GPU, all started at once (CPU-bound, below the suite's priority)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {}
    for arch, name, sms in GPUS:
        out = tmp_path_factory.mktemp(f"aot-sm{arch}")
        env_one = env | {"TRITON_CACHE_DIR": str(out / "triton-cache")}  # compile for real, every time
        cmd = [sys.executable, "-m", "vllm_router_ext.tools.compile_check", "--arch", str(arch)]
        cmd += ["--device-name", name, "--sms", str(sms), "--json", str(out / "aot.json")]
        cmd += ["--routers"] if name in ROUTERS_ON else []
        log = open(out / "log.txt", "w")  # noqa: SIM115 -- closed by stop_runs, after the process ends
        proc = subprocess.Popen(cmd, env=env_one, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_nice)
        runs[name] = (proc, out, log)
    return runs


def start_users_triton_runs(tmp_path_factory) -> dict:
    """One compile run of the H200 table's shapes per users' Triton, all started at once."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    runs = {}
    for version in USERS_TRITONS:
        site = os.path.join(REPO, ".tritons", version)
        if not os.path.isfile(os.path.join(site, "triton", "__init__.py")):
            runs[version] = None
            continue
        out = tmp_path_factory.mktemp(f"aot-triton-{version}")
        env_one = env | {
            "TRITON_CACHE_DIR": str(out / "triton-cache"),
            "PYTHONPATH": os.pathsep.join([site, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        }
        cmd = [sys.executable, "-m", "vllm_router_ext.tools.compile_check", "--arch", "90"]
        # the routers of the table's gates: every released routing compiles in the H200 and B200 runs
        cmd += ["--shapes", "table", "--device-name", "NVIDIA H200", "--weights", "16-bit"]
        cmd += ["--routers", "shapes"]
        cmd += ["--json", str(out / "aot.json")]
        log = open(out / "log.txt", "w")  # noqa: SIM115 -- closed by stop_runs, after the process ends
        proc = subprocess.Popen(cmd, env=env_one, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_nice)
        runs[version] = (proc, out, log)
    return runs


def stop_runs(runs: dict) -> None:
    for run in runs.values():
        if run is not None:
            proc, _, log = run
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()


@pytest.fixture(scope="module")
def compile_runs(request, tmp_path_factory):
    """The runs conftest started when this module's tests were collected (else started now)."""
    runs = getattr(request.config, "aot_compile_runs", None) or start_compile_runs(tmp_path_factory)
    yield runs
    stop_runs(runs)


@pytest.mark.parametrize("arch,name,sms", GPUS, ids=[f"sm{a}-{n.split()[1]}" for a, n, _ in GPUS])
def test_every_dispatched_kernel_compiles(compile_runs, arch, name, sms):
    proc, out, _ = compile_runs[name]
    returncode = proc.wait(timeout=1200)
    assert returncode == 0, (out / "log.txt").read_text(encoding="utf-8")[-5000:]
    results = json.loads((out / "aot.json").read_text(encoding="utf-8"))
    kernels = {r["kernel"] for r in results}
    # every kernel family is reached: the GEMV, split-K (ticket, pipelined, splits in one program)
    # and, for the fp32 mode at the largest M, the tiled kernel
    assert {"_gemv_kernel", "_splitk_partials_kernel", "_tiled_kernel"} <= kernels, kernels
    assert any("splits_in_program" in r["what"] for r in results)
    if arch == 90:  # the fp32 mode's warp-specialised Gluon kernel (tuned table and heuristic)
        assert "_wgmma_ws_kernel" in kernels, kernels
    assert any("fp32 weight" in r["what"] for r in results)
    tuned = name == "NVIDIA H200"
    assert any(r["source"].startswith("tuned") for r in results) == tuned
    # <= 8 bytes: ptxas parks one value around the K loop in some sm_100 compiles (one STL before
    # it, one LDL after, per program), which is not register pressure
    spilled = [r["what"] for r in results if r["spill_bytes"] > 8 and r["source"] == "heuristic"]
    assert not spilled, f"heuristic configs spill registers on sm_{arch}: {spilled}"
    _check_routers(results, name in ROUTERS_ON)


def _check_routers(results: list[dict], compiled: bool, gates: set[tuple[int, int]] | None = None) -> None:
    """The router op's kernels, where compiled: both kinds for every released routing, none spilling
    beyond one parked 8-byte value (as the GEMV check allows: under Triton 3.7.1 the fused router of
    ERNIE-4.5-300B at one token parks one at 40 registers, since the GEMV's explicit FMA)."""
    routers = [r for r in results if r["kernel"] in ROUTER_KERNELS]
    if not compiled:
        assert not routers
        return
    from vllm_router_ext.tools.compile_check import router_cases

    assert {r["kernel"] for r in routers} == ROUTER_KERNELS
    for case in router_cases(gates):  # each release's routing: the fused router at decode, the kernel above
        mine = {r["kernel"] for r in routers if r["what"].startswith(f"{case.name} ")}
        assert mine == ROUTER_KERNELS, (case.name, mine)
    spilled = [r["what"] for r in routers if r["spill_bytes"] > 8]
    assert not spilled, f"the router kernels spill registers: {spilled}"


@pytest.fixture(scope="module")
def users_triton_runs(request, tmp_path_factory):
    runs = getattr(request.config, "aot_users_triton_runs", None) or start_users_triton_runs(tmp_path_factory)
    yield runs
    stop_runs(runs)


@pytest.mark.parametrize("version", USERS_TRITONS)
def test_tuned_table_compiles_without_spills_under_the_triton_users_run(users_triton_runs, version):
    run = users_triton_runs[version]
    assert run is not None, f"Triton {version} is not in .tritons/{version}: run scripts/setup_cpu_env.sh"
    proc, out, _ = run
    returncode = proc.wait(timeout=1200)
    log = (out / "log.txt").read_text(encoding="utf-8")
    assert returncode == 0, log[-5000:]
    assert f"with Triton {version};" in log, log[-500:]  # the pinned Triton, not the installed one
    results = json.loads((out / "aot.json").read_text(encoding="utf-8"))
    assert {"_gemv_kernel", "_splitk_partials_kernel", "_wgmma_ws_kernel"} <= {r["kernel"] for r in results}
    from vllm_router_ext.tools.compile_check import table_shapes

    _check_routers(results, True, {(s.k, s.n) for s in table_shapes("NVIDIA H200")})
    assert any(r["source"].startswith("tuned") for r in results)
    spilled = [r for r in results if r["spill_bytes"] and r["kernel"] not in ROUTER_KERNELS]  # the table's
    unmeasured = sorted(
        {f"{r['what']}: {r['spill_bytes']} B" for r in spilled if version not in r["timed_under"]}
    )
    assert not unmeasured, f"launches spill registers under Triton {version}, never timed there: {unmeasured}"
    assert all(r["spill_bytes"] <= 32 for r in spilled), spilled  # a few registers' worth at most


def test_wgmma_ws_forms_compile_for_sm90_without_spills():
    """Every form of the Gluon kernel, whether or not the table selects it today: plain, K split,
    a 32-column tail (the default partition's second accumulator), a 64-column tail split between
    the consumers (the second one raised to 232 registers), 64-row tiles (one consumer, 128
    registers: two programs an SM). The sm_90 compile (in a subprocess, like the dispatch compile:
    no TRITON_INTERPRET) must not spill."""
    script = """
import json, torch
from vllm_router_ext.tools.compile_check import _captured_launches, _compile, _resources
from csrc_triton.choice import wgmma_ws
from csrc_triton.router_gemm_wgmma_ws import GLUON, wgmma_ws_launch
out = []
forms = [dict(k_per_split=0), dict(k_per_split=1792), dict(k_per_split=0, block_n_tail=32),
         dict(k_per_split=0, block_n_tail=64), dict(k_per_split=0, block_m=64),
         dict(k_per_split=1792, block_m=64), dict(block_n=64, k_per_split=0, block_m=64)]
for form in forms if GLUON else []:
    n = 160 if form.get("block_n_tail") == 32 else 384
    x, w = torch.zeros(8192, 7168, dtype=torch.bfloat16), torch.zeros(n, 7168, dtype=torch.bfloat16)
    with _captured_launches() as launches:
        wgmma_ws_launch(x, w, torch.empty(8192, n), wgmma_ws(**{"block_n": 128, **form}))
    for fn, args, kwargs in launches:
        out.append([str(form), fn.__name__, *_resources(_compile(fn, args, kwargs, 90))])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    from csrc_triton.router_gemm_wgmma_ws import GLUON

    if not GLUON:
        pytest.skip("this Triton has no Gluon warp specialisation: the dispatch never selects the kernel")
    kernels = {r[1] for r in results}
    assert {"_wgmma_ws_kernel", "_split_sum_kernel"} <= kernels
    assert not [r for r in results if r[3]], results  # spill bytes
    rows64 = [r for r in results if "block_m" in r[0] and r[1] == "_wgmma_ws_kernel"]
    assert len(rows64) == 3 and all(r[2] <= 128 for r in rows64), rows64  # two programs an SM


def test_pdl_forms_compile_with_grid_dependency_control():
    """The K-split sums' programmatic dependent launch in the sm_90 compile: the first kernel lets
    the second go (``griddepcontrol.launch_dependents``: at its start, or late in each of the
    ``wgmma_ws`` kernel's three partitions) and the split sum waits (``griddepcontrol.wait``)
    before reading a partial; on sm_80 (no PDL) neither instruction, no ``launch_pdl``."""
    script = """
import json, torch
from csrc_triton import pdl
from vllm_router_ext.tools.compile_check import _captured_launches, _compile
from dataclasses import replace
from csrc_triton.launches import SplitKLaunch
from csrc_triton.router_gemm_splitk import splitk_launch
from csrc_triton.router_gemm_wgmma_ws import GLUON, wgmma_ws_launch
from csrc_triton.choice import wgmma_ws
x, w = torch.zeros(512, 7168, dtype=torch.bfloat16), torch.zeros(384, 7168, dtype=torch.bfloat16)
out = []
for arch in (90, 80):
    wgmma = [("wgmma", {"pdl": 1}), ("wgmma", {"pdl": 2})] if GLUON and arch == 90 else []
    forms = [("splitk", {})] + wgmma
    for kind, form in forms:
        with _captured_launches() as launches, pdl.forced(arch >= 90):
            if kind == "splitk":
                splitk_launch(x, w, torch.empty(512, 384), SplitKLaunch(64, 64, 128, 1024, promote_chunks=2,
                              ticket=False, num_stages=3, pdl=True))
            else:
                wgmma_ws_launch(x, w, torch.empty(512, 384), replace(wgmma_ws(128, 1792), **form))
        for fn, args, kwargs in launches:
            ptx = _compile(fn, args, kwargs, arch).asm["ptx"]
            out.append([arch, kind, str(form), fn.__name__, ptx.count("griddepcontrol.launch_dependents"),
                        ptx.count("griddepcontrol.wait"), bool(kwargs.get("launch_pdl"))])
print(json.dumps(out))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {(a, kind, form, fn): (trig, wait, flag) for a, kind, form, fn, trig, wait, flag in json.loads(
        run.stdout.strip().splitlines()[-1])}  # fmt: skip
    assert rows[(90, "splitk", "{}", "_splitk_partials_kernel")] == (1, 0, False)
    assert rows[(90, "splitk", "{}", "_split_sum_kernel")] == (0, 1, True)
    assert rows[(80, "splitk", "{}", "_splitk_partials_kernel")] == (0, 0, False)
    assert rows[(80, "splitk", "{}", "_split_sum_kernel")] == (0, 0, False)
    from csrc_triton.router_gemm_wgmma_ws import GLUON

    if GLUON:
        assert rows[(90, "wgmma", "{'pdl': 1}", "_wgmma_ws_kernel")] == (1, 0, False)
        assert rows[(90, "wgmma", "{'pdl': 2}", "_wgmma_ws_kernel")] == (3, 0, False)  # each partition
        assert rows[(90, "wgmma", "{'pdl': 2}", "_split_sum_kernel")] == (0, 1, True)


@pytest.mark.parametrize("fusion", ["1", "0"])
def test_the_gemv_multiplies_and_adds_in_one_fma_whatever_the_fusion_default(fusion):
    """The decode GEMV's inner loop is one fp32 FMA per weight element with Triton's FP fusion on or
    off (``TRITON_DEFAULT_FP_FUSION``; Triton announces it off by default from 3.10): a multiply and
    an add instead would cost a third more instructions for the same sum."""
    script = """
import torch
from csrc_triton import pdl
from csrc_triton.launches import GemvLaunch
from csrc_triton.router_gemm_gemv import gemv_launch
from vllm_router_ext.tools.compile_check import _captured_launches, _compile
x, w = torch.zeros(2, 7168, dtype=torch.bfloat16), torch.zeros(256, 7168, dtype=torch.bfloat16)
with _captured_launches() as launches, pdl.forced(True):
    gemv_launch(x, w, torch.empty(2, 256), GemvLaunch(2, 2, num_warps=8))
fn, args, kwargs = launches[0]
ptx = _compile(fn, args, kwargs, 90).asm["ptx"]
print(ptx.count("fma.rn.f32"), ptx.count("mul.rn.f32") + ptx.count("mul.f32"))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = fusion
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    fmas, muls = map(int, run.stdout.split()[-2:])
    # 7168 / (8 warps x 32 threads x 8 values) = 3.5 -> 4 chunks of 8 products a thread, 2 x 2 outputs
    assert fmas >= 4 * 8 and muls == 0, (fmas, muls)
