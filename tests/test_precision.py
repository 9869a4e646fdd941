"""Precision modes and their resolution order (no vLLM)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from vllm_router_ext.precision import (
    CLI_CONFIG_KEY,
    CONFIG_KEY,
    ENV_VAR,
    RouterPrecision,
    bf16_round_trip_exact,
    resolve_batch_invariant,
    resolve_router_precision,
    resolve_router_settings,
)

# Precedence order, highest first, with the keyword resolve_router_precision takes.
SOURCES = ["cli", "additional_config", "env", "hf_config"]
CONCRETE = ["fp32", "bf16-fp32out", "bf16"]


def test_values_are_exactly_the_documented_ones():
    assert RouterPrecision.choices() == ["auto", "fp32", "bf16-fp32out", "bf16"]
    assert RouterPrecision.FP32.logits_dtype == torch.float32
    assert RouterPrecision.BF16_FP32OUT.logits_dtype == torch.float32
    assert RouterPrecision.BF16.logits_dtype is None


@pytest.mark.parametrize("source", SOURCES)
@pytest.mark.parametrize("value", CONCRETE)
def test_each_source_alone(source, value):
    p, src, overridden = resolve_router_precision(architecture="DeepseekV3ForCausalLM", **{source: value})
    assert p.value == value and overridden == ()


@pytest.mark.parametrize("hi,lo", list(itertools.combinations(SOURCES, 2)))
def test_every_pair_of_conflicting_sources_higher_wins(hi, lo):
    p, src, overridden = resolve_router_precision(
        architecture="DeepseekV3ForCausalLM", **{hi: "fp32", lo: "bf16"}
    )
    assert p is RouterPrecision.FP32
    assert len(overridden) == 1 and overridden[0][1] == "bf16"
    # ...and the other way round.
    p, _, overridden = resolve_router_precision(
        architecture="DeepseekV3ForCausalLM", **{hi: "bf16", lo: "fp32"}
    )
    assert p is RouterPrecision.BF16 and overridden[0][1] == "fp32"


@pytest.mark.parametrize("source", SOURCES)
def test_every_source_beats_moe_router_dtype(source):
    p, _, overridden = resolve_router_precision(
        architecture="DeepseekV3ForCausalLM", moe_router_dtype="float32", **{source: "bf16"}
    )
    assert p is RouterPrecision.BF16 and overridden == (("HF config moe_router_dtype='float32'", "fp32"),)


def test_moe_router_dtype_beats_architecture_table():
    p, src, _ = resolve_router_precision(architecture="DeepseekV3ForCausalLM", moe_router_dtype="float32")
    assert p is RouterPrecision.FP32 and "moe_router_dtype" in src


@pytest.mark.parametrize(
    "arch",
    [
        "DeepseekV2ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV32ForCausalLM",
        "GlmMoeDsaForCausalLM",
        "DeepSeekMTPModel",  # speculative-decoding drafts route like their target
        "DeepseekV32MTPModel",
        "EagleDeepSeekMTPModel",
    ],
)
def test_architecture_table(arch):
    p, src, _ = resolve_router_precision(architecture=arch)
    assert p is RouterPrecision.FP32 and src == f"auto: architecture {arch}"


def test_auto_follows_each_familys_reference():
    p, src, _ = resolve_router_precision(architecture="Glm4MoeForCausalLM")  # fp32 reference
    assert p is RouterPrecision.FP32 and src == "auto: architecture Glm4MoeForCausalLM"
    p, src, _ = resolve_router_precision(architecture="Qwen3MoeForCausalLM")  # model-dtype reference
    assert p is None and src == "auto: Qwen3-MoE routes on model-dtype logits (Qwen3MoeForCausalLM)"
    p, src, _ = resolve_router_precision(architecture="LlamaForCausalLM")
    assert p is None and "not in the family table" in src


def test_where_vllm_rounds_the_logits_to_the_model_dtype_auto_keeps_its_gate_and_fp32_is_refused():
    """Bailing V1-V2.5 and Param2-MoE round the gate's logits to bf16 before routing: ``auto`` keeps
    vLLM's gate there (Bailing V3 routes on them: fp32); an fp32-output mode stops the start-up with
    one line naming the model, the source and what it allows; ``bf16`` applies unless the gate is
    fp32 (Param2-MoE: only ``auto``)."""
    from vllm_router_ext.families import family_of
    from vllm_router_ext.precision import RouterSettings, check_family_logits

    for arch in ("BailingMoeV2ForCausalLM", "BailingMoeV2_5ForCausalLM", "Param2MoEForCausalLM"):
        p, src, _ = resolve_router_precision(architecture=arch)
        name = family_of(arch).name
        assert p is None and src == f"auto: {name} rounds its gate's logits to the model dtype ({arch})"
    assert resolve_router_precision(architecture="BailingMoeV3ForCausalLM")[0] is RouterPrecision.FP32

    def settings(precision, arch):
        return RouterSettings(RouterPrecision(precision), "--router-precision", model=f"M ({arch})")

    for precision in ("fp32", "bf16-fp32out"):
        with pytest.raises(ValueError) as e:
            check_family_logits(settings(precision, "BailingMoeV2ForCausalLM"), "BailingMoeV2ForCausalLM")
        assert str(e.value) == (
            f"vllm-router-ext: router precision {precision} (from --router-precision) cannot apply to M "
            "(BailingMoeV2ForCausalLM): vLLM rounds its gate's logits to the model dtype before routing "
            "(router_logits.to(hidden_states.dtype)), so no fp32 logits reach the choice of experts; "
            "allowed for this model: auto, bf16"
        )
        check_family_logits(settings(precision, "BailingMoeV3ForCausalLM"), "BailingMoeV3ForCausalLM")
    check_family_logits(settings("bf16", "BailingMoeV2ForCausalLM"), "BailingMoeV2ForCausalLM")
    with pytest.raises(ValueError, match="allowed for this model: auto$"):
        check_family_logits(settings("bf16", "Param2MoEForCausalLM"), "Param2MoEForCausalLM")
    with pytest.raises(
        ValueError, match="routes on fp32 logits .* allowed for this model: auto, fp32, bf16-"
    ):
        check_family_logits(settings("bf16", "DeepseekV4ForCausalLM"), "DeepseekV4ForCausalLM")
    check_family_logits(RouterSettings(None, "auto"), "Param2MoEForCausalLM")


def test_every_family_names_a_reference_that_says_what_auto_runs():
    """Each family's reference file exists in the installed transformers, and an fp32 ``auto``
    comes with an fp32 router line in it."""
    import importlib.util
    from pathlib import Path

    from vllm_router_ext.families import FAMILIES, family_of

    root = Path(importlib.util.find_spec("transformers").origin).parent / "models"
    missing = []
    archs = [a for f in FAMILIES for a in f.architectures + f.drafts]
    assert len(archs) == len(set(archs))  # one family per architecture
    for family in FAMILIES:
        assert all(family_of(a) is family for a in family.architectures + family.drafts)
        assert family.auto in (None, "fp32")
        if family.reference.startswith(("DeepSeek's inference code", "the model's own Hugging Face")):
            continue  # the vendor's code (not installed here); the Transformers backend runs HF's own
        if not family.reference.startswith("transformers "):
            assert family.reference.startswith("no reference modeling file read")
            continue
        name = family.reference.split()[1].rstrip(":")
        path = root / name / f"modeling_{name}.py"
        if not path.is_file():  # newer than this transformers: so must the vLLM that runs it be
            missing.append(family)
            continue
        source = path.read_text(encoding="utf-8")
        fp32_router = any(
            s in source for s in ("hidden_states.type(torch.float32)", "F.linear(hidden_states.float()",
                                  "dtype=torch.float32)", "hidden_states.to(self.weight.dtype)")
        )  # fmt: skip
        if family.auto == "fp32":
            assert fp32_router, family.name
    from vllm.model_executor.models.registry import ModelRegistry

    supported = set(ModelRegistry.get_supported_archs())
    assert not [f.name for f in missing if supported & set(f.architectures)]


def test_auto_means_not_set_at_that_level():
    p, src, _ = resolve_router_precision(architecture="DeepseekV3ForCausalLM", cli="auto", env="fp32")
    assert p is RouterPrecision.FP32 and ENV_VAR in src


@pytest.mark.parametrize("source", SOURCES)
def test_invalid_value_names_source_and_allowed(source):
    with pytest.raises(ValueError) as e:
        resolve_router_precision(architecture="DeepseekV3ForCausalLM", **{source: "fp16-ish"})
    msg = str(e.value)
    assert "'fp16-ish'" in msg and "fp32, bf16-fp32out, bf16" in msg
    expected = {
        "cli": "--router-precision",
        "additional_config": CONFIG_KEY,
        "env": ENV_VAR,
        "hf_config": "HF config",
    }
    assert expected[source] in msg


def test_invalid_value_in_a_losing_source_is_still_an_error():
    with pytest.raises(ValueError, match=ENV_VAR):
        resolve_router_precision(architecture="DeepseekV3ForCausalLM", cli="fp32", env="nonsense")


def _vllm_config(extra=None, hf=None, arch="DeepseekV3ForCausalLM"):
    hf_config = SimpleNamespace(architectures=[arch], **(hf or {}))
    return SimpleNamespace(model_config=SimpleNamespace(hf_config=hf_config), additional_config=extra or {})


def test_resolve_from_vllm_config_all_sources(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "bf16")
    cfg = _vllm_config(
        extra={CLI_CONFIG_KEY: "fp32", CONFIG_KEY: "bf16-fp32out"},
        hf={"router_precision": "bf16", "moe_router_dtype": "float32"},
    )
    s = resolve_router_settings(cfg)
    assert s.precision is RouterPrecision.FP32 and s.source == "--router-precision"
    assert {v for _, v in s.overridden} == {"bf16-fp32out", "bf16"}
    monkeypatch.delenv(ENV_VAR)
    s = resolve_router_settings(_vllm_config(hf={"router_precision": "bf16"}))
    assert s.precision is RouterPrecision.BF16 and "HF config" in s.source


def test_batch_invariant_sources(monkeypatch):
    assert resolve_batch_invariant() == (False, "default")
    assert resolve_batch_invariant(cli=True)[0]
    assert resolve_batch_invariant(additional_config="true")[0]
    assert resolve_batch_invariant(vllm_batch_invariant=True) == (True, "VLLM_BATCH_INVARIANT=1")
    with pytest.raises(ValueError, match="'maybe'.*allowed: true, false"):
        resolve_batch_invariant(additional_config="maybe")
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert resolve_router_settings(_vllm_config()).batch_invariant


def test_bf16_round_trip_exactness(gen):
    w = torch.randn(16, 64, generator=gen)
    assert not bf16_round_trip_exact(w)
    assert bf16_round_trip_exact(w.to(torch.bfloat16).float())
    assert bf16_round_trip_exact(w.to(torch.bfloat16))


def test_the_docs_family_table_is_the_code_table():
    from pathlib import Path

    from vllm_router_ext.families import FAMILIES

    text = (Path(__file__).resolve().parents[1] / "docs" / "precision.md").read_text(encoding="utf-8")
    rows = [ln.split("|") for ln in text.splitlines() if ln.startswith("| ") and ln.count("|") == 6]
    documented = {r[1].strip(): (r[3].strip(), r[5].strip()) for r in rows}
    for family in FAMILIES:
        tested = ", ".join(family.tested) or "resolution only"
        auto = "`fp32`" if family.auto else "vLLM's gate"
        assert documented.get(family.name) == (auto, tested), family.name
        assert all(f"`{a}`" in text for a in family.architectures + family.drafts), family.name


def test_a_draft_takes_its_own_precision_where_set_and_the_targets_otherwise(monkeypatch):
    """``--router-precision-draft`` / ``additional_config["router_precision_draft"]`` applies to a
    speculative draft only (MTP layers, DSpark); ``vllm`` keeps vLLM's own gate in the draft;
    unset or ``auto``: the target's; a bad value fails every model's start-up, naming the values."""
    from vllm_router_ext.precision import CLI_DRAFT_CONFIG_KEY, DRAFT_CONFIG_KEY

    monkeypatch.delenv(ENV_VAR, raising=False)
    extra = {CLI_CONFIG_KEY: "fp32", CLI_DRAFT_CONFIG_KEY: "bf16-fp32out"}
    target = resolve_router_settings(_vllm_config(extra=extra))
    assert target.precision is RouterPrecision.FP32 and target.source == "--router-precision"
    draft = resolve_router_settings(_vllm_config(extra=extra, arch="DeepSeekMTPModel"))
    assert draft.precision is RouterPrecision.BF16_FP32OUT and draft.source == "--router-precision-draft"
    assert draft.asked == ("router precision bf16-fp32out (from --router-precision-draft)",)
    kept = resolve_router_settings(_vllm_config(extra={DRAFT_CONFIG_KEY: "vllm"}, arch="DSparkDraftModel"))
    assert kept.precision is None and "vLLM's own gate for the draft" in kept.source and not kept.asked
    assert resolve_router_settings(_vllm_config(arch="DSparkDraftModel")).precision is RouterPrecision.FP32
    same = resolve_router_settings(_vllm_config(extra={DRAFT_CONFIG_KEY: "auto"}, arch="DeepSeekV4MTPModel"))
    assert same.precision is RouterPrecision.FP32 and same.source == "auto: architecture DeepSeekV4MTPModel"
    for arch in ("DeepseekV3ForCausalLM", "DeepSeekMTPModel"):
        with pytest.raises(ValueError) as e:
            resolve_router_settings(_vllm_config(extra={DRAFT_CONFIG_KEY: "fp16"}, arch=arch))
        assert str(e.value) == (
            "invalid draft router precision 'fp16' from additional_config['router_precision_draft']; "
            "allowed values: auto, fp32, bf16-fp32out, bf16, vllm"
        )
