"""The MoE families whose router vLLM builds with ``GateLinear``, and what ``auto`` runs for each.

``auto`` follows the family's reference implementation (its Hugging Face modeling file, read in
transformers 5.19): ``fp32`` where the reference computes the router logits in fp32, ``None`` (vLLM's
own gate, untouched) where it computes them in the model dtype. A family without a reference file
keeps vLLM's port as it is: ``fp32`` where that port builds an fp32 gate, else ``None``.
A family whose vendor publishes its own inference code (DeepSeek-V4) follows that code.
Each entry also says where the plugin is tested on it (:data:`TESTED`).
Imports nothing of vLLM, Triton or this package: the precision resolution reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FP32 = "fp32"
#: How vLLM picks a family's experts from the router logits (:mod:`vllm_router_ext.ops.routing_fp64`).
ROUTINGS = {
    "deepseek": "the config's own: DeepSeek-V3's noaux_tc (sigmoid + correction bias, grouped) or "
    "DeepSeek-V2's softmax (greedy or group-limited)",
    "softmax_topk": "softmax, top-k, renormalised where the config's norm_topk_prob says",
    "softmax_topk_renorm": "softmax over the top-k logits (always renormalised)",
    "sigmoid_bias": "DeepSeek-V3's noaux_tc read from the family's own config keys: sigmoid (or the "
    "config's score) + correction bias choose, on the config's expert groups; the scores weigh",
    "softmax_bias": "softmax scores + correction bias choose, renormalised",
    "sigmoid_topk": "sigmoid of the top-k logits, not renormalised",
    "sqrtsoftplus_bias": "sqrt(softplus) scores + correction bias, renormalised; hash layers first",
    "scored_topk": "the config's score function (sigmoid or softmax), top-k on the scores, renormalised "
    "where the config says; no bias, no groups",
}
#: Routing paths that read the gate's weight in their own kernels and never call the gate: where
#: one is on, a precision of ours cannot apply there (what turns it on, what it does).
BYPASSES = {
    "mega_moe": "--kernel-config moe_backend=deep_gemm_mega_moe: DeepGEMM's MegaMoE computes the "
    "gate GEMM, scores and top-k in its own bf16 kernel (bf16_mega_gate) above 16 tokens",
    "specialized_decode": "additional_config decode_backend=latency_specialized: DeepSeek-V4.1's "
    "specialized decode routes inside its own fused decode kernels",
    "flint_kernels": "Flint's own MoE kernels (NVFP4 experts, or its bf16 decode kernels) route "
    "from the gate's weight inside them",
}
#: Where a family is tested: served by the CPU build, served on the GPU, its model (or MoE block)
#: constructed with our gates and checked against fp64 without an engine.
TESTED = ("CPU build", "GPU", "construction")


@dataclass(frozen=True)
class RoutingKeys:
    """Where a ``sigmoid_bias`` family's config keeps its routing (DeepSeek-V3's noaux_tc: sigmoid
    + correction bias choose, grouped or not) and where its checkpoint keeps the bias, as vLLM
    reads them (a ``scored_topk`` family: its score function and renormalisation). A key of None:
    the fixed value vLLM uses there."""

    renormalize: str | None = "norm_topk_prob"  # None: always renormalised; missing key: True
    groups: tuple[str, str] | None = ("n_group", "topk_group")  # None: one group; missing: one
    grouped: str | None = None  # a flag that turns the groups on (missing: on)
    scale: str | None = "routed_scaling_factor"  # None: vLLM scales by 1.0; missing key: scale_default
    scale_default: float = 1.0
    score: str | None = "scoring_func"  # None or a missing key: ``score_default``
    score_default: str = "sigmoid"
    #: The config key and the value (also its default) under which the correction bias is used.
    bias_if: tuple[str, object] = ("use_routing_bias", True)
    #: Where the bias sits, relative to the MoE block (``{gate}``: the router's own name).
    bias: tuple[str, ...] = ("{gate}.e_score_correction_bias", "e_score_correction_bias")
    #: A config key whose value vLLM multiplies into the gate weight as it loads it (the logits'
    #: scale: Muse-Spark's ``output_multiplier``); None: none.
    weight_scale: str | None = None
    #: The renormalisation key applies to sigmoid scores only; softmax scores are not renormalised.
    renormalize_sigmoid_only: bool = False


@dataclass(frozen=True)
class Release:
    """A published checkpoint of a family: its gate's shape (what the kernels are tuned and
    benchmarked on) and its config.json's routing keys (what the fp64 references replay on that
    gate and a tiny checkpoint of the release copies)."""

    name: str
    hidden: int
    experts: int
    #: The routing keys as the release's config.json states them (``model_type`` included).
    config: dict[str, Any] = field(compare=False, hash=False)
    #: Its architecture, where a tiny checkpoint of it is built (:data:`tiny` set).
    architecture: str | None = None
    #: A tiny checkpoint of this release keeps these besides its routing (shared experts, the
    #: indexer's sizes); None: no tiny checkpoint of this release.
    tiny: dict[str, Any] | None = field(default=None, compare=False, hash=False)
    #: Its gate has another release's shape (timed there), so it is no benchmark shape of its own.
    shape_of: str | None = None


@dataclass(frozen=True)
class MoeFamily:
    name: str
    #: vLLM's architecture names: checkpoints' and the speculative-decoding drafts' (``drafts``).
    architectures: tuple[str, ...]
    #: What ``auto`` runs: a router precision's value, or None for vLLM's own gate.
    auto: str | None
    #: Where the reference computes the router logits, and how.
    reference: str
    drafts: tuple[str, ...] = ()
    #: Where it is tested, a subset of :data:`TESTED`; empty: the table and resolution only.
    tested: tuple[str, ...] = ()
    #: vLLM paths of this family that route without calling the gate, keys of :data:`BYPASSES`.
    bypassed_by: tuple[str, ...] = ()
    #: The Hugging Face ``model_type`` values of its checkpoints, and how vLLM routes them (a key
    #: of :data:`ROUTINGS`): what the fp64 references and the audit replay. None: not replayed.
    model_types: tuple[str, ...] = ()
    routing: str | None = None
    #: The ``sigmoid_bias`` routing's config keys and bias names (:class:`RoutingKeys`).
    keys: RoutingKeys = RoutingKeys()
    #: Its releases' gates (:class:`Release`): the benchmark's and the tuner's shapes.
    releases: tuple[Release, ...] = ()
    #: vLLM's port builds every gate of the family with fp32 logits (an fp32 ``out_dtype`` or weight):
    #: its routing reads them, so ``bf16`` is refused before the engine starts.
    fp32_logits: bool = False
    #: Its architectures whose vLLM forward rounds the gate's logits to the model dtype before the
    #: routing reads them (``router_logits.to(hidden_states.dtype)``): no fp32 logits reach the
    #: choice of experts, so ``auto`` keeps vLLM's gate there and fp32 logits are refused.
    rounds_logits: tuple[str, ...] = ()
    #: The tiny checkpoint the tests build of the family: (its name, the Hugging Face config
    #: beside a tiny body); None: none, or built from its releases' :attr:`Release.tiny`.
    tiny: tuple[str, dict[str, Any]] | None = field(default=None, compare=False, hash=False)


_REF = "transformers {}: {}"
_IN_FP32 = "F.linear(hidden_states.float(), weight.float())"
_IN_MODEL_DTYPE = "F.linear(hidden_states, weight) in the model dtype"
_IN_FP32_WEIGHT = "F.linear(hidden_states.to(weight.dtype), weight), an fp32 weight"
_LINEAR = "nn.Linear router in the model dtype"
_ROUNDED = "vLLM's forward{} rounds the logits to the model dtype before routing, so `auto` keeps its gate"
_NO_REFERENCE = "no reference modeling file read; vLLM's port builds {} gate"
_CPU_GPU_BUILT = ("CPU build", "GPU", "construction")
_CPU_BUILT = ("CPU build", "construction")
_GPU_BUILT = ("GPU", "construction")
_TRANSFORMERS_BACKEND = (
    "the model's own Hugging Face modeling file, which vLLM's Transformers backend runs: it rebuilds "
    "the router as a GateLinear at the dtype it traces there"
)


# --- releases: each one's gate shape and config.json routing (DeepSeek's: n_routed_experts)
# fmt: off


def _deepseek(model_type: str, top_k: int, groups: tuple[int, int], method: str, score: str,
              scale: float, renormalize: bool) -> dict[str, Any]:
    return dict(model_type=model_type, num_experts_per_tok=top_k, n_group=groups[0],
                topk_group=groups[1], topk_method=method, scoring_func=score,
                routed_scaling_factor=scale, norm_topk_prob=renormalize)


_V3, _V2 = "DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"
_INDEXER = dict(n_shared_experts=1, index_n_heads=4, index_head_dim=128, index_topk=64)
_DEEPSEEK_RELEASES = (
    Release("DeepSeek-V3", 7168, 256, _deepseek("deepseek_v3", 8, (8, 4), "noaux_tc", "sigmoid", 2.5, True),
            _V3, dict(n_shared_experts=1)),
    Release("Kimi-K2", 7168, 384, _deepseek("kimi_k2", 8, (1, 1), "noaux_tc", "sigmoid", 2.827, True),
            _V3, dict(n_shared_experts=1)),
    Release("DeepSeek-V2", 5120, 160,
            _deepseek("deepseek_v2", 6, (8, 3), "group_limited_greedy", "softmax", 16.0, False),
            _V2, dict(n_shared_experts=2)),
    Release("DeepSeek-V2-Lite", 2048, 64,
            _deepseek("deepseek_v2", 6, (1, 1), "greedy", "softmax", 1.0, False), _V2,
            dict(n_shared_experts=2)),
)
#: The two DSA models: DeepSeek-V3's routing (V3.2) or GLM-5's, plus the sparse-attention indexer.
_DSA_RELEASES = (
    Release("DeepSeek-V3.2", 7168, 256,
            _deepseek("deepseek_v32", 8, (8, 4), "noaux_tc", "sigmoid", 2.5, True), "DeepseekV32ForCausalLM",
            _INDEXER, shape_of="DeepSeek-V3"),
    Release("GLM-5", 6144, 256, _deepseek("glm_moe_dsa", 8, (1, 1), "noaux_tc", "sigmoid", 2.5, True),
            "GlmMoeDsaForCausalLM", _INDEXER),
)
_V4 = dict(model_type="deepseek_v4", num_experts_per_tok=6, scoring_func="sqrtsoftplus",
           topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5)
_V4_RELEASES = (Release("DeepSeek-V4-Flash", 4096, 256, _V4), Release("DeepSeek-V4-Pro", 7168, 384, _V4))
_GLM4_5 = dict(model_type="glm4_moe", num_experts_per_tok=8, n_group=1, topk_group=1, norm_topk_prob=True,
               routed_scaling_factor=2.5)
_MINIMAX_M2 = dict(model_type="minimax_m2", num_experts_per_tok=8, scoring_func="sigmoid",
                   use_routing_bias=True)
_ERNIE = (Release("ERNIE-4.5-300B-A47B", 8192, 64, dict(model_type="ernie4_5_moe", moe_k=8)),
          Release("ERNIE-4.5-21B-A3B", 2560, 64, dict(model_type="ernie4_5_moe", moe_k=6)))
_QWEN3 = dict(model_type="qwen3_moe", num_experts_per_tok=8, norm_topk_prob=True)
_QWEN3_NEXT = dict(model_type="qwen3_next", num_experts_per_tok=10, norm_topk_prob=True)
_GPT_OSS = dict(model_type="gpt_oss", num_experts_per_tok=4)
_MIXTRAL = dict(model_type="mixtral", num_experts_per_tok=2)
_LLAMA4 = dict(model_type="llama4_text", num_experts_per_tok=1)
#: The releases of the families in vLLM's model packages: each gate's shape and routing keys as
#: transformers 5.22's config class defaults them (its docs name the release they resemble).
_KIMI_LINEAR = Release("Kimi-Linear-48B-A3B", 2304, 256,
                       dict(model_type="kimi_linear", num_experts_per_token=8, moe_renormalize=True,
                            num_expert_group=1, topk_group=1, routed_scaling_factor=2.446))
_MINIMAX_M3 = Release("MiniMax-M3", 6144, 128,
                      dict(model_type="minimax_m3_vl_text", num_experts_per_tok=4, routed_scaling_factor=2.0))
_GLM5_NEXT = Release("GLM-5.3-Flash", 4096, 288,
                     dict(model_type="glm5_next_text", num_experts_per_tok=8, n_group=1, topk_group=1,
                          norm_topk_prob=True, routed_scaling_factor=2.5))
_HY_V4 = Release("Hy4-preview", 2816, 256,
                 dict(model_type="hy_v4", num_experts_per_tok=8, norm_topk_prob=True,
                      routed_scaling_factor=2.827))
_MISTRAL4 = Release("Mistral-Small-4-119B", 4096, 128,
                    dict(model_type="mistral4", num_experts_per_tok=4, n_group=1, topk_group=1,
                         norm_topk_prob=True, routed_scaling_factor=1.0), shape_of="Qwen3-235B-A22B")
_QWEN4_EXP = Release("Qwen4-Exp", 2048, 512,
                     dict(model_type="qwen4_exp_text", num_experts_per_tok=10, norm_topk_prob=True),
                     shape_of="Qwen3-Next-80B")
_MUSE_SPARK = Release("Muse-Spark-Open-816B-A42B", 8192, 256,
                      dict(model_type="muse_spark_text", num_experts_per_tok=8, routed_scaling_factor=1.0,
                           output_multiplier=0.1767766952966369))
_BEAM = Release("Beam-1.0-501B-A23B", 5120, 256,
                dict(model_type="beam", num_experts_per_tok=8, n_group=8, topk_group=4, norm_topk_prob=True,
                     routed_scaling_factor=2.5))
_FLINT = Release("Flint", 2048, 256, dict(model_type="flint", num_experts_per_tok=6, norm_topk_prob=True))

#: StepFun's routing keys (Step-3.5, Step-5): its own names for DeepSeek-V3's noaux_tc on one group.
_STEP_KEYS = RoutingKeys(renormalize="norm_expert_weight", groups=None, scale="moe_router_scaling_factor",
                         score="moe_router_activation", bias_if=("use_moe_router_bias", True),
                         bias=("router_bias",))

# --- tiny checkpoints of the other families (a tiny body; the tests' sizes, the routing's keys)

_TINY_QWEN3 = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], intermediate_size=512,
                   moe_intermediate_size=64, num_experts=32, num_experts_per_tok=4, norm_topk_prob=True)
_TINY_MIXTRAL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], intermediate_size=128,
                     num_local_experts=8, num_experts_per_tok=2)
_TINY_GPT_OSS = dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], intermediate_size=128,
                     num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
                     layer_types=["sliding_attention", "full_attention"])
_TINY_LLAMA4 = dict(model_type="llama4_text", architectures=["Llama4ForCausalLM"], intermediate_size=128,
                    intermediate_size_mlp=256, num_local_experts=8, num_experts_per_tok=1,
                    interleave_moe_layer_step=1, no_rope_layers=[1, 1], attn_temperature_tuning=False)
_TINY_GLM4_MOE = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], intermediate_size=512,
                      moe_intermediate_size=64, n_routed_experts=32, n_shared_experts=1,
                      num_experts_per_tok=4, first_k_dense_replace=1, n_group=1, topk_group=1,
                      norm_topk_prob=True, routed_scaling_factor=2.5, partial_rotary_factor=0.5)
_TINY_MINIMAX_M2 = dict(model_type="minimax_m2", architectures=["MiniMaxM2ForCausalLM"],
                        intermediate_size=64, num_local_experts=32, num_experts_per_tok=4, rotary_dim=32,
                        scoring_func="sigmoid", use_routing_bias=True)
_TINY_ERNIE = dict(model_type="ernie4_5_moe", architectures=["Ernie4_5_MoeForCausalLM"],
                   intermediate_size=512, moe_intermediate_size=64, moe_num_experts=32, moe_k=4,
                   moe_num_shared_experts=1, moe_layer_start_index=1, use_bias=False)
_TINY_QWEN3_NEXT = dict(model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
                        intermediate_size=512, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                        num_experts=32, num_experts_per_tok=4, norm_topk_prob=True, full_attention_interval=2,
                        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=128,
                        linear_value_head_dim=128)
# fmt: on

FAMILIES: tuple[MoeFamily, ...] = (
    MoeFamily("DeepSeek-V2/V3 (Kimi-K2)", ("DeepseekForCausalLM", "DeepseekV2ForCausalLM",
              "DeepseekV3ForCausalLM", "DeepseekV3BidirectionalModel"), FP32,
              _REF.format("deepseek_v3", _IN_FP32),
              drafts=("DeepSeekMTPModel", "EagleDeepSeekMTPModel"), tested=_CPU_GPU_BUILT,
              model_types=("deepseek", "deepseek_v2", "deepseek_v3", "kimi_k2"), routing="deepseek",
              releases=_DEEPSEEK_RELEASES),
    MoeFamily("DeepSeek-V3.2 / GLM-5", ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"), FP32,
              _REF.format("deepseek_v3", _IN_FP32), drafts=("DeepseekV32MTPModel",),
              tested=_GPU_BUILT,
              model_types=("deepseek_v32", "glm_moe_dsa"), routing="deepseek", releases=_DSA_RELEASES),
    MoeFamily("GLM-4.5", ("Glm4MoeForCausalLM",), FP32, _REF.format("glm4_moe", _IN_FP32),
              drafts=("Glm4MoeMTPModel",), tested=_CPU_BUILT,
              model_types=("glm4_moe",), routing="sigmoid_bias",
              releases=(Release("GLM-4.5", 5120, 160, _GLM4_5),),
              tiny=("glm4-moe", _TINY_GLM4_MOE), fp32_logits=True),
    MoeFamily("GLM-4.7-Flash", ("Glm4MoeLiteForCausalLM",), FP32,
              _REF.format("glm4_moe_lite", _IN_FP32), drafts=("Glm4MoeLiteMTPModel",),
              model_types=("glm4_moe_lite",), routing="sigmoid_bias"),
    MoeFamily("MiniMax-M2", ("MiniMaxM2ForCausalLM",), FP32,
              _REF.format("minimax_m2", _IN_FP32_WEIGHT), tested=_GPU_BUILT,
              model_types=("minimax_m2",), routing="sigmoid_bias",
              releases=(Release("MiniMax-M2", 3072, 256, _MINIMAX_M2),),
              tiny=("minimax-m2", _TINY_MINIMAX_M2), fp32_logits=True),
    MoeFamily("ERNIE-4.5", ("Ernie4_5_MoeForCausalLM", "Ernie4_5_VLMoeForConditionalGeneration"), FP32,
              _REF.format("ernie4_5_moe", _IN_FP32 + ", gate.weight kept in fp32"), tested=_CPU_BUILT,
              model_types=("ernie4_5_moe",), routing="softmax_bias",
              releases=_ERNIE,
              tiny=("ernie4.5-moe", _TINY_ERNIE), fp32_logits=True),
    MoeFamily("Hunyuan-V3", ("HYV3ForCausalLM",), FP32, _REF.format("hy_v3", _IN_FP32),
              drafts=("HYV3MTPModel",), model_types=("hy_v3",), routing="sigmoid_bias",
              keys=RoutingKeys(renormalize="route_norm", groups=None, scale="router_scaling_factor",
                               score=None, bias=("expert_bias", "e_score_correction_bias")),
              fp32_logits=True),
    MoeFamily("EXAONE-MoE", ("ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM"), FP32,
              _REF.format("exaone_moe", _IN_FP32), drafts=("ExaoneMoeMTP",), model_types=("exaone_moe",),
              routing="sigmoid_bias", keys=RoutingKeys(score=None)),
    MoeFamily("Nemotron-H", ("NemotronHForCausalLM", "NemotronHPuzzleForCausalLM"), FP32,
              _REF.format("nemotron_h", _IN_FP32), drafts=("NemotronHMTPModel",), model_types=("nemotron_h",),
              routing="sigmoid_bias", keys=RoutingKeys(score=None), fp32_logits=True),
    MoeFamily("LongCat-Flash", ("LongcatFlashForCausalLM",), FP32, _REF.format("longcat_flash", _IN_FP32),
              drafts=("LongCatFlashMTPModel",)),
    MoeFamily("MiMo-V2", ("MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM"), FP32,
              _REF.format("mimo_v2_flash", _IN_FP32), drafts=("MiMoV2MTPModel",),
              model_types=("mimo_v2_flash",), routing="sigmoid_bias",
              keys=RoutingKeys(scale=None, score=None), fp32_logits=True),
    MoeFamily("A.X K1", ("AXK1ForCausalLM",), FP32, _REF.format("axk1", _IN_FP32), model_types=("axk1",),
              routing="sigmoid_bias", keys=RoutingKeys(bias_if=("topk_method", "noaux_tc"))),
    MoeFamily("Bailing / Ling", ("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
              "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM"), FP32,
              _NO_REFERENCE.format("an fp32") + "; " + _ROUNDED.format(" of V1 to V2.5"),
              rounds_logits=("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
                             "BailingMoeV2_5ForCausalLM")),
    MoeFamily("Step-3.5", ("Step3p5ForCausalLM",), FP32, _NO_REFERENCE.format("an fp32"),
              drafts=("Step3p5MTP",), model_types=("step3p5",), routing="sigmoid_bias", keys=_STEP_KEYS,
              fp32_logits=True),
    MoeFamily("Param2-MoE", ("Param2MoEForCausalLM",), None,
              _NO_REFERENCE.format("an fp32") + "; " + _ROUNDED.format(""),
              fp32_logits=True, rounds_logits=("Param2MoEForCausalLM",)),
    MoeFamily("AFMoE (Trinity)", ("AfmoeForCausalLM",), FP32, _NO_REFERENCE.format("an fp32"),
              model_types=("afmoe",), routing="sigmoid_bias",
              keys=RoutingKeys(renormalize="route_norm", scale="route_scale", score="score_func",
                               bias=("expert_bias",), renormalize_sigmoid_only=True), fp32_logits=True),
    MoeFamily("DeepSeek-V4", ("DeepseekV4ForCausalLM", "DeepseekV4ForConditionalGeneration",
              "DeepseekV41ForCausalLM"), FP32,
              "DeepSeek's inference code (DeepSeek-V4 inference/model.py, Gate.forward): "
              "linear(x.float(), weight.float()); transformers deepseek_v4 computes in the model dtype",
              drafts=("DeepSeekV4MTPModel", "DSparkDraftModel", "DSparkV41DraftModel"),
              tested=_GPU_BUILT, bypassed_by=("mega_moe", "specialized_decode"),
              model_types=("deepseek_v4", "deepseek_v41"), routing="sqrtsoftplus_bias",
              releases=_V4_RELEASES, fp32_logits=True),
    MoeFamily("Kimi-K3 / Kimi-Linear", ("KimiLinearForCausalLM", "KimiK3ForConditionalGeneration",
              "KimiK31ForConditionalGeneration"), FP32, _REF.format("kimi_linear", _IN_FP32),
              drafts=("KimiK3MTPModel", "K3DSparkModel"), model_types=("kimi_linear", "kimi_k3"),
              routing="sigmoid_bias",
              keys=RoutingKeys(renormalize="moe_renormalize", groups=("num_expert_group", "topk_group"),
                               grouped="use_grouped_topk", score="moe_router_activation_func"),
              fp32_logits=True,
              releases=(_KIMI_LINEAR,)),
    MoeFamily("MiniMax-M3", ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"), FP32,
              _REF.format("minimax_m3_vl", _IN_FP32_WEIGHT),
              drafts=("MiniMaxM3MTP", "DSparkMiniMaxDraftModel"),
              model_types=("minimax_m3_vl", "minimax_m3_vl_text"), routing="sigmoid_bias",
              keys=RoutingKeys(renormalize=None, groups=None, score=None), fp32_logits=True,
              releases=(_MINIMAX_M3,)),
    MoeFamily("GLM-5-Next", ("Glm5NextForCausalLM", "Glm5NextForConditionalGeneration"), FP32,
              _REF.format("glm5_next", _IN_FP32), drafts=("Glm5NextMTPModel",), bypassed_by=("mega_moe",),
              model_types=("glm5_next", "glm5_next_text"), routing="sigmoid_bias",
              keys=RoutingKeys(bias_if=("topk_method", "noaux_tc")),
              releases=(_GLM5_NEXT,)),
    MoeFamily("Hunyuan-V4", ("HYV4ForCausalLM",), FP32, _REF.format("hy_v4", _IN_FP32),
              drafts=("HYV4MTPModel",), model_types=("hy_v4",), routing="sigmoid_bias",
              keys=RoutingKeys(groups=None, score=None), fp32_logits=True,
              releases=(_HY_V4,)),
    MoeFamily("Step-5", ("Step5ForCausalLM", "Step5ForConditionalGeneration"), FP32,
              _NO_REFERENCE.format("an fp32"), drafts=("Step5MTP",), model_types=("step5", "step5_vl"),
              routing="sigmoid_bias",
              keys=_STEP_KEYS, fp32_logits=True),
    MoeFamily("Beam", ("BeamForCausalLM",), FP32, _NO_REFERENCE.format("an fp32"),
              drafts=("DFlash2BeamDraftModel",), model_types=("beam",), routing="sigmoid_bias",
              keys=RoutingKeys(score=None), fp32_logits=True,
              releases=(_BEAM,)),
    MoeFamily("Qwen3-MoE", ("Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration"), None,
              _REF.format("qwen3_moe", _IN_MODEL_DTYPE), tested=_CPU_GPU_BUILT,
              model_types=("qwen3_moe", "qwen3_vl_moe_text"), routing="softmax_topk",
              releases=(Release("Qwen3-235B-A22B", 4096, 128, _QWEN3),
                        Release("Qwen3-30B-A3B", 2048, 128, _QWEN3)),
              tiny=("qwen3-moe", _TINY_QWEN3)),
    MoeFamily("Qwen3-Next", ("Qwen3NextForCausalLM",), None, _REF.format("qwen3_next", _IN_MODEL_DTYPE),
              drafts=("Qwen3NextMTP",), tested=_CPU_GPU_BUILT,
              model_types=("qwen3_next",), routing="softmax_topk",
              releases=(Release("Qwen3-Next-80B", 2048, 512, _QWEN3_NEXT),),
              tiny=("qwen3-next", _TINY_QWEN3_NEXT)),
    MoeFamily("Qwen3.5-MoE", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), None,
              _REF.format("qwen3_5_moe", _IN_MODEL_DTYPE), drafts=("Qwen3_5MoeMTP",),
              model_types=("qwen3_5_moe", "qwen3_5_moe_text"), routing="softmax_topk"),
    MoeFamily("Qwen2-MoE", ("Qwen2MoeForCausalLM",), None, _REF.format("qwen2_moe", _IN_MODEL_DTYPE),
              model_types=("qwen2_moe",), routing="softmax_topk"),
    MoeFamily("gpt-oss", ("GptOssForCausalLM",), None,
              _REF.format("gpt_oss", "F.linear(hidden_states, weight, bias) in the model dtype"),
              tested=_CPU_GPU_BUILT,
              model_types=("gpt_oss",), routing="softmax_topk_renorm",
              releases=(Release("gpt-oss-120b", 2880, 128, _GPT_OSS),
                        Release("gpt-oss-20b", 2880, 32, _GPT_OSS)),
              tiny=("gpt-oss", _TINY_GPT_OSS)),
    MoeFamily("Mixtral", ("MixtralForCausalLM",), None, _REF.format("mixtral", _IN_MODEL_DTYPE),
              tested=_CPU_BUILT,
              model_types=("mixtral",), routing="softmax_topk_renorm",
              releases=(Release("Mixtral-8x7B", 4096, 8, _MIXTRAL),
                        Release("Mixtral-8x22B", 6144, 8, _MIXTRAL)),
              tiny=("mixtral", _TINY_MIXTRAL)),
    MoeFamily("Llama-4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), None,
              _REF.format("llama4", _LINEAR), drafts=("EagleLlama4ForCausalLM",), tested=_CPU_BUILT,
              model_types=("llama4_text",), routing="sigmoid_topk",
              releases=(Release("Llama-4-Scout", 5120, 16, _LLAMA4),
                        Release("Llama-4-Maverick", 5120, 128, _LLAMA4)),
              tiny=("llama4", _TINY_LLAMA4)),
    MoeFamily("OLMoE", ("OlmoeForCausalLM",), None, _REF.format("olmoe", _IN_MODEL_DTYPE),
              model_types=("olmoe",), routing="softmax_topk"),
    MoeFamily("PhiMoE", ("PhiMoEForCausalLM",), None, _REF.format("phimoe", _LINEAR)),
    MoeFamily("GraniteMoE", ("GraniteMoeForCausalLM",), None,
              _REF.format("granitemoe", "F.linear(hidden_states, weight).float(): a model-dtype GEMM"),
              model_types=("granitemoe",), routing="softmax_topk_renorm"),
    MoeFamily("DBRX", ("DbrxForCausalLM",), None, _REF.format("dbrx", _LINEAR)),
    MoeFamily("Jamba", ("JambaForCausalLM", "JambaForSequenceClassification"), None,
              _REF.format("jamba", _LINEAR), model_types=("jamba",), routing="softmax_topk"),
    MoeFamily("Cohere2-MoE", ("Cohere2MoeForCausalLM",), None, _REF.format("cohere2_moe", _IN_MODEL_DTYPE),
              model_types=("cohere2_moe",), routing="scored_topk",
              keys=RoutingKeys(score="expert_selection_fn", score_default="softmax")),
    MoeFamily("LFM2-MoE", ("Lfm2MoeForCausalLM",), None, _REF.format("lfm2_moe", _IN_MODEL_DTYPE),
              model_types=("lfm2_moe",), routing="sigmoid_bias",
              keys=RoutingKeys(groups=None, score=None, bias_if=("use_expert_bias", True),
                               bias=("expert_bias", "{gate}.e_score_correction_bias"))),
    MoeFamily("Laguna", ("LagunaForCausalLM",), None,
              _REF.format("laguna", "F.linear(hidden_states, weight).float(): a model-dtype GEMM"),
              model_types=("laguna",), routing="sigmoid_bias",
              keys=RoutingKeys(renormalize=None, groups=None, scale=None, score=None,
                               bias=("experts.e_score_correction_bias",))),
    MoeFamily("Gemma-4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), None,
              _REF.format("gemma4", "self.proj(hidden_states) in the model dtype"),
              drafts=("Gemma4MTPModel",), fp32_logits=True),
    MoeFamily("MiniCPM", ("MiniCPMForCausalLM",), None, _NO_REFERENCE.format("a model-dtype"),
              model_types=("minicpm",), routing="softmax_topk_renorm"),
    MoeFamily("Step-3", ("Step3TextForCausalLM",), None, _NO_REFERENCE.format("a model-dtype"),
              model_types=("step3_text",), routing="softmax_topk",
              keys=RoutingKeys(renormalize="norm_expert_weight")),
    MoeFamily("openPangu", ("PanguProMoEV2ForCausalLM", "PanguUltraMoEForCausalLM"), None,
              _NO_REFERENCE.format("a model-dtype"), drafts=("OpenPanguMTPModel",)),
    MoeFamily("Sarvam", ("SarvamMoEForCausalLM", "SarvamMLAForCausalLM"), None,
              _NO_REFERENCE.format("a model-dtype"), model_types=("sarvam_mla",), routing="sigmoid_bias",
              keys=RoutingKeys(score="score_function", scale_default=2.5,
                               bias_if=("moe_router_enable_expert_bias", True))),
    MoeFamily("K2-Horizon", ("K2HorizonForCausalLM",), None, _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("Moondream3", ("Moondream3ForCausalLM", "HfMoondream"), None,
              _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("AliceAI", ("AliceAIForCausalLM",), None, _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("Nomic-BERT-MoE", ("NomicBertModel",), None, _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("Intern-S1-Pro / S2", ("InternS1ProForConditionalGeneration",
              "InternS2MobiusForConditionalGeneration"), None, _NO_REFERENCE.format("a model-dtype"),
              drafts=("InternS2MobiusMTP",)),
    MoeFamily("Mistral-Large-4", ("MistralLarge4ForCausalLM",), None,
              _REF.format("mistral4", _IN_MODEL_DTYPE),
              drafts=("MistralLarge4DSparkModel",), model_types=("mistral4",), routing="softmax_topk",
              fp32_logits=True,
              releases=(_MISTRAL4,)),
    MoeFamily("Qwen4-Exp", ("Qwen4ExpForCausalLM", "Qwen4ExpForConditionalGeneration"), None,
              _REF.format("qwen4_exp", _IN_MODEL_DTYPE), drafts=("Qwen4ExpMTP",),
              model_types=("qwen4_exp", "qwen4_exp_text"), routing="softmax_topk",
              releases=(_QWEN4_EXP,)),
    MoeFamily("Flint", ("FlintForCausalLM",), None, _NO_REFERENCE.format("a model-dtype"),
              bypassed_by=("flint_kernels",), model_types=("flint",), routing="scored_topk",
              keys=RoutingKeys(score="router_score_function"),
              releases=(_FLINT,)),
    MoeFamily("Muse-Spark", ("MuseSparkForConditionalGeneration",), None,
              _REF.format("muse_spark", _IN_FP32 + " x output_multiplier; vLLM's port already holds "
                          "the router in fp32 (fp32 weight, the multiplier folded in, fp32 logits)"),
              drafts=("MuseSparkDSparkModel",), model_types=("muse_spark", "muse_spark_text"),
              routing="sigmoid_bias",
              keys=RoutingKeys(renormalize=None, groups=None, score=None, weight_scale="output_multiplier",
                               bias=("{gate}.e_score_correction_bias", "expert_bias")),
              releases=(_MUSE_SPARK,)),
    # vLLM's config class is DeepSeek-V3's with one expert group: a key the checkpoint leaves out
    # takes V3's default (noaux_tc, sigmoid, renormalised, scale 2.5), the groups one.
    MoeFamily("dots.3-note", ("Dots3NoteForCausalLM",), None,
              _NO_REFERENCE.format("DeepSeek-V3.2's MoE block with a model-dtype"),
              drafts=("Dots3NoteMTPModel",), model_types=("dots3_note",), routing="sigmoid_bias",
              keys=RoutingKeys(bias_if=("topk_method", "noaux_tc"), scale_default=2.5)),
    MoeFamily("Transformers backend (MoE)", ("TransformersMoEForCausalLM",
              "TransformersMultiModalMoEForCausalLM", "TransformersMoEEmbeddingModel",
              "TransformersMoEForSequenceClassification", "FlexOlmoForCausalLM", "HunYuanMoEV1ForCausalLM",
              "MellumForCausalLM", "Kolibri1ForCausalLM", "AriaForConditionalGeneration"),
              None, _TRANSFORMERS_BACKEND, drafts=("TransformersMoEForMTP",)),
)  # fmt: skip

_BY_ARCH: dict[str, MoeFamily] = {
    arch: family for family in FAMILIES for arch in family.architectures + family.drafts
}
DRAFTS: frozenset[str] = frozenset(a for f in FAMILIES for a in f.drafts)


RELEASES: tuple[Release, ...] = tuple(r for f in FAMILIES for r in f.releases)


def family_of(architecture: str | None) -> MoeFamily | None:
    """The family of a vLLM architecture name (a checkpoint's or a draft's), None if none."""
    return _BY_ARCH.get(architecture or "")


def is_draft(architecture: str | None) -> bool:
    return architecture in DRAFTS
