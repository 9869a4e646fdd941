"""Routing audit: what each router precision does to a checkpoint's expert choice.

    python -m vllm_router_ext.audit MODEL_DIR [--hidden-states FILE] [--tokens 4096] [--seed 0]
        [--device cpu|cuda] [--modes fp32,bf16-fp32out,bf16] [--no-batch-invariant] [--out DIR]

Reads ``config.json`` and, through the safetensors index, only each MoE layer's router tensors
(its weight, a router bias, an ``e_score_correction_bias``), one layer at a time (never the
experts). For every mode it computes the logits with the plugin's own ``router_gemm`` on the
chosen device, routes them the way vLLM routes that family (``ops/routing_fp64.py``: DeepSeek's
grouped top-k, sigmoid + correction bias for GLM-4.5 / MiniMax-M2, softmax top-k with or without
renormalisation for Qwen / OLMoE / Mixtral / gpt-oss, ERNIE-4.5's softmax + correction bias,
Llama-4's sigmoid top-k) and compares with an fp64 reference: relative error, % of tokens whose
expert set changed, mean and p99 of |Δ routed weight| (L1 over a token's experts). Prints a
per-layer and an overall table, writes ``audit.json``, ``audit.md`` and ``audit.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_router_ext.capture import FILE_RE, CaptureError, captures_in, describe_capture, read_capture
from vllm_router_ext.ops import router_gemm
from vllm_router_ext.ops.router_gemm import fp32_weight_terms
from vllm_router_ext.ops.routing_fp64 import (
    DEEPSEEK_MODEL_TYPES,
    ROUTED_MODEL_TYPES,
    ROUTING_KEYS,
    SQRTSOFTPLUS_BIAS,
    RoutingConfig,
    changed_expert_sets,
    experts_per_token,
    num_experts,
    routing_fields,
    select_experts,
)
from vllm_router_ext.plotting import PLOT_MISSING, pyplot

#: A MoE layer's router weight, under each family's names (``model.layers.N.mlp.gate``,
#: ``...block_sparse_moe.gate``, gpt-oss's ``...mlp.router``, Llama-4's ``...feed_forward.router``,
#: a multimodal checkpoint's ``model.language_model.layers.N...`` or ``language_model.[model.]layers.N...``,
#: DeepSeek-V4's ``layers.N.ffn.gate``,
#: Step-5's ``...moe.gate``, Hunyuan-V4's ``...mlp.router.gate``, Nemotron-H's
#: ``backbone.layers.N.mixer.gate``).
GATE_RE = re.compile(
    r"^(?:model\.|model\.language_model\.|language_model\.model\.|language_model\.|backbone\.)?"
    r"layers\.(\d+)\."
    r"(mlp|block_sparse_moe|feed_forward|ffn|moe|mixer)\.(gate|router|router\.gate|router\.layer)\.weight$"
)
#: Where a family keeps ``e_score_correction_bias``, relative to the MoE block (ERNIE-4.5's
#: ``moe_statics`` holds it as [1, experts]).
CORRECTION_BIAS_NAMES = (
    "{gate}.e_score_correction_bias", "e_score_correction_bias", "moe_statics.e_score_correction_bias",
)  # fmt: skip
ALL_MODES = ("fp32", "bf16-fp32out", "bf16")


class AuditError(ValueError):
    """A checkpoint or input the audit cannot use; the message says what and why."""


@dataclass
class Checkpoint:
    root: Path
    config: dict
    weight_map: dict[str, str]  # tensor name -> file name
    gates: dict[int, str]  # MoE layer -> its router's name, without ".weight"

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.weight_map:
            raise AuditError(f"{self.root}: tensor {name!r} is not in the checkpoint")
        shard = self.root / self.weight_map[name]
        if not shard.is_file():
            raise AuditError(f"{self.root}: the shard {self.weight_map[name]} holding {name} is missing")
        try:
            with safe_open(str(shard), framework="pt") as f:
                return f.get_tensor(name)
        except Exception as e:  # noqa: BLE001 -- safetensors' own error types: a damaged shard
            raise AuditError(f"{shard}: cannot read {name} ({type(e).__name__}: {e})") from None


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise AuditError(f"{path}: the {what} is not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise AuditError(f"{path}: the {what} is not a JSON object")
    return value


def open_checkpoint(model_dir: str | Path) -> Checkpoint:
    root = Path(model_dir)
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise AuditError(f"{root} has no config.json: not a Hugging Face checkpoint directory")
    config = _read_json(cfg_path, "config.json")
    model_type = routing_fields(config).get("model_type", config.get("model_type"))
    if model_type not in ROUTED_MODEL_TYPES:
        raise AuditError(
            f"{root}: the audit does not know the routing of model_type {model_type!r} "
            f"(architectures {config.get('architectures') or []}); supported: {', '.join(ROUTED_MODEL_TYPES)}"
        )
    if "hidden_size" not in routing_fields(config):
        raise AuditError(f"{cfg_path}: missing 'hidden_size', needed for routing")
    if experts_per_token(config) is None:
        raise AuditError(f"{cfg_path}: no experts per token (num_experts_per_tok or moe_k)")
    if num_experts(config) is None:
        raise AuditError(
            f"{cfg_path}: no expert count (n_routed_experts, num_experts, num_local_experts or "
            "moe_num_experts)"
        )
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise AuditError(f"{index}: no 'weight_map' object: not a safetensors index")
    elif (root / "model.safetensors").is_file():
        from safetensors import safe_open

        try:
            with safe_open(str(root / "model.safetensors"), framework="pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        except Exception as e:  # noqa: BLE001 -- safetensors' own error types
            raise AuditError(f"{root / 'model.safetensors'}: not a safetensors file ({e})") from None
    else:
        raise AuditError(f"{root} has neither model.safetensors.index.json nor model.safetensors")
    gates = {int(m.group(1)): name[: -len(".weight")] for name in weight_map if (m := GATE_RE.match(name))}
    if not gates:
        raise AuditError(
            f"{root}: no MoE router tensors (model.layers.N.mlp.gate.weight, "
            "...block_sparse_moe.gate.weight, ...mlp.router.weight, ...feed_forward.router.weight)"
        )
    return Checkpoint(root, config, weight_map, dict(sorted(gates.items())))


@dataclass
class Gate:
    weight: torch.Tensor
    correction_bias: torch.Tensor | None  # fp32: added to the scores that choose
    linear_bias: torch.Tensor | None  # added to the logits (gpt-oss's router)


def load_gate(ckpt: Checkpoint, layer: int, routing: RoutingConfig) -> Gate:
    cfg = routing_fields(ckpt.config)
    n, k = num_experts(ckpt.config), int(cfg["hidden_size"])
    name = ckpt.gates[layer]
    w = ckpt.tensor(f"{name}.weight")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise AuditError(
            f"layer {layer}: router weight is stored as {w.dtype}; the audit needs an unquantized router "
            "(bfloat16, float16 or float32), as DeepSeek's FP8 releases store it"
        )
    if tuple(w.shape) != (n, k):
        raise AuditError(f"layer {layer}: router weight has shape {tuple(w.shape)}, config says [{n}, {k}]")
    model_type = cfg.get("model_type", ckpt.config.get("model_type"))
    model_keys = ROUTING_KEYS.get(model_type)
    if model_keys is not None and model_keys.weight_scale in cfg:  # as vLLM folds it in at load
        w = w.float() * float(cfg[model_keys.weight_scale])
    correction = None
    # DeepSeek-V4 stores its correction bias as the gate's ``bias`` (its gate has no linear bias)
    bias_is_correction = model_type in SQRTSOFTPLUS_BIAS
    if routing.uses_correction_bias:
        block, gate = name.rsplit(".", 1)
        if block.endswith(".router"):  # Hunyuan-V4's mlp.router.gate: its bias sits beside mlp.gate
            block = block[: -len(".router")]
        patterns = ("{gate}.bias",) if bias_is_correction else CORRECTION_BIAS_NAMES
        if model_keys is not None:
            patterns = tuple(dict.fromkeys(model_keys.bias + CORRECTION_BIAS_NAMES))
        names = [f"{block}.{pattern.format(gate=gate)}" for pattern in patterns]
        found = next((x for x in names if x in ckpt.weight_map), None)
        if found is None:
            raise AuditError(f"layer {layer}: no e_score_correction_bias (looked for {', '.join(names)})")
        correction = ckpt.tensor(found).float()
        if correction.numel() == n:
            correction = correction.reshape(n)
        if tuple(correction.shape) != (n,):
            raise AuditError(f"layer {layer}: {found} has shape {tuple(correction.shape)}, expected [{n}]")
    has_linear = f"{name}.bias" in ckpt.weight_map and not bias_is_correction
    linear = ckpt.tensor(f"{name}.bias").float() if has_linear else None
    return Gate(w, correction, linear)


def random_hidden_states(tokens: int, k: int, seed: int) -> torch.Tensor:
    """RMS-normalised Gaussian activations (what a gate sees after RMSNorm with unit weight)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g)
    return (x / x.pow(2).mean(-1, keepdim=True).sqrt()).to(torch.bfloat16)


