"""DeepSeek-V3's blocks of ``config.json`` <-> ``ModelConfig``: multi-latent attention with YaRN
(``mla_*``) and the sigmoid-routed MoE dialect that GLM-4.5 shares (``deepseek_moe_*``: scores with
the expert bias ``e_score_correction_bias``, grouped top-k, top-k weights renormalised
(``norm_topk_prob``) and scaled (``routed_scaling_factor``), one ungated shared expert block,
``first_k_dense_replace`` dense layers). ``ValueError`` naming the field the other side cannot express.

RoPE scales, ``transformers`` vs Megatron-Core (``f`` = YaRN ``factor``, ``ms(f, a) = 0.1 a ln f + 1``,
1 for ``f <= 1``): the softmax scale is ``ms(f, mscale_all_dim)^2 / sqrt(q_head_dim)`` in both; the
cos / sin factor is ``ms(f, mscale) / ms(f, mscale_all_dim)`` in Megatron, in ``transformers`` only
when both are non-zero (else ``ms(f, 1)``). So ``mscale_all_dim`` 0 maps to Megatron's ``mscale=1,
mscale_all_dim=0``, and ``mscale`` 0 with a non-zero ``mscale_all_dim`` is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mcore_engine.config import ModelConfig
from mcore_engine.config.checks import require
from mcore_engine.config.mla import MLAConfig
from mcore_engine.config.moe import MoEConfig
from mcore_engine.hf.families import Family, partial_rotary_factor, rope_params

__all__ = ["deepseek_moe_from_hf", "deepseek_moe_to_hf", "mla_from_hf", "mla_rope_parameters", "mla_to_hf"]


def mla_from_hf(hf_config: Mapping[str, Any]) -> MLAConfig:
    """``MLAConfig`` of a DeepSeek-V3 config (RoPE ``default`` or ``yarn``; module docstring)."""
    if hf_config.get("rope_interleave", True) is not True:
        raise ValueError("rope_interleave: only interleaved MLA RoPE (rope_interleave=True, DeepSeek's "
                         "layout and Megatron-Core's) is supported")
    if hf_config.get("attention_bias"):
        raise ValueError("attention_bias: MLA projection biases are not supported")
    if partial_rotary_factor(hf_config, 1.0) != 1.0:
        raise ValueError("partial_rotary_factor: MLA rotates all qk_rope_head_dim channels (expected 1.0)")
    params = rope_params(hf_config)
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


def deepseek_moe_from_hf(hf_config: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """``{"moe": MoEConfig}`` of the sigmoid-routed dialect (see the module docstring)."""
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
    return {"moe": MoEConfig(
        num_experts=int(hf_config["n_routed_experts"]), router_topk=int(hf_config["num_experts_per_tok"]),
        router_pre_softmax=not hf_config.get("norm_topk_prob", True), ffn_hidden_size=ffn,
        shared_expert_ffn_hidden_size=shared * ffn,
        layer_freq=[0] * dense + [1] * (num_layers - dense) if dense else 1,
        router_score_function="sigmoid", router_expert_bias=True,
        router_num_groups=groups if groups > 1 else None,
        router_group_topk=group_topk if groups > 1 else None,
        router_topk_scaling_factor=None if scaling == 1.0 else scaling, aux_loss_coeff=0.0)}


def deepseek_moe_to_hf(cfg: ModelConfig, family: Family, base: Mapping[str, Any] | None) -> dict[str, Any]:
    moe = cfg.moe
    require(moe is not None, f"ModelConfig.moe: {family.model_type} models have MoE layers", "model.moe")
    pattern = moe.layer_pattern(cfg.num_layers)
    dense = pattern.index(1) if 1 in pattern else cfg.num_layers
    require(pattern == [0] * dense + [1] * (cfg.num_layers - dense) and dense < cfg.num_layers,
            f"MoEConfig.layer_freq: {pattern} is not first_k_dense_replace dense layers then MoE layers",
            "model.moe.layer_freq")
    require(moe.router_score_function == "sigmoid" and moe.router_expert_bias,
            "MoEConfig.router_score_function / router_expert_bias: DeepSeek-V3 / GLM-4.5 route by sigmoid "
            "scores with the expert bias (router_score_function='sigmoid', router_expert_bias=True)",
            "model.moe.router_expert_bias")
    ffn, shared = moe.ffn_hidden_size or cfg.ffn_size, moe.shared_expert_ffn_hidden_size
    require(shared is not None and shared % ffn == 0 and not moe.shared_expert_gate,
            f"MoEConfig.shared_expert_ffn_hidden_size / shared_expert_gate: an ungated shared expert of "
            f"n_shared_experts x {ffn} channels is expected, got {shared} (gate={moe.shared_expert_gate})",
            "model.moe.shared_expert_ffn_hidden_size")
    return dict(n_routed_experts=moe.num_experts, num_experts_per_tok=moe.router_topk,
                moe_intermediate_size=ffn, n_shared_experts=shared // ffn, first_k_dense_replace=dense,
                n_group=moe.router_num_groups or 1, topk_group=moe.router_group_topk or 1,
                norm_topk_prob=not moe.router_pre_softmax,
                routed_scaling_factor=moe.router_topk_scaling_factor or 1.0, output_router_logits=False)


def mla_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    mla = cfg.mla
    if mla.rope_type == "rope":
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    require(mla.mscale_all_dim == 0 and mla.mscale == 1.0 or mla.mscale_all_dim > 0 and mla.mscale > 0,
            f"MLAConfig.mscale: {mla.mscale} with mscale_all_dim={mla.mscale_all_dim} has no transformers "
            "equivalent (it ignores mscale unless both are non-zero)", "model.mla.mscale")
    return {"rope_type": "yarn", "rope_theta": cfg.rotary_base, "factor": mla.rotary_scaling_factor,
            "original_max_position_embeddings": mla.original_max_position_embeddings,
            "beta_fast": mla.beta_fast, "beta_slow": mla.beta_slow, "mscale": mla.mscale,
            "mscale_all_dim": mla.mscale_all_dim}


def mla_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The MLA fields of ``config.json`` (over the common ones)."""
    mla = cfg.mla
    return {"q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
            "qk_nope_head_dim": mla.qk_head_dim, "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
            "v_head_dim": mla.v_head_dim, "qk_head_dim": mla.q_head_dim, "head_dim": mla.qk_pos_emb_head_dim,
            "num_key_value_heads": cfg.num_attention_heads, "rope_interleave": True, "attention_bias": False}
