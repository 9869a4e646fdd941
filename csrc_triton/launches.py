"""What one launch of a router GEMM kernel takes: one frozen type per kernel, with its own fields.

The decision (``choice.py``) returns one of these; each type declares its kernel once: ``kernel``
(its name in tables), ``title`` (in logs), ``launcher`` (``module:function``, what ``dispatch.py``
calls with ``(x, weight, out, launch)``) and ``needs`` (the GPU it runs on). Tuned tables store
launches as JSON buckets (:func:`from_bucket`, :func:`to_bucket`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from csrc_triton.capability import GpuNeeds

#: The Triton kernels' needs: any GPU Triton compiles for (the launcher checks its own limits).
ANY_GPU = GpuNeeds()


@dataclass(frozen=True)
class GemvLaunch:
    """The FMA GEMV (``router_gemm_gemv``): BLOCK_M tokens x BLOCK_N experts per program, all of K.
    ``maxnreg`` (0: ptxas decides) and ``copy_stages`` (0: unrolled chunks) as in the launcher."""

    kernel: ClassVar[str] = "gemv"
    title: ClassVar[str] = "triton GEMV (fp32 FMA)"
    launcher: ClassVar[str] = "csrc_triton.router_gemm_gemv:gemv_launch"
    needs: ClassVar[GpuNeeds] = ANY_GPU
    block_m: int
    block_n: int
    num_warps: int = 4
    maxnreg: int = 0
    copy_stages: int = 0
    source: str = "heuristic"


@dataclass(frozen=True)
class SplitKLaunch:
    """The split-K kernel (``router_gemm_splitk``). ``promote_chunks`` 0: one MMA chain per split
    (the 16-bit modes); the fp32 mode promotes every that many BLOCK_K chunks. The split sum: a
    ticket (one launch), or with ``ticket=False`` a second launch (``pdl``: programmatic dependent
    launch), or ``splits_in_program`` (one program per tile runs every split)."""

    kernel: ClassVar[str] = "splitk"
    title: ClassVar[str] = "triton split-K"
    launcher: ClassVar[str] = "csrc_triton.router_gemm_splitk:splitk_launch"
    needs: ClassVar[GpuNeeds] = ANY_GPU
    block_m: int
    block_n: int
    block_k: int
    k_per_split: int
    promote_chunks: int = 0
    num_warps: int = 4
    num_stages: int = 1
    splits_in_program: bool = False
    ticket: bool = True
    pdl: bool = False
    flat_chain: bool = False
    source: str = "heuristic"


@dataclass(frozen=True)
class TiledLaunch:
    """The tiled kernel (``router_gemm_tiled``): one program per output tile, grouped rows."""

    kernel: ClassVar[str] = "tiled"
    title: ClassVar[str] = "triton tiled"
    launcher: ClassVar[str] = "csrc_triton.router_gemm_tiled:tiled_launch"
    needs: ClassVar[GpuNeeds] = ANY_GPU
    block_m: int
    block_n: int
    block_k: int
    promote_chunks: int = 0
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    source: str = "heuristic"


#: The ``wgmma_ws`` kernel's tile rows: two consumer warpgroups of one m64 wgmma each, or one
#: (64-row tiles: twice the programs, two of them resident on an SM).
WGMMA_WS_BLOCK_M = 128
WGMMA_WS_BLOCK_MS = (128, 64)
#: Its ``pdl`` values: where the K-split kernel lets its split sum launch (programmatic dependent
#: launch): at its start, or once each partition has issued its last load / chain (the early
#: trigger slows launches that fill most SMs; the tuner times both).
WGMMA_WS_PDL_EARLY = 1
WGMMA_WS_PDL_LATE = 2


@dataclass(frozen=True)
class WgmmaWsLaunch:
    """The warp-specialised wgmma kernel (``router_gemm_wgmma_ws``, Hopper, fp32 mode): tiles of
    ``block_m`` (128 or 64) rows and ``block_n`` + ``block_n_tail`` columns, K split in
    ``k_per_split`` (0: none), the split sum plain or with PDL (``WGMMA_WS_PDL_EARLY`` / ``_LATE``)."""

    kernel: ClassVar[str] = "wgmma_ws"
    title: ClassVar[str] = "gluon warp-specialised wgmma"
    launcher: ClassVar[str] = "csrc_triton.router_gemm_wgmma_ws:wgmma_ws_launch"
    needs: ClassVar[GpuNeeds] = GpuNeeds(90, 100, gluon=True, gpus="Hopper, sm_90")
    block_n: int
    block_k: int
    k_per_split: int
    promote_chunks: int
    num_stages: int
    block_n_tail: int = 0
    pdl: int = 0
    block_m: int = WGMMA_WS_BLOCK_M
    source: str = "heuristic"


@dataclass(frozen=True)
class CublasLaunch:
    """``torch.mm`` (cuBLAS): the 16-bit modes where the table measured it faster."""

    kernel: ClassVar[str] = "cublas"
    title: ClassVar[str] = "cuBLAS"
    needs: ClassVar[GpuNeeds] = ANY_GPU
    source: str = "heuristic"


@dataclass(frozen=True)
class VllmGateLaunch:
    """vLLM's own router GEMM for 1-16 tokens (cuteDSL ``ll_bf16_gemm``, the first tier of its
    ``GateLinear``): the ``bf16-fp32out`` mode's arithmetic, faster there than our Triton GEMV on
    the H100 and the H200 (docs/kernels.md). It compiles per token count ``m`` (a dot product up to
    4 tokens, a clustered split-K above, tuned by vLLM per M), so each ``m`` is its own launch:
    the warm-up runs every one."""

    kernel: ClassVar[str] = "vllm_ll_bf16"
    title: ClassVar[str] = "vLLM cuteDSL ll_bf16"
    needs: ClassVar[GpuNeeds] = GpuNeeds(90, 110, gpus="Hopper or datacenter Blackwell, sm_90-sm_10x")
    m: int
    source: str = "vLLM"


@dataclass(frozen=True)
class Fp32WeightTermsLaunch:
    """An fp32 gate weight's GEMM as one launch on its three bf16 terms ``[3N, K]`` (``terms``,
    the fp32 mode's launch for that problem), then hi + mid + lo added per logit."""

    kernel: ClassVar[str] = "fp32_weight_terms"
    title: ClassVar[str] = "fp32 weight as three bf16 terms"
    needs: ClassVar[GpuNeeds] = ANY_GPU
    terms: Launch
    source: str = "heuristic"


