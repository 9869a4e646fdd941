"""fp64 references: router logits and expert selection, as vLLM routes each MoE family.

Used by the tests, the benchmark and the audit command. Routing follows vLLM 0.32's routers:
DeepSeek-V3 ``noaux_tc`` (sigmoid + ``e_score_correction_bias``, group score = sum of the top-2
biased scores; GLM-4.5 and MiniMax-M2 the same on one group), DeepSeek-V2 (softmax, ``greedy`` or
``group_limited_greedy``), softmax top-k with or without renormalisation (Qwen, OLMoE, Mixtral,
gpt-oss: a softmax over the top-k logits is the renormalised one), ERNIE-4.5's softmax scores that
choose with a correction bias, Llama-4's sigmoid of the top-k logits, and DeepSeek-V4's
``sqrtsoftplus`` scores (``sqrt(softplus(logit))``) + correction bias, whose first
``num_hash_layers`` layers route by a token-id table instead (no logit decides there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_router_ext.families import FAMILIES, ROUTINGS, RoutingKeys


def reference_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp64 ``x @ weight.T`` on the CPU."""
    return x.detach().double().cpu() @ weight.detach().double().cpu().T


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64; ``inf`` if ``out`` holds a NaN or inf."""
    o = out.detach().double().cpu()
    if not torch.isfinite(o).all():
        return float("inf")
    denom = ref.norm().item()
    return (o - ref).norm().item() / (denom if denom > 0 else 1.0)


def _model_types(*routings: str) -> tuple[str, ...]:
    """The ``model_type`` values of the families routed so (the family table's facts)."""
    return tuple(t for f in FAMILIES if f.routing in routings for t in f.model_types)


#: Softmax top-k families (``model_type``) and their renormalisation when the config has no
#: ``norm_topk_prob``: Mixtral and gpt-oss always renormalise.
SOFTMAX_TOP_K = {t: False for t in _model_types("softmax_topk")} | {
    t: True for t in _model_types("softmax_topk_renorm")
}
#: Sigmoid + correction bias on one expert group, as DeepSeek-V3's noaux_tc.
SIGMOID_BIAS = _model_types("sigmoid_bias")
SOFTMAX_BIAS = _model_types("softmax_bias")  # softmax scores + correction bias choose, renormalised
SIGMOID_TOP_K = _model_types("sigmoid_topk")  # sigmoid of the top-k logits, no renormalisation
SCORED_TOP_K = _model_types("scored_topk")  # the config's score function, top-k, renormalised or not
SQRTSOFTPLUS_BIAS = _model_types("sqrtsoftplus_bias")  # sqrt(softplus) + correction bias; hash layers
#: DeepSeek-V4.1: vLLM builds every MoE layer with a gate (``num_hash_layers=0``), whatever its config says.
NO_HASH_LAYERS = ("deepseek_v41",)
DEEPSEEK_MODEL_TYPES = _model_types("deepseek")
ROUTED_MODEL_TYPES = _model_types(*ROUTINGS)
SCORING_FUNCS = ("sigmoid", "softmax", "sqrtsoftplus")
_EXPERT_KEYS = ("n_routed_experts", "num_experts", "num_local_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "num_experts_per_token", "moe_top_k")
#: Each ``sigmoid_bias``, ``scored_topk`` or softmax top-k model type's config keys (the family
#: table's :class:`RoutingKeys`; softmax top-k reads only ``renormalize``).
ROUTING_KEYS = {
    t: f.keys
    for f in FAMILIES
    if f.routing in ("sigmoid_bias", "scored_topk", "softmax_topk", "softmax_topk_renorm")
    for t in f.model_types
}


def routing_fields(cfg: dict) -> dict:
    """The config that holds the routing keys: a multimodal checkpoint's ``text_config``."""
    text = cfg.get("text_config")
    if isinstance(text, dict) and not any(k in cfg for k in _EXPERT_KEYS):
        return text
    return cfg


def num_experts(cfg: dict) -> int | None:
    cfg = routing_fields(cfg)
    return next((int(cfg[k]) for k in _EXPERT_KEYS if cfg.get(k)), None)


def experts_per_token(cfg: dict) -> int | None:
    cfg = routing_fields(cfg)
    return next((int(cfg[k]) for k in _TOP_K_KEYS if cfg.get(k)), None)


@dataclass(frozen=True)
class RoutingConfig:
    """How vLLM picks a token's experts from the router logits."""

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    scoring_func: str = "softmax"
    topk_method: str = "greedy"
    renormalize: bool = False
    routed_scaling_factor: float = 1.0
    #: The first layers route by a token-id table (DeepSeek-V4's hash layers): no logit decides.
    hash_layers: int = 0

    @property
    def uses_correction_bias(self) -> bool:
        return self.topk_method == "noaux_tc"

    @classmethod
    def from_hf_config(cls, cfg: dict) -> RoutingConfig:
        """The routing of a Hugging Face config of one of :data:`ROUTED_MODEL_TYPES`."""
        top_k = experts_per_token(cfg)
        if top_k is None:
            raise ValueError(f"no experts per token ({' or '.join(_TOP_K_KEYS)}) in the config")
        top_model_type = cfg.get("model_type")
        cfg = routing_fields(cfg)
        model_type = cfg.get("model_type") or top_model_type  # a text_config may not repeat it
        if model_type in SOFTMAX_TOP_K:
            key = ROUTING_KEYS[model_type].renormalize or "norm_topk_prob"
            return cls(top_k, renormalize=bool(cfg.get(key, SOFTMAX_TOP_K[model_type])))
        if model_type in SOFTMAX_BIAS:
            return cls(top_k, topk_method="noaux_tc", renormalize=True)
        if model_type in SIGMOID_TOP_K:
            return cls(top_k, scoring_func="sigmoid")
        if model_type in SCORED_TOP_K:
            keys = ROUTING_KEYS[model_type]
            score = cfg.get(keys.score, keys.score_default) if keys.score else keys.score_default
            return cls(top_k, scoring_func=score, renormalize=bool(cfg.get(keys.renormalize, True)))
        if model_type in SQRTSOFTPLUS_BIAS:
            return cls(
                top_k,
                scoring_func=cfg.get("scoring_func", "sqrtsoftplus"),
                topk_method="noaux_tc",
                renormalize=bool(cfg.get("norm_topk_prob", True)),
                routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
                hash_layers=0
                if model_type in NO_HASH_LAYERS
                else int(
                    cfg.get("num_hash_layers") or list(cfg.get("mlp_layer_types") or []).count("hash_moe")
                ),
            )
        if model_type in SIGMOID_BIAS:
            return cls._sigmoid_bias(top_k, cfg, ROUTING_KEYS[model_type])
        return cls(
            top_k=top_k,
            n_group=int(cfg.get("n_group") or 1),
            topk_group=int(cfg.get("topk_group") or 1),
            scoring_func=cfg.get("scoring_func", "softmax"),
            topk_method=cfg.get("topk_method", "greedy"),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        )

    @classmethod
    def _sigmoid_bias(cls, top_k: int, cfg: dict, keys: RoutingKeys) -> RoutingConfig:
        """noaux_tc as vLLM builds it from one family's keys (:class:`RoutingKeys`)."""
        grouped = keys.groups is not None and (keys.grouped is None or bool(cfg.get(keys.grouped, True)))
        n_group, topk_group = (int(cfg.get(k) or 1) for k in keys.groups) if grouped else (1, 1)
        bias_key, bias_value = keys.bias_if
        score = cfg.get(keys.score, keys.score_default) if keys.score else keys.score_default
        renormalize = bool(cfg.get(keys.renormalize, True)) if keys.renormalize else True
        if keys.renormalize_sigmoid_only and score != "sigmoid":
            renormalize = False
        if cfg.get(bias_key, bias_value) == bias_value:
            method = "noaux_tc"
        else:  # vLLM's grouped top-k without a bias ranks groups by their best score
            method = "group_limited_greedy" if n_group > 1 else "greedy"
        return cls(
            top_k,
            n_group=n_group,
            topk_group=topk_group,
            scoring_func=score,
            topk_method=method,
            renormalize=renormalize,
            routed_scaling_factor=float(cfg.get(keys.scale, keys.scale_default)) if keys.scale else 1.0,
        )


def expert_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """The per-expert scores the selection ranks (before any correction bias)."""
    if scoring_func == "sigmoid":
        return logits.sigmoid()
    if scoring_func == "softmax":
        return logits.softmax(dim=-1)
    if scoring_func == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits).sqrt()
    raise ValueError(f"unsupported scoring_func {scoring_func!r}; allowed: {', '.join(SCORING_FUNCS)}")


def select_experts(
    logits: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids ``[M, top_k]`` (sorted ascending) and their weights, computed in ``logits.dtype``
    (pass fp64 logits for the reference). ``bias`` is ``e_score_correction_bias`` (noaux_tc)."""
    scores = expert_scores(logits, cfg.scoring_func)
    m, n = scores.shape
    choice = scores if bias is None else scores + bias.to(scores.dtype).unsqueeze(0)
    grouped = cfg.n_group > 1 and cfg.topk_method in ("noaux_tc", "group_limited_greedy")
    if grouped:
        g = choice.view(m, cfg.n_group, n // cfg.n_group)
        if bias is not None:
            group_scores = g.topk(2, dim=-1).values.sum(-1)
        else:
            group_scores = g.max(dim=-1).values
        group_idx = group_scores.topk(cfg.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
        mask = mask.unsqueeze(-1).expand(m, cfg.n_group, n // cfg.n_group).reshape(m, n)
        choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    weights = weights * cfg.routed_scaling_factor
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


def near_tie_mask(
    logits_ref: torch.Tensor, cfg: RoutingConfig, bias: torch.Tensor | None, margin: float
) -> torch.Tensor:
    """Tokens whose fp64 selection would change under a perturbation of the logits of ``margin``:
    the gap between the k-th and (k+1)-th selection score, at expert or group level, is within
    ``2 * margin`` (in score units; sigmoid, sqrtsoftplus and softmax slopes are <= 1/4, 1/3, 1)."""
    scores = expert_scores(logits_ref, cfg.scoring_func)
    choice = scores if bias is None else scores + bias.double().unsqueeze(0)
    m, n = choice.shape
    tie = torch.zeros(m, dtype=torch.bool)
    if cfg.n_group > 1 and cfg.topk_method in ("noaux_tc", "group_limited_greedy"):
        g = choice.view(m, cfg.n_group, n // cfg.n_group)
        gs = g.topk(2, dim=-1).values.sum(-1) if bias is not None else g.max(-1).values
        top = gs.topk(min(cfg.topk_group + 1, cfg.n_group), dim=-1).values
        if top.shape[1] > cfg.topk_group:
            tie |= (top[:, cfg.topk_group - 1] - top[:, cfg.topk_group]) <= 4 * margin
        group_idx = gs.topk(cfg.topk_group, dim=-1).indices
        mask = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, group_idx, True)
        mask = mask.unsqueeze(-1).expand(m, cfg.n_group, n // cfg.n_group).reshape(m, n)
        choice = choice.masked_fill(~mask, float("-inf"))
    top = choice.topk(cfg.top_k + 1, dim=-1).values
    tie |= (top[:, cfg.top_k - 1] - top[:, cfg.top_k]) <= 2 * margin
    return tie


def changed_expert_sets(ids_a: torch.Tensor, ids_b: torch.Tensor) -> torch.Tensor:
    """Per token: True where the two (sorted) expert sets differ."""
    return (ids_a.cpu().long() != ids_b.cpu().long()).any(dim=-1)
