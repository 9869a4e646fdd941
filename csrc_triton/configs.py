"""Kernel configs: tuned tables (JSON per GPU, written by ``benchmarks/tune.py``) and a heuristic.

A table maps a (K, N) shape and a mode to buckets ``{"max_m": int | null, "kernel": ..., params}``,
looked up by the first bucket whose ``max_m`` >= M. ``kernel`` is ``gemv``, ``splitk``,
``tiled``, ``wgmma_ws`` (the ``fp32`` mode on Hopper at prefill sizes) or ``cublas`` (the 16-bit
modes: where cuBLAS measured faster on that GPU). Batch-invariant tables
hold split-K configs that share one K structure (K_PER_SPLIT, BLOCK_K, promotion) for every M; only
tiles, pipelining and where the partials are added (ticket or ``splits_in_program``) vary with M,
and the tuner admits only configs bitwise equal to the structure's reference. Nothing here
autotunes at run time.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from csrc_triton import environment

CONFIG_DIR = Path(__file__).parent / "configs"

#: Launch parameters a table entry may carry; other keys ("us", "worst_ratio") are notes.
PARAM_KEYS = (
    "block_m",
    "block_n",
    "block_n_tail",
    "consumers",
    "stream_k",
    "block_k",
    "k_per_split",
    "promote_chunks",
    "ticket",
    "group_m",
    "num_warps",
    "num_stages",
    "splits_in_program",
    "fixed_point",
    "fixed_ticket",
    "pdl",
    "flat_chain",
    "maxnreg",
    "copy_stages",
)


@dataclass(frozen=True)
class KernelConfig:
    kernel: str  # "gemv" | "splitk" | "tiled" | "wgmma_ws" | "cublas"
    params: dict[str, Any] = field(default_factory=dict)
    source: str = "heuristic"

    def describe(self) -> str:
        if self.kernel == "cublas":
            return "cuBLAS"
        keys = (
            "block_m",
            "block_n",
            "block_k",
            "k_per_split",
            "promote_chunks",
            "num_warps",
            "num_stages",
            "copy_stages",
            "maxnreg",
        )
        if self.kernel == "wgmma_ws":  # fixed: 128-row tiles, two consumer warpgroups, one loader warp
            keys = (
                "block_n",
                "block_n_tail",
                "consumers",
                "block_k",
                "k_per_split",
                "stream_k",
                "promote_chunks",
                "num_stages",
            )
        inner = ",".join(f"{k}={self.params[k]}" for k in keys if k in self.params)
        if self.params.get("splits_in_program"):
            inner += ",splits_in_program"
        if self.params.get("fixed_point"):
            inner += ",fixed_point" + ("(ticket)" if self.params.get("fixed_ticket") else "")
        if self.params.get("flat_chain"):
            inner += ",flat_chain"
        if self.kernel == "splitk" and self.params.get("ticket") is False:
            inner += ",two_launch"
        if self.params.get("pdl"):
            inner += ",pdl" + ("(late)" if self.kernel == "wgmma_ws" and self.params["pdl"] == 2 else "")
        return f"triton {self.kernel}({inner})"

    def __hash__(self) -> int:
        return hash((self.kernel, tuple(sorted(self.params.items())), self.source))


@functools.cache  # called on every dispatch (the config's source note): keep it off the host path
def device_key(name: str) -> str:
    """File-name key of a GPU: 'NVIDIA H200' -> 'nvidia_h200'."""
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


#: Which tuned table the dispatch reads. Unset: the GPU's own (``configs/<gpu name>.json``, e.g.
#: ``nvidia_h200``); ``none``: the heuristic for every shape; a table's name in ``configs/`` (e.g.
#: ``nvidia_h200`` on an H100, whose SMs and shared memory are the H200's); or the path of a JSON
#: table written by ``benchmarks/tune.py`` for this GPU.
TABLE_ENV_VAR = environment.TABLE

#: Set by :func:`table_override` (the benchmark's heuristic columns, tests); wins over the env var.
_FORCED_TABLE: list[str] = []


def available_tables() -> list[str]:
    """Names of the tuned tables shipped with the package."""
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def table_choice() -> str | None:
    """The validated table override: None (the GPU's own table), ``"none"``, a shipped table's name
    or a JSON path. Raises ValueError naming the bad value and the allowed ones (checked when a
    model is built, so a typo stops the start-up, not a serving step)."""
    value = _FORCED_TABLE[-1] if _FORCED_TABLE else environment.table()
    return _validated_choice(value, CONFIG_DIR) if value else None


def _is_path(value: str) -> bool:
    """A table override that names a file rather than a shipped table."""
    return value.endswith(".json") or os.sep in value


@functools.cache
def _validated_choice(value: str, config_dir: Path) -> str:
    if value.lower() == "none":
        return "none"
    if _is_path(value):
        if not Path(value).is_file():
            raise ValueError(f"{TABLE_ENV_VAR}={value!r}: no such file (a tuned table's JSON path)")
        return value
    if not (config_dir / f"{value}.json").is_file():
        allowed = ", ".join(["none", *available_tables(), "a path to a JSON table"])
        raise ValueError(f"{TABLE_ENV_VAR}={value!r} is not a tuned table; allowed: {allowed}")
    return value


def table_name(device_name: str) -> str | None:
    """What :func:`load_table` reads for this GPU (a table name or a path), None for no table."""
    choice = table_choice()
    if choice == "none":
        return None
    return choice or device_key(device_name)


def table_label(device_name: str) -> str:
    """For logs and ``KernelConfig.source``: the table's name, marked when it is an override."""
    name = table_name(device_name)
    if name is None:
        return "none (heuristic)"
    label = Path(name).name if _is_path(name) else name
    return f"{label} ({TABLE_ENV_VAR})" if table_choice() else label


def load_table(device_name: str) -> dict[str, Any]:
    """The tuned table the dispatch uses on this GPU ({} = none: the heuristic)."""
    name = table_name(device_name)
    return {} if name is None else _read_table(name, CONFIG_DIR)


@functools.cache
def _read_table(name: str, config_dir: Path) -> dict[str, Any]:
    path = Path(name) if _is_path(name) else config_dir / f"{name}.json"
    if not path.exists():
        return {}
    table = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(table, dict) or not isinstance(table.get("shapes", {}), dict):
        raise ValueError(f"{path}: not a tuned table (a JSON object with a 'shapes' object)")
    return table


def clear_table_cache() -> None:
    """Forget tables read so far and re-read ``VLLM_ROUTER_EXT_TABLE`` (the tuner rewrites its
    table while it runs; tests change the variable)."""
    _read_table.cache_clear()
    _validated_choice.cache_clear()
    environment.reread()


@contextlib.contextmanager
def table_override(value: str) -> Iterator[None]:
    """Dispatch with ``value`` as if ``VLLM_ROUTER_EXT_TABLE`` held it (``"none"``: the heuristic).
    The choice is made when a config is selected: a CUDA graph captured inside keeps it."""
    _validated_choice(value, CONFIG_DIR)
    _FORCED_TABLE.append(value)
    try:
        yield
    finally:
        _FORCED_TABLE.pop()


#: The fp32 mode's promotion: every FP32_PROMOTE_CHUNKS chunks of BLOCK_K (<= FP32_MAX_BLOCK_K) the
#: MMA chain is added into the fp32 accumulator, so no tensor-core chain is longer than 256 along K.
#: Measured on the H200 at K=7168, 8192 tokens (benchmarks/NOTES.md): chains of 128
#: 1.4-1.8e-7 relative error, 256 2.4-2.5e-7, 512 4.8e-7, the whole K 7.9e-6; torch's fp32 upcast
#: 2.4-5.6e-7. Never one chunk per chain: Triton folds ``acc + dot(a, b, 0)`` into
#: ``dot(a, b, acc)``, which would silently make the whole K one chain again.
FP32_PROMOTE_CHUNKS = 2
FP32_MAX_BLOCK_K = 128


def fp32_promote_chunks(block_k: int) -> int:
    """Chunks per promoted MMA chain in the fp32 mode (chains of 2 * BLOCK_K <= 256 along K)."""
    if block_k > FP32_MAX_BLOCK_K:
        raise ValueError(f"fp32 mode: block_k={block_k} makes chains longer than {2 * FP32_MAX_BLOCK_K}")
    return FP32_PROMOTE_CHUNKS


def one_chain_split(cfg: KernelConfig) -> bool:
    """A split-K config whose every split is one MMA chain (no promotion, or a split exactly one
    promoted chain long): the splits ``flat_chain`` may loop over."""
    p = cfg.params
    return p["promote_chunks"] == 0 or p["k_per_split"] == p["block_k"] * p["promote_chunks"]


def splitk_config(
    block_m: int,
    block_n: int,
    block_k: int,
    k_per_split: int,
    mode: str,
    num_warps: int = 4,
    *,
    num_stages: int = 1,
    splits_in_program: bool = False,
    fixed_point: bool = False,
    fixed_ticket: bool = False,
) -> KernelConfig:
    """A split-K config; the fp32 mode uses BLOCK_K <= 128 and promoted MMA chains of two chunks.
    ``num_stages`` 1 unrolls each split's K loop, more software-pipelines it (same sums).
    ``fixed_point``: the split partials are summed exactly (the batch-invariant configs), by one
    atomic per logit or (``fixed_ticket``) by the last program of a tile (the same integers)."""
    fp32 = mode == "fp32"
    if fp32:
        block_k = min(block_k, FP32_MAX_BLOCK_K)
    params = dict(
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        k_per_split=k_per_split,
        promote_chunks=fp32_promote_chunks(block_k) if fp32 else 0,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits_in_program:  # only when set: tables and configs without the key stay equal
        params["splits_in_program"] = True
    if fixed_point:
        params["fixed_point"] = True
    if fixed_point and fixed_ticket and not splits_in_program:
        params["fixed_ticket"] = True
    return KernelConfig("splitk", params)


def pipelined_splitk_config(
    block_m: int,
    block_n: int,
    k_per_split: int,
    mode: str,
    num_warps: int,
    block_k: int = 64,
    num_stages: int = 3,
) -> KernelConfig:
    """A split-K config with large tiles and a software-pipelined K loop."""
    return splitk_config(block_m, block_n, block_k, k_per_split, mode, num_warps, num_stages=num_stages)


#: Batch-invariant heuristic: above this M, a tile's splits run in one program (same sums), except
#: on Hopper+ while the split partials in memory (M x N x splits) stay below BI_SPLIT_PARTIALS_MAX
#: and M within BI_SPLIT_TILES_TO: there, pipelined split tiles (more programs) measured faster.
BI_SPLITS_IN_PROGRAM_FROM = 256
BI_SPLIT_TILES_TO = 2048
BI_SPLIT_PARTIALS_MAX = 6 << 20

#: The warp-specialised wgmma kernel (``csrc_triton/router_gemm_wgmma_ws.py``, Hopper only) serves
#: the fp32 mode from this M: 128-row tiles, 64-wide chunks in chains of 4 (256 along K), 6 TMA
#: stages (196 KB of shared memory: one program per SM), K split so the tiles fill the SMs once.
#: On the H200 it beat the Triton fp32 kernels from 1024 tokens (benchmarks/NOTES.md).
WGMMA_WS_FROM_M = 1024
WGMMA_WS_BLOCK_M = 128
WGMMA_WS_MAX_SPLITS = 8
#: From this M, N a multiple of 192 above 256 (Kimi-K2's 384 experts) takes 192-wide tiles (128 +
#: a 64-column tail, each consumer partition carrying its own 64 rows of it): a third less
#: activation traffic from L2 per logit than 128-wide tiles. On the H200 they measured 0.87-0.98x
#: the best 128-wide form's time at 2048-16384 tokens and lost at 1024 (benchmarks/NOTES.md).
WGMMA_WS_192_FROM_M = 2048


#: Shared memory one program may use on Hopper (227 KB), less what the kernel keeps beside its ring.
WGMMA_WS_SMEM_BYTES = 227 * 1024 - 1024
WGMMA_WS_MAX_STAGES = 6


def wgmma_ws_stages(block_n: int, block_k: int = 64, block_n_tail: int = 0) -> int:
    """TMA ring depth: as many stages (<= 6, the probe's best) of the [128 + block_n + tail,
    block_k] 16-bit blocks as fit in shared memory (6 with 128 or 128 + 32 columns)."""
    stage_bytes = (WGMMA_WS_BLOCK_M + block_n + block_n_tail) * block_k * 2
    return min(WGMMA_WS_MAX_STAGES, WGMMA_WS_SMEM_BYTES // stage_bytes)


def wgmma_ws_config(
    block_n: int,
    k_per_split: int,
    block_k: int = 64,
    num_stages: int | None = None,
    block_n_tail: int = 0,
    stream_k: int = 0,
    consumers: int = 2,
) -> KernelConfig:
    """A ``wgmma_ws`` config: fp32-mode chains of 256 along K (4 chunks of 64, 2 of 128). Tiles are
    128 rows by block_n + block_n_tail columns (the tail on a second accumulator; 0 = none).
    ``consumers``: two 4-warp consumer partitions (the default), or one of 8 warps.
    ``stream_k``: that many programs share all tiles' chains evenly (0 = one program per
    tile and K split)."""
    params = dict(
        block_n=block_n,
        block_k=block_k,
        k_per_split=k_per_split,
        promote_chunks=2 * FP32_MAX_BLOCK_K // block_k,
        num_stages=num_stages or wgmma_ws_stages(block_n, block_k, block_n_tail),
    )
    if block_n_tail:  # absent otherwise: the tables written before these existed stay valid
        params["block_n_tail"] = block_n_tail
    if consumers != 2:
        params["consumers"] = consumers
    if stream_k:
        params["stream_k"] = stream_k
    return KernelConfig("wgmma_ws", params)


def wgmma_ws_tail(n: int, block_n: int = 128) -> int:
    """The tail (0, 16 or 32 columns) whose tiles of block_n + tail columns pad N least (ties: the
    narrower), where plain tiles would pad more than a quarter of N; else 0. DeepSeek-V2's 160
    experts: one 160-wide tile (128 + 32) instead of two 128-wide ones of which 96 columns are
    padding (measured 0.62x the time at 16384 tokens). Not for its fp32 weight's 480 bf16 terms:
    four 128-wide tiles pad 32 columns, and three 160-wide ones measured slower from 2048 to 8192
    tokens (fewer programs, and the tail's MMAs all on one warpgroup)."""
    padding = lambda t: -(-n // (block_n + t)) * (block_n + t) - n  # noqa: E731
    if n <= block_n or 4 * padding(0) <= n:
        return 0
    return min((0, 16, 32), key=lambda t: (padding(t), t))


def wgmma_ws_tiles(m: int, n: int, block_n: int, block_n_tail: int = 0) -> int:
    """Output tiles (programs per K split) of a ``wgmma_ws`` launch."""
    return -(-m // WGMMA_WS_BLOCK_M) * -(-n // (block_n + block_n_tail))


def wgmma_ws_k_per_split(k: int, splits: int) -> int:
    """K per split for ``splits`` parts of K, rounded up to a multiple of 256 (whole chains)."""
    return (-(-k // splits) + 255) // 256 * 256


def wgmma_ws_split(m: int, k: int, n: int, block_n: int, sm_count: int, block_n_tail: int = 0) -> int:
    """K per split for the ``wgmma_ws`` kernel: enough splits (<= 8) for its 128 x block_n tiles to
    fill the SMs once (one program per SM), in multiples of 256; 0 = no split."""
    tiles = wgmma_ws_tiles(m, n, block_n, block_n_tail)
    splits = max(1, min(WGMMA_WS_MAX_SPLITS, sm_count // tiles, k // 512))
    return 0 if splits == 1 else wgmma_ws_k_per_split(k, splits)


#: Hopper, non-invariant, from 65 tokens to MID_M_SPLIT_TO (the 16-bit modes: 512; fp32: up to
#: the wgmma_ws kernel's first M): pipelined 64 x 64 split tiles with 128-wide chunks and the
#: split sum a second launch with PDL, K split as finely as keeps the programs within this many
#: per SM (the 16-bit modes: 2, splits of 512, else cuBLAS; fp32: 1, splits of 512 or 1024, else
#: 64-wide chunks in splits of 1024 / 2048 as before). 256 only where K < 4096 (DeepSeek-V2-Lite:
#: 8 splits); 2048 measured 1.3-1.7x slower than these everywhere. The H200 table's winners there,
#: generalised (benchmarks/NOTES.md).
MID_M_SPLIT_TO = {"fp32": WGMMA_WS_FROM_M - 1, "16-bit": 512}
MID_M_PROGRAMS_PER_SM = {"fp32": 1, "16-bit": 2}


def heuristic_config(
    m: int,
    k: int,
    n: int,
    mode: str,
    batch_invariant: bool,
    sm_count: int,
    cublas: bool = False,
    capability: int = 90,
    wgmma_ws: bool | None = None,
    fp32_weight: bool = False,
) -> KernelConfig:
    """Default for shapes and GPUs without a tuned table (the H200 probe's winners, generalised).
    Up to 4 tokens: the FMA GEMV, one K split. Up to 64: unrolled split-K with >= 2 programs per
    SM. From 65 on Hopper (to 512, fp32 to 1023): pipelined 64 x 64 split tiles with the finest
    K split that keeps the programs few enough (``_mid_m_split``; faster than cuBLAS there on the
    H200, 0.73-0.94x at 65-256 tokens). Otherwise above 64 the 16-bit modes go to cuBLAS where it
    exists; the fp32 mode has no cuBLAS equivalent and takes pipelined split-K / tiled kernels.
    Batch-invariant: one K structure for every M; above 256 tokens the same splits run inside one
    program per tile (``splits_in_program``: bitwise the same sums, no partials in memory),
    software-pipelined, in tiles that grow with M on Hopper and later (``fp32_weight``: a
    genuinely fp32 gate weight, which keeps the smaller tile); on Hopper+ a program per split
    still runs above 256 tokens, in pipelined 64 x 64 tiles, while the partials are few
    (BI_SPLIT_PARTIALS_MAX). The split partials are added in
    split order: the exact fixed-point sum (``fixed_point``) is faster at 1-16 tokens but
    measured 1.3-2.5x slower from 256 tokens on the H200 (docs/benchmarks.md), so only a tuned
    table selects it.
    ``capability`` (compute capability x10): below 90 (no wgmma) the fp32 mode's promoted
    128x128 tiles need two register accumulators of 64 values per thread beside the mma.sync
    operands and spill (sm_80 / sm_89 compile, ``python -m vllm_router_ext.testing.aot``), so
    those GPUs get 128x64 tiles. On Hopper (9.x) the fp32 mode takes the warp-specialised wgmma
    kernel from WGMMA_WS_FROM_M tokens when this Triton has Gluon (``wgmma_ws``: None = find out;
    False = never, the kernel's own fallback), in tiles of 128 + a 16/32-column tail where
    128-wide tiles would pad more than a quarter of N, and of 192 (128 + 64) from
    WGMMA_WS_192_FROM_M tokens where 192 divides N (above 256).
    On Hopper a split-K config that adds its splits across programs does so in a second kernel,
    launched with PDL (``split_sum_variants``): on the H200 that form won 48 of the 53 such table
    buckets above 16 tokens and timed like the ticket below (benchmarks/NOTES.md); the
    ``wgmma_ws`` sum stays a plain launch (PDL was slower there on full launches)."""
    cfg = _heuristic_kernel(
        m, k, n, mode, batch_invariant, sm_count, cublas, capability, wgmma_ws, fp32_weight
    )
    if capability // 10 == 9 and cfg.kernel == "splitk" and (forms := split_sum_variants(cfg, k)):
        return forms[-1]  # partials, then their split-order sum as a programmatic dependent launch
    return cfg


def _heuristic_kernel(
    m: int,
    k: int,
    n: int,
    mode: str,
    batch_invariant: bool,
    sm_count: int,
    cublas: bool,
    capability: int,
    wgmma_ws: bool | None,
    fp32_weight: bool = False,
) -> KernelConfig:
    """:func:`heuristic_config`'s kernel, tiles and K split."""
    fp32 = mode == "fp32"
    if fp32 and not batch_invariant and capability // 10 == 9 and m >= WGMMA_WS_FROM_M:
        if wgmma_ws is None:
            from csrc_triton.capability import gluon_available

            wgmma_ws = gluon_available()
        if wgmma_ws:
            block_n = 128 if n > 64 else 64
            tail = wgmma_ws_tail(n, block_n)
            if tail == 0 and n > 256 and n % 192 == 0 and m >= WGMMA_WS_192_FROM_M:
                tail = 64  # 192-wide tiles, the tail split between the two consumers
            split = wgmma_ws_split(m, k, n, block_n, sm_count, tail)
            return wgmma_ws_config(block_n, split, block_n_tail=tail)
    if not batch_invariant and m <= 4:
        block_m = min(2, 1 << (m - 1).bit_length())
        # 8 warps: what the H200 table picks at 1-4 tokens (or more); with 4 warps and two tokens
        # the sm_89 compile spills at K=6144.
        return KernelConfig("gemv", dict(block_m=block_m, block_n=1, k_per_split=0, num_warps=8))
    if not batch_invariant and capability // 10 == 9 and not fp32_weight:
        if (split := _mid_m_split(m, k, n, mode, sm_count)) is not None:
            return split
    if cublas and not fp32 and not batch_invariant and m > 64:
        return KernelConfig("cublas")
    if batch_invariant or m <= 64:
        block_m = 64 if batch_invariant else 16
        block_n = 32 if n >= 128 else 16
        # Split K so that N/BLOCK_N * splits >= 2 * SMs: K / splits rounded down to a multiple of
        # 256 (more splits, never fewer; 256 on every shape here with 132 SMs).
        n_blocks = -(-n // block_n)
        splits = max(1, min(k // 256, -(-2 * sm_count // n_blocks)))
        k_per_split = max(256, k // splits // 256 * 256)
        split_k = -(-k // k_per_split)
        wide_programs = -(-m // 64) * -(-n // 64) * split_k  # 64 x 64 split tiles
        mid_m = BI_SPLITS_IN_PROGRAM_FROM < m <= BI_SPLIT_TILES_TO
        few_partials = mid_m and m * n * split_k < BI_SPLIT_PARTIALS_MAX
        enough_programs = 64 < m <= BI_SPLITS_IN_PROGRAM_FROM and 2 * wide_programs >= 3 * sm_count
        if batch_invariant and capability >= 90 and not fp32_weight and (few_partials or enough_programs):
            # Hopper+ software-pipelined 64 x 64 split tiles, their partials added by a second
            # launch (PDL): above 256 tokens while the partials stay under ~24 MB, where the
            # H200 table's retunes chose them over one program per tile (every shape at 512,
            # DeepSeek-V3 / GLM-5 at 768, DeepSeek-V2 at 1024, V2-Lite to 2048; not with 6.3M+
            # partials: GLM-5 / DeepSeek-V3 at 1024 with K split 256); one program per tile
            # measured 2.1-2.6x the table at 512 tokens. From 65 tokens where they still make
            # >= 1.5 programs per SM, as the table's DeepSeek-V3 / Kimi-K2 / GLM-5 buckets (the
            # 64 x 32 unrolled tile measured 1.4-1.85x the table at 256 tokens there).
            return splitk_config(block_m, 64, 128, k_per_split, mode, 4, num_stages=3)
        if batch_invariant and m > BI_SPLITS_IN_PROGRAM_FROM:
            # On Hopper and later (>= 227 KB of shared memory) tiles grow with M (the K
            # structure does not), as the H200 table's do: 64 x 64 above 1024 tokens, 128 x 128
            # with 8 warps above 4096 (64 experts: 64 x 64). One 64 x 32 tile for every M
            # measured 1.5-2.9x the fastest path at 16384 tokens on the H200
            # (bench-h200-27b1408-heuristic.json; e87236d's in docs/benchmarks.md). An fp32 gate
            # weight keeps 64 x 32 below 128 x 128: its 64 x 64 tile with 4 warps spills 64
            # bytes in the sm_90 compile. Older GPUs keep one tile: three stages of larger ones
            # overflow the A100's / L40S's shared memory.
            warps = 4
            if capability >= 90 and m > 1024:
                if m > 4096 and n > 64:
                    block_m, block_n, warps = 128, 128, 8
                elif not fp32_weight:
                    block_n = 64
            return splitk_config(
                block_m, block_n, 128, k_per_split, mode, warps, num_stages=3, splits_in_program=True
            )
        return splitk_config(block_m, block_n, 128, k_per_split, mode)
    if m <= 512:
        return pipelined_splitk_config(64, 64, 1024, mode, 4)
    if m <= 2048:
        return pipelined_splitk_config(64, 64, 2048, mode, 4)
    wide = 64 if fp32 and capability < 90 else 128
    if m <= 8192:
        return pipelined_splitk_config(128, wide, 3584, mode, 8)
    return KernelConfig(
        "tiled",
        dict(
            block_m=128,
            block_n=wide if n >= 128 else 64,
            block_k=64,
            promote_chunks=fp32_promote_chunks(64) if fp32 else 0,
            group_m=8,
            num_warps=8,
            num_stages=3,
        ),
    )


def _mid_m_split(m: int, k: int, n: int, mode: str, sm_count: int) -> KernelConfig | None:
    """Hopper's pipelined split tiles from 65 tokens (to ``MID_M_SPLIT_TO``): the finest K split
    whose programs stay within ``MID_M_PROGRAMS_PER_SM`` per SM; a split that is one MMA chain
    loops over its chunks (``flat_chain``). None: no split fits (the 16-bit modes take cuBLAS,
    the fp32 mode the older pipelined split in 64-wide chunks) or M outside that range."""
    fp32 = mode == "fp32"
    kind = "fp32" if fp32 else "16-bit"
    if not 64 < m <= MID_M_SPLIT_TO[kind]:
        return None
    limit = MID_M_PROGRAMS_PER_SM[kind] * sm_count
    tiles = -(-m // 64) * -(-n // 64)
    for k_per_split in ((256,) if k < 4096 else ()) + ((512, 1024) if fp32 else (512,)):
        if tiles * -(-k // k_per_split) <= limit:
            cfg = splitk_config(64, 64, 128, k_per_split, mode, 4, num_stages=3)
            return KernelConfig("splitk", {**cfg.params, "flat_chain": True}) if one_chain_split(cfg) else cfg
    return None


def split_sum_variants(cfg: KernelConfig, k: int) -> list[KernelConfig]:
    """``cfg`` with each way of launching its cross-program K-split sum, all adding the same
    partials in the same order: the split-K kernel's one-launch ticket, or two launches with the
    second a programmatic dependent launch (PDL); the ``wgmma_ws`` sum (or stream-K fixup) plain
    or with PDL, let go early or late (``PDL_EARLY``, ``PDL_LATE``). Empty for configs without
    such a sum (one split, splits summed in one program, the fixed-point sum). On the H200 PDL
    saves ~0.6 µs of the second launch, and two launches with PDL beat the ticket by up to 1.5 µs
    on many buckets, but an early trigger slowed ``wgmma_ws`` where its first launch fills >= 112
    of the 132 SMs (``probe-pdl-split-sum-h200-*.log``): the tuner times each per M."""
    p = {key: v for key, v in cfg.params.items() if key not in ("ticket", "pdl")}
    if cfg.kernel == "splitk":
        if p.get("splits_in_program") or p.get("fixed_point") or p["k_per_split"] >= k:
            return []
        return [KernelConfig("splitk", p), KernelConfig("splitk", {**p, "ticket": False, "pdl": True})]
    if cfg.kernel == "wgmma_ws" and (0 < p.get("k_per_split", 0) < k or p.get("stream_k")):
        return [
            KernelConfig("wgmma_ws", {**p, "pdl": pdl}) if pdl else KernelConfig("wgmma_ws", p)
            for pdl in (0, 1, 2)
        ]
    return []


def bucket_for(buckets: list[dict[str, Any]], m: int) -> dict[str, Any] | None:
    """The bucket that serves M: the first whose ``max_m`` >= M (``None`` = unbounded)."""
    return next((b for b in buckets if b["max_m"] is None or m <= b["max_m"]), None)


def table_buckets(
    device_name: str, k: int, n: int, mode: str, batch_invariant: bool = False, variant: str = ""
) -> list[dict[str, Any]]:
    """This GPU's tuned buckets for a [n, k] gate in ``mode`` (its batch-invariant ones, or a
    ``variant`` such as ``"triton"``); [] where the table has none (the heuristic serves)."""
    key = ("fp32" if mode == "fp32" else "bf16-fp32out") + ("/batch_invariant" if batch_invariant else "")
    key += f"/{variant}" if variant else ""
    return load_table(device_name).get("shapes", {}).get(f"{k}x{n}", {}).get(key, [])


def select_config(
    m: int,
    k: int,
    n: int,
    mode: str,
    batch_invariant: bool,
    device_name: str,
    sm_count: int,
    cublas: bool = True,
    capability: int = 90,
    wgmma_ws: bool | None = None,
    fp32_weight: bool = False,
) -> KernelConfig:
    """The config for M: the device's tuned table if it has this shape and mode, else the
    heuristic. ``wgmma_ws=False``: a Triton kernel where the ``wgmma_ws`` kernel cannot run (an
    fp32 gate weight, rows TMA cannot read, no Gluon): the table's ``fp32/triton`` buckets (the
    fastest Triton configs, timed beside it), else the heuristic's. ``fp32_weight``: the gate
    weight is genuinely fp32 (the heuristic's tiles for it)."""
    bucket = bucket_for(table_buckets(device_name, k, n, mode, batch_invariant), m)
    if wgmma_ws is False and bucket is not None and bucket["kernel"] == "wgmma_ws":
        bucket = bucket_for(table_buckets(device_name, k, n, mode, variant="triton"), m)
    # cuBLAS has no fp32-accurate equivalent (and none off-GPU): the heuristic serves those.
    if bucket is not None and not (bucket["kernel"] == "cublas" and (mode == "fp32" or not cublas)):
        params = {p: v for p, v in bucket.items() if p in PARAM_KEYS}
        return KernelConfig(bucket["kernel"], params, source=f"tuned {table_label(device_name)}")
    return heuristic_config(
        m,
        k,
        n,
        mode,
        batch_invariant,
        sm_count,
        cublas=cublas,
        capability=capability,
        wgmma_ws=wgmma_ws,
        fp32_weight=fp32_weight,
    )


def fp32_weight_max_block_k(capability: int) -> int:
    """BLOCK_K for a genuinely fp32 gate weight: each chunk of the weight tile is held in fp32 and
    as three bf16 terms at once. Before sm_90 (mma.sync: operands in registers) 64- and 128-wide
    chunks spill 0.1-7 KB per thread in the compile (``python -m vllm_router_ext.testing.aot``),
    and on sm_100 64-wide heuristic tiles do too; 32 does not. On sm_90 the H200 table's 128-wide
    chunks spill 72-176 bytes, yet capping them at 64 measured slower on the H200 (DeepSeek-V3
    M=2048 157 -> 194 µs): no cap on Hopper."""
    return 128 if 90 <= capability < 100 else 32


def wgmma_ws_fallback(
    m: int, k: int, n: int, device_name: str, sm_count: int, capability: int, fp32_weight: bool
) -> KernelConfig:
    """The Triton config that runs where a ``wgmma_ws`` config cannot: the tuned table's fastest
    Triton config for this M (``fp32/triton``), else the heuristic's (also when a hand-edited
    ``fp32/triton`` names ``wgmma_ws`` again: never a loop)."""
    kw = dict(capability=capability, wgmma_ws=False, fp32_weight=fp32_weight)
    fallback = select_config(m, k, n, "fp32", False, device_name, sm_count, **kw)
    if fallback.kernel == "wgmma_ws":
        fallback = heuristic_config(m, k, n, "fp32", False, sm_count, **kw)
    return fallback


def config_to_run(
    cfg: KernelConfig,
    m: int,
    k: int,
    n: int,
    device_name: str,
    sm_count: int,
    capability: int,
    fp32_weight: bool,
    wgmma_ws_problem: str | None = None,
) -> KernelConfig:
    """The config that launches for a selected (or a tuner's, a test's) ``cfg``: a ``wgmma_ws``
    config with a ``wgmma_ws_problem`` here becomes :func:`wgmma_ws_fallback`'s; a genuinely fp32
    weight's tiles are capped (held in fp32 and as three bf16 terms: narrower chunks where
    registers need it, 64 x 64 pipelined tiles in two stages, the tiled kernel's 64 x 64 x 32 with
    chains of 128); split-K's promotion defaults to one chain per split. None of this changes a
    sum's order per mode (its buckets share one BLOCK_K), so batch invariance holds."""
    if cfg.kernel == "wgmma_ws" and wgmma_ws_problem is not None:
        cfg = wgmma_ws_fallback(m, k, n, device_name, sm_count, capability, fp32_weight)
    if cfg.kernel not in ("splitk", "tiled"):
        return cfg
    p = dict(cfg.params)
    if cfg.kernel == "splitk":
        if fp32_weight:
            p["block_k"] = min(p["block_k"], fp32_weight_max_block_k(capability))
            if p.get("num_stages", 1) > 1:
                p.update(block_m=min(p["block_m"], 64), block_n=min(p["block_n"], 64), num_stages=2)
        if not p.get("promote_chunks"):
            p["promote_chunks"] = p["k_per_split"] // p["block_k"]
    elif fp32_weight:
        if p.get("promote_chunks"):
            p["promote_chunks"] = 4
        p.update(block_m=min(p["block_m"], 64), block_n=min(p["block_n"], 64), block_k=32, num_stages=2)
    return cfg if p == cfg.params else KernelConfig(cfg.kernel, p, cfg.source)


def shrink_config(cfg: KernelConfig) -> KernelConfig | None:
    """The same sums in a smaller on-chip footprint, or None: one software-pipeline stage fewer,
    else the larger of BLOCK_M / BLOCK_N halved (down to 16). BLOCK_K, the K split, the promotion
    and the order of the split sum stay, so every logit is the same sum of the same products."""
    p = dict(cfg.params)
    if p.get("num_stages", 1) > 1:
        p["num_stages"] -= 1
    elif p.get("block_n_tail"):  # wgmma_ws: plain 128-wide tiles (its BLOCK_M is fixed)
        del p["block_n_tail"]
    elif "block_m" in p and max(p["block_m"], p["block_n"]) > 16:
        p["block_m" if p["block_m"] >= p["block_n"] else "block_n"] //= 2
    else:
        return None
    return KernelConfig(cfg.kernel, p, f"{cfg.source}, shrunk to fit this GPU")