KernelLaunch = GemvLaunch | SplitKLaunch | TiledLaunch | WgmmaWsLaunch | CublasLaunch | VllmGateLaunch
Launch = KernelLaunch | Fp32WeightTermsLaunch

#: The kernels a table bucket may name, by name.
BY_KERNEL: dict[str, type] = {
    t.kernel: t for t in (GemvLaunch, SplitKLaunch, TiledLaunch, WgmmaWsLaunch, CublasLaunch)
}
#: Bucket keys that are notes, not launch fields.
NOTE_KEYS = frozenset(("max_m", "us", "us_by_triton", "worst_ratio", "fastest_us", "kernel"))
#: Each kind's launch fields (read once: a table bucket becomes its launch on every dispatch).
_FIELDS = {
    kind: frozenset(f.name for f in dataclasses.fields(kind)) - {"source"} for kind in BY_KERNEL.values()
}


def fields(launch: Any) -> dict[str, Any]:
    """The launch fields of ``launch`` (its ``source`` left out)."""
    return {f.name: getattr(launch, f.name) for f in dataclasses.fields(launch) if f.name != "source"}


def from_bucket(bucket: dict[str, Any], source: str) -> KernelLaunch:
    """A table bucket (``{"max_m": ..., "kernel": ..., fields}``) as its launch. Raises ValueError
    naming an unknown kernel or field and the allowed ones (a hand-edited or older table)."""
    kind = BY_KERNEL.get(bucket.get("kernel"))
    if kind is None:
        raise ValueError(f"table bucket kernel {bucket.get('kernel')!r}; allowed: {', '.join(BY_KERNEL)}")
    allowed = _FIELDS[kind]
    params = {k: v for k, v in bucket.items() if k not in NOTE_KEYS}
    if unknown := sorted(params.keys() - allowed):
        raise ValueError(
            f"table bucket {bucket}: {kind.kernel} has no field {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )
    return kind(**params, source=source)


def to_bucket(launch: KernelLaunch) -> dict[str, Any]:
    """``launch`` as a table bucket's fields: its kernel and the fields that differ from their
    defaults (what ``benchmarks/tune.py`` writes)."""
    out: dict[str, Any] = {"kernel": launch.kernel}
    for f in dataclasses.fields(launch):
        value = getattr(launch, f.name)
        if f.name != "source" and (f.default is dataclasses.MISSING or value != f.default):
            out[f.name] = value
    return out


def describe(launch: Launch) -> str:
    """A launch for logs: ``cuBLAS`` or ``triton <kernel>(field=value,...)``, defaults left out."""
    if isinstance(launch, CublasLaunch):
        return "cuBLAS"
    if isinstance(launch, VllmGateLaunch):
        return f"{launch.title}(m={launch.m})"
    if isinstance(launch, Fp32WeightTermsLaunch):
        return f"fp32 weight as three bf16 terms: {describe(launch.terms)}"
    parts = []
    for name, value in to_bucket(launch).items():
        if name == "kernel":
            continue
        if value is True:
            parts.append(name)
        elif name == "ticket":
            parts.append("two_launch")
        else:
            parts.append(f"{name}={value}")
    return f"triton {launch.kernel}({','.join(parts)})"