def _one_capture(directory: Path) -> str:
    """The one router capture (``--router-capture``) in ``directory``; an error naming them all
    when there are several (pass one file then)."""
    found = captures_in(directory)
    if len(found) != 1:
        what = "no router capture" if not found else f"{len(found)} router captures ({', '.join(found)})"
        raise AuditError(f"{directory} holds {what}; pass --hidden-states one capture .safetensors file")
    return found[0]


def load_hidden_states(
    path: str | Path, k: int
) -> tuple[dict[int, torch.Tensor] | torch.Tensor, dict | None]:
    """A [T, K] tensor shared by all layers, or per-layer tensors: safetensors keys
    ``hidden_states`` or ``layers.N`` (a router capture: a file, or its directory, whole or the
    chunks a killed server left); a .pt file holding a tensor or a {layer: tensor} dict. With
    them, what the capture says of itself (None for other files)."""
    p = Path(path)
    info = None
    capture = FILE_RE.match(p.name)
    if p.is_dir() or (capture and not p.is_file()):
        directory, stem = (p, _one_capture(p)) if p.is_dir() else (p.parent, capture.group(1))
        try:
            read = read_capture(directory, stem)
        except CaptureError as e:
            raise AuditError(str(e)) from None
        data, info = read.tensors, read.info
    elif not p.is_file():
        raise AuditError(f"hidden-states file {p} does not exist")
    elif p.suffix == ".safetensors":
        if capture:  # one capture among several in its directory: its rows as its JSON counts them
            try:
                read = read_capture(p.parent, capture.group(1))
            except CaptureError as e:
                raise AuditError(str(e)) from None
            data, info = read.tensors, read.info
        else:
            from safetensors.torch import load_file

            try:
                data = load_file(str(p))
            except Exception as e:  # noqa: BLE001 -- safetensors' own error types
                raise AuditError(f"{p}: not a safetensors file ({e})") from None
    else:
        try:
            data = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 -- a file torch cannot read, whatever the reason
            first = (str(e).strip().splitlines() or [""])[0]
            why = f"{type(e).__name__}: {first}"
            raise AuditError(f"{p}: not a tensor file torch.load reads ({why})") from None
    if isinstance(data, dict) and not isinstance(next(iter(data), 0), int):
        if "hidden_states" in data:
            data = data["hidden_states"]
        else:
            data = {
                int(name.split(".")[1]): t for name, t in data.items() if re.match(r"^layers\.\d+$", name)
            }
    tensors = data.values() if isinstance(data, dict) else [data]
    if isinstance(data, dict) and not data:
        raise AuditError(f"{p}: no 'hidden_states' or 'layers.N' tensors")
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.shape[1] != k:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise AuditError(f"{p}: hidden states must be [T, {k}] (hidden_size), got {shape}")
        if t.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise AuditError(f"{p}: hidden states are {t.dtype}; allowed: bfloat16, float16, float32")
        if t.shape[0] == 0:
            raise AuditError(f"{p}: no tokens (0 rows): nothing to audit")
    return data, info


