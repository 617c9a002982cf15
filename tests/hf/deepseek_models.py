"""Tiny random DeepSeek-V3 and GLM-4.5 checkpoints built with ``transformers`` (no downloads).

All have vocab 250 (padded by Megatron), hidden 64, 4 heads, 4 layers (two per stage at PP=2): one
dense (ffn 88) and three MoE layers of 8 experts (width 24) with one shared expert block and sigmoid
routing with a random, non-zero expert bias (``e_score_correction_bias``; ``transformers``' init
zeroes it):

- ``ds_qlora``: MLA with a query LoRA (rank 48), kv rank 32, nope / rope / v dims 16 / 8 / 12, YaRN
  (factor 4 over 16 positions, mscale 0.9 / mscale_all_dim 0.8), 4 groups of 2 experts, 2 groups per
  token, top-4 (k = 2 x topk_group: Megatron-Core's group rule agrees), routed scaling 2.5.
- ``ds_top2``: MLA without query LoRA, plain RoPE, the same groups at top-2 (k != 2 x topk_group: the
  top-2 group rule), routed scaling 1.5.
- ``glm``: GLM-4.5: GQA (4 heads in 2 groups, head_dim 24 != 64 / 4), partial RoPE (half of the
  dims), QK-norm, q / k / v biases, no expert groups, top-2, routed scaling 1.8.

No MTP layers (``num_nextn_predict_layers`` 0). Weights are drawn with std 0.2 and norms around 1
(as ``tests.hf.models``), so every tensor matters for the logits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 250
MODELS = ("ds_qlora", "ds_top2", "glm")

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=88, moe_intermediate_size=24,
               num_hidden_layers=4, num_attention_heads=4, n_routed_experts=8, n_shared_experts=1,
               first_k_dense_replace=1, max_position_embeddings=64, num_nextn_predict_layers=0)
_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, rms_norm_eps=1e-6,
            n_group=4, topk_group=2)
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16,
            beta_fast=32.0, beta_slow=1.0, mscale=0.9, mscale_all_dim=0.8)
_CONFIGS: dict[str, dict[str, Any]] = {
    "ds_qlora": dict(_MLA, q_lora_rank=48, num_experts_per_tok=4, routed_scaling_factor=2.5,
                     rope_parameters=YARN),
    "ds_top2": dict(_MLA, q_lora_rank=None, num_experts_per_tok=2, routed_scaling_factor=1.5,
                    rope_parameters=dict(rope_type="default", rope_theta=5000.0)),
    "glm": dict(num_key_value_heads=2, head_dim=24, attention_bias=True, use_qk_norm=True, n_group=1,
                topk_group=1, num_experts_per_tok=2, routed_scaling_factor=1.8, rms_norm_eps=1e-5,
                rope_parameters=dict(rope_type="default", rope_theta=20000.0, partial_rotary_factor=0.5)),
}


def hf_config(name: str, **overrides: Any):
    """The ``transformers`` config object of tiny model ``name`` (``overrides``: other fields)."""
    import transformers

    fields = {**_COMMON, **_CONFIGS[name], **overrides}
    fields["num_mtp_layers"] = fields.pop("num_nextn_predict_layers")
    if name == "glm":
        return transformers.Glm4MoeConfig(**fields, architectures=["Glm4MoeForCausalLM"])
    return transformers.DeepseekV3Config(**fields, architectures=["DeepseekV3ForCausalLM"])


def hf_config_dict(name: str, **overrides: Any) -> dict[str, Any]:
    """``config.json`` content of the tiny model, as ``save_pretrained`` writes it."""
    return hf_config(name, **overrides).to_dict()


def build_tiny_model(name: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Random model ``name`` in eval mode: weights ``0.2 N(0, 1)``, norms ``1 + 0.3 N(0, 1)``, expert
    biases ``0.3 N(0, 1)`` (the scale of the sigmoid scores' spread, so the bias changes the routing)."""
    import transformers

    torch.manual_seed(seed)
    cls = transformers.Glm4MoeForCausalLM if name == "glm" else transformers.DeepseekV3ForCausalLM
    model = cls(hf_config(name, **overrides)).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            noise = torch.randn_like(p)
            p.copy_(1 + 0.3 * noise if param_name.endswith("norm.weight") else 0.2 * noise)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn_like(b))
    return model


def save_tiny_model(name: str, path: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """:func:`build_tiny_model` saved (safetensors) to ``path``; returns it."""
    model = build_tiny_model(name, seed, **overrides)
    model.save_pretrained(path)
    return model
