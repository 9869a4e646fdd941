"""The routing audit command, on checkpoints the tests build (CPU)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from near_tie import build_near_tie_checkpoint

from vllm_router_ext.audit import AuditError, Checkpoint, open_checkpoint, run_audit
from vllm_router_ext.plotting import PLOT_MISSING

LABELS = ["fp32", "bf16-fp32out", "bf16", "fp32 batch-invariant", "bf16-fp32out batch-invariant"]


def test_cli_on_the_tiny_checkpoint(tiny_model, tmp_path):
    """The command as the docs show it: tables on stdout, audit.json and audit.png written."""
    out = tmp_path / "audit"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_router_ext.audit",
            str(tiny_model),
            "--tokens",
            "512",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "overall (mean over 1 MoE layer):" in p.stdout
    assert "auditing router layers" in p.stderr  # the progress bar
    assert (out / "audit.md").read_text(encoding="utf-8").strip() in p.stdout
    result = json.loads((out / "audit.json").read_text(encoding="utf-8"))
    assert list(result["layers"]) == ["1"] and list(result["overall"]) == LABELS
    assert result["tokens"] == 512
    o = result["overall"]
    for label in ("fp32", "bf16-fp32out", "fp32 batch-invariant", "bf16-fp32out batch-invariant"):
        assert o[label]["rel_err"] <= 1e-6
    assert 1e-4 <= o["bf16"]["rel_err"] <= 1e-2
    if importlib.util.find_spec("matplotlib"):
        assert (out / "audit.png").stat().st_size > 1000
    else:  # an environment without the plot extra
        assert PLOT_MISSING in p.stdout


def test_without_matplotlib_the_tables_and_json_still_come(tiny_model, tmp_path):
    """A plain install (no ``plot`` extra): matplotlib cannot be imported, the audit still prints
    every table and writes its JSON, and one line says how to get the plot."""
    hidden = tmp_path / "hide" / "matplotlib"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'matplotlib'\")\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(hidden.parent), os.environ.get("PYTHONPATH")])),
    }
    out = tmp_path / "audit"
    cmd = [
        sys.executable,
        "-m",
        "vllm_router_ext.audit",
        str(tiny_model),
        "--tokens",
        "64",
        "--out",
        str(out),
    ]
    p = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    assert "\n| bf16-fp32out batch-invariant |" in p.stdout
    assert json.loads((out / "audit.json").read_text(encoding="utf-8"))["tokens"] == 64
    assert not (out / "audit.png").exists()
    assert p.stdout.rstrip().endswith(PLOT_MISSING)


def test_the_benchmark_plot_is_skipped_without_matplotlib(monkeypatch, tmp_path):
    import vllm_router_ext.bench as bench

    monkeypatch.setattr(bench, "pyplot", lambda: None)
    row = {"shape": "DeepSeek-V3", "K": 7168, "N": 256, "M": 1, "cublas": 7.0, "floor_us": 1.0}
    assert bench.plot([row], ["cublas"], tmp_path / "bench.png") is False
    assert not (tmp_path / "bench.png").exists()


def test_console_script_runs_on_the_tiny_checkpoint(tiny_model, tmp_path):
    exe = Path(sys.executable).parent / "vllm-router-audit"
    p = subprocess.run(
        [str(exe), str(tiny_model), "--tokens", "64", "--out", str(tmp_path), "--no-progress"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "\n| bf16 |" in p.stdout and (tmp_path / "audit.json").exists()


def test_near_tied_gate_flips_exactly_the_known_tokens_in_bf16_only(tmp_path):
    model, states, expected = build_near_tie_checkpoint(tmp_path)
    result = run_audit(model, hidden_states=states, progress=False)
    layer = result["layers"]["1"]
    assert layer["bf16"]["changed_tokens"] == expected
    for label in ("fp32", "bf16-fp32out", "fp32 batch-invariant", "bf16-fp32out batch-invariant"):
        assert layer[label]["changed_tokens"] == 0, label
        assert layer[label]["dw_mean"] < 1e-6
    assert layer["bf16"]["dw_p99"] > 0.01  # a flipped expert moves its whole routed weight


def test_reads_only_gate_tensors(tiny_model, monkeypatch):
    read = []
    original = Checkpoint.tensor

    def spy(self, name):
        read.append(name)
        return original(self, name)

    monkeypatch.setattr(Checkpoint, "tensor", spy)
    run_audit(tiny_model, tokens=64, progress=False, batch_invariant=False)
    assert read and all(n.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")) for n in read)


def test_the_audit_routes_every_deepseek_v41_layer(tmp_path):
    """DeepSeek-V4.1's config nests the text model (``text_config``, the model type only at the top)
    and vLLM builds every one of its MoE layers with a gate: no layer is reported table-routed even
    where the config carries V4's ``num_hash_layers``; the routing is V4's."""
    from safetensors.torch import save_file

    from vllm_router_ext.tools.tiny_checkpoint import TINY_V4

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n, k = TINY_V4["n_routed_experts"], TINY_V4["hidden_size"]
    text = {key: v for key, v in TINY_V4.items() if key not in ("model_type", "architectures")}
    cfg = {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"],
           "text_config": {**text, "num_hidden_layers": 3, "num_hash_layers": 2}}  # fmt: skip
    tensors = {}
    for layer in range(3):
        tensors[f"layers.{layer}.ffn.gate.weight"] = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        tensors[f"layers.{layer}.ffn.gate.bias"] = torch.randn(n, generator=g) * 0.1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = run_audit(tmp_path, tokens=512, progress=False)
    assert not result.get("table_routed_layers") and list(result["layers"]) == ["0", "1", "2"]
    r = result["routing"]
    assert (r["scoring_func"], r["topk_method"], r["top_k"], r["hash_layers"]) == (
        "sqrtsoftplus",
        "noaux_tc",
        6,
        0,
    )
    o = result["overall"]
    assert o["fp32"]["rel_err"] <= 1e-6 and o["fp32"]["changed_pct"] == 0.0
    assert o["bf16"]["changed_pct"] > 0.0


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_clear_errors(tiny_model, tmp_path):
    not_ds = _copy_checkpoint(tiny_model, tmp_path / "llama")
    cfg = json.loads((not_ds / "config.json").read_text(encoding="utf-8"))
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (not_ds / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        AuditError,
        match="does not know the routing of model_type 'llama'.*LlamaForCausalLM.*supported: deepseek",
    ):
        run_audit(not_ds, progress=False)

    with pytest.raises(AuditError, match="no config.json"):
        run_audit(tmp_path / "nowhere", progress=False)

    missing = _copy_checkpoint(tiny_model, tmp_path / "missing")
    index = json.loads((missing / "model.safetensors.index.json").read_text(encoding="utf-8"))
    del index["weight_map"]["model.layers.1.mlp.gate.e_score_correction_bias"]
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(
        AuditError,
        match="no e_score_correction_bias .looked for model.layers.1.mlp.gate.e_score_correction_bias",
    ):
        run_audit(missing, progress=False)

    wrong = _copy_checkpoint(tiny_model, tmp_path / "wrong")
    cfg = json.loads((wrong / "config.json").read_text(encoding="utf-8"))
    cfg["n_routed_experts"] = 32
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(AuditError, match=r"router weight has shape \(16, 256\), config says \[32, 256\]"):
        run_audit(wrong, progress=False)

    bad_states = tmp_path / "states.pt"
    torch.save(torch.zeros(8, 100), bad_states)
    with pytest.raises(AuditError, match=r"hidden states must be \[T, 256\].*\(8, 100\)"):
        run_audit(tiny_model, hidden_states=bad_states, progress=False)

    with pytest.raises(AuditError, match="unknown mode.*allowed: fp32, bf16-fp32out, bf16"):
        run_audit(tiny_model, modes=("fp16",), progress=False)


def test_cli_error_exit_code_and_message(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "vllm_router_ext.audit", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "vllm-router-audit: error:" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--tokens", "-1"], "argument --tokens: '-1': allowed: a positive integer"),
        (["--tokens", "0"], "argument --tokens: '0': allowed: a positive integer"),
        (["--modes", ","], "--modes ',' names no mode; allowed: fp32, bf16-fp32out, bf16"),
        (["--out", "/proc/no-such-dir/out"], "--out '/proc/no-such-dir/out' is not a writable directory"),
    ],
)
def test_bad_arguments_exit_2_in_one_line_before_any_computation(tiny_model, tmp_path, args, message):
    import time

    start = time.monotonic()
    cmd = [sys.executable, "-m", "vllm_router_ext.audit", str(tiny_model), "--no-progress", *args]
    if "--out" not in args:
        cmd += ["--out", str(tmp_path / "out")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert message in p.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out" / "audit.json").exists()
    assert time.monotonic() - start < 60


def _result(layers: list[int], pct: float) -> dict:
    row = {"rel_err": 1e-3, "changed_pct": pct, "changed_tokens": 1, "dw_mean": 0.0, "dw_p99": 0.0}
    per_layer = {str(i): {"fp32": {**row, "changed_pct": 0.0}, "bf16": row} for i in layers}
    return {
        "model": "/m/tiny",
        "tokens": 64,
        "device": "cpu",
        "layers": per_layer,
        "overall": {"fp32": {**row, "changed_pct": 0.0}, "bf16": row},
    }


def test_tables_are_headed_by_what_each_column_holds():
    from vllm_router_ext.audit import format_tables

    text = format_tables(_result([3, 4], 0.5))
    per_layer, overall = text.split("overall (mean over 2 MoE layers):")
    assert "| MoE layer | mode | rel err vs fp64 | changed expert sets |" in per_layer
    assert "| 3 | bf16 | 1.00e-03 | 0.500 % |" in per_layer
    header = overall.strip().splitlines()[0]
    assert header.startswith("| mode | rel err vs fp64 |") and "all" not in text.replace("overall", "")
    assert "| bf16 | 1.00e-03 | 0.500 % |" in overall


@pytest.mark.skipif(not importlib.util.find_spec("matplotlib"), reason="needs the plot extra (matplotlib)")
@pytest.mark.parametrize(("layers", "pct"), [([1], 0.0), (list(range(3, 64)), 2.5)])
def test_the_plot_has_integer_layer_ticks_and_a_y_axis_from_zero(tmp_path, layers, pct):
    """One MoE layer with nothing changed, and DeepSeek-V3's 61 layers: ticks are whole layer
    numbers within the layers' range, the y axis starts at 0 % and shows the largest value."""
    from vllm_router_ext.audit import figure, plot
    from vllm_router_ext.plotting import pyplot

    assert plot(_result(layers, pct), tmp_path / "audit.png")
    assert (tmp_path / "audit.png").stat().st_size > 1000
    plt = pyplot()
    fig = figure(_result(layers, pct), plt)
    ax = fig.axes[0]
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)
    assert min(layers) - 1 < min(ticks) and max(ticks) < max(layers) + 1
    assert ax.get_xlim() == (min(layers) - 0.5, max(layers) + 0.5)
    low, high = ax.get_ylim()
    assert low == 0 and high >= max(pct, 0.5)
    assert [t.get_text() for t in ax.get_yticklabels()][0].startswith("0")
    if len(layers) == 1:
        assert list(ticks) == [1]
    else:
        assert 5 <= len(ticks) <= 21
    plt.close(fig)