def check_same_model(info: dict | None, ckpt: Checkpoint) -> None:
    """A capture names the model it was recorded from: auditing it against another checkpoint
    would compare one model's activations with another's routers."""
    if not info or not info.get("model"):
        return
    recorded, arch = str(info["model"]), info.get("architecture")
    archs = ckpt.config.get("architectures") or routing_fields(ckpt.config).get("architectures") or []
    same_path = Path(recorded).expanduser().resolve() == ckpt.root.resolve()
    same_name = Path(recorded.rstrip("/")).name == ckpt.root.resolve().name
    if (same_path or same_name) and (not arch or not archs or arch in archs):
        return
    theirs = f"{recorded!r} ({arch or 'architecture unknown'})"
    ours = f"{str(ckpt.root)!r} ({', '.join(archs) or 'architecture unknown'})"
    raise AuditError(
        f"the capture was recorded from {theirs}, not {ours}; pass --allow-other-model to audit it "
        "against this checkpoint anyway"
    )


def _routed_weight_delta(ids_a, w_a, ids_b, w_b, n: int) -> torch.Tensor:
    dense_a = torch.zeros(ids_a.shape[0], n, dtype=torch.float64).scatter_(1, ids_a.long(), w_a.double())
    dense_b = torch.zeros(ids_b.shape[0], n, dtype=torch.float64).scatter_(1, ids_b.long(), w_b.double())
    return (dense_a - dense_b).abs().sum(-1)


