"""The kernel choice (``csrc_triton.choice``): the heuristic, the tuned tables, what a
GPU or the operands allow, the start-up line. Pure Python: no kernel runs here."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch

import csrc_triton.problem as problem_types
from csrc_triton import choice, launches, tables
from csrc_triton.capability import GpuNeeds
from csrc_triton.launches import SplitKLaunch, WgmmaWsLaunch, describe, fields, from_bucket, to_bucket
from csrc_triton.problem import Device, Precision, Problem
from vllm_router_ext.ops import startup
from vllm_router_ext.precision import RouterPrecision

BF16 = torch.bfloat16
H100 = Device("NVIDIA H100 80GB HBM3", 132, 90)


def heuristic(m, k, n, mode, bi, sms=132, *, capability=90, wgmma_ws=None, fp32_weight=False, cublas=False):
    device = Device("GPU", sms, capability, cublas=cublas, gluon=wgmma_ws)
    w_dtype = torch.float32 if fp32_weight else BF16
    return choice.heuristic(Problem(m, k, n, Precision(mode), bi, BF16, w_dtype, device))


def select(m, k, n, mode, bi, device_name, sms=132, cublas=True):
    return choice.selected(Problem(m, k, n, Precision(mode), bi, device=Device(device_name, sms, 90, cublas)))


def gpu(monkeypatch, name="NVIDIA H200", sms=132, cap=90):
    """The start-up line's device: ``name`` as a CUDA GPU."""
    monkeypatch.setattr(problem_types, "cuda_device", lambda index: Device(name, sms, cap))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)


def bi_buckets(k, n, mode, device_name, sms=132):
    problem = Problem(1, k, n, Precision(mode), True, device=Device(device_name, sms, 90))
    return choice.batch_invariant_buckets(problem)


@pytest.mark.parametrize("w_dtype", [BF16, torch.float32], ids=["bf16-weight", "fp32-weight"])
def test_heuristic_gemv_range_follows_the_h200_picks(w_dtype):
    """The GEMV up to 4 tokens, then up to 16 while the call has at most 2048 logits (H200: split-K
    won beyond); one expert a program below 64 experts with every load issued (maxnreg 255), as up
    to 4 tokens on a 16-bit weight; two experts a program from 5 tokens (and at 3 on a 16-bit
    weight) except on an fp32 weight; never under batch invariance."""
    for n, gemv_to in ((8, 16), (64, 16), (128, 16), (160, 12), (256, 8), (384, 5), (512, 4)):
        for m in range(1, 18):
            launch = choice.heuristic(Problem(m, 4096, n, Precision.FP32, False, BF16, w_dtype, H100))
            assert (launch.kernel == "gemv") == (m <= gemv_to), (n, m, launch)
            if launch.kernel != "gemv":
                continue
            every_load = n < 64 or (m <= 4 and w_dtype is BF16)
            assert launch.num_warps == 8 and launch.maxnreg == (255 if every_load else 0), (n, m, launch)
            if n < 64:
                assert (launch.block_m, launch.block_n) == (1, 1)
            elif m == 3 and w_dtype is BF16:  # two tokens a program would leave one half empty
                assert (launch.block_m, launch.block_n) == (1, 2)
            elif m <= 4 or w_dtype is torch.float32:
                assert (launch.block_m, launch.block_n) == (min(2, m), 1)
            else:
                assert launch.block_n == 2 and launch.block_m == (1 if m <= 8 else 2 if n <= 128 else 4)
        bi = choice.heuristic(Problem(8, 4096, n, Precision.FP32, True, BF16, w_dtype, H100))
        assert bi.kernel == "splitk"


