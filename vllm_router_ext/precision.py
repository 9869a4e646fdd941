"""Router precision modes and their resolution order. Imports neither vLLM nor Triton.

Resolution, first source that is set wins (``auto`` at any level means "not set here"):

1. ``--router-precision`` on the vLLM command line (copied into ``additional_config``),
2. ``--additional-config '{"router_precision": ...}'``,
3. the environment variable ``VLLM_ROUTER_PRECISION``,
4. the model's HF config key ``router_precision`` (settable with ``--hf-overrides``),
5. vLLM's own HF config key ``moe_router_dtype: "float32"`` -> ``fp32``,
6. the family table (``auto``, :mod:`vllm_router_ext.families`): ``fp32`` for a family whose
   reference computes its router logits in fp32 (the DeepSeek-V2 family, GLM-4.5, MiniMax-M2, ...),
   vLLM's own gate for one whose reference computes them in the model dtype and for any model
   outside the table.

A speculative-decoding draft (MTP layers, EAGLE heads, DSpark) resolves the same way, unless its
own precision is set: ``--router-precision-draft`` / ``additional_config["router_precision_draft"]``,
one of the modes or ``vllm`` (vLLM's own gate, as the draft was trained on); ``auto``: the target's.

Batch invariance: ``--router-batch-invariant`` / ``additional_config["router_batch_invariant"]`` /
vLLM's ``VLLM_BATCH_INVARIANT=1``.

The fused router (the gate GEMM and the expert selection in one op, ``router_ext::route``):
``--router-fused`` / ``additional_config["router_fused"]``: ``on``, ``off`` or ``auto`` (on where it
was measured faster than vLLM's router on our logits: :func:`vllm_router_ext.layers.router.fused_by_default`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from csrc_triton import environment
from csrc_triton.problem import Precision
from vllm_router_ext.families import family_of, is_draft
from vllm_router_ext.settings import CHECKED

ENV_VAR = environment.PRECISION
CONFIG_KEY = "router_precision"
#: ``additional_config`` key that carries the command-line flag into every vLLM process.
CLI_CONFIG_KEY = "router_precision_cli"
BATCH_INVARIANT_KEY = "router_batch_invariant"
DRAFT_CONFIG_KEY = "router_precision_draft"
#: ``additional_config`` key of the settings checked where the engine starts (per role, target or draft):
#: every process of the engine takes them as checked instead of resolving its own sources again.
CHECKED_KEY = CHECKED
CLI_DRAFT_CONFIG_KEY = "router_precision_draft_cli"
#: The draft precision's value for vLLM's own gate (no gate of ours in the draft).
DRAFT_VLLM = "vllm"
CLI_BATCH_INVARIANT_KEY = "router_batch_invariant_cli"
FUSED_KEY = "router_fused"
CLI_FUSED_KEY = "router_fused_cli"
FUSED_CHOICES = ("auto", "on", "off")


class RouterPrecision(str, enum.Enum):
    """How the router GEMM stores its weight, accumulates and stores its logits."""

    AUTO = "auto"
    FP32 = "fp32"
    BF16_FP32OUT = "bf16-fp32out"
    BF16 = "bf16"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def choices(cls) -> list[str]:
        return [p.value for p in cls]

    @classmethod
    def parse(cls, value: Any, source: str = "value") -> RouterPrecision:
        """Parse a user value; the error names the source and the allowed values."""
        if isinstance(value, RouterPrecision):
            return value
        if isinstance(value, str):
            found = _BY_VALUE.get(value.strip().lower())  # a dict lookup: traceable by Dynamo
            if found is not None:
                return found
        raise ValueError(
            f"invalid router precision {value!r} from {source}; allowed values: {', '.join(cls.choices())}"
        )

    @property
    def logits_dtype(self) -> torch.dtype | None:
        """dtype of the logits; ``None`` for bf16 (the activations' dtype, as stock vLLM)."""
        if self in (RouterPrecision.FP32, RouterPrecision.BF16_FP32OUT):
            return torch.float32
        if self is RouterPrecision.AUTO:
            raise ValueError("'auto' must be resolved before it has a logits dtype")
        return None

    @property
    def kernel(self) -> Precision:
        """The kernel library's precision of this mode (``auto`` must be resolved first)."""
        if self is RouterPrecision.AUTO:
            raise ValueError("'auto' must be resolved before the kernels can run it")
        return Precision(self.value)


_BY_VALUE: dict[str, RouterPrecision] = {p.value: p for p in RouterPrecision}


@dataclass(frozen=True)
class RouterSettings:
    """The resolved router settings for one model, handed to every gate it builds.
    ``precision`` None: vLLM's own gate (``auto`` on a family that routes in the model dtype)."""

    precision: RouterPrecision | None
    source: str
    batch_invariant: bool = False
    batch_invariant_source: str = "default"
    #: (source, value) pairs that were set but lost to a higher-precedence source.
    overridden: tuple[tuple[str, str], ...] = field(default=())
    #: The model, as messages name it: its family and architecture.
    model: str = "this model"
    #: A router capture records in our gates (at vLLM's own precision where none is set).
    captures: bool = False
    #: The fused router: "on", "off", or "auto" (decided per device where the model is built).
    fused: str = "auto"
    fused_source: str = "default"

    @property
    def asked(self) -> tuple[str, ...]:
        """What a user set (flag, configs, environment) that needs gates of ours, in words."""
        out = []
        if self.precision is not None and not self.source.startswith(("auto", "HF config moe_router_dtype")):
            out.append(f"router precision {self.precision.value} (from {self.source})")
        if self.batch_invariant and self.batch_invariant_source != "VLLM_BATCH_INVARIANT=1":
            out.append(f"router batch invariance (from {self.batch_invariant_source})")
        if self.fused == "on":
            out.append(f"the fused router (from {self.fused_source})")
        return tuple(out)

    @property
    def owns_gates(self) -> bool:
        return self.precision is not None or self.batch_invariant or self.captures or self.fused == "on"

    def to_json(self) -> dict:
        """The settings as plain values (they travel in ``additional_config``)."""
        return {
            "precision": None if self.precision is None else self.precision.value,
            "source": self.source,
            "batch_invariant": self.batch_invariant,
            "batch_invariant_source": self.batch_invariant_source,
            "overridden": [list(pair) for pair in self.overridden],
            "model": self.model,
            "fused": self.fused,
            "fused_source": self.fused_source,
        }

    @classmethod
    def from_json(cls, value: dict) -> RouterSettings:
        precision = value["precision"]
        return cls(
            precision=None if precision is None else RouterPrecision(precision),
            source=str(value["source"]),
            batch_invariant=bool(value["batch_invariant"]),
            batch_invariant_source=str(value["batch_invariant_source"]),
            overridden=tuple((str(s), str(v)) for s, v in value["overridden"]),
            model=str(value["model"]),
            fused=str(value["fused"]),
            fused_source=str(value["fused_source"]),
        )

    def describe(self) -> str:
        precision = "vLLM's own" if self.precision is None else self.precision.value
        return (
            f"router precision {precision} (from {self.source}), "
            f"batch-invariant {'on' if self.batch_invariant else 'off'}"
            f" (from {self.batch_invariant_source})"
        )


def _is_set(value: Any) -> bool:
    return value is not None and not (isinstance(value, str) and value.strip().lower() in ("", "auto"))


def resolve_router_precision(
    *,
    architecture: str | None,
    cli: Any = None,
    additional_config: Any = None,
    env: Any = None,
    hf_config: Any = None,
    moe_router_dtype: Any = None,
) -> tuple[RouterPrecision | None, str, tuple[tuple[str, str], ...]]:
    """Resolve one precision from its sources; pure function of its arguments.

    Returns ``(precision, source, overridden)``; precision None keeps vLLM's own gate. Every set
    source is validated, also
    those that lose, so a typo anywhere is an error rather than silently ignored.
    """
    candidates: list[tuple[str, RouterPrecision]] = []
    for source, raw in (
        ("--router-precision", cli),
        (f"additional_config[{CONFIG_KEY!r}]", additional_config),
        (f"environment variable {ENV_VAR}", env),
        (f"HF config key {CONFIG_KEY!r}", hf_config),
    ):
        if _is_set(raw):
            candidates.append((source, RouterPrecision.parse(raw, source)))
    if moe_router_dtype is not None and str(moe_router_dtype) in ("float32", "torch.float32"):
        candidates.append(("HF config moe_router_dtype='float32'", RouterPrecision.FP32))

    if candidates:
        source, precision = candidates[0]
        overridden = tuple((s, p.value) for s, p in candidates[1:] if p is not precision)
        return precision, source, overridden

    family = family_of(architecture)
    if family is None:
        return None, f"auto: architecture {architecture} is not in the family table", ()
    if architecture in family.rounds_logits:
        return None, f"auto: {family.name} rounds its gate's logits to the model dtype ({architecture})", ()
    if family.auto is None:
        return None, f"auto: {family.name} routes on model-dtype logits ({architecture})", ()
    return RouterPrecision(family.auto), f"auto: architecture {architecture}", ()


def draft_choices() -> list[str]:
    return [*RouterPrecision.choices(), DRAFT_VLLM]


def resolve_draft_precision(
    *, cli: Any = None, additional_config: Any = None
) -> tuple[RouterPrecision | None, str] | None:
    """A draft's own precision: None where unset (``auto``: the draft takes the target's);
    ``(None, source)`` for ``vllm`` (vLLM's own gate), else ``(precision, source)``."""
    for source, raw in (
        ("--router-precision-draft", cli),
        (f"additional_config[{DRAFT_CONFIG_KEY!r}]", additional_config),
    ):
        if not _is_set(raw):
            continue
        if isinstance(raw, str) and raw.strip().lower() == DRAFT_VLLM:
            return None, source
        try:
            return RouterPrecision.parse(raw, source), source
        except ValueError:
            allowed = ", ".join(draft_choices())
            message = f"invalid draft router precision {raw!r} from {source}; allowed values: {allowed}"
            raise ValueError(message) from None
    return None


def _parse_bool(value: Any, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"invalid router batch-invariant value {value!r} from {source}; allowed: true, false")


def resolve_batch_invariant(
    *, cli: Any = None, additional_config: Any = None, vllm_batch_invariant: bool = False
) -> tuple[bool, str]:
    """Batch invariance is on if any source asks for it; an explicit ``false`` cannot override
    ``VLLM_BATCH_INVARIANT=1``, because the rest of vLLM is then batch-invariant too."""
    if cli is not None and _parse_bool(cli, "--router-batch-invariant"):
        return True, "--router-batch-invariant"
    if additional_config is not None and _parse_bool(
        additional_config, f"additional_config[{BATCH_INVARIANT_KEY!r}]"
    ):
        return True, f"additional_config[{BATCH_INVARIANT_KEY!r}]"
    if vllm_batch_invariant:
        return True, "VLLM_BATCH_INVARIANT=1"
    return False, "default"


def resolve_fused(*, cli: Any = None, additional_config: Any = None) -> tuple[str, str]:
    """The fused router's setting (``auto``, ``on`` or ``off``) and its source; the flag wins."""
    for source, raw in (("--router-fused", cli), (f"additional_config[{FUSED_KEY!r}]", additional_config)):
        if raw is None:
            continue
        if isinstance(raw, bool):
            raw = "on" if raw else "off"
        value = raw.strip().lower() if isinstance(raw, str) else None
        if value not in FUSED_CHOICES:
            raise ValueError(
                f"invalid router fused value {raw!r} from {source}; allowed: {', '.join(FUSED_CHOICES)}"
            )
        if value != "auto":
            return value, source
    return "auto", "default"


def resolve_router_settings(vllm_config: Any, *, draft: bool | None = None) -> RouterSettings:
    """Resolve the settings for the model in a ``VllmConfig`` (duck-typed: no vLLM import): the
    ones checked where the engine started, where they travel with it, else from every source.
    ``draft``: a speculative-decoding draft (default: its architecture says)."""
    model_config = vllm_config.model_config
    hf_config = model_config.hf_config
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    archs = list(getattr(hf_config, "architectures", None) or [])
    if draft is None:
        draft = is_draft(archs[0] if archs else None)
    role = "draft" if draft else "target"
    checked = extra.get(CHECKED_KEY)
    if isinstance(checked, dict) and isinstance(checked.get(role), dict):
        return RouterSettings.from_json(checked[role])
    precision, source, overridden = resolve_router_precision(
        architecture=archs[0] if archs else None,
        cli=extra.get(CLI_CONFIG_KEY),
        additional_config=extra.get(CONFIG_KEY),
        env=environment.precision(),
        hf_config=getattr(hf_config, CONFIG_KEY, None),
        moe_router_dtype=getattr(hf_config, "moe_router_dtype", None),
    )
    batch_invariant, bi_source = resolve_batch_invariant(
        cli=extra.get(CLI_BATCH_INVARIANT_KEY),
        additional_config=extra.get(BATCH_INVARIANT_KEY),
        vllm_batch_invariant=environment.batch_invariant(),
    )
    fused, fused_source = resolve_fused(cli=extra.get(CLI_FUSED_KEY), additional_config=extra.get(FUSED_KEY))
    arch = archs[0] if archs else None
    family = family_of(arch)
    own = resolve_draft_precision(
        cli=extra.get(CLI_DRAFT_CONFIG_KEY), additional_config=extra.get(DRAFT_CONFIG_KEY)
    )  # validated for every model: a typo fails the target's start-up too
    if own is not None and draft:  # the draft's own choice replaces the target's
        precision, draft_source = own
        source = draft_source if precision is not None else f"{draft_source}: vLLM's own gate for the draft"
        overridden = ()
    return RouterSettings(
        model=f"{family.name} ({arch})" if family else (arch or "this model"),
        precision=precision,
        source=source,
        batch_invariant=batch_invariant,
        batch_invariant_source=bi_source,
        overridden=overridden,
        fused=fused,
        fused_source=fused_source,
    )


class GateSettingsError(ValueError):
    """Router settings a model cannot take; raised while the model is built (start-up)."""


def refuse_bf16_logits(settings: RouterSettings, why: str) -> None:
    """A model whose routing reads fp32 logits (``why`` says what asks for them) takes no bf16 ones."""
    if settings.precision is not RouterPrecision.BF16:
        return
    allowed = [p.value for p in RouterPrecision if p is not RouterPrecision.BF16]
    raise GateSettingsError(
        f"vllm-router-ext: {settings.model} routes on fp32 logits ({why}), so router precision bf16 "
        f"(from {settings.source}) cannot apply; allowed for this model: {', '.join(allowed)}"
    )


def check_family_logits(settings: RouterSettings, architecture: str | None) -> None:
    """The logits a family's routing reads, checked before any engine starts and as the model is
    built: no fp32 logits where vLLM rounds them to the model dtype before routing, no ``bf16``
    where it builds fp32-logit gates."""
    family = family_of(architecture)
    if family is None or settings.precision is None:
        return
    if architecture in family.rounds_logits:
        allowed = ["auto"] if family.fp32_logits else ["auto", RouterPrecision.BF16.value]
        if settings.precision.value not in allowed:
            raise GateSettingsError(
                f"vllm-router-ext: router precision {settings.precision.value} (from {settings.source}) "
                f"cannot apply to {settings.model}: vLLM rounds its gate's logits to the model dtype "
                "before routing (router_logits.to(hidden_states.dtype)), so no fp32 logits reach the "
                f"choice of experts; allowed for this model: {', '.join(allowed)}"
            )
    if family.fp32_logits:
        refuse_bf16_logits(settings, "vLLM builds its gates with fp32 logits")


def bf16_round_trip_exact(weight: torch.Tensor) -> bool:
    """True when every value of ``weight`` survives a round trip through bf16 unchanged."""
    if weight.dtype == torch.bfloat16:
        return True
    w = weight.detach()
    return bool(torch.equal(w.to(torch.bfloat16).to(w.dtype), w))