def audit_layer(
    x, gate: Gate, routing: RoutingConfig, paths: list[tuple[str, str, bool]], device: str
) -> dict:
    w, bias, linear = gate.weight, gate.correction_bias, gate.linear_bias
    ref = x.double() @ w.double().T + (0 if linear is None else linear.double())
    ref_bias = None if bias is None else bias.double()
    ref_ids, ref_w = select_experts(ref, routing, ref_bias)
    n = w.shape[0]
    xd = x.to(device)
    out = {}
    for label, mode, bi in paths:
        weight = (w if mode == "fp32" else w.to(torch.bfloat16)).to(device)
        # as the gate layer serves an fp32 weight: with its bf16 terms (used at large M on CUDA)
        terms = fp32_weight_terms(weight) if weight.dtype == torch.float32 and not bi else None
        if linear is None:
            logits = router_gemm(xd, weight, mode, batch_invariant=bi, weight_terms=terms).cpu()
        else:  # as the gate adds a router bias: to fp32 sums, then one rounding for bf16 logits
            sums = router_gemm(
                xd, weight, "bf16-fp32out" if mode == "bf16" else mode, batch_invariant=bi, weight_terms=terms
            ).cpu()
            logits = (sums + linear).to(torch.bfloat16 if mode == "bf16" else torch.float32)
        # Route as vLLM does for this config, in fp32 (bf16 logits keep their rounding).
        ids, wts = select_experts(logits.float(), routing, None if bias is None else bias.float())
        delta = _routed_weight_delta(ids, wts, ref_ids, ref_w, n)
        out[label] = {
            "rel_err": ((logits.double() - ref).norm() / ref.norm()).item(),
            "changed_pct": changed_expert_sets(ids, ref_ids).double().mean().item() * 100,
            "changed_tokens": int(changed_expert_sets(ids, ref_ids).sum()),
            "dw_mean": delta.mean().item(),
            "dw_p99": torch.quantile(delta, 0.99).item() if len(delta) else 0.0,
        }
    return out