def test_heuristic_configs_are_well_formed():
    for m in (1, 4, 5, 16, 64, 65, 4096, 16384):
        for bi in (False, True):
            for mode in ("fp32", "bf16-fp32out"):
                cfg = heuristic(m, 7168, 256, mode, bi, 132, wgmma_ws=False)
                if cfg.kernel == "splitk":
                    chunks = cfg.promote_chunks or cfg.k_per_split // cfg.block_k
                    assert cfg.k_per_split % (cfg.block_k * chunks) == 0
                    if m <= 64 and not bi:  # small M: enough programs to fill the GPU
                        assert (256 // cfg.block_n) * (7168 // cfg.k_per_split) >= 132
                gemv = m <= 4 or m * 256 <= choice.GEMV_MAX_LOGITS  # 5-8 tokens on 256 experts
                expected = "splitk" if bi else "gemv" if gemv else "splitk" if m <= 8192 else "tiled"
                assert cfg.kernel == expected, (m, bi, mode, cfg)
                with_cublas = heuristic(m, 7168, 256, mode, bi, 132, cublas=True)
                if mode != "fp32" and not bi and m > 64:  # Hopper's split tiles to 512 (below)
                    assert with_cublas.kernel == ("splitk" if m <= 512 else "cublas"), m
    # Batch invariance: one K structure for every M; above 256 tokens the same splits are summed
    # inside one program (software-pipelined), in tiles that grow with M on Hopper and later
    # (64 x 64 above 1024 tokens, 128 x 128 with 8 warps above 4096, 64 x 64 for 64 experts; a
    # genuinely fp32 weight keeps 64 x 32 below 128 x 128) and stay 64 x 32 before sm_90; on
    # Hopper+ pipelined 64 x 64 split tiles run from 65 tokens while they make enough programs and
    # the partials are few (below; not an fp32 weight). On Hopper a split form's sum is a second
    # kernel launched with PDL (same adds).
    structure = ("block_k", "k_per_split", "promote_chunks")
    for mode in ("fp32", "bf16-fp32out"):
        small = {heuristic(m, 7168, 256, mode, True, 132) for m in (1, 17, 64)}
        assert len(small) == 1
        (s,) = small
        assert s.ticket is False and s.pdl is True
        launch = {p: getattr(s, p) for p in structure}
        for m, tile, cap, fp32_weight in (
            (878, (64, 32, 4), 90, False), (1024, (64, 32, 4), 90, False), (1025, (64, 64, 4), 90, False),
            (257, (64, 32, 4), 90, True), (257, (64, 32, 4), 89, False),
            (4096, (64, 64, 4), 90, False), (4096, (64, 32, 4), 90, True), (4097, (128, 128, 8), 90, False),
            (16384, (128, 128, 8), 90, True), (16384, (64, 32, 4), 80, False),
            (16384, (64, 32, 4), 89, False), (16384, (128, 128, 8), 100, False),
        ):  # fmt: skip
            g = heuristic(m, 7168, 256, mode, True, 132, capability=cap, fp32_weight=fp32_weight)
            assert (g.block_m, g.block_n, g.num_warps) == tile, (m, cap)
            assert g.splits_in_program and g.num_stages == 3
            assert {p: getattr(g, p) for p in structure} == launch
        # V2-Lite: 64 x 64 split tiles make too few programs up to 256 tokens, few partials to 2048
        for m, tile in ((256, (64, 16, 1)), (257, (64, 64, 3))):
            lite = heuristic(m, 2048, 64, mode, True, 132)
            assert (lite.block_m, lite.block_n, lite.num_stages) == tile, m
        for m, splits_in_program in ((2048, False), (2049, True)):
            lite = heuristic(m, 2048, 64, mode, True, 132)
            assert getattr(lite, "splits_in_program", False) == splits_in_program, m
        lite = heuristic(16384, 2048, 64, mode, True, 132)
        assert (lite.block_m, lite.block_n, lite.num_warps) == (64, 64, 4)
        # Hopper+ above 256 tokens: split tiles while M x N x splits < 6 x 2^20 partials (28 splits
        # of 256 here: to 877 tokens), then one program per tile; from 65 tokens where 64 x 64
        # split tiles make >= 1.5 programs per SM (here 2 x 4 x 28 = 224 >= 198).
        for m, cap, fp32_weight, split_tiles in (
            (257, 90, False, True), (512, 90, False, True), (877, 100, False, True), (878, 90, False, False),
            (257, 90, True, False), (512, 89, False, False), (256, 90, False, True), (65, 90, False, True),
            (65, 89, False, False), (65, 90, True, False), (64, 90, False, False),
        ):  # fmt: skip
            g = heuristic(m, 7168, 256, mode, True, 132, capability=cap, fp32_weight=fp32_weight)
            assert {p: getattr(g, p) for p in structure} == launch
            assert (g.block_n == 64 and g.num_stages == 3) == split_tiles, (m, cap)
            assert (not g.splits_in_program) == (split_tiles or m <= 256), (m, cap)
            assert g.pdl == (cap // 10 == 9 and not g.splits_in_program)
        ampere = heuristic(1, 7168, 256, mode, True, 108, capability=80)
        assert ampere.ticket and not ampere.pdl  # the one-launch ticket
    # PDL only for cross-program split sums: not the GEMV, cuBLAS, one split or the wgmma_ws sum
    assert not hasattr(heuristic(1, 7168, 256, "fp32", False, 132), "pdl")
    assert heuristic(2048, 7168, 256, "fp32", False, 132, wgmma_ws=True).pdl == 0
    assert heuristic(64, 7168, 256, "bf16-fp32out", False, 132).pdl is True


def test_heuristic_mid_m_split_tiles_on_hopper():
    """65-512 tokens, not batch-invariant, Hopper: pipelined 64 x 64 split tiles, 128-wide chunks,
    the finest K split (256 only below K=4096, then 512, in fp32 also 1024) whose programs stay
    within 2 per SM (16-bit modes; else cuBLAS) or 1 per SM (fp32; else the older split of 1024 in
    64-wide chunks); one chain a split loops flat. A genuinely fp32 weight (64 x 64 x 128 spills
    on sm_90): 64 x 32 x 128 while those programs fit one wave, else 64 x 64 x 64, two stages.
    What measured fastest on the H200, shape by shape (benchmarks/NOTES.md)."""

    def split(m, k, n, mode, **kw):
        cfg = heuristic(m, k, n, mode, False, 132, cublas=True, **kw)
        if cfg.kernel != "splitk":
            return cfg.kernel
        if kw.get("fp32_weight"):
            return cfg.block_n, cfg.block_k, cfg.k_per_split, cfg.num_stages, cfg.flat_chain
        assert (cfg.block_m, cfg.block_n, cfg.num_stages) == (64, 64, 3), cfg
        assert cfg.pdl == (kw.get("capability", 90) // 10 == 9), cfg  # the sum: PDL on Hopper
        return cfg.block_k, cfg.k_per_split, cfg.flat_chain

    bf16, fp32 = "bf16-fp32out", "fp32"
    for m, k, n, mode, expected in (
        (65, 7168, 256, bf16, (128, 512, True)), (256, 7168, 256, bf16, (128, 512, True)),
        (257, 7168, 256, bf16, "cublas"), (128, 7168, 384, bf16, (128, 512, True)),
        (192, 7168, 384, bf16, (128, 512, True)), (193, 7168, 384, bf16, "cublas"),
        (512, 5120, 160, bf16, (128, 512, True)),
        (512, 2048, 64, "bf16", (128, 256, True)), (512, 6144, 256, bf16, "cublas"),
        (65, 7168, 256, fp32, (128, 512, False)), (128, 7168, 256, fp32, (128, 512, False)),
        (129, 7168, 256, fp32, (128, 1024, False)), (512, 7168, 256, fp32, (64, 1024, False)),
        (65, 7168, 384, fp32, (128, 1024, False)), (512, 5120, 160, fp32, (128, 1024, False)),
        (256, 2048, 64, fp32, (128, 256, True)),
    ):  # fmt: skip
        assert split(m, k, n, mode) == expected, (m, k, n, mode)
    # A genuinely fp32 weight: 64 x 32 tiles while they make <= 132 programs, else 64-wide chunks
    for m, k, n, expected in (
        (256, 4096, 8, (32, 128, 512, 2, False)), (512, 2048, 64, (32, 128, 256, 2, True)),
        (256, 8192, 64, (32, 128, 512, 2, False)), (512, 8192, 64, (64, 64, 512, 2, False)),
        (65, 7168, 256, (64, 64, 512, 2, False)),
    ):  # fmt: skip
        assert split(m, k, n, fp32, fp32_weight=True) == expected, (m, k, n)
    # Not on Ampere / Ada, not above 512 tokens
    assert split(65, 7168, 256, bf16, capability=89) == "cublas"
    assert split(65, 7168, 256, fp32, capability=89) == (64, 1024, False)
    assert split(513, 2048, 64, bf16) == "cublas"
    assert heuristic(64, 7168, 256, bf16, False, 132, cublas=True).num_stages == 1


def test_heuristic_takes_the_wgmma_ws_kernel_only_where_it_runs():
    """The fp32 mode on Hopper from WGMMA_WS_FROM_M tokens, with a Triton that has Gluon; never
    under batch invariance (one kernel for every M), in the 16-bit modes, or on other GPUs."""
    from csrc_triton.choice import WGMMA_WS_FROM_M, wgmma_ws_split

    def kernel(m, mode="fp32", bi=False, cap=90, ws=True, n=256):
        return heuristic(m, 7168, n, mode, bi, 132, capability=cap, wgmma_ws=ws).kernel

    assert kernel(WGMMA_WS_FROM_M) == kernel(16384) == "wgmma_ws"
    assert kernel(WGMMA_WS_FROM_M - 1) == "splitk"
    assert kernel(4096, bi=True) == kernel(4096, mode="bf16-fp32out") == "splitk"
    assert kernel(16384, cap=80) == kernel(16384, cap=100) == kernel(16384, ws=False) == "tiled"
    cfg = heuristic(1024, 7168, 256, "fp32", False, 132, wgmma_ws=True)
    assert cfg.block_k * cfg.promote_chunks == 256 and cfg.promote_chunks >= 2  # fp32-mode chains
    assert heuristic(4096, 2048, 64, "fp32", False, 132, wgmma_ws=True).block_n == 64
    # K split: the 128-row tiles times the splits fill the SMs once, in multiples of 256.
    assert wgmma_ws_split(1024, 7168, 256, 128, 132) == 1024  # 16 tiles x 7 splits
    assert wgmma_ws_split(2048, 7168, 256, 128, 132) == 1792  # 32 tiles x 4
    assert wgmma_ws_split(8192, 7168, 256, 128, 132) == 0  # 128 tiles: no split
    assert wgmma_ws_split(1024, 2048, 64, 64, 132) == 512  # at most K / 512 splits


def test_wgmma_ws_tiles_cover_160_experts_with_a_tail():
    """DeepSeek-V2's 160 experts: one 128 + 32 tile instead of two 128-wide ones (96 padding
    columns); 256 / 384 experts need no tail; the ring as deep as shared memory allows."""
    from csrc_triton.choice import (
        WGMMA_WS_SMEM_BYTES,
        wgmma_ws_split,
        wgmma_ws_stages,
        wgmma_ws_tail,
        wgmma_ws_tiles,
    )

    assert [wgmma_ws_tail(n) for n in (64, 128, 144, 160, 256, 288, 384, 480)] == [0, 0, 16, 32, 0, 16, 0, 0]
    cfg = heuristic(8192, 5120, 160, "fp32", False, 132, wgmma_ws=True)
    assert cfg.block_n == 128 and cfg.block_n_tail == 32
    assert "block_n_tail=32" in describe(cfg)
    assert heuristic(8192, 7168, 256, "fp32", False, 132, wgmma_ws=True).block_n_tail == 0
    # Kimi-K2's 384 experts: 192-wide tiles (the 64-column tail split between the consumers) from
    # 2048 tokens, 128-wide below; five stages of 320 rows fit in shared memory, six do not
    kimi = heuristic(2048, 7168, 384, "fp32", False, 132, wgmma_ws=True)
    assert kimi.block_n_tail == 64 and kimi.num_stages == 5
    assert wgmma_ws_tiles(2048, 384, 128, 64) == 32 and kimi.k_per_split == 1792
    assert heuristic(1024, 7168, 384, "fp32", False, 132, wgmma_ws=True).block_n_tail == 0
    assert wgmma_ws_tiles(8192, 160, 128, 32) == 64 and wgmma_ws_tiles(8192, 160, 128) == 128
    assert wgmma_ws_split(8192, 5120, 160, 128, 132, 32) == 2560  # 64 tiles x 2 splits
    assert [wgmma_ws_stages(128, 64, t) for t in (0, 32)] == [6, 6]
    assert wgmma_ws_stages(128, 128, 32) == 3
    for tail in (0, 16, 32, 64):
        assert wgmma_ws_stages(128, 64, tail) * (256 + tail) * 64 * 2 <= WGMMA_WS_SMEM_BYTES
    # 64-row tiles: twice the programs, and two programs' rings in one SM's shared memory
    assert wgmma_ws_tiles(1024, 512, 64, 0, 64) == 128 == 2 * wgmma_ws_tiles(1024, 512, 64)
    for block_n in (64, 128):
        stages = wgmma_ws_stages(block_n, 64, 0, 64)
        assert stages >= 2 and 2 * stages * (64 + block_n) * 64 * 2 <= WGMMA_WS_SMEM_BYTES
        assert choice.wgmma_ws(block_n, 0, block_m=64).num_stages == stages
    assert [wgmma_ws_stages(n, 64, 0, 64) for n in (64, 128)] == [6, 4]
    rows64 = choice.wgmma_ws(64, 1024, block_m=64)
    assert to_bucket(rows64)["block_m"] == 64 and "block_m=64" in describe(rows64)
    assert from_bucket({"max_m": None, **to_bucket(rows64)}, "table") == replace(rows64, source="table")
    assert "block_m" not in to_bucket(choice.wgmma_ws(128, 0))  # the tables' 128-row buckets read as before


def test_tuned_table_lookup(monkeypatch):

    table = {
        "shapes": {
            "7168x256": {
                "bf16-fp32out": [
                    {
                        "max_m": 16,
                        "kernel": "splitk",
                        "block_m": 16,
                        "block_n": 16,
                        "block_k": 128,
                        "k_per_split": 512,
                    },
                    {"max_m": 512, "kernel": "cublas"},
                    {"max_m": None, "kernel": "tiled", "block_m": 128, "block_n": 128, "block_k": 64},
                ]
            }
        }
    }
    monkeypatch.setattr(tables, "load_table", lambda name: table)
    assert select(8, 7168, 256, "bf16-fp32out", False, "GPU", 132).kernel == "splitk"
    assert select(100, 7168, 256, "bf16-fp32out", False, "GPU", 132).kernel == "cublas"
    assert select(9000, 7168, 256, "bf16-fp32out", False, "GPU", 132).kernel == "tiled"
    # cuBLAS serves the bf16 mode too (bf16 logits), never the fp32 mode, never off-GPU.
    assert select(100, 7168, 256, "bf16", False, "GPU", 132).kernel == "cublas"
    assert select(100, 7168, 256, "fp32", False, "GPU", 132).source == "heuristic"
    assert select(100, 7168, 256, "bf16", False, "GPU", 132, cublas=False).kernel == "splitk"


def test_startup_description_of_the_cuda_dispatch(monkeypatch):
    """The implementation named in the start-up log line, against the shipped H200 table."""
    gpu(monkeypatch)
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.bfloat16, 7168, 256)
    assert "promoted fp32 accumulation" in text and "tuned table" in text and "16-bit MMA" in text
    assert text.startswith("by M at run time: triton GEMV (fp32 FMA) M<=16, triton split-K M<=")
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, False, torch.bfloat16, 7168, 256)
    assert text.endswith("cuBLAS above (16-bit MMA; tuned table nvidia_h200)"), text
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.float32, 7168, 256)
    assert "fp32 weight split into 3 bf16 MMAs" in text
    assert text.endswith(
        "; from M=1024: one GEMM on the weight's three bf16 terms (split once at load), "
        "hi + mid + lo added per logit"
    )
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.float32, 4096, 8)
    assert "from M=1024: one GEMM on the weight's three bf16 terms" in text  # any number of experts
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, True, torch.bfloat16, 7168, 256)
    assert text.startswith("batch-invariant triton split-K, K split 512 (BLOCK_K 128) fixed for every M")
    assert "splits added in order" in text
    assert "; splits summed in one program from M=" in text
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, True, torch.bfloat16, 1000, 10)
    # the heuristic (no table for this shape): split tiles while the partials are few (to 2048 here)
    assert "splits summed in one program from M=2049 " in text and "heuristic" in text
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, False, torch.bfloat16, 1000, 10)
    assert "heuristic configs" in text
    assert "no gluon" not in startup.describe_cuda_dispatch(RouterPrecision.FP32, False, BF16, 7168, 256)
    gpu(monkeypatch, "NVIDIA A100", 108, 80)  # what the wgmma_ws launch type declares it needs
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.bfloat16, 7168, 256)
    assert text.endswith(
        "; no gluon warp-specialised wgmma here: compute capability 8.0 (needs Hopper, sm_90)"
    ), text