#: What vLLM's router does for each family preset: (scoring, choice, renormalised).
FAMILY_ROUTING = {
    "qwen3-moe": ("softmax", "greedy", True),
    "qwen3-next": ("softmax", "greedy", True),
    "mixtral": ("softmax", "greedy", True),
    "gpt-oss": ("softmax", "greedy", True),
    "llama4": ("sigmoid", "greedy", False),
    "glm4-moe": ("sigmoid", "noaux_tc", True),
    "minimax-m2": ("sigmoid", "noaux_tc", True),
    "ernie4.5-moe": ("softmax", "noaux_tc", True),
}


@pytest.mark.parametrize("family", FAMILY_ROUTING)
def test_audit_reads_each_familys_routers_and_routing(tmp_path, family):
    """Each family's router tensors (``mlp.gate``, ``block_sparse_moe.gate``, gpt-oss's
    ``mlp.router`` with its bias, Llama-4's ``feed_forward.router``) are found in every MoE layer,
    routed as vLLM routes that family, and audited: fp32 logits at fp32's error, bf16's above."""
    from safetensors.torch import load_file

    from vllm_router_ext.tools.tiny_checkpoint import FAMILY_PRESETS, build_tiny_family

    path = build_tiny_family(tmp_path / family, family)
    preset = FAMILY_PRESETS[family]
    experts = next(
        preset[k]
        for k in ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
        if k in preset
    )
    tensors = {k: v for f in path.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    routers = sorted(
        int(name.split(".")[2])
        for name, t in tensors.items()
        if name.endswith((".gate.weight", ".router.weight")) and tuple(t.shape) == (experts, 256)
    )
    result = run_audit(path, tokens=256, progress=False)
    assert [int(i) for i in result["layers"]] == routers and routers
    r = result["routing"]
    assert (r["scoring_func"], r["topk_method"], r["renormalize"]) == FAMILY_ROUTING[family]
    assert r["top_k"] == preset.get("num_experts_per_tok", preset.get("moe_k"))
    o = result["overall"]
    # ERNIE-4.5 keeps its router weight in fp32: only the fp32 mode reads it unrounded.
    weights = [tensors[f"{name}.weight"] for name in open_checkpoint(path).gates.values()]
    exact = all(torch.equal(w, w.bfloat16().to(w.dtype)) for w in weights)
    assert exact == (family != "ernie4.5-moe")
    for label in ("fp32", "fp32 batch-invariant"):
        assert o[label]["rel_err"] <= 1e-6 and o[label]["changed_pct"] == 0.0, label
    for label in ("bf16-fp32out", "bf16-fp32out batch-invariant"):
        if exact:
            assert o[label]["rel_err"] <= 1e-6 and o[label]["changed_pct"] == 0.0, label
        else:
            assert 1e-4 <= o[label]["rel_err"] <= 1e-2, label
    assert 1e-4 <= o["bf16"]["rel_err"] <= 1e-2


def test_each_routing_picks_what_the_familys_own_formula_picks():
    """``select_experts`` under each family's config against the family's formula written out:
    softmax then top-k (Qwen, renormalised or not), a softmax over the top-k logits (Mixtral,
    gpt-oss), the sigmoid of the top-k logits (Llama-4), sigmoid + correction bias choosing and
    the plain sigmoid weighting (GLM-4.5, MiniMax-M2), softmax scores + bias choosing (ERNIE-4.5)."""
    from vllm_router_ext.ops.routing_fp64 import RoutingConfig, select_experts

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    logits = torch.randn(64, 32, generator=g, dtype=torch.float64)
    bias = torch.randn(32, generator=g, dtype=torch.float64) * 0.3

    def check(cfg: dict, ids, weights, bias_=None):
        got_ids, got_w = select_experts(logits, RoutingConfig.from_hf_config(cfg), bias_)
        order = ids.argsort(-1)
        assert torch.equal(got_ids, ids.gather(1, order))
        torch.testing.assert_close(got_w, weights.gather(1, order), rtol=1e-12, atol=1e-12)

    probs = logits.softmax(-1)
    top = probs.topk(4, -1)
    check(
        {"model_type": "qwen2_moe", "num_experts_per_tok": 4, "norm_topk_prob": False},
        top.indices,
        top.values,
    )
    norm = top.values / top.values.sum(-1, keepdim=True)
    check({"model_type": "qwen3_moe", "num_experts_per_tok": 4, "norm_topk_prob": True}, top.indices, norm)
    top_logits = logits.topk(2, -1)
    for model_type in ("mixtral", "gpt_oss"):
        check(
            {"model_type": model_type, "num_experts_per_tok": 2},
            top_logits.indices,
            top_logits.values.softmax(-1),
        )
    top1 = logits.topk(1, -1)
    check({"model_type": "llama4_text", "num_experts_per_tok": 1}, top1.indices, top1.values.sigmoid())
    chosen = (logits.sigmoid() + bias).topk(4, -1).indices
    w = logits.sigmoid().gather(1, chosen)
    for model_type, scale in (("glm4_moe", 2.5), ("minimax_m2", 1.0)):
        cfg = {"model_type": model_type, "num_experts_per_tok": 4, "routed_scaling_factor": scale}
        check(cfg, chosen, w / w.sum(-1, keepdim=True) * scale, bias)
    chosen = (probs + bias).topk(4, -1).indices  # ERNIE-4.5: softmax scores + bias choose
    w = probs.gather(1, chosen)
    check({"model_type": "ernie4_5_moe", "moe_k": 4}, chosen, w / w.sum(-1, keepdim=True), bias)
    top = logits.sigmoid().topk(6, -1)  # Flint: its score function, top-k, renormalised or not
    flint = {"model_type": "flint", "num_experts_per_tok": 6}
    check(flint, top.indices, top.values / top.values.sum(-1, keepdim=True))
    check({**flint, "norm_topk_prob": False}, top.indices, top.values)
    top = probs.topk(6, -1)
    check(
        {**flint, "router_score_function": "softmax"},
        top.indices,
        top.values / top.values.sum(-1, keepdim=True),
    )


#: Each ``scored_topk`` family: its config, the key naming its score function and the score vLLM
#: uses without that key.
SCORED_CHECKPOINTS = {
    "flint": ({"model_type": "flint", "architectures": ["FlintForCausalLM"], "hidden_size": 256,
               "num_experts": 32, "num_experts_per_tok": 6}, "router_score_function", "sigmoid"),
    "cohere2-moe": ({"model_type": "cohere2_moe", "architectures": ["Cohere2MoeForCausalLM"],
                     "hidden_size": 256, "num_experts": 32, "num_experts_per_tok": 6},
                    "expert_selection_fn", "softmax"),
}  # fmt: skip


@pytest.mark.parametrize("family", SCORED_CHECKPOINTS)
def test_the_audit_routes_each_scored_family_from_its_checkpoint(tmp_path, family):
    """The ``mlp.gate`` in every MoE layer, routed by the config's score function (sigmoid or
    softmax; the family's default without the key) and ``norm_topk_prob``, no bias: fp32 at
    fp64's choice on every token, bf16 not."""
    from safetensors.torch import save_file

    from vllm_router_ext.families import family_of

    config, score_key, default = SCORED_CHECKPOINTS[family]
    assert family_of(config["architectures"][0]).routing == "scored_topk"
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tensors = {
        f"model.layers.{i}.mlp.gate.weight": (torch.randn(32, 256, generator=g) / 16).bfloat16()
        for i in (0, 1)
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for score in ("softmax", "sigmoid", None):
        cfg = config if score is None else {**config, score_key: score}
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        result = run_audit(tmp_path, tokens=256, progress=False)
        assert [int(i) for i in result["layers"]] == [0, 1]
        r = result["routing"]
        expected = (6, score or default, "greedy", True)
        assert (r["top_k"], r["scoring_func"], r["topk_method"], r["renormalize"]) == expected
        o = result["overall"]
        assert o["fp32"]["rel_err"] <= 1e-6 and o["fp32"]["changed_pct"] == 0.0
        assert 1e-4 <= o["bf16"]["rel_err"] <= 1e-2


def test_each_new_familys_config_keys_route_as_vllm_reads_them():
    """The families of vLLM's model packages route by DeepSeek-V3's noaux_tc under their own
    config keys (vLLM 0.34's ``vllm/models/<name>/``): Kimi-K3's ``moe_renormalize`` and
    ``num_expert_group`` (groups only with ``use_grouped_topk``), Step-5's ``moe_top_k``,
    ``norm_expert_weight`` and ``moe_router_scaling_factor``, GLM-5-Next's bias only under
    ``topk_method == "noaux_tc"``, Hunyuan-V4 on one group whatever ``n_group`` says, MiniMax-M3
    always renormalised."""
    from vllm_router_ext.ops.routing_fp64 import RoutingConfig, select_experts

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    logits = torch.randn(64, 32, generator=g, dtype=torch.float64)
    bias = torch.randn(32, generator=g, dtype=torch.float64) * 0.3
    sig = logits.sigmoid()

    def expect(cfg: dict, ids, weights, bias_=bias, **fields):
        routing = RoutingConfig.from_hf_config(cfg)
        assert {k: getattr(routing, k) for k in fields} == fields, cfg
        got_ids, got_w = select_experts(logits, routing, bias_)
        order = ids.argsort(-1)
        assert torch.equal(got_ids, ids.gather(1, order)), cfg
        torch.testing.assert_close(got_w, weights.gather(1, order), rtol=1e-12, atol=1e-12)

    def grouped_choice(scores, n_group, topk_group, k):
        groups = scores.view(64, n_group, -1)
        keep = groups.topk(2, -1).values.sum(-1).topk(topk_group, -1).indices
        mask = torch.zeros(64, n_group, dtype=torch.bool).scatter_(1, keep, True)
        kept = scores.masked_fill(~mask.repeat_interleave(32 // n_group, 1), float("-inf"))
        return kept.topk(k, -1).indices

    kimi = {"model_type": "kimi_linear", "num_experts": 32, "num_experts_per_token": 4,
            "moe_renormalize": False, "num_expert_group": 4, "topk_group": 2,
            "routed_scaling_factor": 2.0}  # fmt: skip
    chosen = grouped_choice(sig + bias, 4, 2, 4)
    expect(kimi, chosen, sig.gather(1, chosen) * 2.0, n_group=4, topk_group=2, renormalize=False)
    chosen = (sig + bias).topk(4, -1).indices
    expect({**kimi, "use_grouped_topk": False}, chosen, sig.gather(1, chosen) * 2.0, n_group=1)
    step5 = {"model_type": "step5", "moe_num_experts": 32, "moe_top_k": 4, "norm_expert_weight": True,
             "moe_router_scaling_factor": 3.0, "n_group": 4, "use_moe_router_bias": True}  # fmt: skip
    w = sig.gather(1, chosen)
    expect(step5, chosen, w / w.sum(-1, keepdim=True) * 3.0, top_k=4, n_group=1, topk_method="noaux_tc")
    for model_type in ("hy_v4", "minimax_m3_vl_text"):  # one group; MiniMax-M3 renormalises always
        cfg = {"model_type": model_type, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 1,
               "norm_topk_prob": model_type == "hy_v4" or False, "routed_scaling_factor": 1.5}  # fmt: skip
        expect(cfg, chosen, w / w.sum(-1, keepdim=True) * 1.5, n_group=1, renormalize=True)
    glm = {"model_type": "glm5_next_text", "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
           "scoring_func": "sigmoid", "routed_scaling_factor": 2.5}  # fmt: skip
    chosen = grouped_choice(sig + bias, 4, 2, 4)
    w = sig.gather(1, chosen)
    expect(glm, chosen, w / w.sum(-1, keepdim=True) * 2.5, topk_method="noaux_tc")
    best = sig.view(64, 4, 8).max(-1).values.topk(2, -1).indices  # no bias: groups by their best score
    mask = torch.zeros(64, 4, dtype=torch.bool).scatter_(1, best, True).repeat_interleave(8, 1)
    chosen = sig.masked_fill(~mask, float("-inf")).topk(4, -1).indices
    w = sig.gather(1, chosen)
    expect({**glm, "topk_method": "greedy"}, chosen, w / w.sum(-1, keepdim=True) * 2.5, None,
           topk_method="group_limited_greedy", uses_correction_bias=False)  # fmt: skip


#: A router-only checkpoint of each new family, under the names vLLM's loader reads (its
#: ``load_weights``): the MoE block, the router, where the correction bias sits.
NEW_FAMILY_CHECKPOINTS = {
    "sarvam-mla": ({"model_type": "sarvam_mla", "architectures": ["SarvamMLAForCausalLM"], "hidden_size": 256,
                    "num_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2},
                   "model.layers.{}.mlp", "gate", "gate.e_score_correction_bias"),
    "afmoe": ({"model_type": "afmoe", "architectures": ["AfmoeForCausalLM"], "hidden_size": 256,
               "num_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
               "score_func": "sigmoid", "route_norm": True, "route_scale": 2.0},
              "model.layers.{}.mlp", "router.gate", "expert_bias"),
    "kimi-k3": ({"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
                 "text_config": {"model_type": "kimi_linear", "hidden_size": 256, "num_experts": 32,
                                 "num_experts_per_token": 4, "num_expert_group": 4, "topk_group": 2}},
                "language_model.layers.{}.block_sparse_moe", "gate", "gate.e_score_correction_bias"),
    "step5": ({"model_type": "step5", "architectures": ["Step5ForCausalLM"], "hidden_size": 256,
               "moe_num_experts": 32, "moe_top_k": 4, "use_moe_router_bias": True},
              "model.layers.{}.moe", "gate", "router_bias"),
    "hy-v4": ({"model_type": "hy_v4", "architectures": ["HYV4ForCausalLM"], "hidden_size": 256,
               "n_routed_experts": 32, "num_experts_per_tok": 4},
              "model.layers.{}.mlp", "router.gate", "gate.e_score_correction_bias"),
    "minimax-m3": ({"model_type": "minimax_m3_vl",
                    "architectures": ["MiniMaxM3SparseForConditionalGeneration"],
                    "text_config": {"model_type": "minimax_m3_vl_text", "hidden_size": 256,
                                    "num_local_experts": 32, "num_experts_per_tok": 4}},
                   "language_model.model.layers.{}.block_sparse_moe", "gate", "e_score_correction_bias"),
    "glm5-next": ({"model_type": "glm5_next", "architectures": ["Glm5NextForCausalLM"], "hidden_size": 256,
                   "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2},
                  "model.layers.{}.mlp", "gate", "gate.e_score_correction_bias"),
    "muse-spark": ({"model_type": "muse_spark", "architectures": ["MuseSparkForConditionalGeneration"],
                    "text_config": {"model_type": "muse_spark_text", "hidden_size": 256,
                                    "num_local_experts": 32, "num_experts_per_tok": 4,
                                    "output_multiplier": 0.1767766952966369}},
                   "model.language_model.layers.{}.mlp", "gate", "gate.e_score_correction_bias"),
    "hy-v3": ({"model_type": "hy_v3", "architectures": ["HYV3ForCausalLM"], "hidden_size": 256,
               "num_experts": 32, "num_experts_per_tok": 4, "route_norm": True, "router_scaling_factor": 2.0},
              "model.layers.{}.mlp", "gate", "expert_bias"),
    "exaone-moe": ({"model_type": "exaone_moe", "architectures": ["ExaoneMoEForCausalLM"], "hidden_size": 256,
                    "num_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5},
                   "model.layers.{}.mlp", "gate", "e_score_correction_bias"),
    "mimo-v2": ({"model_type": "mimo_v2_flash", "architectures": ["MiMoV2FlashForCausalLM"],
                 "hidden_size": 256, "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4,
                 "topk_group": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5},
                "model.layers.{}.mlp", "gate", "gate.e_score_correction_bias"),
    "step-3.5": ({"model_type": "step3p5", "architectures": ["Step3p5ForCausalLM"], "hidden_size": 256,
                  "moe_num_experts": 32, "moe_top_k": 4, "use_moe_router_bias": True},
                 "model.layers.{}.moe", "gate", "router_bias"),
    "nemotron-h": ({"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "hidden_size": 256,
                    "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1,
                    "norm_topk_prob": True, "routed_scaling_factor": 2.5},
                   "backbone.layers.{}.mixer", "gate", "gate.e_score_correction_bias"),
    "beam": ({"model_type": "beam", "architectures": ["BeamForCausalLM"], "hidden_size": 256,
              "n_routed_experts": 32, "num_experts_per_tok": 4},
             "model.layers.{}.mlp", "gate", "gate.e_score_correction_bias"),
    "lfm2-moe": ({"model_type": "lfm2_moe", "architectures": ["Lfm2MoeForCausalLM"], "hidden_size": 256,
                  "num_experts": 32, "num_experts_per_tok": 4, "use_expert_bias": True,
                  "norm_topk_prob": True, "routed_scaling_factor": 2.0},
                 "model.layers.{}.feed_forward", "gate", "expert_bias"),
    "axk1": ({"model_type": "axk1", "architectures": ["AXK1ForCausalLM"], "hidden_size": 256,
              "n_routed_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
              "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 2.5},
             "model.layers.{}.mlp", "gate", "gate.e_score_correction_bias"),
    "laguna": ({"model_type": "laguna", "architectures": ["LagunaForCausalLM"], "hidden_size": 256,
                "num_experts": 32, "num_experts_per_tok": 4, "moe_routed_scaling_factor": 2.5},
               "model.layers.{}.mlp", "gate", "experts.e_score_correction_bias"),
    # only the counts: each routing key left out takes vLLM's config class default (DeepSeek-V3's
    # noaux_tc, sigmoid, renormalised, x2.5; one group)
    "dots.3-note": ({"model_type": "dots3_note", "architectures": ["Dots3NoteForCausalLM"],
                     "hidden_size": 256, "n_routed_experts": 32, "num_experts_per_tok": 4},
                    "model.layers.{}.mlp", "gate", "gate.e_score_correction_bias"),
}  # fmt: skip


@pytest.mark.parametrize("family", NEW_FAMILY_CHECKPOINTS)
def test_the_audit_routes_each_new_family_from_its_checkpoint(tmp_path, family):
    """The audit finds each new family's router in every MoE layer and its correction bias where
    vLLM loads it from, routes by the family's keys, and fp32 matches fp64's choice on every
    token while bf16 logits do not stay at fp32's error."""
    from safetensors.torch import save_file

    from vllm_router_ext.families import family_of

    config, block, router, bias_name = NEW_FAMILY_CHECKPOINTS[family]
    assert family_of(config["architectures"][0]).routing == "sigmoid_bias"
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tensors = {}
    for layer in (1, 2):  # layer 0 dense, as the releases' first layers are
        weight = torch.randn(32, 256, generator=g) / 16
        tensors[f"{block.format(layer)}.{router}.weight"] = weight.bfloat16()
        tensors[f"{block.format(layer)}.{bias_name}"] = torch.randn(32, generator=g) * 0.5
    tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(8, 256, dtype=torch.bfloat16)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run_audit(tmp_path, tokens=256, progress=False)
    assert [int(i) for i in result["layers"]] == [1, 2]
    r = result["routing"]
    assert (r["top_k"], r["topk_method"], r["scoring_func"]) == (4, "noaux_tc", "sigmoid")
    grouped = ("kimi-k3", "glm5-next", "exaone-moe", "mimo-v2", "axk1", "afmoe", "sarvam-mla")
    assert r["n_group"] == (4 if family in grouped else 1)
    # the weights' scale as vLLM applies it in the router (MiMo-V2: none; Laguna: to the layer's
    # output, not the weights; Hunyuan-V3: its router_scaling_factor)
    scale = {
        "hy-v3": 2.0,
        "exaone-moe": 2.5,
        "mimo-v2": 1.0,
        "lfm2-moe": 2.0,
        "laguna": 1.0,
        "axk1": 2.5,
        "afmoe": 2.0,
        "sarvam-mla": 2.5,
        "dots.3-note": 2.5,
    }  # Sarvam, dots.3-note: vLLM's default scale without the key
    if family in scale:
        assert r["routed_scaling_factor"] == scale[family] and r["renormalize"]
    o = result["overall"]
    assert o["fp32"]["rel_err"] <= 1e-6 and o["fp32"]["changed_pct"] == 0.0
    assert 1e-4 <= o["bf16"]["rel_err"] <= 1e-2
    if family == "muse-spark":  # the logits' scale is folded into the fp32 weight, as vLLM loads it
        from vllm_router_ext.audit import load_gate, open_checkpoint
        from vllm_router_ext.ops.routing_fp64 import RoutingConfig

        ckpt = open_checkpoint(tmp_path)
        gate = load_gate(ckpt, 1, RoutingConfig.from_hf_config(config))
        folded = tensors[f"{block.format(1)}.{router}.weight"].float() * 0.1767766952966369
        assert gate.weight.dtype == torch.float32 and torch.equal(gate.weight, folded)
    del tensors[f"{block.format(2)}.{bias_name}"]  # a missing bias is named, not skipped
    save_file(tensors, str(tmp_path / "model.safetensors"))
    missing = rf"layer 2: no e_score_correction_bias .*{bias_name.split('.')[-1]}"
    with pytest.raises(AuditError, match=missing):
        run_audit(tmp_path, tokens=16, progress=False)


#: A router-only checkpoint of each softmax family (names as vLLM's loader reads them) and whether
#: vLLM renormalises its top-k weights.
SOFTMAX_CHECKPOINTS = {
    "mistral-large-4": ({"model_type": "mistral4", "architectures": ["MistralLarge4ForCausalLM"],
                         "hidden_size": 256, "n_routed_experts": 32, "num_experts_per_tok": 4,
                         "norm_topk_prob": True, "scoring_func": "softmax", "routed_scaling_factor": 1.0},
                        "model.layers.{}.mlp.gate", True),
    "jamba": ({"model_type": "jamba", "architectures": ["JambaForCausalLM"], "hidden_size": 256,
               "num_experts": 32, "num_experts_per_tok": 2},
              "model.layers.{}.feed_forward.router", False),
    "minicpm": ({"model_type": "minicpm", "architectures": ["MiniCPMForCausalLM"], "hidden_size": 256,
                 "num_experts": 32, "num_experts_per_tok": 2},
                "model.layers.{}.mlp.gate", True),
    "qwen3.5-moe": ({"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                     "text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 256, "num_experts": 32,
                                     "num_experts_per_tok": 8, "norm_topk_prob": True}},
                    "model.language_model.layers.{}.mlp.gate", True),
    "granitemoe": ({"model_type": "granitemoe", "architectures": ["GraniteMoeForCausalLM"],
                    "hidden_size": 256, "num_local_experts": 32, "num_experts_per_tok": 4},
                   "model.layers.{}.block_sparse_moe.router.layer", True),
    "step-3": ({"model_type": "step3_text", "architectures": ["Step3TextForCausalLM"], "hidden_size": 256,
                "moe_num_experts": 32, "moe_top_k": 3, "norm_expert_weight": True},
               "model.layers.{}.moe.gate", True),
    "qwen4-exp": ({"model_type": "qwen4_exp", "architectures": ["Qwen4ExpForCausalLM"], "hidden_size": 256,
                   "num_experts": 32, "num_experts_per_tok": 8, "norm_topk_prob": True},
                  "model.layers.{}.mlp.gate", True),
}  # fmt: skip


@pytest.mark.parametrize("family", SOFTMAX_CHECKPOINTS)
def test_the_audit_routes_each_softmax_family_from_its_checkpoint(tmp_path, family):
    """Softmax top-k families: the routers found in every MoE layer, routed as vLLM routes them
    (renormalised or not), fp32 at fp64's choice on every token, bf16 logits not at fp32's error."""
    from safetensors.torch import save_file

    from vllm_router_ext.families import family_of

    config, router, renormalize = SOFTMAX_CHECKPOINTS[family]
    assert family_of(config["architectures"][0]).routing.startswith("softmax_topk")
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    tensors = {f"{router.format(layer)}.weight": (torch.randn(32, 256, generator=g) / 16).bfloat16()
               for layer in (1, 3)}  # fmt: skip
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    result = run_audit(tmp_path, tokens=256, progress=False)
    assert [int(i) for i in result["layers"]] == [1, 3]
    r = result["routing"]
    text = config.get("text_config", config)
    assert (r["scoring_func"], r["topk_method"], r["n_group"]) == ("softmax", "greedy", 1)
    top_k = text.get("num_experts_per_tok", text.get("moe_top_k"))
    assert (r["top_k"], r["renormalize"]) == (top_k, renormalize)
    if family == "step-3":  # its own renormalisation key, read both ways
        from vllm_router_ext.ops.routing_fp64 import RoutingConfig

        assert not RoutingConfig.from_hf_config({**config, "norm_expert_weight": False}).renormalize
    o = result["overall"]
    assert o["fp32"]["rel_err"] <= 1e-6 and o["fp32"]["changed_pct"] == 0.0
    assert 1e-4 <= o["bf16"]["rel_err"] <= 1e-2


def test_the_audit_routes_deepseek_v4_and_reports_its_hash_layers(tmp_path):
    """A DeepSeek-V4 checkpoint in the release's names (``layers.N.ffn.gate.weight``, the correction
    bias as ``...gate.bias``, the hash table as ``...gate.tid2eid``): the hash layers are reported as
    table-routed, the others routed as vLLM routes V4 (sqrtsoftplus scores + bias choose, top-6
    renormalised x1.5) with the bias read as the correction bias, not added to the logits."""
    from safetensors.torch import save_file

    from vllm_router_ext.audit import format_tables, load_gate
    from vllm_router_ext.ops.routing_fp64 import RoutingConfig, expert_scores
    from vllm_router_ext.tools.tiny_checkpoint import TINY_V4

    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    n, k, top_k = TINY_V4["n_routed_experts"], TINY_V4["hidden_size"], TINY_V4["num_experts_per_tok"]
    cfg = {**TINY_V4, "num_hidden_layers": 4, "num_hash_layers": 2}
    tensors = {}
    for layer in range(4):
        tensors[f"layers.{layer}.ffn.gate.weight"] = (torch.randn(n, k, generator=g) / k**0.5).bfloat16()
        if layer < 2:
            tensors[f"layers.{layer}.ffn.gate.tid2eid"] = torch.randint(0, n, (cfg["vocab_size"], top_k))
        else:
            tensors[f"layers.{layer}.ffn.gate.bias"] = torch.randn(n, generator=g) * 0.1
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    result = run_audit(tmp_path, tokens=512, progress=False)
    assert result["table_routed_layers"] == [0, 1] and list(result["layers"]) == ["2", "3"]
    r = result["routing"]
    assert (r["scoring_func"], r["topk_method"], r["renormalize"], r["top_k"]) == ("sqrtsoftplus", "noaux_tc",
                                                                                   True, 6)  # fmt: skip
    assert r["routed_scaling_factor"] == 1.5 and r["hash_layers"] == 2
    ckpt = open_checkpoint(tmp_path)
    gate = load_gate(ckpt, 2, RoutingConfig.from_hf_config(cfg))
    assert gate.linear_bias is None and torch.equal(gate.correction_bias, tensors["layers.2.ffn.gate.bias"])
    o = result["overall"]
    assert o["fp32"]["rel_err"] <= 1e-6 and o["fp32"]["changed_pct"] == 0.0
    assert o["bf16"]["changed_pct"] > 0.0 and 1e-4 <= o["bf16"]["rel_err"] <= 1e-2
    assert "MoE layer(s) 0, 1 route by a token-id table" in format_tables(result)
    logits = torch.randn(8, n, generator=g, dtype=torch.float64)
    assert torch.allclose(expert_scores(logits, "sqrtsoftplus"), torch.log1p(logits.exp()).sqrt())


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _bad_inputs(tiny_model: Path, tmp: Path) -> dict[str, tuple[list[str], str]]:
    """Each bad input a user may hand the audit: (arguments, the one line it must end with)."""
    from safetensors.torch import save_file

    cases = {}
    ckpt = _copy_checkpoint(tiny_model, tmp / "not-json")
    (ckpt / "config.json").write_text("{not json", encoding="utf-8")
    cases["config not JSON"] = ([str(ckpt)], "config.json: the config.json is not readable JSON")
    ckpt = _copy_checkpoint(tiny_model, tmp / "missing-shard")
    index = ckpt / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"model.safetensors"', '"model-00002.safetensors"'))
    cases["missing shard"] = (
        [str(ckpt)],
        "the shard model-00002.safetensors holding model.layers.1.mlp.gate",
    )
    ckpt = _copy_checkpoint(tiny_model, tmp / "garbage-shard")
    (ckpt / "model.safetensors").write_bytes(os.urandom(4096))
    cases["garbage shard"] = ([str(ckpt)], "model.safetensors: cannot read model.layers.1.mlp.gate.weight")
    (tmp / "garbage.safetensors").write_bytes(os.urandom(512))
    cases["garbage safetensors"] = (
        ["--hidden-states", str(tmp / "garbage.safetensors")],
        "not a safetensors file",
    )
    (tmp / "garbage.pt").write_bytes(os.urandom(512))
    cases["garbage .pt"] = (
        ["--hidden-states", str(tmp / "garbage.pt")],
        "not a tensor file torch.load reads",
    )
    save_file({"hidden_states": torch.zeros(4, 256, dtype=torch.int32)}, str(tmp / "ints.safetensors"))
    cases["wrong dtype"] = (
        ["--hidden-states", str(tmp / "ints.safetensors")],
        "allowed: bfloat16, float16, float32",
    )
    save_file({"hidden_states": torch.zeros(0, 256)}, str(tmp / "empty.safetensors"))
    cases["no tokens"] = (
        ["--hidden-states", str(tmp / "empty.safetensors")],
        "no tokens (0 rows): nothing to audit",
    )
    return cases


def test_every_bad_input_exits_2_with_one_line_and_no_traceback(tiny_model, tmp_path):
    """A config that is not JSON, an index naming a missing shard, a damaged shard, garbage
    hidden-state files (safetensors, .pt), integer or empty hidden states: exit 2, one line."""
    import concurrent.futures as cf

    cases = _bad_inputs(tiny_model, tmp_path)

    def run(case: str):
        args, _ = cases[case]
        model = [] if args[0].startswith(str(tmp_path)) else [str(tiny_model)]
        out = ["--out", str(tmp_path / "out" / case.replace(" ", "-"))]
        cmd = [
            sys.executable,
            "-m",
            "vllm_router_ext.audit",
            *model,
            *args,
            "--no-progress",
            "--tokens",
            "64",
            *out,
        ]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    with cf.ThreadPoolExecutor(2) as pool:
        results = dict(zip(cases, pool.map(run, cases), strict=True))
    for case, p in results.items():
        assert p.returncode == 2 and "Traceback" not in p.stderr, (case, p.stderr[-2000:])
        last = p.stderr.strip().splitlines()[-1]
        assert last.startswith("vllm-router-audit: error: ") and cases[case][1] in last, (case, last)


def test_a_capture_of_another_model_is_refused_unless_allowed(tiny_model, tmp_path, gen, monkeypatch):
    """A capture says which model it was recorded from: audited against another checkpoint it is
    refused, naming both, unless ``--allow-other-model``; a capture cut short is named."""
    from vllm_router_ext.capture import CaptureSettings, GateCapture, GateShape

    other = _copy_checkpoint(tiny_model, tmp_path / "other-model")
    capture = tmp_path / "capture"
    capture.mkdir()
    layers = sorted(open_checkpoint(tiny_model).gates)
    shapes = [GateShape(layer, 256, 16, torch.bfloat16) for layer in layers]
    meta = {"model": str(tiny_model), "architecture": "DeepseekV3ForCausalLM", "run": 1}
    import vllm_router_ext.capture as c

    monkeypatch.setattr(c, "_serving_pass", lambda: True)
    rec = GateCapture(CaptureSettings(capture, 32, "test"), shapes, "router-capture-1-dp0", meta)
    x = torch.randn(32, 256, generator=gen).to(torch.bfloat16)
    for layer in layers:
        rec.record(layer, x, torch.zeros(32, 16))
    assert run_audit(tiny_model, hidden_states=capture, progress=False)["tokens"] == 32
    with pytest.raises(AuditError) as e:
        run_audit(other, hidden_states=capture, progress=False)
    assert str(e.value) == (
        f"the capture was recorded from {str(tiny_model)!r} (DeepseekV3ForCausalLM), not {str(other)!r} "
        "(DeepseekV3ForCausalLM); pass --allow-other-model to audit it against this checkpoint anyway"
    )
    assert run_audit(other, hidden_states=capture, progress=False, allow_other_model=True)["tokens"] == 32
    path = capture / "router-capture-1-dp0.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(AuditError, match="cut short"):
        run_audit(tiny_model, hidden_states=capture, progress=False)


def test_afmoe_renormalises_sigmoid_scores_only():
    """vLLM's AFMoE passes ``route_norm`` only with sigmoid scores; softmax scores stay as they are."""
    from vllm_router_ext.ops.routing_fp64 import RoutingConfig

    base = {"model_type": "afmoe", "num_experts": 32, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
            "route_norm": True, "route_scale": 2.0}  # fmt: skip
    sigmoid = RoutingConfig.from_hf_config({**base, "score_func": "sigmoid"})
    softmax = RoutingConfig.from_hf_config({**base, "score_func": "softmax"})
    assert (sigmoid.renormalize, softmax.renormalize) == (True, False)
    assert sigmoid.routed_scaling_factor == softmax.routed_scaling_factor == 2.0