def run_audit(
    model_dir: str | Path,
    *,
    hidden_states: str | Path | None = None,
    tokens: int = 4096,
    seed: int = 0,
    device: str = "cpu",
    modes: tuple[str, ...] = ALL_MODES,
    batch_invariant: bool = True,
    progress: bool = True,
    allow_other_model: bool = False,
) -> dict:
    if device == "cuda" and not torch.cuda.is_available():
        raise AuditError("--device cuda requested but no CUDA GPU is available; allowed here: cpu")
    bad = [m for m in modes if m not in ALL_MODES]
    if bad:
        raise AuditError(f"unknown mode(s) {bad}; allowed: {', '.join(ALL_MODES)}")
    ckpt = open_checkpoint(model_dir)
    cfg = ckpt.config
    k = int(routing_fields(cfg)["hidden_size"])
    routing = RoutingConfig.from_hf_config(cfg)
    paths = [(m, m, False) for m in modes]
    if batch_invariant:
        paths += [(f"{m} batch-invariant", m, True) for m in modes if m != "bf16"]
    shared, capture = (
        (random_hidden_states(tokens, k, seed), None)
        if hidden_states is None
        else load_hidden_states(hidden_states, k)
    )
    if not allow_other_model:
        check_same_model(capture, ckpt)
    # hash layers choose by a token-id table: no logit decides there, nothing to audit
    table_routed = [i for i in ckpt.gates if i < routing.hash_layers]
    layers = [i for i in ckpt.gates if i >= routing.hash_layers]
    if not layers:
        raise AuditError(f"{ckpt.root}: every MoE layer routes by its token-id table (num_hash_layers)")
    if cfg.get("model_type") in DEEPSEEK_MODEL_TYPES and cfg.get("moe_layer_freq", 1) == 1:
        expected = range(int(cfg.get("first_k_dense_replace", 0)), int(cfg.get("num_hidden_layers", 0)))
        missing = [i for i in expected if i not in layers]
        if missing:
            raise AuditError(f"{ckpt.root}: MoE layer(s) {missing} have no mlp.gate.weight in the checkpoint")
    from tqdm import tqdm

    per_layer = {}
    for layer in tqdm(layers, desc="auditing router layers", disable=not progress, file=sys.stderr):
        gate = load_gate(ckpt, layer, routing)
        if isinstance(shared, dict):
            if layer not in shared:
                raise AuditError(f"hidden states have no tensor for layer {layer} (have {sorted(shared)})")
            x = shared[layer]
        else:
            x = shared
        per_layer[layer] = audit_layer(x.to(torch.bfloat16), gate, routing, paths, device)
    labels = [p[0] for p in paths]
    overall = {
        label: {
            key: sum(per_layer[i][label][key] for i in layers) / len(layers)
            for key in per_layer[layers[0]][label]
        }
        for label in labels
    }
    return {
        "model": str(ckpt.root),
        "architectures": cfg.get("architectures"),
        "routing": routing.__dict__,
        "tokens": int(next(iter(shared.values())).shape[0])
        if isinstance(shared, dict)
        else int(shared.shape[0]),
        "device": device,
        "capture": capture,
        "layers": {str(i): v for i, v in per_layer.items()},
        "table_routed_layers": table_routed,
        "overall": overall,
    }


def format_tables(result: dict) -> str:
    labels = list(result["overall"])
    cols = "| mode | rel err vs fp64 | changed expert sets | mean |Δw| | p99 |Δw| |"
    sep = "|---|---:|---:|---:|---:|"
    lines = [f"router audit: {result['model']} ({result['tokens']} tokens, device {result['device']})"]
    if result.get("capture"):
        lines.append(describe_capture(result["capture"]))

    def cells(r: dict) -> str:
        return f" {r['rel_err']:.2e} | {r['changed_pct']:.3f} % | {r['dw_mean']:.2e} | {r['dw_p99']:.2e} |"

    if result.get("table_routed_layers"):
        table = ", ".join(str(i) for i in result["table_routed_layers"])
        lines.append(f"MoE layer(s) {table} route by a token-id table (no logit decides there): not audited")
    lines += ["", "per MoE layer:", "| MoE layer " + cols, "|---:" + sep]
    for layer, per_mode in result["layers"].items():
        lines += [f"| {layer} | {label} |" + cells(per_mode[label]) for label in labels]
    n = len(result["layers"])
    lines += ["", f"overall (mean over {n} MoE layer{'s' if n != 1 else ''}):", cols, sep]
    lines += [f"| {label} |" + cells(result["overall"][label]) for label in labels]
    return "\n".join(lines)


