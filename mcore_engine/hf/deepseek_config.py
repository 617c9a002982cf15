"""``config.json`` <-> ``ModelConfig`` fields of DeepSeek-V3 (``deepseek_v3``: also Kimi-K2 and
Moonlight folders) and GLM-4.5 (``glm4_moe``): multi-latent attention with YaRN, partial RoPE, and
their common MoE (sigmoid scores with the expert bias ``e_score_correction_bias``, grouped top-k,
top-k weights renormalised (``norm_topk_prob``: ``not MoEConfig.router_pre_softmax``) and scaled
(``routed_scaling_factor``), one ungated shared expert block, ``first_k_dense_replace`` dense
layers). ``hf_config`` calls these for the two families; ``ValueError`` naming the field for what the
other side cannot express.

The RoPE scales, ``transformers`` vs Megatron-Core (``f`` = YaRN ``factor``,
``ms(f, a) = 0.1 a ln f + 1``, 1 for ``f <= 1``):

- softmax scale: both ``ms(f, mscale_all_dim)^2 / sqrt(q_head_dim)`` (no rescaling when
  ``mscale_all_dim`` is 0);
- cos / sin factor: ``transformers`` takes ``ms(f, mscale) / ms(f, mscale_all_dim)`` only when both are
  non-zero, else ``ms(f, 1)``; Megatron always takes the ratio. So a folder with ``mscale_all_dim`` 0
  maps to Megatron's ``mscale=1, mscale_all_dim=0`` (ratio ``ms(f, 1)``), and ``mscale`` 0 with a
  non-zero ``mscale_all_dim`` (no Megatron equivalent) is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mcore_engine.config import ModelConfig
from mcore_engine.config.checks import _require
from mcore_engine.config.mla import MLAConfig
from mcore_engine.config.moe import MoEConfig

__all__ = ["SIGMOID_MOE_FAMILIES", "deepseek_from_hf", "deepseek_to_hf"]

SIGMOID_MOE_FAMILIES = ("deepseek_v3", "glm4_moe")


def _rope_params(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    return {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}


def _partial_rotary_factor(hf_config: Mapping[str, Any], default: float) -> float:
    params = _rope_params(hf_config)
    return float(params.get("partial_rotary_factor", hf_config.get("partial_rotary_factor", default)))


def _mla_from_hf(hf_config: Mapping[str, Any]) -> MLAConfig:
    """``MLAConfig`` of a DeepSeek-V3 config (RoPE ``default`` or ``yarn``; module docstring)."""
    if hf_config.get("rope_interleave", True) is not True:
        raise ValueError("rope_interleave: only interleaved MLA RoPE (rope_interleave=True, DeepSeek's "
                         "layout and Megatron-Core's) is supported")
    if hf_config.get("attention_bias"):
        raise ValueError("attention_bias: MLA projection biases are not supported")
    if _partial_rotary_factor(hf_config, 1.0) != 1.0:
        raise ValueError("partial_rotary_factor: MLA rotates all qk_rope_head_dim channels (expected 1.0)")
    params = _rope_params(hf_config)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    dims = dict(q_lora_rank=hf_config.get("q_lora_rank"), kv_lora_rank=int(hf_config["kv_lora_rank"]),
                qk_head_dim=int(hf_config["qk_nope_head_dim"]),
                qk_pos_emb_head_dim=int(hf_config["qk_rope_head_dim"]),
                v_head_dim=int(hf_config["v_head_dim"]))
    if dims["q_lora_rank"] is not None:
        dims["q_lora_rank"] = int(dims["q_lora_rank"])
    if rope_type == "default":
        return MLAConfig(**dims)
    if rope_type != "yarn":
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported with MLA (only 'default' "
                         "and 'yarn')")
    if params.get("attention_factor") is not None:
        raise ValueError("rope_scaling.attention_factor: an explicit YaRN attention factor is not supported "
                         "(Megatron derives it from factor, mscale and mscale_all_dim)")
    if params.get("truncate", True) is not True:
        raise ValueError("rope_scaling.truncate: only the rounded YaRN correction range (True) is supported")
    original = params.get("original_max_position_embeddings")
    if not isinstance(original, int) or original < 1:
        raise ValueError("rope_scaling.original_max_position_embeddings: YaRN needs an int >= 1, got "
                         f"{original!r}")
    factor = params.get("factor")
    factor = float(hf_config["max_position_embeddings"]) / original if factor is None else float(factor)
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise ValueError(f"rope_scaling.mscale: {mscale!r} with mscale_all_dim={mscale_all_dim!r} has no "
                         "Megatron-Core equivalent (transformers then scales cos / sin by ms(factor, 1))")
    if not mscale_all_dim:
        mscale, mscale_all_dim = 1.0, 0.0
    return MLAConfig(**dims, rope_type="yarn", rotary_scaling_factor=factor,
                     original_max_position_embeddings=original,
                     beta_fast=float(params.get("beta_fast") or 32),
                     beta_slow=float(params.get("beta_slow") or 1),
                     mscale=float(mscale), mscale_all_dim=float(mscale_all_dim))


def _moe_from_hf(hf_config: Mapping[str, Any]) -> MoEConfig:
    """The sigmoid-routed MoE of both families (see the module docstring)."""
    num_layers = int(hf_config["num_hidden_layers"])
    dense = int(hf_config.get("first_k_dense_replace") or 0)
    if not 0 <= dense < num_layers:
        raise ValueError(f"first_k_dense_replace: must be in [0, num_hidden_layers={num_layers}) (at least "
                         f"one MoE layer), got {dense}")
    if hf_config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func: only 'sigmoid' is supported, got {hf_config['scoring_func']!r}")
    if hf_config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError("topk_method: only 'noaux_tc' (grouped top-k on bias-corrected sigmoid scores) is "
                         f"supported, got {hf_config['topk_method']!r}")
    ffn, shared = int(hf_config["moe_intermediate_size"]), int(hf_config.get("n_shared_experts") or 0)
    if shared < 1:
        raise ValueError(f"n_shared_experts: must be >= 1 (a shared expert block), got {shared}")
    groups, group_topk = int(hf_config.get("n_group") or 1), int(hf_config.get("topk_group") or 1)
    scaling = float(hf_config.get("routed_scaling_factor", 1.0))
    return MoEConfig(
        num_experts=int(hf_config["n_routed_experts"]), router_topk=int(hf_config["num_experts_per_tok"]),
        router_pre_softmax=not hf_config.get("norm_topk_prob", True), ffn_hidden_size=ffn,
        shared_expert_ffn_hidden_size=shared * ffn,
        layer_freq=[0] * dense + [1] * (num_layers - dense) if dense else 1,
        router_score_function="sigmoid", router_expert_bias=True,
        router_num_groups=groups if groups > 1 else None,
        router_group_topk=group_topk if groups > 1 else None,
        router_topk_scaling_factor=None if scaling == 1.0 else scaling, aux_loss_coeff=0.0)


def deepseek_from_hf(hf_config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """``ModelConfig`` fields of a ``deepseek_v3`` / ``glm4_moe`` config (over the common ones)."""
    fields: dict[str, Any] = dict(moe=_moe_from_hf(hf_config),
                                  mtp_num_layers=int(hf_config.get("num_nextn_predict_layers") or 0))
    if family == "deepseek_v3":
        fields.update(mla=_mla_from_hf(hf_config), num_query_groups=None, kv_channels=None,
                      add_qkv_bias=False, qk_layernorm=False)
    else:
        fields.update(add_qkv_bias=bool(hf_config.get("attention_bias", False)),
                      qk_layernorm=bool(hf_config.get("use_qk_norm", False)),
                      rotary_percent=_partial_rotary_factor(hf_config, 0.5))
    return fields


def _moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    moe = cfg.moe
    _require(moe is not None, "ModelConfig.moe: DeepSeek-V3 / GLM-4.5 models have MoE layers")
    pattern = moe.layer_pattern(cfg.num_layers)
    dense = pattern.index(1) if 1 in pattern else cfg.num_layers
    _require(pattern == [0] * dense + [1] * (cfg.num_layers - dense) and dense < cfg.num_layers,
             f"MoEConfig.layer_freq: {pattern} is not first_k_dense_replace dense layers then MoE layers")
    _require(moe.router_score_function == "sigmoid" and moe.router_expert_bias,
             "MoEConfig.router_score_function / router_expert_bias: DeepSeek-V3 / GLM-4.5 route by sigmoid "
             "scores with the expert bias (router_score_function='sigmoid', router_expert_bias=True)")
    ffn, shared = moe.ffn_hidden_size or cfg.ffn_size, moe.shared_expert_ffn_hidden_size
    _require(shared is not None and shared % ffn == 0 and not moe.shared_expert_gate,
             f"MoEConfig.shared_expert_ffn_hidden_size / shared_expert_gate: an ungated shared expert of "
             f"n_shared_experts x {ffn} channels is expected, got {shared} (gate={moe.shared_expert_gate})")
    return dict(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                moe_intermediate_size=ffn, n_shared_experts=shared // ffn, first_k_dense_replace=dense,
                n_group=moe.router_num_groups or 1, topk_group=moe.router_group_topk or 1,
                norm_topk_prob=not moe.router_pre_softmax,
                routed_scaling_factor=moe.router_topk_scaling_factor or 1.0,
                num_nextn_predict_layers=cfg.mtp_num_layers, output_router_logits=False)


def _mla_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    mla = cfg.mla
    if mla.rope_type == "rope":
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    _require(mla.mscale_all_dim == 0 and mla.mscale == 1.0 or mla.mscale_all_dim > 0 and mla.mscale > 0,
             f"MLAConfig.mscale: {mla.mscale} with mscale_all_dim={mla.mscale_all_dim} has no transformers "
             "equivalent (it ignores mscale unless both are non-zero)")
    return {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": mla.rotary_scaling_factor,
            "original_max_position_embeddings": mla.original_max_position_embeddings,
            "beta_fast": mla.beta_fast, "beta_slow": mla.beta_slow, "mscale": mla.mscale,
            "mscale_all_dim": mla.mscale_all_dim}


def deepseek_to_hf(cfg: ModelConfig, family: str) -> dict[str, Any]:
    """The family-specific ``config.json`` fields of ``cfg`` (over the common ones ``hf_config``
    writes); ``ValueError`` naming the ``ModelConfig`` field the family cannot express."""
    out = _moe_to_hf(cfg)
    if family == "glm4_moe":
        params = {"rope_type": "default", "rope_theta": cfg.rotary_base,
                  "partial_rotary_factor": cfg.rotary_percent}
        _require(cfg.rope_scaling_factor is None,
                 "ModelConfig.rope_scaling_factor: GLM-4.5 here has unscaled (partial) RoPE")
        return {**out, "attention_bias": cfg.add_qkv_bias, "use_qk_norm": cfg.qk_layernorm,
                "partial_rotary_factor": cfg.rotary_percent, "rope_parameters": params}
    mla = cfg.mla
    return {**out, "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_head_dim, "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
            "v_head_dim": mla.v_head_dim, "qk_head_dim": mla.q_head_dim, "head_dim": mla.qk_pos_emb_head_dim,
            "num_key_value_heads": cfg.num_attention_heads, "rope_interleave": True, "attention_bias": False,
            "rope_parameters": _mla_rope_parameters(cfg)}