def test_batch_invariant_buckets_start_where_the_table_or_heuristic_changes(table_env, tmp_path):
    """The self-check probes M at and below every start of a batch-invariant bucket: the starts
    must be exact wherever a bucket ends (a table retuned at 768 tokens, the heuristic's switch
    where the split partials outgrow its limit), not only just above powers of two."""
    table_env(None)
    table = tables.load_table("NVIDIA H200")["shapes"]
    for key, entry in table.items():
        k, n = map(int, key.split("x"))
        for mode in ("bf16-fp32out", "fp32"):
            if f"{mode}/batch_invariant" not in entry:  # a shape whose batch invariance is the heuristic's
                continue
            buckets = entry[f"{mode}/batch_invariant"]
            notes = ("max_m", "us", "fastest_us")
            launch = [{a: b for a, b in bk.items() if a not in notes} for bk in buckets]
            ends = [bk["max_m"] for i, bk in enumerate(buckets[:-1]) if launch[i] != launch[i + 1]]
            expected = [1] + [m + 1 for m in ends]
            got = [m for m, _ in bi_buckets(k, n, mode, "NVIDIA H200")]
            assert got == expected, (key, mode)
    # the heuristic (an H100): DeepSeek-V3's split tiles end where M x 256 x 28 reaches 6 x 2^20
    got = [m for m, _ in bi_buckets(7168, 256, "fp32", "NVIDIA H100 80GB HBM3")]
    assert 65 in got and 878 in got and 1025 in got and 257 not in got  # 65-877: the same split tiles
    # a table of one's own (VLLM_ROUTER_EXT_TABLE=path) whose bucket ends above 16384 tokens
    v3 = table["7168x256"]["fp32/batch_invariant"]
    custom = {"shapes": {"7168x256": {"fp32/batch_invariant": [{**v3[-2], "max_m": 20000}, v3[-1]]}}}
    path = tmp_path / "big.json"
    path.write_text(json.dumps(custom))
    table_env(str(path))
    assert [m for m, _ in bi_buckets(7168, 256, "fp32", "NVIDIA H200")] == [1, 20001]


