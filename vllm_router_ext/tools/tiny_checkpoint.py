"""Build tiny random MoE checkpoints (DeepSeek family, other families) and a tokenizer, offline.

A DeepSeek-family checkpoint uses DeepSeek's original tensor names (what vLLM's ``deepseek_v2.py``
loads) and the MLA sizes vLLM's CPU backends accept (``kv_lora_rank + qk_rope_head_dim == 576``).
The routing is DeepSeek-V3's on 16 experts, or that of a real release (``--model``, with its expert
count); ``--fp8`` writes DeepSeek-V3's FP8 block-quantized layout. The other families
(:func:`build_tiny_family`) are written by transformers from their own configs.

    python -m vllm_router_ext.tools.tiny_checkpoint OUT_DIR [--model kimi-k2] [--fp8]
        [--gate-dtype float32] [--seed 0]

It ships: the demo serves one, and the GPU end-to-end suite builds its checkpoints with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from vllm_router_ext.families import FAMILIES, RELEASES

TINY_V3 = dict(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=512,
    q_lora_rank=96,
    qk_rope_head_dim=64,
    qk_nope_head_dim=32,
    v_head_dim=32,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


#: vLLM's MLA prefill kernels on CUDA take only DeepSeek's own head sizes (with the body's
#: ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64): overrides for a checkpoint served on a GPU.
GPU_MLA_SIZES = {"qk_nope_head_dim": 128, "v_head_dim": 128}


#: The routing of each DeepSeek-family release, as its config.json states it (expert count, group
#: top-k, scoring, scaling; the family table's :class:`~vllm_router_ext.families.Release`), on the
#: tiny body above. Dense layers, attention and sizes stay tiny.
ROUTING_PRESETS: dict[str, dict] = {
    r.name.lower(): dict(architectures=[r.architecture], n_routed_experts=r.experts, **r.config, **r.tiny)
    for r in RELEASES
    if r.tiny is not None
}


def _config_dict(arch: str, overrides: dict) -> dict:
    cfg = dict(TINY_V3)
    cfg.update(
        architectures=[arch],
        model_type="deepseek_v3",
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        num_nextn_predict_layers=0,
        torch_dtype="bfloat16",
        rope_theta=10000.0,
        rope_scaling=None,
        attention_bias=False,
        use_cache=True,
    )
    cfg.update(overrides)
    return cfg


def _tensors(cfg: dict, gen: torch.Generator, gate_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    qk_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    E, moe_i = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    bf16 = torch.bfloat16

    def rand(*shape: int, dtype: torch.dtype = bf16) -> torch.Tensor:
        fan_in = shape[-1]
        return (torch.randn(*shape, generator=gen) / fan_in**0.5).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=bf16)

    def decoder_layer(p: str, dense: bool) -> dict[str, torch.Tensor]:
        t = {p + "input_layernorm.weight": ones(H), p + "post_attention_layernorm.weight": ones(H)}
        a = p + "self_attn."
        t[a + "q_a_proj.weight"] = rand(cfg["q_lora_rank"], H)
        t[a + "q_a_layernorm.weight"] = ones(cfg["q_lora_rank"])
        t[a + "q_b_proj.weight"] = rand(heads * qk_head, cfg["q_lora_rank"])
        t[a + "kv_a_proj_with_mqa.weight"] = rand(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], H)
        t[a + "kv_a_layernorm.weight"] = ones(cfg["kv_lora_rank"])
        t[a + "kv_b_proj.weight"] = rand(
            heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]
        )
        t[a + "o_proj.weight"] = rand(H, heads * cfg["v_head_dim"])
        if "index_n_heads" in cfg:  # the sparse-attention (DSA) indexer of V3.2 / GLM-5
            ix, n_ix, d_ix = a + "indexer.", cfg["index_n_heads"], cfg["index_head_dim"]
            t[ix + "wq_b.weight"] = rand(n_ix * d_ix, cfg["q_lora_rank"])
            t[ix + "wk.weight"] = rand(d_ix, H)
            t[ix + "weights_proj.weight"] = rand(n_ix, H)
            t[ix + "k_norm.weight"] = ones(d_ix)
            t[ix + "k_norm.bias"] = torch.zeros(d_ix, dtype=bf16)
        m = p + "mlp."
        if dense:
            t[m + "gate_proj.weight"] = rand(cfg["intermediate_size"], H)
            t[m + "up_proj.weight"] = rand(cfg["intermediate_size"], H)
            t[m + "down_proj.weight"] = rand(H, cfg["intermediate_size"])
            return t
        # Gate weights ~ N(0, 1/H): logits of O(1), so sigmoid scores sit close together and the
        # bf16-vs-fp32 choice of experts is visible even in a model this small.
        t[m + "gate.weight"] = rand(E, H, dtype=torch.float32).to(gate_dtype)
        if cfg["topk_method"] == "noaux_tc":  # the other methods have no bias
            t[m + "gate.e_score_correction_bias"] = torch.randn(E, generator=gen) * 1e-3
        for e in range(E):
            x = f"{m}experts.{e}."
            t[x + "gate_proj.weight"] = rand(moe_i, H)
            t[x + "up_proj.weight"] = rand(moe_i, H)
            t[x + "down_proj.weight"] = rand(H, moe_i)
        n_sh = moe_i * cfg["n_shared_experts"]
        t[m + "shared_experts.gate_proj.weight"] = rand(n_sh, H)
        t[m + "shared_experts.up_proj.weight"] = rand(n_sh, H)
        t[m + "shared_experts.down_proj.weight"] = rand(H, n_sh)
        return t

    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(V, H) * 16}
    layers = cfg["num_hidden_layers"]
    for i in range(layers):
        t.update(decoder_layer(f"model.layers.{i}.", dense=i < cfg["first_k_dense_replace"]))
    for i in range(layers, layers + cfg["num_nextn_predict_layers"]):
        # DeepSeek-V3's multi-token-prediction (MTP) layer, under its checkpoint names: a MoE
        # decoder layer (with its own router gate) plus the projections around it.
        p = f"model.layers.{i}."
        t.update(decoder_layer(p, dense=False))
        t[p + "enorm.weight"] = ones(H)
        t[p + "hnorm.weight"] = ones(H)
        t[p + "eh_proj.weight"] = rand(H, 2 * H)
        t[p + "shared_head.norm.weight"] = ones(H)
        t[p + "shared_head.head.weight"] = rand(V, H)
        t[p + "embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    t["model.norm.weight"] = ones(H)
    t["lm_head.weight"] = rand(V, H)
    return t


#: DeepSeek-V3's own ``quantization_config``: e4m3 weights in 128 x 128 blocks, dynamic activations.
FP8_QUANTIZATION_CONFIG = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "weight_block_size": [128, 128],
}
FP8_BLOCK = 128


def cpu_runs_fp8() -> bool:
    """Whether vLLM can run this layout on this CPU: its CPU build's FP8 block-scaled linear
    kernel needs AMX tiles (Sapphire Rapids or newer); vLLM's CUDA wheel, imported on a CPU,
    has no such kernel anywhere."""
    try:
        amx = "amx_tile" in Path("/proc/cpuinfo").read_text(encoding="utf-8")
    except OSError:
        return False
    return amx and vllm_has_cpu_op("fp8_scaled_mm_cpu")


def vllm_has_cpu_op(name: str) -> bool:
    """Whether the installed vLLM registered the CPU kernel ``torch.ops._C.<name>``."""
    try:
        import vllm._C  # noqa: F401  (registers the ops; the CUDA wheel's fails without a GPU)
    except Exception:  # noqa: BLE001
        return False
    return hasattr(torch.ops._C, name)


def _is_fp8_linear(name: str) -> bool:
    """The linear layers DeepSeek-V3's FP8 release stores in fp8: attention and MLP / expert
    projections. The router gate, norms, embeddings, LM head and MTP's eh_proj stay bf16."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and not name.endswith("eh_proj.weight")


