"""The family table's "tested" column is what the tests run: each claim names a test that serves
or builds one of the family's architectures, and each family those tests run claims it."""

from __future__ import annotations

from vllm_router_ext.families import FAMILIES, TESTED, family_of
from vllm_router_ext.tools.tiny_checkpoint import (
    FAMILY_PRESETS,
    ROUTING_PRESETS,
    TINY_V4,
    V41_ARCHITECTURE,
)


def _arch(preset: str) -> str:
    v4 = {"deepseek-v4": TINY_V4, "deepseek-v4.1": V41_ARCHITECTURE}
    config = {**v4, **ROUTING_PRESETS, **FAMILY_PRESETS}[preset]
    return config["architectures"][0]


def _runs() -> dict[str, set[str]]:
    """Per kind, the families that tests run."""
    import test_architectures
    import test_gpu_vllm
    import test_vllm_families

    cpu = {_arch(p) for p, _ in test_vllm_families.SERVED} | {"DeepseekV3ForCausalLM"}  # test_vllm_serve
    gpu = {_arch(spec.model) for spec in test_gpu_vllm.SPECS.values()}
    built = {_arch(p) for p in [*ROUTING_PRESETS, *test_architectures.BUILT]}
    built |= set(test_architectures.V4_ARCHITECTURES)
    runs = {"CPU build": cpu, "GPU": gpu, "construction": built}
    assert set(runs) == set(TESTED)
    return {kind: {family_of(a).name for a in archs} for kind, archs in runs.items()}


def test_the_tested_column_is_what_the_tests_run():
    runs = _runs()
    for family in FAMILIES:
        assert set(family.tested) <= set(TESTED), family.name
        claimed = {kind for kind in TESTED if kind in family.tested}
        ran = {kind for kind in TESTED if family.name in runs[kind]}
        assert claimed == ran, (family.name, claimed, ran)


def test_each_family_says_how_it_is_routed_and_the_references_read_it():
    """A family's ``model_types`` and ``routing`` are its own facts: one family per model type, a
    routing that the references know, and the references' tables are exactly those facts."""
    from vllm_router_ext.families import ROUTINGS
    from vllm_router_ext.ops import routing_fp64

    types = [t for f in FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))
    for family in FAMILIES:
        assert (family.routing is None) == (not family.model_types), family.name
        assert family.routing is None or family.routing in ROUTINGS, family.name
    assert set(routing_fp64.ROUTED_MODEL_TYPES) == set(types)
    renorm = {"gpt_oss": True, "mixtral": True, "minicpm": True, "granitemoe": True}
    plain = dict.fromkeys(
        ("qwen3_moe", "qwen3_vl_moe_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text", "qwen2_moe",
         "olmoe", "jamba", "step3_text", "mistral4", "qwen4_exp", "qwen4_exp_text"),
        False,
    )  # fmt: skip
    assert routing_fp64.SOFTMAX_TOP_K == plain | renorm
    assert set(routing_fp64.DEEPSEEK_MODEL_TYPES) == {
        "deepseek", "deepseek_v2", "deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa"
    }  # fmt: skip
    for preset in FAMILY_PRESETS.values():  # every tiny checkpoint's model type is a family's
        assert family_of(preset["architectures"][0]).model_types.count(preset["model_type"]) == 1


def test_every_release_belongs_to_its_family_and_routes():
    """A family's releases (its benchmark shapes and tiny checkpoints) are its own: their model
    type and architecture are the family's, their config routes as the audit reads a config, and
    a release that names another's gate (``shape_of``) has exactly that gate."""
    from vllm_router_ext.bench_harness import SHAPE_BY_NAME
    from vllm_router_ext.families import RELEASES
    from vllm_router_ext.ops.routing_fp64 import RoutingConfig

    names = [r.name for r in RELEASES]
    assert len(names) == len(set(names)) and len(RELEASES) >= 20
    for family in FAMILIES:
        for release in family.releases:
            assert release.config["model_type"] in family.model_types, release.name
            assert release.architecture in (None, *family.architectures), release.name
            routing = RoutingConfig.from_hf_config(release.config)
            assert routing.top_k <= release.experts, release.name
            if release.shape_of is None:
                assert SHAPE_BY_NAME[release.name].routing == routing
            else:
                other = SHAPE_BY_NAME[release.shape_of]
                assert (other.k, other.n) == (release.hidden, release.experts), release.name
                assert release.name not in SHAPE_BY_NAME
    # the tiny checkpoints of releases are the DeepSeek family's (built on its body)
    assert set(ROUTING_PRESETS) == {r.name.lower() for r in RELEASES if r.tiny is not None}
    assert ROUTING_PRESETS["deepseek-v3"]["n_group"] == 8
    assert ROUTING_PRESETS["kimi-k2"]["n_routed_experts"] == 384