def test_table_override_picks_a_table_or_the_heuristic(table_env, tmp_path):
    """VLLM_ROUTER_EXT_TABLE: unset = the GPU's own table (none for an H100), a shipped table by
    name, ``none`` = the heuristic, a JSON path; a bad value names itself and the allowed ones;
    ``table_override`` (the benchmark's heuristic columns) wins over the variable."""
    c = tables
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    table_env(None)

    def pick(device: str, m: int = 300, mode: str = "fp32", bi: bool = False):
        return select(m, 7168, 256, mode, bi, device, 132)

    stock = heuristic(300, 7168, 256, "fp32", False, 132, cublas=True)
    assert pick(h100) == stock and c.table_name(h100) == "nvidia_h100_80gb_hbm3"
    tuned = pick(h200)
    assert tuned.source == "tuned nvidia_h200" and tuned != stock
    table_env("nvidia_h200")
    on_h100 = pick(h100)
    assert fields(on_h100) == fields(tuned) and on_h100.source == "tuned nvidia_h200 (VLLM_ROUTER_EXT_TABLE)"
    assert fields(pick(h100, 1, bi=True)) == fields(pick(h200, 1, bi=True))
    table_env("none")
    assert pick(h200) == stock and c.load_table(h200) == {}
    assert c.table_label(h200) == "none (heuristic)"
    own = tmp_path / "my_gpu.json"
    bucket = dict(max_m=None, kernel="splitk", block_m=16, block_n=16, block_k=128, k_per_split=1024)
    own.write_text(json.dumps({"shapes": {"7168x256": {"fp32": [bucket]}}}))
    table_env(str(own))
    assert pick(h100).k_per_split == 1024 and "my_gpu.json" in pick(h100).source
    assert pick(h100, mode="bf16-fp32out").kernel == "cublas"  # no such mode in the file: the heuristic
    with c.table_override("nvidia_h200"):
        assert fields(pick(h100)) == fields(tuned)
    assert pick(h100).k_per_split == 1024
    for bad, message in (
        ("nvidia_h100", "'nvidia_h100' is not a tuned table; allowed: none, nvidia_h200, a path"),
        (str(tmp_path / "missing.json"), "no such file"),
    ):
        table_env(bad)
        with pytest.raises(ValueError, match=re.escape(message)):
            pick(h200)
        with pytest.raises(ValueError, match="VLLM_ROUTER_EXT_TABLE"):
            c.table_choice()
    (tmp_path / "list.json").write_text("[]")
    table_env(str(tmp_path / "list.json"))
    with pytest.raises(ValueError, match="not a tuned table"):
        pick(h200)
    table_env(None)
    with pytest.raises(ValueError, match="allowed: none"), c.table_override("h200"):
        pass


