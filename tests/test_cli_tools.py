"""Command-line tools that need no vLLM engine: checkpoint builder, benchmark, tuner (CPU side)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def test_tiny_checkpoint_cli(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "vllm_router_ext.tools.tiny_checkpoint", str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text(encoding="utf-8"))
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["topk_method"] == "noaux_tc"
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576  # what vLLM's CPU MLA accepts
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text(encoding="utf-8"))
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in index["weight_map"]
    assert (tmp_path / "ckpt" / "tokenizer.json").exists()


def _bench_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_router_ext.bench", *args], capture_output=True, text=True, timeout=300
    )


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-side message")
def test_bench_cli_without_a_gpu_says_so():
    p = _bench_cli("--out", "unused")
    assert p.returncode == 2 and "needs a CUDA GPU" in p.stderr


def test_bench_cli_names_unknown_methods_and_the_allowed_ones():
    p = _bench_cli("--methods", "ours fp32,ours fp64")
    assert p.returncode == 2 and "unknown method(s) ['ours fp64']" in p.stderr
    assert "'heuristic BI fp32'" in p.stderr


def test_bench_heuristic_columns_run_without_the_table(gen):
    """The benchmark's heuristic columns call the op with the table bypassed, and agree with it."""
    from csrc_triton.tables import table_choice
    from vllm_router_ext.bench import METHODS

    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    w = (torch.randn(16, 256, generator=gen) / 16).to(torch.bfloat16)
    ref = x.double() @ w.double().T
    for mode in ("bf16-fp32out", "fp32", "BI bf16-fp32out", "BI fp32"):
        out = METHODS[f"heuristic {mode}"](x, w, None, None)
        assert out.dtype == torch.float32 and ((out.double() - ref).norm() / ref.norm()).item() <= 1e-5
    assert table_choice() is None  # the override ends with the call


def test_bench_and_tune_help():
    for cmd in (
        [sys.executable, "-m", "vllm_router_ext.bench", "--help"],
        [sys.executable, str(REPO / "benchmarks/tune.py"), "--help"],
    ):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0 and "--out" in p.stdout, p.stderr


