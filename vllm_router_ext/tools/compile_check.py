"""Compile every Triton kernel the CUDA dispatch would launch, for a GPU architecture, without a GPU.
It ships as a user's check of a Triton upgrade or a new GPU's compile (docs/kernels.md).

    python -m vllm_router_ext.tools.compile_check [--arch 90] [--shapes DeepSeek-V3,...] [--routers]

The device tests run on an H200 with one Triton version; vLLM's CUDA builds pin others
(:data:`TRITON_OF_VLLM`), and vLLM 0.32's CPU build here brings Triton 3.9. CPU CI runs the
kernels only under ``TRITON_INTERPRET=1``, which never compiles them. This tool takes the launches
the choice would make (every bucket of the tuned table for the shape, and the heuristic's for
other GPUs), launches them through the real launchers on CPU tensors with the launch intercepted,
and compiles each captured launch with Triton's own argument specialisation for ``sm_<arch>``:
a kernel that no longer compiles with the installed Triton, or that starts spilling registers,
shows up here. Needs Triton's bundled ptxas; must run with ``TRITON_INTERPRET`` unset. Uses
Triton's internal argument binder (``create_function_from_signature``, ``JITFunction._pack_args``;
the same in Triton 3.6 and 3.9), so it may need adjusting for a later Triton.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from csrc_triton.launches import KernelLaunch
from csrc_triton.problem import Precision
from csrc_triton.routing import Routing, Scoring
from vllm_router_ext.bench_harness import SHAPE_BY_NAME, SHAPES, RouterShape

#: The Triton each supported CUDA build of vLLM pins: what its users compile these kernels with.
TRITON_OF_VLLM = {"0.32": "3.7.1", "0.33": "3.8.0", "0.34": "3.8.0"}

#: M values whose configs are compiled: the tables' bucket bounds lie between these.
M_POINTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Compiled:
    what: str  # shape, mode, M bucket and config
    source: str  # where the config came from: "tuned <gpu>" (measured there) or "heuristic"
    kernel: str
    registers: int
    spill_bytes: int
    #: The Tritons the launch's table bucket was timed under and won (its ``us_by_triton``).
    timed_under: tuple[str, ...] = ()


@contextmanager
def _captured_launches() -> Iterator[list]:
    """Replace Triton's launch with a recorder of (kernel, args, kwargs)."""
    from triton.runtime.jit import JITFunction

    launches: list = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = original


def _compile(fn, args, kwargs, arch: int):
    """Triton's own specialisation of this launch (as ``JITFunction.run`` does), compiled for
    ``sm_<arch>``; returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    if getattr(fn, "is_gluon", lambda: False)():  # the wgmma_ws kernel
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def _resources(kernel) -> tuple[int, int]:
    """(registers per thread, spill bytes) of a compiled kernel, from its cubin."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = [int(v) for v in re.findall(r"REG:(\d+)", usage)]
    stack = [int(v) for v in re.findall(r"STACK:(\d+)", usage)]
    return max(regs, default=0), max(stack, default=0)


#: (mode, weight dtype) pairs the dispatch serves: logits dtype follows the mode (bf16 for ``bf16``),
#: and an fp32 gate weight takes the exact three-term split in the ``fp32`` mode.
CASES = (
    (Precision.BF16_FP32OUT, torch.bfloat16),
    (Precision.BF16, torch.bfloat16),
    (Precision.FP32, torch.bfloat16),
    (Precision.FP32, torch.float32),
)


def _arg_key(arg) -> object:
    """What of a launch argument decides its compiled specialisation (hashable)."""
    if isinstance(arg, torch.Tensor):
        return str(arg.dtype)
    if hasattr(arg, "block_shape"):  # a Gluon TMA descriptor
        return ("tensordesc", str(arg.base.dtype), tuple(arg.block_shape), repr(arg.layout))
    return arg


def launches_to_compile(
    shape: RouterShape, device_name: str, sm_count: int, arch: int, cases=CASES
) -> list[tuple[str, Precision, torch.dtype, int, KernelLaunch, tuple[str, ...]]]:
    """(label, mode, weight dtype, M, launch, Tritons its bucket was timed under) of every distinct
    Triton launch the choice makes for this shape on this GPU: each of ``cases``, batch invariance
    off and on (not for ``bf16``, which has no batch-invariant form), at every M of :data:`M_POINTS`."""
    from csrc_triton.choice import choose, table_key
    from csrc_triton.problem import Device, Problem
    from csrc_triton.tables import bucket_for, table_buckets

    device = Device(device_name, sm_count, arch, vllm_gate=False)  # Triton launches only
    seen: dict = {}
    for mode, w_dtype in cases:
        for bi in (False, True) if mode is not Precision.BF16 else (False,):
            for m in M_POINTS:
                launch = choose(Problem(m, shape.k, shape.n, mode, bi, torch.bfloat16, w_dtype, device))
                if launch.kernel != "cublas" and (mode, w_dtype, launch) not in seen:
                    w_name = "" if w_dtype is torch.bfloat16 else ", fp32 weight"
                    label = f"{shape.name} {mode.value}{w_name}{' batch-invariant' if bi else ''} M={m}"
                    bucket = bucket_for(table_buckets(device_name, shape.k, shape.n, table_key(mode, bi)), m)
                    tuned = bucket is not None and launch.source != "heuristic"
                    timed = tuple(bucket.get("us_by_triton", {})) if tuned else ()
                    seen[(mode, w_dtype, launch)] = (label, m, timed)
    return [(label, mode, w, m, launch, timed) for (mode, w, launch), (label, m, timed) in seen.items()]