def test_startup_description_names_the_table_override(monkeypatch, table_env):
    gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    table_env(None)
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.bfloat16, 7168, 256)
    assert text.endswith("heuristic configs: no 7168x256 entry in table nvidia_h100_80gb_hbm3)"), text
    table_env("nvidia_h200")
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, False, torch.bfloat16, 7168, 256)
    assert text.endswith("tuned table nvidia_h200 (VLLM_ROUTER_EXT_TABLE))"), text
    text = startup.describe_cuda_dispatch(RouterPrecision.FP32, True, torch.bfloat16, 7168, 256)
    assert "tuned nvidia_h200 (VLLM_ROUTER_EXT_TABLE)" in text
    table_env("none")
    text = startup.describe_cuda_dispatch(RouterPrecision.BF16_FP32OUT, False, torch.bfloat16, 7168, 256)
    assert text.endswith("heuristic configs: VLLM_ROUTER_EXT_TABLE=none)"), text


def test_split_sum_variants_launch_one_sum_each_way():
    """What the tuner times per bucket: the split-K kernel's ticket and two launches with PDL, the
    ``wgmma_ws`` sum plain / PDL early / PDL late; nothing for launches without a cross-program
    sum (one split, every split in one program). The other fields are kept."""
    launch = choice.splitk(64, 64, 128, 1024, True)
    variants = choice.split_sum_variants(replace(launch, pdl=True, ticket=False), 7168)
    assert [(v.ticket, v.pdl) for v in variants] == [(True, False), (False, True)]
    assert all(replace(v, ticket=True, pdl=False) == launch for v in variants)
    assert describe(variants[1]).endswith(",two_launch,pdl)")
    assert choice.split_sum_variants(launch, 1024) == []  # one split
    assert choice.split_sum_variants(replace(launch, splits_in_program=True), 7168) == []
    ws = choice.split_sum_variants(choice.wgmma_ws(128, 1792), 7168)
    assert [v.pdl for v in ws] == [0, 1, 2]
    assert describe(ws[1]).endswith(",pdl=1)") and describe(ws[2]).endswith(",pdl=2)")
    assert choice.split_sum_variants(choice.wgmma_ws(128, 0), 7168) == []


