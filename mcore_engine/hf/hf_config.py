"""Hugging Face ``config.json`` <-> ``ModelConfig``: the families of ``ARCHITECTURES``, RoPE (default
and Llama-3 scaling) and the MoE fields of Qwen2-MoE / Qwen3-MoE / Mixtral; DeepSeek-V3 (MLA, YaRN)
and GLM-4.5 (partial RoPE) with their sigmoid-routed MoE in ``deepseek_config``; ``ValueError`` naming
the field for what the other side cannot express. The tensor-name rules are in ``mapping``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mcore_engine.config import ModelConfig
from mcore_engine.hf.deepseek_config import SIGMOID_MOE_FAMILIES, deepseek_from_hf, deepseek_to_hf
from mcore_engine.hf.mapping import _MOE_NAMES, head_dim, model_family

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # also Kimi-K2 and Moonlight folders
    "Glm4MoeForCausalLM": "glm4_moe",
    "LlamaForTokenClassification": "llama",
    "Qwen2ForTokenClassification": "qwen2",
    "Qwen3ForTokenClassification": "qwen3",
}


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a Hugging Face folder as a dict (``ValueError`` when absent or invalid)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"hf_path: no config.json in {str(path)!r}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"hf_path: {file} is not valid JSON ({e})") from e


def hf_family(hf_config: Mapping[str, Any]) -> str:
    """'llama' | 'qwen2' | 'qwen3' | 'qwen2_moe' | 'qwen3_moe' | 'mixtral' | 'deepseek_v3' | 'glm4_moe'
    from ``architectures`` (or ``model_type``); ValueError otherwise."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    model_type = hf_config.get("model_type")
    if not archs and model_type in ARCHITECTURES.values():
        return model_type
    raise ValueError(f"architectures: unknown architecture {archs or model_type!r}; supported: "
                     f"{sorted(ARCHITECTURES)}")


def is_token_classification(hf_config: Mapping[str, Any]) -> bool:
    """A ``*ForTokenClassification`` config (``model.head: value``); ``ValueError`` unless it has one
    label (``num_labels`` or ``id2label``)."""
    if not any(str(a).endswith("ForTokenClassification") for a in hf_config.get("architectures") or []):
        return False
    labels = hf_config.get("num_labels", len(hf_config.get("id2label") or {0: None}))
    if labels != 1:
        raise ValueError(f"num_labels: a value head has one output, the checkpoint has {labels} labels")
    return True