def compile_configs(
    shapes: list[RouterShape],
    device_name: str,
    sm_count: int,
    arch: int,
    progress: bool = False,
    cases=CASES,
) -> list[Compiled]:
    """Compile every kernel of every launch (:func:`launches_to_compile`) for ``sm_<arch>``."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter never compiles the kernels")
    from csrc_triton import pdl
    from csrc_triton.dispatch import launch_exactly
    from csrc_triton.launches import describe

    results: list[Compiled] = []
    done: dict = {}  # (kernel, specialisation) -> Compiled: the same launch compiles once
    for shape in shapes:
        to_compile = launches_to_compile(shape, device_name, sm_count, arch, cases)
        for label, mode, w_dtype, m, launch, timed in to_compile:
            x = torch.zeros(m, shape.k, dtype=torch.bfloat16)
            w = torch.zeros(shape.n, shape.k, dtype=w_dtype)
            out_dtype = torch.bfloat16 if mode is Precision.BF16 else torch.float32
            out = torch.empty(m, shape.n, dtype=out_dtype)
            # as launched on a GPU of that arch: two-launch sums with PDL from sm_90
            with _captured_launches() as launches, pdl.forced(arch >= 90):
                launch_exactly(launch, x, w, out)
            for fn, args, kwargs in launches:
                types = tuple(_arg_key(a) for a in args)
                key = (fn.__name__, repr(sorted(kwargs.items())), types)
                if key not in done:
                    kernel = _compile(fn, args, kwargs, arch)
                    regs, spill = _resources(kernel)
                    done[key] = Compiled(
                        f"{label} {describe(launch)}", launch.source, fn.__name__, regs, spill
                    )
                    if progress:
                        c = done[key]
                        print(f"{c.what}: {c.kernel} {c.registers} registers, {c.spill_bytes} B spilled")
                results.append(replace(done[key], what=f"{label} {describe(launch)}", timed_under=timed))
    return results


@dataclass(frozen=True)
class RouterCase:
    """A release's gate with the routing its config states, as the router op runs it."""

    name: str
    hidden: int
    experts: int
    routing: Routing


def router_cases(gates: set[tuple[int, int]] | None = None) -> list[RouterCase]:
    """Every release of the family table whose routing the routing kernels take, once per distinct
    gate shape and routing (``gates``: only releases of these (hidden, experts) gates)."""
    from vllm_router_ext.families import FAMILIES
    from vllm_router_ext.ops.routing_fp64 import RoutingConfig

    cases: dict = {}
    for family in FAMILIES:
        for release in family.releases:
            if gates is not None and (release.hidden, release.experts) not in gates:
                continue
            rc = RoutingConfig.from_hf_config(release.config)
            scoring = Scoring.__members__.get(rc.scoring_func.upper())  # the config's name, the kernel's
            if scoring is None:
                continue
            topk_group = rc.topk_group if rc.n_group > 1 else 1
            routing = Routing(rc.top_k, scoring, rc.n_group, topk_group,
                              rc.uses_correction_bias, rc.renormalize, rc.routed_scaling_factor)  # fmt: skip
            routing.check(release.experts)
            key = (release.hidden, release.experts, routing)
            cases.setdefault(key, RouterCase(release.name, release.hidden, release.experts, routing))
    return list(cases.values())