def test_a_table_bucket_becomes_its_launch_or_names_what_is_wrong():
    """Tables store launches as buckets: every shipped bucket reads back as its launch and writes
    back as the same fields; a bucket naming an unknown kernel or a field its kernel lacks (a
    hand-edited table, or one from a version with other kernels) is refused by name."""
    for entry in tables.load_table("NVIDIA H200")["shapes"].values():
        for key, buckets in entry.items():
            if not isinstance(buckets, list):
                continue
            for bucket in buckets:
                launch = from_bucket(bucket, "tuned")
                kept = {
                    k: v for k, v in bucket.items() if k not in ("max_m", "us", "worst_ratio", "fastest_us")
                }
                assert to_bucket(launch) == {k: v for k, v in kept.items() if k in to_bucket(launch)}, key
                assert from_bucket({**to_bucket(launch), "max_m": 1}, "tuned") == launch
    with pytest.raises(ValueError, match="splitk has no field fixed_point; allowed: block_k"):
        from_bucket({"max_m": 4, "kernel": "splitk", "block_m": 16, "block_n": 16, "block_k": 128,
                     "k_per_split": 512, "fixed_point": True}, "tuned")  # fmt: skip
    with pytest.raises(ValueError, match="kernel 'stream_k'; allowed: gemv, splitk, tiled, wgmma_ws, cublas"):
        from_bucket({"max_m": None, "kernel": "stream_k"}, "tuned")


