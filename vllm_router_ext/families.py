"""The MoE families whose router vLLM builds with ``GateLinear``, and what ``auto`` runs for each.

``auto`` follows the family's reference implementation (its Hugging Face modeling file, read in
transformers 5.19): ``fp32`` where the reference computes the router logits in fp32, ``None`` (vLLM's
own gate, untouched) where it computes them in the model dtype. A family without a reference file
keeps vLLM's port as it is: ``fp32`` where that port builds an fp32 gate, else ``None``.
Imports nothing of vLLM, Triton or this package: the precision resolution reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = "fp32"


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


_REF = "transformers {}: {}"
_IN_FP32 = "F.linear(hidden_states.float(), weight.float())"
_IN_MODEL_DTYPE = "F.linear(hidden_states, weight) in the model dtype"
_LINEAR = "nn.Linear router in the model dtype"
_NO_REFERENCE = "no reference modeling file read; vLLM's port builds {} gate"

FAMILIES: tuple[MoeFamily, ...] = (
    MoeFamily("DeepSeek-V2/V3 (Kimi-K2)", ("DeepseekForCausalLM", "DeepseekV2ForCausalLM",
              "DeepseekV3ForCausalLM", "DeepseekV3BidirectionalModel"), FP32,
              _REF.format("deepseek_v3", _IN_FP32),
              drafts=("DeepSeekMTPModel", "EagleDeepSeekMTPModel")),
    MoeFamily("DeepSeek-V3.2 / GLM-5", ("DeepseekV32ForCausalLM", "GlmMoeDsaForCausalLM"), FP32,
              _REF.format("deepseek_v3", _IN_FP32), drafts=("DeepseekV32MTPModel",)),
    MoeFamily("GLM-4.5", ("Glm4MoeForCausalLM",), FP32, _REF.format("glm4_moe", _IN_FP32),
              drafts=("Glm4MoeMTPModel",)),
    MoeFamily("GLM-4.7-Flash", ("Glm4MoeLiteForCausalLM",), FP32,
              _REF.format("glm4_moe_lite", _IN_FP32), drafts=("Glm4MoeLiteMTPModel",)),
    MoeFamily("MiniMax-M2", ("MiniMaxM2ForCausalLM",), FP32,
              _REF.format("minimax_m2", "F.linear(hidden_states.to(weight.dtype), weight), an fp32 weight")),
    MoeFamily("ERNIE-4.5", ("Ernie4_5_MoeForCausalLM", "Ernie4_5_VLMoeForConditionalGeneration"), FP32,
              _REF.format("ernie4_5_moe", _IN_FP32 + ", gate.weight kept in fp32")),
    MoeFamily("Hunyuan-V3", ("HYV3ForCausalLM",), FP32, _REF.format("hy_v3", _IN_FP32),
              drafts=("HYV3MTPModel",)),
    MoeFamily("EXAONE-MoE", ("ExaoneMoEForCausalLM", "ExaoneMoeForCausalLM"), FP32,
              _REF.format("exaone_moe", _IN_FP32), drafts=("ExaoneMoeMTP",)),
    MoeFamily("Nemotron-H", ("NemotronHForCausalLM", "NemotronHPuzzleForCausalLM"), FP32,
              _REF.format("nemotron_h", _IN_FP32), drafts=("NemotronHMTPModel",)),
    MoeFamily("LongCat-Flash", ("LongcatFlashForCausalLM",), FP32, _REF.format("longcat_flash", _IN_FP32),
              drafts=("LongCatFlashMTPModel",)),
    MoeFamily("MiMo-V2", ("MiMoV2ForCausalLM", "MiMoV2FlashForCausalLM"), FP32,
              _REF.format("mimo_v2_flash", _IN_FP32), drafts=("MiMoV2MTPModel",)),
    MoeFamily("A.X K1", ("AXK1ForCausalLM",), FP32, _REF.format("axk1", _IN_FP32)),
    MoeFamily("Bailing / Ling", ("BailingMoeForCausalLM", "BailingMoeV2ForCausalLM",
              "BailingMoeV2_5ForCausalLM", "BailingMoeV3ForCausalLM"), FP32, _NO_REFERENCE.format("an fp32")),
    MoeFamily("Step-3.5", ("Step3p5ForCausalLM",), FP32, _NO_REFERENCE.format("an fp32"),
              drafts=("Step3p5MTP",)),
    MoeFamily("Param2-MoE", ("Param2MoEForCausalLM",), FP32, _NO_REFERENCE.format("an fp32")),
    MoeFamily("AFMoE (Trinity)", ("AfmoeForCausalLM",), FP32, _NO_REFERENCE.format("an fp32")),
    MoeFamily("Qwen3-MoE", ("Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration"), None,
              _REF.format("qwen3_moe", _IN_MODEL_DTYPE)),
    MoeFamily("Qwen3-Next", ("Qwen3NextForCausalLM",), None, _REF.format("qwen3_next", _IN_MODEL_DTYPE),
              drafts=("Qwen3NextMTP",)),
    MoeFamily("Qwen3.5-MoE", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), None,
              _REF.format("qwen3_5_moe", _IN_MODEL_DTYPE), drafts=("Qwen3_5MoeMTP",)),
    MoeFamily("Qwen2-MoE", ("Qwen2MoeForCausalLM",), None, _REF.format("qwen2_moe", _IN_MODEL_DTYPE)),
    MoeFamily("gpt-oss", ("GptOssForCausalLM",), None,
              _REF.format("gpt_oss", "F.linear(hidden_states, weight, bias) in the model dtype")),
    MoeFamily("Mixtral", ("MixtralForCausalLM",), None, _REF.format("mixtral", _IN_MODEL_DTYPE)),
    MoeFamily("Llama-4", ("Llama4ForCausalLM", "Llama4ForConditionalGeneration"), None,
              _REF.format("llama4", _LINEAR), drafts=("EagleLlama4ForCausalLM",)),
    MoeFamily("OLMoE", ("OlmoeForCausalLM",), None, _REF.format("olmoe", _IN_MODEL_DTYPE)),
    MoeFamily("PhiMoE", ("PhiMoEForCausalLM",), None, _REF.format("phimoe", _LINEAR)),
    MoeFamily("GraniteMoE", ("GraniteMoeForCausalLM",), None,
              _REF.format("granitemoe", "F.linear(hidden_states, weight).float(): a model-dtype GEMM")),
    MoeFamily("DBRX", ("DbrxForCausalLM",), None, _REF.format("dbrx", _LINEAR)),
    MoeFamily("Jamba", ("JambaForCausalLM", "JambaForSequenceClassification"), None,
              _REF.format("jamba", _LINEAR)),
    MoeFamily("Cohere2-MoE", ("Cohere2MoeForCausalLM",), None, _REF.format("cohere2_moe", _IN_MODEL_DTYPE)),
    MoeFamily("LFM2-MoE", ("Lfm2MoeForCausalLM",), None, _REF.format("lfm2_moe", _IN_MODEL_DTYPE)),
    MoeFamily("Laguna", ("LagunaForCausalLM",), None,
              _REF.format("laguna", "F.linear(hidden_states, weight).float(): a model-dtype GEMM")),
    MoeFamily("Gemma-4", ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"), None,
              _REF.format("gemma4", "self.proj(hidden_states) in the model dtype"),
              drafts=("Gemma4MTPModel",)),
    MoeFamily("MiniCPM", ("MiniCPMForCausalLM",), None, _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("Step-3", ("Step3TextForCausalLM",), None, _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("openPangu", ("PanguProMoEV2ForCausalLM", "PanguUltraMoEForCausalLM"), None,
              _NO_REFERENCE.format("a model-dtype"), drafts=("OpenPanguMTPModel",)),
    MoeFamily("Sarvam", ("SarvamMoEForCausalLM", "SarvamMLAForCausalLM"), None,
              _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("K2-Horizon", ("K2HorizonForCausalLM",), None, _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("Moondream3", ("Moondream3ForCausalLM", "HfMoondream"), None,
              _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("AliceAI", ("AliceAIForCausalLM",), None, _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("Nomic-BERT-MoE", ("NomicBertModel",), None, _NO_REFERENCE.format("a model-dtype")),
    MoeFamily("Intern-S1-Pro / S2", ("InternS1ProForConditionalGeneration",
              "InternS2MobiusForConditionalGeneration"), None, _NO_REFERENCE.format("a model-dtype"),
              drafts=("InternS2MobiusMTP",)),
)  # fmt: skip

_BY_ARCH: dict[str, MoeFamily] = {
    arch: family for family in FAMILIES for arch in family.architectures + family.drafts
}
DRAFTS: frozenset[str] = frozenset(a for f in FAMILIES for a in f.drafts)


def family_of(architecture: str | None) -> MoeFamily | None:
    """The family of a vLLM architecture name (a checkpoint's or a draft's), None if none."""
    return _BY_ARCH.get(architecture or "")


def is_draft(architecture: str | None) -> bool:
    return architecture in DRAFTS