def figure(result: dict, plt):
    """The per-layer figure: one integer tick per MoE layer (at most ~20 labelled), the y axis from 0 %."""
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    layers = [int(i) for i in result["layers"]]
    fig, ax = plt.subplots(figsize=(min(16, max(6, len(layers) * 0.15 + 4)), 4))
    top = 0.0
    for label in result["overall"]:
        values = [result["layers"][str(i)][label]["changed_pct"] for i in layers]
        top = max(top, *values)
        ax.plot(layers, values, marker="o", ms=3, label=label)
    ax.set_xlim(min(layers) - 0.5, max(layers) + 0.5)
    if len(layers) <= 20:
        ax.set_xticks(layers)
    else:
        ax.xaxis.set_major_locator(MaxNLocator(nbins=20, integer=True))
    # 0 % at the bottom; an audit where nothing changed still shows a 0-1 % scale
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.yaxis.set_major_formatter(PercentFormatter(decimals=None))
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("tokens with a changed expert set vs fp64")
    ax.set_title(Path(result["model"]).name)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot(result: dict, path: Path) -> bool:
    """Write the per-layer plot; False (nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False
    fig = figure(result, plt)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-router-audit",
        description=__doc__.splitlines()[0],
    )
    p.add_argument(
        "model_dir", help="a Hugging Face checkpoint directory (config.json and *.safetensors with the gates)"
    )
    p.add_argument(
        "--hidden-states",
        metavar="PATH",
        default=None,
        help="[T, K] activations: a safetensors/.pt file, or the directory of a --router-capture "
        "(default: --tokens random activations)",
    )
    p.add_argument(
        "--tokens",
        metavar="N",
        type=_positive_int,
        default=4096,
        help="random tokens when no --hidden-states (default: %(default)s)",
    )
    p.add_argument(
        "--seed",
        metavar="N",
        type=int,
        default=0,
        help="seed of the random activations (default: %(default)s)",
    )
    p.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="where each mode's router GEMM runs (default: %(default)s)",
    )
    p.add_argument(
        "--modes",
        metavar="MODES",
        default=",".join(ALL_MODES),
        help=f"comma-separated modes to compare with fp64, from: {', '.join(ALL_MODES)} (default: all)",
    )
    p.add_argument(
        "--no-batch-invariant",
        action="store_true",
        help="skip the batch-invariant run of each mode (default: run it)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        default="router-audit",
        help="directory for audit.json, audit.md and audit.png (default: %(default)s)",
    )
    p.add_argument(
        "--allow-other-model",
        action="store_true",
        help="audit a --router-capture recorded from another model than MODEL_DIR (default: refused)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: shown)")
    return p


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: allowed: a positive integer")
    return number


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes:
        p.error(f"--modes {args.modes!r} names no mode; allowed: {', '.join(ALL_MODES)}")
    out = Path(args.out)
    try:  # before any computation: an output that cannot be written is known at once
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".audit-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        p.error(f"--out {str(out)!r} is not a writable directory: {e}")
    try:
        result = run_audit(
            args.model_dir,
            hidden_states=args.hidden_states,
            tokens=args.tokens,
            seed=args.seed,
            device=args.device,
            modes=modes,
            batch_invariant=not args.no_batch_invariant,
            progress=not args.no_progress,
            allow_other_model=args.allow_other_model,
        )
    except AuditError as e:
        print(f"vllm-router-audit: error: {' '.join(str(e).split())}", file=sys.stderr)  # one line
        return 2
    tables = format_tables(result)
    (out / "audit.json").write_text(json.dumps(result, indent=1))
    (out / "audit.md").write_text(tables + "\n", encoding="utf-8")
    print(tables)
    written = f"{out / 'audit.json'}, {out / 'audit.md'}"
    if plot(result, out / "audit.png"):
        print(f"\nwrote {written} and {out / 'audit.png'}")
    else:
        print(f"\nwrote {written}; {PLOT_MISSING}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
