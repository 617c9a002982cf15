"""gpt-oss (``GptOssForCausalLM``) ``config.json`` <-> ``ModelConfig``: the family's dialect of
``hf_config.MOE_DIALECTS`` (its MoE fields and the attention features only it has here).

- every layer MoE of ``num_local_experts`` experts of width ``intermediate_size``, top
  ``num_experts_per_tok`` by the biased router's logits, softmax over the top-k logits
  (``router_pre_softmax=False``);
- the clamped SwiGLU of the experts: ``(clamp(up, -l, l) + 1) * g * sigmoid(1.702 g)``,
  ``g = clamp(gate, max=l)``, ``l = swiglu_limit`` (``glu_activation="quick_gelu"``,
  ``glu_linear_offset=1``, ``glu_clamp=l``; another ``swiglu_alpha`` is refused);
- biases on q / k / v / o, the router and the experts (``add_bias_linear``; ``attention_bias`` must
  be true), per-head ``sinks`` (``attention_sinks``);
- ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``) with ``sliding_window`` W: query ``i``
  sees keys ``i - W < j <= i`` on the sliding layers (``sliding_window`` + ``sliding_window_pattern``);
- YaRN RoPE (``rope_parameters`` with ``rope_type: yarn`` -> ``YaRNConfig``; ``truncate`` defaults to
  True as in ``transformers``, the Hub's folders say False).

An MXFP4 folder's ``quantization_config`` is dropped on export (the tensors are written dequantised).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mcore_engine.config import ModelConfig
from mcore_engine.config.moe import MoEConfig
from mcore_engine.config.rope import YaRNConfig
from mcore_engine.hf.families import Family, rope_params

__all__ = ["SWIGLU_ALPHA", "gpt_oss_from_hf", "gpt_oss_to_hf", "yarn_from_hf", "yarn_to_hf"]

SWIGLU_ALPHA = 1.702  # Megatron-Core's quick_gelu: x * sigmoid(1.702 x)
_LAYER_TYPES = {"sliding_attention": 1, "full_attention": 0}


def _yarn_mscale(factor: float, m: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def yarn_from_hf(hf_config: Mapping[str, Any]) -> YaRNConfig | None:
    """``YaRNConfig`` of ``rope_parameters`` / ``rope_scaling`` (None for default RoPE); ``ValueError``
    naming the field for what Megatron-Core's ``YarnRotaryEmbedding`` cannot express."""
    params = rope_params(hf_config)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        raise ValueError(f"rope_parameters: rope type {rope_type!r} is not supported for gpt_oss (only "
                         "'default' and 'yarn')")
    if not isinstance(params.get("factor"), (int, float)) or params["factor"] <= 0:
        raise ValueError(f"rope_parameters.factor: YaRN needs a factor > 0, got {params.get('factor')!r}")
    if "original_max_position_embeddings" not in params:
        raise ValueError("rope_parameters.original_max_position_embeddings: YaRN needs it")
    factor = float(params["factor"])
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers: both or neither
        mscale, mscale_all_dim = 1.0, 0.0
    implied = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
    given = params.get("attention_factor")
    if given is not None and not math.isclose(float(given), implied, rel_tol=1e-6):
        raise ValueError(f"rope_parameters.attention_factor: {given} differs from the {implied} that factor, "
                         "mscale and mscale_all_dim imply (Megatron-Core has no separate one)")
    original = int(params["original_max_position_embeddings"])
    return YaRNConfig(factor=factor, original_max_position_embeddings=original,
                      beta_fast=float(params.get("beta_fast") or 32.0),
                      beta_slow=float(params.get("beta_slow") or 1.0),
                      truncate=bool(params.get("truncate", True)), mscale=float(mscale),
                      mscale_all_dim=float(mscale_all_dim))


def yarn_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """``rope_parameters`` of ``cfg`` (YaRN or default RoPE)."""
    y = cfg.yarn
    if y is None:
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    out = {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": y.factor,
           "original_max_position_embeddings": y.original_max_position_embeddings,
           "beta_fast": y.beta_fast, "beta_slow": y.beta_slow, "truncate": y.truncate}
    if (y.mscale, y.mscale_all_dim) != (1.0, 0.0):
        out.update(mscale=y.mscale, mscale_all_dim=y.mscale_all_dim)
    return out