def test_choose_resolves_what_this_gpu_and_these_operands_allow():
    """``choose``: a ``wgmma_ws`` choice for an fp32 weight or off Hopper becomes the Triton
    fallback; an fp32 weight's tiles are capped (128-wide chunks on sm_90, 32 elsewhere); split-K's
    promotion defaults to one chain a split; an fp32 weight with its terms at hand from 1024
    tokens runs one fp32-mode launch on the [3N, K] terms."""
    h200 = Device("NVIDIA H200", 132, 90, gluon=True)
    p = Problem(4096, 7168, 256, Precision.FP32, device=h200)
    assert choice.choose(p).kernel == "wgmma_ws"
    fp32_weight = replace(p, weight_dtype=torch.float32)
    fallback = choice.choose(fp32_weight)
    assert fallback.kernel != "wgmma_ws" and fallback == choice.wgmma_ws_fallback(fp32_weight)
    assert "dtypes" in choice.wgmma_ws_problem(fp32_weight)
    assert "16-byte" in choice.wgmma_ws_problem(replace(p, layout_problem="x layout (16-byte)"))
    kinds = [v for v in vars(launches).values() if isinstance(v, type) and hasattr(v, "kernel")]
    assert kinds and all(isinstance(k.needs, GpuNeeds) for k in kinds)  # each declares what it needs
    assert WgmmaWsLaunch.needs.unmet(100, True) == "compute capability 10.0 (needs Hopper, sm_90)"
    assert WgmmaWsLaunch.needs.unmet(90, False) == "this Triton has no Gluon warp specialisation"
    assert "8.0 (needs Hopper, sm_90)" in choice.wgmma_ws_problem(replace(p, device=Device("A100", 108, 80)))
    assert choice.wgmma_ws_problem(replace(p, device=Device("H100", 132, 90, gluon=True))) is None
    assert "bfloat16 logits" in choice.wgmma_ws_problem(replace(p, precision=Precision.BF16))
    small = choice.choose(replace(fp32_weight, m=300, device=Device("GPU", 132, 80)))
    assert isinstance(small, SplitKLaunch) and small.block_k == 32 and small.num_stages == 2
    one_chain = choice.choose(Problem(17, 7168, 256, Precision.BF16_FP32OUT, device=Device("GPU", 132, 90)))
    assert one_chain.promote_chunks * one_chain.block_k == one_chain.k_per_split
    terms = choice.choose(replace(fp32_weight, weight_terms=True))
    assert terms.kernel == "fp32_weight_terms" and terms.terms == choice.choose(replace(p, n=768))
    assert choice.choose(replace(fp32_weight, weight_terms=True, m=1023)).kernel != "fp32_weight_terms"
    # cuBLAS multiplies one dtype: a 16-bit mode on an fp32 weight runs the Triton kernels
    for mode in (Precision.BF16_FP32OUT, Precision.BF16):
        assert choice.choose(replace(p, precision=mode)).kernel == "cublas"
        assert choice.choose(replace(fp32_weight, precision=mode)).kernel == "splitk"