def test_router_stage_benchmark_refuses_in_one_line(tmp_path):
    """A bad shape is named with the allowed ones before anything runs; without a GPU the
    router-stage benchmark says so in one line. Both exit 2."""
    script = [sys.executable, str(REPO / "benchmarks" / "router_stage.py"), "--out", str(tmp_path)]
    p = subprocess.run([*script, "--shapes", "Nope"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2
    assert p.stdout.strip() == "router_stage: unknown shape 'Nope'; allowed: DeepSeek-V3, Kimi-K2, Qwen3-MoE"
    if not torch.cuda.is_available():
        p = subprocess.run(script, capture_output=True, text=True, timeout=300)
        assert p.returncode == 2
        assert p.stdout.strip() == "router_stage: needs a CUDA GPU (this machine has none)"


def test_tuner_batch_invariant_candidates_are_well_formed():
    """Every K structure the tuner compares: its reference is the first tile, each candidate holds
    whole promotions per split, and every tuned M has a candidate."""
    tune = _tune_module()
    for mode in ("bf16-fp32out", "fp32"):
        structures = tune.bi_structures(mode)
        assert len(structures) == len(tune.BI_K_STRUCTURES)
        assert tune.bi_structures(mode, (512,)) == [s for s in structures if s[0] == 512]
        with pytest.raises(ValueError, match=r"K split\(s\) \[300\] not among"):
            tune.bi_structures(mode, (300,))
        for structure in structures:
            kps, _ = structure
            cfgs = [tune._bi_config(structure, t, mode) for t in tune.BI_TILES]
            ref = tune._bi_config(structure, tune.BI_TILES[0], mode)
            assert cfgs[0] == ref and ref.num_stages == 1
            for c in cfgs:
                assert c.k_per_split == kps
                assert c.k_per_split % (c.block_k * (c.promote_chunks or 1)) == 0, c
            for m in tune.BI_M:
                assert any(tune._bi_fits(c, m) for c in cfgs), (structure, m)


def _tune_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune", REPO / "benchmarks/tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    return tune


def test_tuner_choice_across_tritons_minimises_the_worst_slowdown(tmp_path):
    """``tune.py --across``: per M, the launch whose worst ratio to each Triton's fastest is the
    smallest, not the fastest under any one Triton; launches missing from a record never win;
    the chosen bucket keeps its time under each Triton; buckets at other M stay."""
    import random

    from csrc_triton.launches import GemvLaunch, from_bucket, to_bucket

    tune = _tune_module()
    rng = random.Random()
    a, b, c = GemvLaunch(1, 4), GemvLaunch(1, 4, maxnreg=255), GemvLaunch(4, 2, num_warps=8)
    base = rng.uniform(3.0, 6.0)
    # a: fastest under the old Triton, 1.8x under the new; b: 3 % behind a, fine under both;
    # c: fastest under the new (the ratios' measure), timed under one Triton only
    times = {"3.6.0": {a: base, b: base * 1.03}, "3.8.0": {a: base * 1.8, b: base * 1.01, c: base * 0.9}}
    records = [
        {"triton": v, "timings": [
            {"shape": "DeepSeek-V3", "mode": "fp32", "m": 8, "launch": to_bucket(k), "us": us}
            for k, us in t.items()
        ]}
        for v, t in times.items()
    ]  # fmt: skip
    old = [
        {"max_m": 4, **to_bucket(GemvLaunch(1, 2, maxnreg=255)), "us": 4.0},
        {"max_m": 8, **to_bucket(a), "us": 5.0},
        {"max_m": None, **to_bucket(GemvLaunch(4, 4)), "us": 6.0},
    ]
    table = {"shapes": {"7168x256": {"fp32": [dict(x) for x in old]}}}
    lines = tune.choose_across(table, records)
    new = table["shapes"]["7168x256"]["fp32"]
    by_m = {bucket["max_m"]: bucket for bucket in new}
    assert from_bucket(by_m[8], "") == from_bucket(to_bucket(b), ""), new
    assert by_m[8]["us_by_triton"] == {"3.6.0": round(base * 1.03, 3), "3.8.0": round(base * 1.01, 3)}
    assert from_bucket(by_m[4], "heuristic") == GemvLaunch(1, 2, maxnreg=255)
    assert by_m[None]["kernel"] == "gemv" and "us_by_triton" not in by_m[None]
    assert table["tritons"] == ["3.6.0", "3.8.0"] and len(lines) == 1
    assert "worst 1.12x" in lines[0]  # against c, 3.8.0's fastest


def test_fp32_configs_promote_short_chains_of_two_or_more_chunks():
    """Every fp32-mode launch the dispatch can pick (the H200 table, the heuristic, the tuner's
    candidates) promotes its MMA chain every 2+ chunks, at most 256 along K: one chunk per chain
    would be folded by Triton (``acc + dot(a, b, 0)`` -> ``dot(a, b, acc)``) into one chain over K,
    8e-6 relative error instead of <= 2.5e-7 (docs/precision.md)."""
    import importlib.util

    from csrc_triton import choice
    from csrc_triton.launches import from_bucket
    from csrc_triton.problem import Device, Precision, Problem
    from csrc_triton.tables import load_table
    from vllm_router_ext.bench_harness import M_LIST, SHAPES

    spec = importlib.util.spec_from_file_location("tune", REPO / "benchmarks/tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    cfgs = [
        from_bucket(b, "tuned")
        for shape in load_table("NVIDIA H200")["shapes"].values()
        for key in ("fp32", "fp32/triton", "fp32/batch_invariant")
        for b in shape.get(key, [])
    ]
    h200 = Device("NVIDIA H200", 132, 90)
    cfgs += [
        choice.heuristic(Problem(m, s.k, s.n, Precision.FP32, bi, device=h200))
        for s in SHAPES
        for m in M_LIST
        for bi in (False, True)
    ]
    cfgs += [c for m in M_LIST for c in tune.splitk_candidates(m, "fp32") + tune.tiled_candidates(m, "fp32")]
    assert {c.kernel for c in cfgs} == {"gemv", "splitk", "tiled", "wgmma_ws"}  # gemv: FMA, no chains
    for c in cfgs:
        if c.kernel == "gemv":
            continue
        assert c.promote_chunks >= 2 and c.block_k * c.promote_chunks <= 2 * choice.FP32_MAX_BLOCK_K, c
    with pytest.raises(ValueError, match="block_k=256"):
        choice.fp32_promote_chunks(256)
    assert choice.splitk(16, 16, 512, 512, True).block_k == choice.FP32_MAX_BLOCK_K


def test_tuner_times_64_wide_and_64_row_wgmma_ws_tiles_on_every_gate(monkeypatch):
    """The tuner's ``wgmma_ws`` candidates (Hopper with Gluon) take 64-wide and 64-row tiles on
    every N, also where 128 divides it (more programs where 128 x 128 tiles are few), beside the
    128-wide and tailed ones (tails on 128 rows only); none below WGMMA_WS_TUNE_FROM tokens."""
    import importlib.util

    import csrc_triton.capability

    spec = importlib.util.spec_from_file_location("tune", REPO / "benchmarks/tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    h200 = SimpleNamespace(multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: h200)
    monkeypatch.setattr(csrc_triton.capability, "gluon_available", lambda: True)
    for k, n, widths in ((2880, 128, {128, 64}), (2048, 512, {128, 64}), (5120, 160, {128, 64, 160})):
        cands = tune.wgmma_ws_candidates(1024, k, n)
        assert {c.block_n + c.block_n_tail for c in cands} == widths, (k, n)
        assert all(c.kernel == "wgmma_ws" for c in cands)
        assert {(c.block_m, c.block_n) for c in cands if not c.block_n_tail} == {
            (128, 128),
            (128, 64),
            (64, 128),
            (64, 64),
        }, (k, n)
        assert all(c.block_m == 128 for c in cands if c.block_n_tail)
    assert tune.wgmma_ws_candidates(tune.WGMMA_WS_TUNE_FROM - 1, 2880, 128) == []


def test_tuner_merges_a_partial_retune_into_the_table_buckets():
    """``tune.py --merge T --m 32,64``: the retuned M get the new configs, every other M of the
    benchmark's list keeps the table's bucket, equal neighbours collapse, the last bucket is open."""
    import importlib.util

    import pytest

    from csrc_triton.launches import SplitKLaunch, to_bucket
    from csrc_triton.tables import bucket_for

    spec = importlib.util.spec_from_file_location("tune", REPO / "benchmarks/tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    gemv = {"kernel": "gemv", "block_m": 1, "block_n": 1, "num_warps": 8}
    split = {"kernel": "splitk", "block_n": 64, "block_k": 128, "k_per_split": 512}
    old = [
        {"max_m": 16, **gemv, "us": 3.5},
        {"max_m": 256, **split, "block_m": 64},
        {"max_m": 384, **split, "block_m": 128},  # an end off the benchmark's M list
        {"max_m": None, "kernel": "cublas"},
    ]
    new_cfg = SplitKLaunch(block_m=32, block_n=64, block_k=128, k_per_split=1024)
    points = sorted(set((32, 64)) | set(tune.M_LIST))
    merged = tune.merge_buckets(old, {32: (7.0, new_cfg), 64: (8.0, new_cfg)}, points)
    for m in (*tune.M_LIST, 300, 384, 385):
        got = {k: v for k, v in bucket_for(merged, m).items() if k not in ("max_m", "us")}
        if m in (32, 64):
            assert got == to_bucket(new_cfg), m
        else:
            assert got == {k: v for k, v in bucket_for(old, m).items() if k not in ("max_m", "us")}, m
    assert merged[-1]["max_m"] is None and len(merged) == 5  # gemv, new splitk, 2 old splitk, cuBLAS
    assert set(tune.TUNE_M_LIST) == set(tune.M_LIST) | {192, 384}
    # a point retuned off the list (a bucket's middle) makes its own bucket; its neighbours stay
    mid = tune.merge_buckets(old, {12: (4.0, new_cfg)}, tune.M_LIST)
    assert {k: v for k, v in bucket_for(mid, 12).items() if k not in ("max_m", "us")} == to_bucket(new_cfg)
    assert [b["max_m"] for b in mid[:3]] == [8, 12, 16] and bucket_for(mid, 13)["kernel"] == "gemv"
    assert set(tune.TARGETED_GEMV[12]) == set(tune.TARGETED_GEMV[8]) | set(tune.TARGETED_GEMV[16])
    with pytest.raises(SystemExit, match="--merge"):
        tune.merge_buckets([], {32: (7.0, new_cfg)}, (16, 32))  # nothing to keep for M=16
    assert tune.bi_structures("fp32", (256, 512)) == [(256, 128), (512, 128)]
    with pytest.raises(ValueError, match=r"K split\(s\) \[384\] not among .* allowed: \[256, 512, 1024\]"):
        tune.bi_structures("fp32", (256, 384))
    assert [tune.bi_limit(m) for m in (1, 256, 257, 16384)] == [1.5, 1.5, 2.0, 2.0]
    # K structures rank by the M over the limit first, then by the worst ratio to it: the H200's
    # DeepSeek-V3 case, where 256 tied 512 on the worst point (M=1) but also missed at 1024.
    fastest = {1: 3.55, 256: 9.52, 1024: 13.23}
    k256 = tune.bi_rank({1: 6.10, 256: 10.76, 1024: 26.62}, fastest)
    k512 = tune.bi_rank({1: 6.11, 256: 9.95, 1024: 22.48}, fastest)
    assert k256[0] == 2 and k512[0] == 1 and k256[1] < k512[1] and min(k256, k512) == k512
    assert tune.bi_rank({1: 4.0, 512: 8.0}, {1: 4.0, 512: 4.0}) == (0, 1.0)  # at the limit: no miss


def test_tuner_keeps_the_fastest_triton_buckets_beside_wgmma_ws():
    """Where the fp32 buckets name the Gluon ``wgmma_ws`` kernel, the table also keeps the fastest
    Triton configs (``fp32/triton``: what an fp32 gate weight or a GPU without Gluon runs), and the
    dispatch's fallback looks them up."""
    import importlib.util
    from dataclasses import replace

    import csrc_triton.tables as c
    from csrc_triton import choice
    from csrc_triton.launches import CublasLaunch, SplitKLaunch, TiledLaunch, to_bucket
    from csrc_triton.problem import Device, Precision, Problem
    from csrc_triton.tables import bucket_for

    spec = importlib.util.spec_from_file_location("tune", REPO / "benchmarks/tune.py")
    tune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune)
    ws = choice.wgmma_ws(128, 1792)
    split = SplitKLaunch(block_m=64, block_n=64, block_k=128, k_per_split=512, promote_chunks=2)
    tiled = TiledLaunch(block_m=128, block_n=128, block_k=64, promote_chunks=2)
    assert tune._fastest_triton([(5.0, ws), (6.0, CublasLaunch()), (7.0, split)]) == (7.0, split)
    small = {**to_bucket(split), "block_m": 16}
    previous = [{"max_m": 512, **small}, {"max_m": None, **to_bucket(tiled)}]
    entry = {"fp32": [{"max_m": 512, **small}, {"max_m": None, **to_bucket(ws)}]}
    tune._triton_buckets(entry, "fp32", previous, {1024: (9.0, split), 4096: (20.0, tiled)}, tune.M_LIST)
    triton = entry["fp32/triton"]
    assert bucket_for(triton, 1024)["block_m"] == 64 and bucket_for(triton, 16384)["kernel"] == "tiled"
    assert bucket_for(triton, 256)["block_m"] == 16  # kept from before the run
    entry = {"fp32": previous, "fp32/triton": triton}
    tune._triton_buckets(entry, "fp32", previous, {}, tune.M_LIST)
    assert "fp32/triton" not in entry  # no wgmma_ws bucket: nothing to fall back from

    table = {"shapes": {"7168x256": {"fp32": [{"max_m": None, **to_bucket(ws)}], "fp32/triton": triton}}}
    gpu = Device("GPU", 132, 90, gluon=True)
    problem = Problem(2048, 7168, 256, Precision.FP32, device=gpu)
    orig = c.load_table
    c.load_table = lambda name: table
    try:
        assert choice.selected(problem).kernel == "wgmma_ws"
        fallback = choice.selected(replace(problem, m=1024), allow_wgmma_ws=False)
        assert fallback.kernel == "splitk" and fallback.block_m == 64
        table["shapes"]["7168x256"].pop("fp32/triton")  # no Triton buckets: the heuristic's
        fallback = choice.selected(problem, allow_wgmma_ws=False)
        assert fallback.source == "heuristic" and fallback.kernel == "splitk"
        # a hand-edited fp32/triton naming wgmma_ws again: the fallback does not loop
        table["shapes"]["7168x256"]["fp32/triton"] = table["shapes"]["7168x256"]["fp32"]
        assert choice.wgmma_ws_fallback(problem).kernel == "splitk"
    finally:
        c.load_table = orig


def test_render_tables_prints_each_shape_with_cublas_and_peer_ratios_and_plots(tmp_path):
    """``render_tables.py``: our columns with (×cuBLAS) and, where the peer ran, [×peer]; "-"
    where the peer does not serve an M; the accuracy table; one plot per mode."""
    base = {"shape": "S", "K": 64, "N": 8, "floor_us": 0.1, "ours BI fp32": 7.5}
    rows = [
        {**base, "M": 4, "ours fp32": 5.0, "ours bf16-fp32out": 4.0, "cuBLAS mm out_dtype=fp32": 2.0,
         "F.linear fp32 upcast": 30.0, "peer (TRT-LLM dsv3RouterGemm)": 2.5},
        {**base, "M": 64, "ours fp32": 6.0, "ours bf16-fp32out": 5.0, "cuBLAS mm out_dtype=fp32": 5.0,
         "F.linear fp32 upcast": 40.0, "peer (TRT-LLM dsv3RouterGemm)": None},
    ]  # fmt: skip
    paths = ["ours fp32", "ours BI fp32", "ours bf16-fp32out", "cuBLAS bf16->fp32", "torch fp32 upcast"]
    accuracy = [{"shape": "S", "path": p, "rel_err": 2.5e-7, "changed_pct": 0.0} for p in paths]
    accuracy.append({"shape": "S", "path": "ours bf16", "rel_err": 1.7e-3, "changed_pct": 2.649})
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"speed": rows, "accuracy": accuracy}))
    cmd = [sys.executable, str(REPO / "benchmarks" / "render_tables.py"), str(path), "--plots", str(tmp_path)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert (
        "| 4 | 5.00 (2.50×) [2.00×] | 4.00 (2.00×) [1.60×] | 7.50 (3.75×) [3.00×] | 2.00 | 30.00 | 2.50 |"
        in lines
    )
    assert "| 64 | 6.00 (1.20×) | 5.00 (1.00×) | 7.50 (1.50×) | 5.00 | 40.00 | - |" in lines
    assert "| bf16 logits (stock vLLM) | 1.7e-03 / 2.649 % |" in lines
    for mode in ("fp32", "bf16-fp32out", "batch-invariant-fp32"):
        assert (tmp_path / f"bench-h200-{mode}.png").stat().st_size > 1000


def test_render_tables_summary_takes_each_point_from_the_newest_run(tmp_path):
    """``render_tables.py --summary old.json new.json``: one row per shape, each (shape, M) from
    the newest run holding it; the worst ratios with their M, fp32 ×cuBLAS at 1/16/1024/16384,
    the peer's range, the runs used."""

    def row(m, fp32, bf16, cublas, peer=None):
        return {"shape": "S", "K": 64, "N": 8, "M": m, "ours fp32": fp32, "ours bf16-fp32out": bf16,
                "cuBLAS mm out_dtype=fp32": cublas, "peer (TRT-LLM dsv3RouterGemm)": peer}  # fmt: skip

    old = [row(1, 2.0, 2.0, 4.0, 2.5), row(16, 3.0, 3.0, 4.0, 3.0), row(1024, 9.0, 5.0, 5.0)]
    new = [row(1024, 6.0, 5.0, 5.0), row(16384, 12.0, 11.0, 10.0)]
    for name, rows in (("old", old), ("new", new)):
        (tmp_path / f"{name}.json").write_text(json.dumps({"speed": rows}))
    cmd = [sys.executable, str(REPO / "benchmarks" / "render_tables.py"), "--summary",
           str(tmp_path / "old.json"), str(tmp_path / "new.json")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[2] == (
        "| S (64 × 8) | 1.10× (16384) | 1.20× (1024) | 0.50× | 0.75× | 1.20× | 1.20× | 0.80-1.00× "
        "| `old`, `new` |"
    )


def test_render_tables_by_triton_sets_each_run_beside_the_first(tmp_path):
    """``render_tables.py --by-triton a.json b.json``: per shape and M our fp32 under each run's
    Triton, the later ones as a ratio to the first, and each run's fastest alternative named;
    a point one run lacks is left out."""

    def run(triton, rows):
        speed = [{"shape": "S", "K": 64, "N": 8, "M": m, "ours fp32": t, "heuristic fp32": h,
                  "cuBLAS mm out_dtype=fp32": c} for m, t, h, c in rows]  # fmt: skip
        return {"environment": {"triton": triton}, "speed": speed}

    runs = {"a": run("3.6.0", [(8, 4.0, 5.0, 7.0), (16, 6.0, 7.0, 8.0)])}
    runs["b"] = run("3.8.0", [(8, 9.0, 5.5, 5.0)])
    for name, data in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    cmd = [sys.executable, str(REPO / "benchmarks" / "render_tables.py"), "--by-triton",
           str(tmp_path / "a.json"), str(tmp_path / "b.json")]  # fmt: skip
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == (
        "| shape | M | fp32, Triton 3.6.0 | fp32, Triton 3.8.0 | best other, Triton 3.6.0 "
        "| best other, Triton 3.8.0 |"
    )
    assert lines[2:] == ["| S | 8 | 4.00 | 9.00 (2.25×) | 5.00 (heuristic) | 5.00 (cuBLAS) |"]


def test_the_peer_comes_from_a_file_or_flashinfer_or_a_note_says_how(tmp_path, monkeypatch, capsys):
    from vllm_router_ext import bench
    from vllm_router_ext.bench_harness import PEER, load_peer

    monkeypatch.setitem(sys.modules, "flashinfer", None)  # not importable here
    peer, note = load_peer()
    assert peer is None and note.startswith("peer skipped: flashinfer is not importable")
    assert "pip install flashinfer-python" in note
    src = tmp_path / "peer.py"
    src.write_text(
        "MS = (1, 2)\nSHAPES = ((64, 8),)\ndef peer_mm(x, w):\n    return x.float() @ w.float().T\n"
    )
    peer, note = load_peer(str(src))
    assert note == f"peer: {src} (peer_mm)"
    assert peer.serves(2, 64, 8) and not peer.serves(4, 64, 8) and not peer.serves(1, 64, 16)
    row = {"shape": "S", "K": 64, "N": 8, "M": 2, "floor_us": 0.1, "ours fp32": 3.0,
           "cuBLAS mm out_dtype=fp32": 6.0, PEER: 2.0}  # fmt: skip
    bench.print_tables([row], ["ours fp32", "cuBLAS mm out_dtype=fp32"])
    assert "| 2 | 3.00 (0.50) [1.50] | 6.00 (1.00) | 2.00 (0.33) | 0.10 |" in capsys.readouterr().out
    # A peer file naming its kernel gets a column of that name, in the rows and the table.
    src.write_text(src.read_text() + 'NAME = "vLLM gate"\n')
    peer, _ = load_peer(str(src))
    assert peer.column == "peer (vLLM gate)"
    named = {k: v for k, v in row.items() if k != PEER} | {peer.column: 2.0}
    bench.print_tables([named], ["ours fp32", "cuBLAS mm out_dtype=fp32"])
    out = capsys.readouterr().out
    assert "| M | ours fp32 | cuBLAS mm out_dtype=fp32 | peer (vLLM gate) | floor |" in out
    assert "| 2 | 3.00 (0.50) [1.50] | 6.00 (1.00) | 2.00 (0.33) | 0.10 |" in out and PEER not in out


def test_bench_methods_take_turns_and_keep_each_ones_best_round(monkeypatch):
    """Each round times every method once (the peer too, where it serves the size), in turn; a
    method's number is its best round, so one slow turn (a clock dip) cannot make a ratio."""
    from vllm_router_ext import bench
    from vllm_router_ext.bench_harness import SHAPE_BY_NAME, Peer, make_inputs

    order = []
    times = iter([5.0, 9.0, 7.0, 4.0, 6.0, 8.0] + [3.0] * 4)

    def fake_time_graph(calls, warmup, rep):
        order.append(id(calls))
        return next(times)

    monkeypatch.setattr(bench, "time_graph", fake_time_graph)
    monkeypatch.setattr(bench, "make_inputs", lambda m, k, n, copies: make_inputs(m, k, n, 2, device="cpu"))
    shape = SHAPE_BY_NAME["DeepSeek-V2-Lite"]
    peer_fn = lambda x, w: x.float() @ w.float().T  # noqa: E731
    peer = Peer(peer_fn, ((shape.k, shape.n),), (1,), "test")
    rows = bench.run_speed([shape], [1, 2], ["ours fp32", "ours bf16"], peer=peer, rounds=2)
    # M=1: three timed methods (two ours + the peer) x two rounds = the six fake times
    assert rows[0]["ours fp32"] == 4.0 and rows[0]["ours bf16"] == 6.0 and rows[0][bench.PEER] == 7.0
    assert rows[1][bench.PEER] is None  # the peer serves M=1 only
    assert len(set(order[:3])) == 3 and order[:3] == order[3:6]  # each once a round, same turns


@pytest.mark.parametrize("module", ["vllm_router_ext.audit", "vllm_router_ext.bench"])
def test_every_option_of_the_commands_explains_itself(module):
    """Each option and argument has help text, and --help never shows a meaningless default."""
    import importlib

    parser = importlib.import_module(module).build_parser()
    for action in parser._actions:
        if action.dest != "help":
            assert action.help and len(action.help) > 10, (module, action.dest)
    text = " ".join(parser.format_help().split())  # unwrapped
    assert "default: None" not in text and "default: False" not in text
    assert text.count("(default: ") >= 4


def test_e2e_benchmark_summarises_and_renders_a_saved_run(tmp_path):
    """The end-to-end benchmark's tables, verdict and plot, from rounds it saved (the run itself
    needs CUDA vLLM): medians per mode; each mode's ratio to stock bf16 of the same round, its
    median and range over rounds; the 0.99x throughput target judged on that median."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("e2e_serve", REPO / "benchmarks/e2e_serve.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    values = {"bf16": [100.0, 90.0, 110.0], "bf16-fp32out": [99.0, 101.0, 80.0], "fp32": [120.0, 95.0, 50.0]}
    rows = [
        {"round": i, "shape": "deepseek-v3", "weights": "fp8", "mode": mode, "metric": "tok_s@8", "value": v}
        for mode, vs in values.items()
        for i, v in enumerate(vs)
    ]
    summary = {r["mode"]: r for r in e2e.summary({"rows": rows})}
    assert summary["bf16"]["median"] == 100.0 and summary["bf16"]["vs_bf16"] == 1.0
    # fp32 / bf16 per round: 1.2, 95/90, 50/110; the median of those, not of the medians (0.95)
    assert summary["fp32"]["median"] == 95.0 and summary["fp32"]["vs_bf16"] == 95 / 90
    assert (summary["fp32"]["ratio_min"], summary["fp32"]["ratio_max"]) == (50 / 110, 1.2)
    assert summary["bf16-fp32out"]["vs_bf16"] == 0.99
    text = e2e.table(list(summary.values()))
    assert "| deepseek-v3 | fp8 | fp32 | 95.0 tok/s (1.056×; 0.455-1.200) |" in text
    assert e2e.verdict(list(summary.values())) == [
        "deepseek-v3 fp8 tok_s@8: fp32 / stock 1.056 (rounds 0.455-1.200) -> met"
    ]
    rows[-1]["value"] = rows[-2]["value"] = 10.0  # fp32's second and third rounds: 0.11x, 0.09x
    assert e2e.verdict(e2e.summary({"rows": rows}))[0].endswith("-> MISSED")
    # The decode step's GPU time, where measured, decides (the host work is the same in every mode).
    step = {"bf16": [400.0, 410.0, 390.0], "bf16-fp32out": [401.0, 410.0, 391.0]}
    step["fp32"] = [402.0, 410.0, 392.0]  # per round 402/400, 1, 392/390: the median is 402/400
    gpu_rows = [
        {**r, "metric": "gpu_step_us@8", "value": step[r["mode"]][r["round"]]} for r in rows
    ]  # fmt: skip
    lines = e2e.verdict(e2e.summary({"rows": rows + gpu_rows}))
    assert lines == [
        "deepseek-v3 fp8 tok_s@8: fp32 / stock 0.111 (rounds 0.091-1.200); decode step GPU time stock / "
        f"fp32 {400 / 402:.3f} (rounds {390 / 392:.3f}-1.000) -> met by the GPU step"
    ]
    gpu_rows[-1]["value"] = gpu_rows[-2]["value"] = 420.0  # +5 % GPU time in two rounds of three
    assert e2e.verdict(e2e.summary({"rows": rows + gpu_rows}))[0].endswith("-> MISSED by the GPU step")
    # The fused router's target: a decode step faster than stock's (stock / fused GPU time >= 1).
    fused = [{**r, "mode": "fp32-fused", "value": v} for r in rows + gpu_rows if r["mode"] == "bf16"
             for v in [r["value"] * (0.99 if r["metric"].startswith("gpu") else 1.0)]]  # fmt: skip
    lines = e2e.verdict(e2e.summary({"rows": rows + gpu_rows + fused}))
    assert lines[-1].startswith("deepseek-v3 fp8 tok_s@8: fp32-fused / stock 1.000") and lines[-1].endswith(
        f"stock / fp32-fused {1 / 0.99:.3f} (rounds {1 / 0.99:.3f}-{1 / 0.99:.3f}) -> met by the GPU step"
    )
    fused = [{**r, "value": r["value"] / 0.99 / 0.995} if r["metric"].startswith("gpu") else r for r in fused]
    assert e2e.verdict(e2e.summary({"rows": rows + gpu_rows + fused}))[-1].endswith("MISSED by the GPU step")
    assert "| deepseek-v3 | fp8 | fp32-fused |" in e2e.table(e2e.summary({"rows": rows + gpu_rows + fused}))
    saved = REPO / "benchmarks/results/e2e-h200-d0d43c4.json"
    p = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks/e2e_serve.py"),
            "--render",
            str(saved),
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("| kimi-k2 | bf16 |") == 3 and "(1.000×" in p.stdout
    assert p.stdout.count("kimi-k2 bf16 tok_s@") == 3  # one verdict per concurrency
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "e2e.png").stat().st_size > 1000


@pytest.mark.parametrize("skip_wheels", ["0", "1"])
def test_the_test_command_stops_at_once_without_room_for_its_environments(tmp_path, skip_wheels):
    """A full disk would surface halfway through the suite as unrelated failures: the test command
    says so in one line before it builds anything."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text((REPO / "scripts" / "test.sh").read_text(encoding="utf-8"))
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "df").write_text(  # 2 GiB free on /fake
        "#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
        "echo '/dev/fake 100000000 97902848 2097152 98% /fake'\n"
    )
    (fake / "df").chmod(0o755)
    env = {"PATH": f"{fake}:/usr/bin:/bin", "ROUTER_EXT_SKIP_WHEELS": skip_wheels, "HOME": str(tmp_path)}
    p = subprocess.run(
        ["bash", "scripts/test.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    need = 9 if skip_wheels == "1" else 29  # no environment exists here yet
    assert p.returncode == 1 and p.stderr == ""
    assert p.stdout.splitlines() == [
        f"[test] 2 GiB free on /fake, the missing environments and the tests need about {need} GiB: free "
        "some, or skip the vLLM wheel environments with ROUTER_EXT_SKIP_WHEELS=1"
    ]
    assert sorted(q.name for q in tmp_path.iterdir()) == ["bin", "scripts"]  # nothing was built