def fp8_block_quantize(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight e4m3, weight_scale_inv fp32 [ceil(out/block), ceil(in/block)])`` with
    ``weight * scale_inv`` ~ ``w`` per block, as in DeepSeek-V3's FP8 checkpoints."""
    out_f, in_f = w.shape
    bo, bi = -(-out_f // block), -(-in_f // block)
    padded = torch.zeros(bo * block, bi * block)
    padded[:out_f, :in_f] = w.float()
    blocks = padded.view(bo, block, bi, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).view(bo * block, bi * block)[:out_f, :in_f]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float()


def _write_generation_config(out: Path) -> None:
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False})
    )


def _write_tokenizer(out: Path, vocab_size: int, specials: dict[str, int] | None = None) -> None:
    """Train a byte-level BPE on this Python installation's own stdlib sources (always local);
    ``specials``: special tokens at fixed ids (a release's), the ids between filled with unused ones."""
    import os

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    stdlib = Path(os.__file__).parent
    files = sorted(str(p) for p in stdlib.glob("*.py"))[:60]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|begin|>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    if specials:
        tok = _with_specials_at(tok, specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin|>", eos_token="<|end|>", pad_token="<|end|>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    fast.save_pretrained(str(out))


def _with_specials_at(tok, specials: dict[str, int]):
    """``tok`` with each special token at its id: the vocabulary grows to the largest id with tokens
    no merge reaches, and each special is an added token matched before the BPE."""
    from tokenizers import Tokenizer

    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    taken = set(specials.values())
    for i in range(len(vocab), max(taken) + 1):
        if i not in taken:
            vocab[f"<unused_{i}>"] = i
    for text, i in specials.items():
        vocab[text] = i
        data["added_tokens"].append(
            {"id": i, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
        )  # fmt: skip
    return Tokenizer.from_str(json.dumps(data))


def build_tiny_deepseek_v3(
    out_dir: str | Path,
    *,
    seed: int = 0,
    gate_dtype: torch.dtype = torch.bfloat16,
    arch: str = "DeepseekV3ForCausalLM",
    config_overrides: dict | None = None,
    tensor_overrides: dict[str, torch.Tensor] | None = None,
    mtp_layers: int = 0,
    fp8: bool = False,
) -> Path:
    """Write config.json, model.safetensors (+ index) and a tokenizer into ``out_dir``.
    ``mtp_layers`` > 0 adds DeepSeek-V3's multi-token-prediction layers (speculative decoding).
    ``fp8``: the layout of DeepSeek-V3's FP8 release: its ``quantization_config``, every attention
    and MLP projection in e4m3 with a ``weight_scale_inv`` per 128 x 128 block, the router gate
    (and its fp32 bias) unquantized; sizes are whole blocks where vLLM shards them."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp8_sizes = {"q_lora_rank": FP8_BLOCK} if fp8 else {}
    overrides = {"num_nextn_predict_layers": mtp_layers, **fp8_sizes, **(config_overrides or {})}
    cfg = _config_dict(arch, overrides)
    if fp8:
        cfg["quantization_config"] = dict(FP8_QUANTIZATION_CONFIG)
    gen = torch.Generator().manual_seed(seed)
    tensors = _tensors(cfg, gen, gate_dtype)
    tensors.update(tensor_overrides or {})
    if fp8:
        for name in [n for n in tensors if _is_fp8_linear(n)]:
            tensors[name], tensors[name + "_scale_inv"] = fp8_block_quantize(tensors[name])
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in tensors.values())},
        "weight_map": {k: "model.safetensors" for k in sorted(tensors)},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_generation_config(out)
    _write_tokenizer(out, cfg["vocab_size"])
    return out


def build_tiny_model(out_dir: str | Path, model: str, *, seed: int = 0, **kwargs) -> Path:
    """:func:`build_tiny_deepseek_v3` with the routing of ``model`` (a key of :data:`ROUTING_PRESETS`);
    experts are narrow (``moe_intermediate_size`` 32, or one 128-wide FP8 block with ``fp8``: vLLM
    shards merged FP8 projections by whole blocks) so that hundreds of them stay small."""
    if model not in ROUTING_PRESETS:
        raise ValueError(f"unknown model {model!r}; allowed: {', '.join(ROUTING_PRESETS)}")
    preset = dict(ROUTING_PRESETS[model])
    arch = preset.pop("architectures")[0]
    narrow = FP8_BLOCK if kwargs.get("fp8") else 32
    overrides = {"moe_intermediate_size": narrow, **preset, **kwargs.pop("config_overrides", {})}
    return build_tiny_deepseek_v3(out_dir, seed=seed, arch=arch, config_overrides=overrides, **kwargs)


def build_tiny_deepseek_eagle_head(out_dir: str | Path, *, seed: int = 0, target_layers: int = 2) -> Path:
    """An EAGLE draft head for :func:`build_tiny_deepseek_v3`'s model, in the layout vLLM's
    ``EagleDeepseekV3ForCausalLM`` loads: one DeepSeek MoE decoder layer (with its router gate)
    as ``layers.0.*``, plus ``fc`` (2H -> H) and the ``enorm`` / ``hnorm`` / ``norm`` weights;
    embeddings and LM head are the target's. Serve it with ``speculative_config={"method":
    "eagle", "model": <this dir>}``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # The layer is drawn as layer ``target_layers`` of a model whose layers are all MoE.
    overrides = {"num_hidden_layers": target_layers + 1, "first_k_dense_replace": 0}
    gen = torch.Generator().manual_seed(seed)
    drawn = _tensors(_config_dict("DeepseekV3ForCausalLM", overrides), gen, torch.bfloat16)
    prefix = f"model.layers.{target_layers}."
    tensors = {"layers.0." + k[len(prefix) :]: v for k, v in drawn.items() if k.startswith(prefix)}
    H = TINY_V3["hidden_size"]
    tensors["fc.weight"] = (torch.randn(H, 2 * H, generator=gen) / (2 * H) ** 0.5).to(torch.bfloat16)
    for norm in ("enorm", "hnorm", "norm"):
        tensors[f"{norm}.weight"] = torch.ones(H, dtype=torch.bfloat16)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    # One layer; vLLM reads the number of draft steps from num_nextn_predict_layers.
    cfg = _config_dict("DeepseekV3ForCausalLM", {"num_hidden_layers": 1, "num_nextn_predict_layers": 1})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


_TINY_BODY = dict(
    vocab_size=2048, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, pad_token_id=1,
)  # fmt: skip

#: Other MoE families, each as its Hugging Face config (``model_type``, architecture) with the
#: release's routing options on a tiny body; transformers writes the weights under its own names,
#: which are what vLLM loads.
FAMILY_PRESETS: dict[str, dict] = {f.tiny[0]: f.tiny[1] for f in FAMILIES if f.tiny is not None}


#: DeepSeek-V4's routing (V4-Flash: hidden 4096, 256 experts) on a tiny body: sqrtsoftplus scores
#: + fp32 correction bias, top-6 renormalised, scaled by 1.5; the first layer routes by a token-id
#: table. Written as vLLM's own DeepSeek-V4 config reads it (the checkpoint's own keys).
TINY_V4 = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=2048, hidden_size=256,
    num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
    moe_intermediate_size=32, n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=1,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
    num_hash_layers=1, swiglu_limit=10.0, hidden_act="silu", max_position_embeddings=2048,
    torch_dtype="bfloat16",
)  # fmt: skip