def test_an_fp32_weight_gemv_with_several_tokens_a_program_runs_8_warps_uncapped():
    """A GEMV holding several tokens a program on fp32 weight rows takes 8 warps and no register
    cap from 5 tokens (H200: the tuned bf16 picks spilled, GLM-5 at 16 tokens 107 -> 12.6 µs);
    below 64 experts one token and one expert a program; a bf16 weight keeps the table's pick."""
    h200 = Device("NVIDIA H200", 132, 90)
    for m, k, n in ((12, 6144, 256), (16, 7168, 256), (16, 8192, 64), (8, 6144, 256)):
        tuned = choice.choose(Problem(m, k, n, Precision.FP32, device=h200))
        assert tuned.kernel == "gemv" and tuned.block_m > 1 and (tuned.num_warps, tuned.maxnreg) != (8, 0)
        fp32_weight = choice.choose(Problem(m, k, n, Precision.FP32, False, BF16, torch.float32, h200))
        assert fp32_weight == replace(tuned, num_warps=8, maxnreg=0), (m, k, n)
    scout = choice.choose(Problem(16, 5120, 16, Precision.FP32, False, BF16, torch.float32, h200))
    assert (scout.block_m, scout.block_n, scout.num_warps, scout.maxnreg) == (1, 1, 8, 255)
    four = Problem(4, 7168, 384, Precision.FP32, device=h200)
    assert choice.choose(replace(four, weight_dtype=torch.float32)) == choice.choose(four)  # to 4 tokens


def test_vllm_gate_kernel_serves_bf16_fp32out_at_1_to_16_tokens_where_it_can():
    """Inside a vLLM that has its cuteDSL ``ll_bf16_gemm`` (Hopper, datacenter Blackwell) the
    ``bf16-fp32out`` mode runs it at 1-16 tokens; never in another mode, batch-invariant, on
    other operands, another GPU, without that vLLM, or for the fused router."""
    h200 = Device("NVIDIA H200", 132, 90, vllm_gate=True)
    for m in range(1, choice.VLLM_GATE_TO_M + 1):
        p = Problem(m, 7168, 256, Precision.BF16_FP32OUT, device=h200)
        assert choice.choose(p) == launches.VllmGateLaunch(m), m
        assert choice.choose(p, allow_vllm_gate=False).kernel == "gemv"  # what the fused router runs
    p = Problem(8, 4096, 256, Precision.BF16_FP32OUT, device=h200)
    assert choice.choose(replace(p, m=17)).kernel != launches.VllmGateLaunch.kernel
    refused = {
        "fp32 (needs bf16-fp32out)": replace(p, precision=Precision.FP32),
        "bf16 (needs bf16-fp32out)": replace(p, precision=Precision.BF16),
        "batch-invariant (needs bf16-fp32out)": replace(p, batch_invariant=True),
        "(needs bfloat16 x bfloat16)": replace(p, weight_dtype=torch.float32),
        "contiguous=False": replace(p, contiguous=False),
        "K=4100": replace(p, k=4100),
        "TRITON_INTERPRET=1": replace(p, interpreting=True),
        "capability 8.9 (needs Hopper or datacenter Blackwell": replace(p, device=Device("L40S", 142, 89)),
        "compute capability 12.0": replace(p, device=Device("RTX", 170, 120, vllm_gate=True)),
        "no vLLM with its cuteDSL ll_bf16 kernel": replace(p, device=replace(h200, vllm_gate=False)),
    }
    for why, problem in refused.items():
        assert why in choice.vllm_gate_problem(problem), why
        assert choice.choose(problem).kernel != launches.VllmGateLaunch.kernel, why
    assert choice.vllm_gate_problem(replace(p, device=Device("B200", 148, 100, vllm_gate=True))) is None
    assert describe(launches.VllmGateLaunch(3)) == "vLLM cuteDSL ll_bf16(m=3)"


def test_vllm_gate_kernel_is_asked_of_a_process_running_vllm_only(monkeypatch):
    """Outside vLLM nothing imports vLLM for a router GEMM; inside, its module decides once."""
    import importlib
    import sys
    import types

    from csrc_triton import capability

    monkeypatch.setattr(capability, "_vllm_gate", None)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    imported = []
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name))
    assert capability.vllm_gate_available() is False and not imported and capability._vllm_gate is None
    monkeypatch.setitem(sys.modules, "vllm", types.ModuleType("vllm"))
    fake = types.SimpleNamespace(is_available=lambda: True)
    monkeypatch.setattr(importlib, "import_module", lambda name: imported.append(name) or fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert capability.vllm_gate_available() is True and imported == [capability.VLLM_GATE_MODULE]
    assert capability.vllm_gate_available() is True and len(imported) == 1  # decided once
    monkeypatch.setattr(capability, "_vllm_gate", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert capability.vllm_gate_available() is False  # vLLM without a GPU: never
    monkeypatch.setattr(capability, "_vllm_gate", None)

    def broken(name):
        raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu)")

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert capability.vllm_gate_available() is False
