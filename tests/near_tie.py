"""A tiny DeepSeek-V3 whose gate is built so that bf16 logits flip a known number of tokens.

Every token has x[0] = 1 and x[1] = d. Experts 0-2 get logit 3 (always chosen), expert 3 gets
1 + d, expert 4 gets 1 with correction bias +1e-4, the rest -3; top-4 of 16, one group.
- tie tokens, d = 2^-10: fp64 and fp32 keep 1 + 2^-10, and sigmoid'(1) * 2^-10 = 1.9e-4 > 1e-4
  picks expert 3; bf16 rounds 1 + 2^-10 to 1.0, so the bias picks expert 4: one flip each.
- clear tokens, d = 2^-3: expert 3 in every mode.
All weights and activations are exact in bf16, so only the logits' storage precision differs.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vllm_router_ext.tools.tiny_checkpoint import TINY_V3, build_tiny_deepseek_v3


def build_near_tie_checkpoint(
    out_dir: str | Path, tie_tokens: int = 24, clear_tokens: int = 40
) -> tuple[Path, Path, int]:
    """Returns (checkpoint dir, hidden-states file, expected bf16 flips)."""
    out = Path(out_dir)
    h, e = TINY_V3["hidden_size"], TINY_V3["n_routed_experts"]
    w = torch.zeros(e, h)
    w[0:3, 0] = 3.0
    w[3, 0], w[3, 1] = 1.0, 1.0
    w[4, 0] = 1.0
    w[5:, 0] = -3.0
    bias = torch.zeros(e)
    bias[4] = 1e-4
    layer = TINY_V3["first_k_dense_replace"]  # the one MoE layer
    model = build_tiny_deepseek_v3(
        out / "near-tie-dsv3",
        seed=5,
        config_overrides={"n_group": 1, "topk_group": 1},
        tensor_overrides={
            f"model.layers.{layer}.mlp.gate.weight": w.to(torch.bfloat16),
            f"model.layers.{layer}.mlp.gate.e_score_correction_bias": bias,
        },
    )
    x = torch.zeros(tie_tokens + clear_tokens, h)
    x[:, 0] = 1.0
    x[:tie_tokens, 1] = 2.0**-10
    x[tie_tokens:, 1] = 2.0**-3
    from safetensors.torch import save_file

    states = out / "near-tie-hidden-states.safetensors"
    save_file({"hidden_states": x.to(torch.bfloat16).contiguous()}, str(states))
    return model, states, tie_tokens