def write_tiny_deepseek_v4_config(out_dir: str | Path, *, v41: bool = False, **overrides) -> Path:
    """The config of a tiny DeepSeek-V4 (:data:`TINY_V4`; with ``v41``, in V4.1's layout:
    :func:`deepseek_v41_config`) into ``out_dir``: enough for vLLM to parse it and build its MoE
    blocks (the attention's kernels run on GPUs only)."""
    config = {**TINY_V4, **overrides}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(deepseek_v41_config(config) if v41 else config, indent=2))
    return out


#: The attention sizes vLLM's DeepSeek-V4 GPU kernels take (V4-Flash's: FlashMLA's sparse heads,
#: the compressor's 512-wide head, the indexer's 64 x 128) and four layers, so that both compressed
#: attention kinds appear as in the release (three heavily compressed layers alone fail vLLM's
#: state-cache block check); the rest of :data:`TINY_V4` stays tiny.
GPU_V4_SIZES = dict(
    num_hidden_layers=4, num_attention_heads=64, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1024,
    o_lora_rank=1024, o_groups=8, index_n_heads=64, index_head_dim=128, index_topk=512, sliding_window=128,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, n_routed_experts=256, hidden_size=1024,
)  # fmt: skip


#: DeepSeek-V4.1's architecture (vLLM's ``vllm/models/deepseek_v41``): V4's text model and MoE block.
V41_ARCHITECTURE = dict(model_type="deepseek_v41", architectures=["DeepseekV41ForCausalLM"])
#: V4.1's image placeholder at the id its tokenizer has (vLLM's V4.1 keys image routing off that id
#: and refuses a tokenizer without it at start-up), and the release's vocabulary around it.
V41_IMAGE_TOKEN = ("<｜deepseek_image｜>", 129264)
V41_VOCAB_SIZE = 129280
#: How a tiny V4.1 is served: text only (every modality's limit 0), since it has no vision layers for
#: vLLM to profile its image encoder with at start-up.
V41_SERVE_ARGS = ("--language-model-only",)
#: Per-layer lists transformers' V4 config derives in its own names, which its base class refuses.
_DERIVED = ("layer_types", "mlp_layer_types")