# Megatron-Core's Llama-3 RoPE scaling has only ``factor`` as a parameter; the rest is hard-coded.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope(hf_config: Mapping[str, Any], family: str) -> tuple[float, float | None]:
    """(rope theta, Llama-3 scaling factor or None) from ``rope_parameters`` or the legacy keys;
    ``ValueError`` for what Megatron cannot do. DeepSeek-V3's scaling (YaRN) is ``MLAConfig``'s.
    """
    params = {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    if rope_type == "default" or family == "deepseek_v3":
        return theta, None
    if family == "glm4_moe":
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported for GLM-4.5 (only "
                         "'default', partial)")
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported (only 'default' and "
                         "'llama3' RoPE)")
    wrong = {k: params.get(k) for k, v in _LLAMA3_FIXED.items() if params.get(k) != v}
    if wrong or not isinstance(params.get("factor"), (int, float)) or params["factor"] <= 0:
        raise ValueError(f"rope_scaling: llama3 RoPE needs a factor > 0 (got {params.get('factor')!r}) and "
                         f"Megatron-Core's fixed {_LLAMA3_FIXED}; the checkpoint has {wrong}")
    return theta, float(params["factor"])


def _moe_from_hf(hf_config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """``ModelConfig`` fields of an MoE family: ``moe`` (a ``MoEConfig``) and the dense FFN size.

    MoE layers: Mixtral all; Qwen ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``.
    Routing ``softmax -> top-k (-> renormalise if norm_topk_prob)`` is ``router_pre_softmax =
    not norm_topk_prob`` (Mixtral always renormalises).
    """
    from mcore_engine.config.moe import MoEConfig

    num_layers = int(hf_config["num_hidden_layers"])
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if experts is None:
        raise ValueError("num_experts: an MoE config needs num_experts (or num_local_experts)")
    moe: dict[str, Any] = dict(num_experts=int(experts), router_topk=int(hf_config["num_experts_per_tok"]),
                               aux_loss_coeff=float(hf_config.get("router_aux_loss_coef", 0.0)))
    if family == "mixtral":
        if hf_config.get("sliding_window") is not None:
            raise ValueError("sliding_window: sliding-window attention is not supported")
        if hf_config.get("router_jitter_noise"):
            raise ValueError("router_jitter_noise: router input jitter is not supported (expected 0)")
        moe.update(ffn_hidden_size=int(hf_config["intermediate_size"]), router_pre_softmax=False)
        return {"moe": MoEConfig(**moe)}
    step = int(hf_config.get("decoder_sparse_step", 1))
    dense = set(hf_config.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]
    moe.update(ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
               router_pre_softmax=not hf_config.get("norm_topk_prob", False),
               layer_freq=1 if all(pattern) else pattern)
    if family == "qwen2_moe":
        if not hf_config.get("qkv_bias", True):
            raise ValueError("qkv_bias: Qwen2-MoE without QKV biases is not supported")
        shared = int(hf_config.get("shared_expert_intermediate_size") or 0)
        if shared <= 0:
            raise ValueError("shared_expert_intermediate_size: Qwen2-MoE needs a shared expert (> 0)")
        moe.update(shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
    return {"moe": MoEConfig(**moe)}


def _moe_to_hf(cfg: ModelConfig, family: str, base: Mapping[str, Any] | None) -> dict[str, Any]:
    """The MoE fields of ``config.json`` (``ValueError`` naming the ``MoEConfig`` field the family
    cannot express)."""
    moe = cfg.moe
    pattern = moe.layer_pattern(cfg.num_layers)
    if moe.router_num_groups is not None or moe.router_expert_bias:
        raise ValueError("MoEConfig.router_num_groups / router_expert_bias: grouped routing and the expert "
                         f"bias are DeepSeek-V3 / GLM-4.5's (sigmoid scores); this model maps to {family}")
    if moe.router_score_function != "softmax" or moe.router_topk_scaling_factor not in (None, 1.0):
        raise ValueError("MoEConfig.router_score_function / router_topk_scaling_factor: Hugging Face "
                         f"{family} routes by softmax without scaling")
    if (moe.shared_expert_ffn_hidden_size is not None) != (family == "qwen2_moe") or (
            family == "qwen2_moe" and not moe.shared_expert_gate):
        raise ValueError("MoEConfig.shared_expert_ffn_hidden_size / shared_expert_gate: a gated shared "
                         f"expert is Qwen2-MoE's (QKV bias) and only its; this model maps to {family}")
    out: dict[str, Any] = dict(num_experts_per_tok=moe.router_topk, router_aux_loss_coef=moe.aux_loss_coeff,
                               output_router_logits=False)
    expert_ffn = moe.ffn_hidden_size or cfg.ffn_size
    if family == "mixtral":
        if not all(pattern) or moe.router_pre_softmax:
            raise ValueError("MoEConfig.layer_freq / router_pre_softmax: Mixtral has MoE in every layer "
                             "and renormalised top-k weights")
        return {**out, "num_local_experts": moe.num_experts, "intermediate_size": expert_ffn,
                "sliding_window": None, "router_jitter_noise": 0.0}
    # transformers writes a Qwen3-MoE count as num_local_experts, the Hub's folders as num_experts
    local_key = family == "qwen3_moe" and "num_local_experts" in (base or {})
    key = "num_local_experts" if local_key else "num_experts"
    out.update({key: moe.num_experts}, moe_intermediate_size=expert_ffn,
               norm_topk_prob=not moe.router_pre_softmax)
    step, dense = 1, [i for i, p in enumerate(pattern) if not p]
    if base is not None:  # keep the source's description of the same pattern
        b_step, b_dense = int(base.get("decoder_sparse_step", 1)), list(base.get("mlp_only_layers") or [])
        if [int(i not in b_dense and (i + 1) % b_step == 0) for i in range(cfg.num_layers)] == pattern:
            step, dense = b_step, b_dense
    out.update(decoder_sparse_step=step, mlp_only_layers=dense)
    if family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size, qkv_bias=True)
    return out


def from_hf_config(hf_config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """``ModelConfig`` from a ``config.json`` dict (``overrides`` set other fields); ``ValueError`` naming
    the field for what this model cannot express (other activations, sliding windows, MLP biases, ...).
    """
    family = hf_family(hf_config)
    hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {hf_config['hidden_act']!r} is not supported (expected 'silu')")
    if hf_config.get("mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported")
    if family not in ("qwen2", "qwen2_moe", "glm4_moe") and hf_config.get("attention_bias"):
        raise ValueError("attention_bias: the output-projection bias it implies is not supported")
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")
    if family != "glm4_moe" and float(hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor: partial RoPE is supported for GLM-4.5 only, not {family}")
    theta, rope_factor = _rope(hf_config, family)
    fields: dict[str, Any] = dict(
        num_layers=int(hf_config["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(hf_config.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf_config["intermediate_size"]),
        vocab_size=int(hf_config["vocab_size"]),
        max_sequence_length=int(hf_config["max_position_embeddings"]),
        rotary_base=theta,
        rope_scaling_factor=rope_factor,
        normalization="RMSNorm",
        norm_epsilon=float(hf_config["rms_norm_eps"]),
        swiglu=True,
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        add_qkv_bias=family in ("qwen2", "qwen2_moe"),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
    )
    d = hf_config.get("head_dim") or hidden // heads
    if family != "deepseek_v3" and (d != hidden // heads or hidden % heads):  # (MLA: the RoPE dims)
        fields["kv_channels"] = int(d)
    if family in SIGMOID_MOE_FAMILIES:
        fields.update(deepseek_from_hf(hf_config, family))
    elif family in _MOE_NAMES:
        fields.update(_moe_from_hf(hf_config, family))
    if is_token_classification(hf_config):
        fields["head"] = "value"
    fields.update(overrides)
    return ModelConfig(**fields)


def to_hf_config(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` dict for ``cfg``; ``base`` (the source config) keeps the fields this mapping does
    not own (token ids, generation settings).
    """
    if cfg.normalization != "RMSNorm" or not cfg.swiglu:
        raise ValueError("cfg: only RMSNorm + SwiGLU models map to Llama/Qwen2/Qwen3 and their MoE families")
    family = model_family(cfg)
    if cfg.rotary_percent != 1.0 and family != "glm4_moe":
        raise ValueError(f"ModelConfig.rotary_percent: partial RoPE maps to GLM-4.5 only (MoE with sigmoid "
                         f"scores); this model maps to {family}")
    if base is not None and hf_family(base) != family:
        base = None  # the source describes another family: do not carry its fields over
    arch = next(a for a, f in ARCHITECTURES.items() if f == family)
    if cfg.head == "value":
        arch = arch.replace("ForCausalLM", "ForTokenClassification")
    out = dict(base or {})
    out.update(
        architectures=[arch], model_type=family, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups,
        head_dim=head_dim(cfg), hidden_act="silu", max_position_embeddings=cfg.max_sequence_length,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base,
        rope_parameters=_rope_parameters(cfg),
        tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=cfg.init_method_std,
        dtype=str(dtype).removeprefix("torch."), torch_dtype=str(dtype).removeprefix("torch."),
    )
    out.pop("rope_scaling", None)
    if cfg.head == "value":  # score = Linear(H, 1) with bias; no lm_head to tie
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
                   tie_word_embeddings=False, token_classification_bias=True)
    if family == "llama":
        out.update(attention_bias=False, mlp_bias=False)
    elif family not in ("mixtral", *SIGMOID_MOE_FAMILIES):
        out.update(use_sliding_window=False,
                   **({"attention_bias": False} if family in ("qwen3", "qwen3_moe") else {}))
    if cfg.moe is not None and cfg.head == "value":
        raise ValueError("model.head: a value head on an MoE model has no Hugging Face class here")
    if family in SIGMOID_MOE_FAMILIES:  # (refuses a DeepSeek-V3 without MoE)
        out.update(deepseek_to_hf(cfg, family))
    elif cfg.moe is not None:
        out.update(_moe_to_hf(cfg, family, base))
    return out


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {"rope_type": "llama3", "rope_theta": cfg.rotary_base, "factor": cfg.rope_scaling_factor,
            **_LLAMA3_FIXED}