def _router_launches(case: RouterCase, problem, launch: KernelLaunch, arch: int) -> list:
    """The kernel launches ``route_cuda`` makes after the GEMM ``launch`` chose for ``problem``: at
    decode (the GEMV) the fused router where the logits are fp32, and the routing kernel as a
    dependent launch from sm_90; after the other GEMMs the routing kernel alone."""
    from csrc_triton import pdl
    from csrc_triton.launches import GemvLaunch
    from csrc_triton.router_route_gemv import route_gemv_launch
    from csrc_triton.routing import route_logits

    m, routing = problem.m, case.routing
    gemv = isinstance(launch, GemvLaunch)
    bias = torch.zeros(case.experts) if routing.bias else None
    logits = torch.empty(m, case.experts, dtype=problem.logits_dtype)
    weights = torch.empty(m, routing.top_k)
    ids = torch.empty(m, routing.top_k, dtype=torch.int32)
    with _captured_launches() as launches, pdl.forced(arch >= 90):
        route_logits(logits, routing, bias, weights, ids, pdl=gemv and arch >= 90)
        if gemv and problem.logits_dtype == torch.float32:
            x = torch.zeros(m, case.hidden, dtype=torch.bfloat16)
            w = torch.zeros(case.experts, case.hidden, dtype=torch.bfloat16)
            route_gemv_launch(x, w, routing, bias, logits, weights, ids, launch)
    return launches


def compile_routers(
    cases: list[RouterCase], device_name: str, sm_count: int, arch: int, progress: bool = False
) -> list[Compiled]:
    """Compile the kernels the router op launches for each case on ``sm_<arch>``
    (:func:`_router_launches`): every mode, batch invariance off and on, M from 1 to 16384. The
    GEMMs are :func:`compile_configs`'."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter never compiles the kernels")
    from csrc_triton.choice import choose
    from csrc_triton.launches import describe
    from csrc_triton.problem import Device, Problem

    device = Device(device_name, sm_count, arch, vllm_gate=False)  # Triton launches only
    bf16 = torch.bfloat16
    results: list[Compiled] = []
    done: dict = {}
    for case in cases:
        for mode in (Precision.FP32, Precision.BF16_FP32OUT, Precision.BF16):
            for bi in (False, True) if mode is not Precision.BF16 else (False,):
                for m in sorted({*M_POINTS, 3}):
                    problem = Problem(m, case.hidden, case.experts, mode, bi, bf16, bf16, device)
                    launch = choose(problem)
                    label = f"{case.name} {mode.value}{' batch-invariant' if bi else ''} M={m}"
                    for fn, args, kwargs in _router_launches(case, problem, launch, arch):
                        what = f"{label} {fn.__name__} after {describe(launch)}"
                        key = (fn.__name__, repr(sorted(kwargs.items())), tuple(_arg_key(a) for a in args))
                        if key not in done:
                            regs, spill = _resources(_compile(fn, args, kwargs, arch))
                            done[key] = Compiled(what, launch.source, fn.__name__, regs, spill)
                            if progress:
                                print(f"{what}: {regs} registers, {spill} B spilled")
                        results.append(replace(done[key], what=what))
    return results


def table_shapes(device_name: str) -> list[RouterShape]:
    """The benchmark shapes this GPU's tuned table has entries for, one name per (K, N)."""
    from csrc_triton.tables import has_shape

    by_size = {(s.k, s.n): s for s in reversed(SHAPE_BY_NAME.values()) if has_shape(device_name, s.k, s.n)}
    return sorted(by_size.values(), key=lambda s: list(SHAPE_BY_NAME).index(s.name))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)")
    ap.add_argument("--device-name", default="NVIDIA H200", help="GPU whose tuned table is used")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument(
        "--shapes",
        default=",".join(s.name for s in SHAPES),
        help="benchmark shape names, or 'table': every shape the GPU's tuned table has",
    )
    ap.add_argument(
        "--weights", choices=("all", "16-bit"), default="all", help="'16-bit': leave out fp32 gate weights"
    )
    ap.add_argument(
        "--routers",
        nargs="?",
        const="all",
        choices=("all", "shapes"),
        help="also the router op's kernels (routing kernel, fused router) for every released routing "
        "('shapes': the releases of this run's gate shapes only)",
    )
    ap.add_argument("--json", type=Path, help="write the per-launch results here")
    args = ap.parse_args(argv)
    if args.shapes == "table":
        names = [s.name for s in table_shapes(args.device_name)]
    else:
        names = args.shapes.split(",")
        if unknown := [s for s in names if s not in SHAPE_BY_NAME]:
            ap.error(f"unknown shape(s) {', '.join(unknown)}; allowed: table, {', '.join(SHAPE_BY_NAME)}")
    cases = CASES if args.weights == "all" else tuple(c for c in CASES if c[1] is not torch.float32)
    shapes = [SHAPE_BY_NAME[s] for s in names]
    results = compile_configs(shapes, args.device_name, args.sms, args.arch, progress=True, cases=cases)
    if args.routers:
        gates = {(s.k, s.n) for s in shapes} if args.routers == "shapes" else None
        results += compile_routers(router_cases(gates), args.device_name, args.sms, args.arch, progress=True)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    import triton

    spilled = sum(1 for r in results if r.spill_bytes)
    print(
        f"{len(results)} kernel launches compiled for sm_{args.arch} with Triton {triton.__version__}; "
        f"{spilled} spill registers"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