def v41_topology(layers: int) -> dict:
    """V4.1's attention topology for ``layers`` layers, in the release's proportions: sliding-window
    layers first (ratio 0), then layers compressed by 2, then the last half compressed by 1 (V4's
    ratios of 4 and 128 stop V4.1's engine at start). Only the first layer of each compressed run
    computes compressed KV (``kv_source_layer_ids``; the run shares it), and the indexers run there
    and on the last layer, which shares its run's index keys."""
    full = max(1, layers // 2)
    sliding = 1 if layers - full >= 2 else 0
    ratios = [0] * sliding + [2] * (layers - full - sliding) + [1] * full
    sources = [i for i, r in enumerate(ratios) if r and (i == 0 or ratios[i - 1] != r)]
    return {
        "compress_ratios": ratios,
        "kv_source_layer_ids": sources,
        "index_source_layer_ids": sorted({*sources, layers - 1}),
    }


def deepseek_v41_config(v4_config: dict) -> dict:
    """V4.1's ``config.json`` around the text model of a V4 config, laid out as the release lays it
    out: the text model under ``text_config``, its rope under ``rope_scaling``, each layer's
    compression as ``compress_ratios`` and every field transformers' V4 config defaults written out
    (V4.1's config class flattens the text model onto the top level and defaults nothing), no vision
    layers, and V4.1's attention topology (:func:`v41_topology`)."""
    from transformers import DeepseekV4Config  # transformers' own: vLLM may register another

    text = {k: v for k, v in v4_config.items() if k not in ("model_type", "architectures")}
    full = DeepseekV4Config(**text).to_dict()
    # V4.1's own names: each layer's compression ratio as a list, the rope as rope_scaling.
    full.pop("compress_rates")
    full.update(v41_topology(full["num_hidden_layers"]))
    full["compress_ratios"] += [0] * full["num_nextn_predict_layers"]  # drafts: sliding window
    full["rope_scaling"] = full.pop("rope_parameters")
    for key in ("model_type", "architectures", "transformers_version", "_name_or_path", "dtype", *_DERIVED):
        full.pop(key, None)
    return {
        **V41_ARCHITECTURE,
        "torch_dtype": v4_config.get("torch_dtype", "bfloat16"),
        "text_config": {**full, **text},
        "vision_config": {"num_hidden_layers": 0},
    }


def build_tiny_deepseek_v4(
    out_dir: str | Path, *, mtp_layers: int = 0, v41: bool = False, **overrides
) -> Path:
    """A tiny DeepSeek-V4 (or, with ``v41``, V4.1) for the GPU (:data:`GPU_V4_SIZES`): config,
    generation config and tokenizer, no weights (served with ``--load-format dummy``)."""
    sizes = {**GPU_V4_SIZES, "num_nextn_predict_layers": mtp_layers, **overrides}
    if v41:
        sizes.setdefault("vocab_size", V41_VOCAB_SIZE)
    out = write_tiny_deepseek_v4_config(out_dir, v41=v41, **sizes)
    _write_generation_config(out)
    _write_tokenizer(out, TINY_V4["vocab_size"], dict([V41_IMAGE_TOKEN]) if v41 else None)
    return out


def build_tiny_family(
    out_dir: str | Path, family: str, *, seed: int = 0, overrides: dict | None = None
) -> Path:
    """A tiny random checkpoint of one of :data:`FAMILY_PRESETS` (its gate weights in the
    release's dtype, as transformers keeps them) and the tokenizer, into ``out_dir``."""
    if family not in FAMILY_PRESETS:
        raise ValueError(f"unknown family {family!r}; allowed: {', '.join(FAMILY_PRESETS)}")
    from transformers import AutoConfig, AutoModelForCausalLM

    preset = {**_TINY_BODY, **FAMILY_PRESETS[family], **(overrides or {})}
    model_type = preset.pop("model_type")
    config = AutoConfig.for_model(model_type, **preset)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # weights of unit scale at the gate (logits ~ N(0, 1) for unit inputs)
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
            elif "bias" in name or "correction" in name:
                p.normal_(0.0, 0.5)
        for name, buf in model.named_buffers():
            if "correction_bias" in name:  # released in fp32, as vLLM builds it
                buf.normal_(0.0, 0.5)
    tensors = {k: v.float() if "correction_bias" in k else v for k, v in model.state_dict().items()}
    out = Path(out_dir)
    model.save_pretrained(str(out), state_dict=tensors)
    _write_tokenizer(out, config.vocab_size)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gate-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--mtp-layers", type=int, default=0, help="multi-token-prediction layers (MTP)")
    p.add_argument("--model", choices=list(ROUTING_PRESETS), default=None, help="another model's routing")
    p.add_argument("--fp8", action="store_true", help="DeepSeek-V3's FP8 block-quantized layout")
    args = p.parse_args(argv)
    kwargs = dict(
        seed=args.seed, gate_dtype=getattr(torch, args.gate_dtype), mtp_layers=args.mtp_layers, fp8=args.fp8
    )
    if args.model:
        path = build_tiny_model(args.out_dir, args.model, **kwargs)
    else:
        path = build_tiny_deepseek_v3(args.out_dir, **kwargs)
    print(f"tiny {args.model or 'deepseek-v3'}{' (fp8)' if args.fp8 else ''} checkpoint written to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