def gpt_oss_from_hf(hf_config: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """``ModelConfig`` fields of a gpt-oss ``config.json`` (see the module docstring)."""
    num_layers = int(hf_config["num_hidden_layers"])
    alpha = float(hf_config.get("swiglu_alpha", SWIGLU_ALPHA))
    if not math.isclose(alpha, SWIGLU_ALPHA, rel_tol=1e-9):
        raise ValueError(f"swiglu_alpha: only {SWIGLU_ALPHA} (Megatron-Core's quick_gelu) is supported, "
                         f"got {alpha}")
    if not hf_config.get("attention_bias", True):
        raise ValueError("attention_bias: gpt_oss without attention biases is not supported (its router "
                         "and experts have biases; Megatron-Core's add_bias_linear covers all of them)")
    types = hf_config.get("layer_types")
    if types is None:  # transformers' default: sliding on even layers
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"layer_types: expected {num_layers} (num_hidden_layers) entries of "
                         f"{sorted(_LAYER_TYPES)}, got {types!r}")
    pattern = [_LAYER_TYPES[t] for t in types]
    window = hf_config.get("sliding_window")
    if any(pattern) and (not isinstance(window, int) or window < 1):
        raise ValueError(f"sliding_window: sliding_attention layers need a window >= 1, got {window!r}")
    if hf_config.get("router_jitter_noise"):
        raise ValueError("router_jitter_noise: router input jitter is not supported (expected 0)")
    limit = hf_config.get("swiglu_limit", 7.0)
    experts = hf_config.get("num_local_experts", hf_config.get("num_experts"))
    if experts is None:
        raise ValueError("num_local_experts: a gpt_oss config needs num_local_experts")
    # transformers adds the load-balancing loss only with output_router_logits (the Hub's: false, with a
    # coefficient of 0.9 that would otherwise dominate an RL gradient)
    aux = float(hf_config.get("router_aux_loss_coef", 0.0)) if hf_config.get("output_router_logits") else 0.0
    moe = MoEConfig(num_experts=int(experts), router_topk=int(hf_config["num_experts_per_tok"]),
                    ffn_hidden_size=int(hf_config["intermediate_size"]), router_pre_softmax=False,
                    aux_loss_coeff=aux, layer_freq=1)
    return dict(moe=moe, add_qkv_bias=False, add_bias_linear=True, attention_sinks=True,
                sliding_window=int(window) if any(pattern) else None,
                sliding_window_pattern=None if all(pattern) or not any(pattern) else pattern,
                glu_activation="quick_gelu", glu_linear_offset=1.0,
                glu_clamp=None if limit is None else float(limit), yarn=yarn_from_hf(hf_config))


def gpt_oss_to_hf(cfg: ModelConfig, family: Family, base: Mapping[str, Any] | None) -> dict[str, Any]:
    """gpt-oss ``config.json`` fields of ``cfg``; ``ValueError`` naming the ``ModelConfig`` field that
    the family cannot express."""
    moe = cfg.moe
    if moe.router_num_groups is not None or moe.router_expert_bias or moe.shared_expert_ffn_hidden_size:
        raise ValueError("MoEConfig.router_num_groups / router_expert_bias / shared_expert_ffn_hidden_size: "
                         "gpt_oss has no grouped routing, expert bias or shared expert")
    if moe.router_score_function != "softmax" or moe.router_topk_scaling_factor not in (None, 1.0):
        raise ValueError("MoEConfig.router_score_function / router_topk_scaling_factor: gpt_oss routes by "
                         "softmax without scaling")
    # an engine without the aux loss keeps the folder's coefficient, switched off as it was
    out = dict(num_experts_per_tok=moe.router_topk, output_router_logits=moe.aux_loss_coeff > 0)
    if moe.aux_loss_coeff > 0:
        out["router_aux_loss_coef"] = moe.aux_loss_coeff
    if not all(moe.layer_pattern(cfg.num_layers)) or moe.router_pre_softmax:
        raise ValueError("MoEConfig.layer_freq / router_pre_softmax: gpt_oss has MoE in every layer and "
                         "softmax over the top-k logits")
    wrong = {k: getattr(cfg, k) for k, v in (("add_bias_linear", True), ("attention_sinks", True),
                                             ("glu_activation", "quick_gelu"), ("glu_linear_offset", 1.0))
             if getattr(cfg, k) != v}
    if wrong:
        raise ValueError(f"ModelConfig.{', '.join(wrong)}: gpt_oss has biases, sinks and the "
                         f"(up + 1) * quick_gelu(gate) experts; got {wrong}")
    window, pattern = cfg.sliding_window, cfg.sliding_window_pattern
    pattern = [int(window is not None)] * cfg.num_layers if pattern is None else pattern
    return {**out, "num_local_experts": moe.num_experts,
            "intermediate_size": moe.ffn_hidden_size or cfg.ffn_size,
            "attention_bias": True, "swiglu_alpha": SWIGLU_ALPHA,
            "swiglu_limit": cfg.glu_clamp, "sliding_window": window,
            "layer_types": ["sliding_attention" if p else "full_attention" for p in pattern],
            "quantization_config": None}
