"""Hugging Face ``config.json`` <-> ``ModelConfig`` for the families of ``families.FAMILIES``, by their
traits: RoPE (default, Llama-3 scaling, partial), QKV bias / QK-norm, MLA (``deepseek_config``), MTP
and the MoE dialects of ``MOE_DIALECTS``. ``ValueError`` naming the field for what the other side
cannot express. The tensor names are in ``mapping``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from mcore_engine.config import ModelConfig
from mcore_engine.config.checks import require
from mcore_engine.config.moe import MoEConfig
from mcore_engine.config.vision import VisionConfig
from mcore_engine.hf.deepseek_config import (
    deepseek_moe_from_hf,
    deepseek_moe_to_hf,
    mla_from_hf,
    mla_rope_parameters,
    mla_to_hf,
)
from mcore_engine.hf.families import (
    ARCHITECTURES,
    MULTIMODAL,
    Family,
    Multimodal,
    family_of,
    hf_family,
    hf_family_of,
    is_multimodal,
    multimodal_of,
    partial_rotary_factor,
    rope_params,
    text_config,
)
from mcore_engine.hf.gpt_oss import gpt_oss_from_hf, gpt_oss_to_hf, yarn_to_hf
from mcore_engine.hf.hybrid import gdn_from_hf, gdn_to_hf
from mcore_engine.hf.mapping import head_dim, source_family

__all__ = ["ARCHITECTURES", "MOE_DIALECTS", "from_hf_config", "hf_family", "is_token_classification",
           "read_hf_config", "to_hf_config"]


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a Hugging Face folder as a dict (``ValueError`` when absent or invalid)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        raise ValueError(f"hf_path: no config.json in {str(path)!r}")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"hf_path: {file} is not valid JSON ({e})") from e


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


def _rope(hf_config: Mapping[str, Any], family: Family) -> tuple[float, float | None]:
    """(rope theta, Llama-3 scaling factor or None); MLA's scaling (YaRN) is ``MLAConfig``'s."""
    params = rope_params(hf_config)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type == "mrope":  # the Hub's Qwen2.5-VL: default RoPE over 3-D positions (ModelConfig.vision)
        rope_type = "default"
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    if rope_type == "default" or family.rope in ("mla", "yarn"):  # YaRN: the gpt_oss dialect's
        return theta, None
    if family.rope != "llama3":
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported for {family.model_type} "
                         f"(only 'default', {family.rope})")
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported (only 'default' and "
                         "'llama3' RoPE)")
    wrong = {k: params.get(k) for k, v in _LLAMA3_FIXED.items() if params.get(k) != v}
    if wrong or not isinstance(params.get("factor"), (int, float)) or params["factor"] <= 0:
        raise ValueError(f"rope_scaling: llama3 RoPE needs a factor > 0 (got {params.get('factor')!r}) and "
                         f"Megatron-Core's fixed {_LLAMA3_FIXED}; the checkpoint has {wrong}")
    return theta, float(params["factor"])


def _rope_parameters(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    if family.rope == "mla":
        return mla_rope_parameters(cfg)
    if family.rope == "yarn":
        return yarn_to_hf(cfg)
    if family.rope == "partial":
        require(cfg.rope_scaling_factor is None, f"ModelConfig.rope_scaling_factor: {family.model_type} here "
                "has unscaled (partial) RoPE", "model.rope_scaling_factor")
        return {"rope_type": "default", "rope_theta": cfg.rotary_base,
                "partial_rotary_factor": cfg.rotary_percent}
    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {"rope_type": "llama3", "rope_theta": cfg.rotary_base, "factor": cfg.rope_scaling_factor,
            **_LLAMA3_FIXED}


# ------------------------------------------------------------------------ softmax-routed MoE dialects
def _softmax_moe(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    experts = hf_config.get("num_experts", hf_config.get("num_local_experts"))
    if experts is None:
        raise ValueError("num_experts: an MoE config needs num_experts (or num_local_experts)")
    return dict(num_experts=int(experts), router_topk=int(hf_config["num_experts_per_tok"]),
                aux_loss_coeff=float(hf_config.get("router_aux_loss_coef", 0.0)))


def _mixtral_from_hf(hf_config: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """Every layer MoE of ``intermediate_size`` experts; top-k weights always renormalised."""
    if hf_config.get("sliding_window") is not None:
        raise ValueError("sliding_window: sliding-window attention is not supported")
    if hf_config.get("router_jitter_noise"):
        raise ValueError("router_jitter_noise: router input jitter is not supported (expected 0)")
    return {"moe": MoEConfig(**_softmax_moe(hf_config), ffn_hidden_size=int(hf_config["intermediate_size"]),
                             router_pre_softmax=False)}


def _qwen_from_hf(hf_config: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """MoE layers ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``;
    ``router_pre_softmax = not norm_topk_prob``; a gated shared expert when the family has one."""
    num_layers = int(hf_config["num_hidden_layers"])
    hf_config = {**family.moe_defaults, **hf_config}
    if family.moe_fixed:  # every layer MoE, top-k renormalised, whatever the config says
        hf_config.update(decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    step, dense = int(hf_config.get("decoder_sparse_step", 1)), set(hf_config.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(num_layers)]
    moe = dict(_softmax_moe(hf_config), ffn_hidden_size=int(hf_config["moe_intermediate_size"]),
               router_pre_softmax=not hf_config.get("norm_topk_prob", False),
               layer_freq=1 if all(pattern) else pattern)
    if family.shared_expert == "gated":
        shared = int(hf_config.get("shared_expert_intermediate_size") or 0)
        if shared <= 0:
            raise ValueError(f"shared_expert_intermediate_size: {family.model_type} needs a shared expert "
                             "(> 0)")
        moe.update(shared_expert_ffn_hidden_size=shared, shared_expert_gate=True)
    return {"moe": MoEConfig(**moe)}


def _softmax_moe_to_hf(cfg: ModelConfig, family: Family) -> dict[str, Any]:
    """The fields both softmax dialects write; ``ValueError`` for what they cannot express."""
    moe, name = cfg.moe, family.model_type
    if moe.router_num_groups is not None or moe.router_expert_bias:
        raise ValueError("MoEConfig.router_num_groups / router_expert_bias: grouped routing and the expert "
                         f"bias are DeepSeek-V3 / GLM-4.5's (sigmoid scores); this model maps to {name}")
    if moe.router_score_function != "softmax" or moe.router_topk_scaling_factor not in (None, 1.0):
        raise ValueError("MoEConfig.router_score_function / router_topk_scaling_factor: Hugging Face "
                         f"{name} routes by softmax without scaling")
    gated = family.shared_expert == "gated"
    if (moe.shared_expert_ffn_hidden_size is not None) != gated or (gated and not moe.shared_expert_gate):
        raise ValueError("MoEConfig.shared_expert_ffn_hidden_size / shared_expert_gate: a gated shared "
                         f"expert is Qwen2-MoE's (QKV bias) and only its; this model maps to {name}")
    return dict(num_experts_per_tok=moe.router_topk, router_aux_loss_coef=moe.aux_loss_coeff,
                output_router_logits=False)


def _mixtral_to_hf(cfg: ModelConfig, family: Family, base: Mapping[str, Any] | None) -> dict[str, Any]:
    out, moe = _softmax_moe_to_hf(cfg, family), cfg.moe
    if not all(moe.layer_pattern(cfg.num_layers)) or moe.router_pre_softmax:
        raise ValueError("MoEConfig.layer_freq / router_pre_softmax: Mixtral has MoE in every layer "
                         "and renormalised top-k weights")
    return {**out, "num_local_experts": moe.num_experts, "sliding_window": None, "router_jitter_noise": 0.0,
            "intermediate_size": moe.ffn_hidden_size or cfg.ffn_size}


def _qwen_to_hf(cfg: ModelConfig, family: Family, base: Mapping[str, Any] | None) -> dict[str, Any]:
    out, moe = _softmax_moe_to_hf(cfg, family), cfg.moe
    pattern = moe.layer_pattern(cfg.num_layers)
    # transformers writes the count as num_local_experts, the Hub's folders as num_experts
    key = "num_local_experts" if "num_local_experts" in (base or {}) else "num_experts"
    out.update({key: moe.num_experts}, moe_intermediate_size=moe.ffn_hidden_size or cfg.ffn_size,
               norm_topk_prob=not moe.router_pre_softmax)
    step, dense = 1, [i for i, p in enumerate(pattern) if not p]
    if base is not None:  # keep the source's description of the same pattern
        b_step, b_dense = int(base.get("decoder_sparse_step", 1)), list(base.get("mlp_only_layers") or [])
        if [int(i not in b_dense and (i + 1) % b_step == 0) for i in range(cfg.num_layers)] == pattern:
            step, dense = b_step, b_dense
    out.update(decoder_sparse_step=step, mlp_only_layers=dense)
    if family.moe_fixed:
        if not all(pattern) or moe.router_pre_softmax:
            raise ValueError(f"MoEConfig.layer_freq / router_pre_softmax: {family.model_type} has MoE in "
                             "every layer and renormalised top-k weights")
        for key in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob"):
            out.pop(key)
        if "intermediate_size" not in (base or {}):
            out["intermediate_size"] = None  # removed by to_hf_config (the family has no dense MLP)
    if family.shared_expert == "gated":
        out["shared_expert_intermediate_size"] = moe.shared_expert_ffn_hidden_size
    return out


# Family.moe -> (config.json -> ModelConfig fields, ModelConfig -> config.json fields)
MOE_DIALECTS: dict[str, tuple[Callable[..., dict[str, Any]], Callable[..., dict[str, Any]]]] = {
    "qwen": (_qwen_from_hf, _qwen_to_hf),
    "mixtral": (_mixtral_from_hf, _mixtral_to_hf),
    "deepseek": (deepseek_moe_from_hf, deepseek_moe_to_hf),
    "gpt_oss": (gpt_oss_from_hf, gpt_oss_to_hf),  # with its attention (sinks, windows, biases, YaRN)
}


# ------------------------------------------------------------------------------------ vision-language
_VISION_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id")
# the top level of a flat (the Hub's Qwen2.5-VL) config.json: not the language model's
_TOP_KEYS = ("architectures", "model_type", "tie_word_embeddings", "transformers_version", "vision_config",
             "vision_end_token_id", "vision_token_id", *_VISION_TOKENS)


def interleaved_section(section: list[int], pairs: int) -> list[int]:
    """The ``[t, h, w]`` counts over ``pairs`` rotary pairs that give interleaved mRoPE's assignment of
    ``section`` as ``transformers`` applies it (pair ``i`` -> h if ``i % 3 == 1 and i < 3 h``, w if
    ``i % 3 == 2 and i < 3 w``, else t; pairs past the rotary dimension dropped): ``section`` when it
    already sums to ``pairs``."""
    if sum(section) == pairs:
        return list(section)
    h = sum(1 for i in range(pairs) if i % 3 == 1 and i < 3 * section[1])
    w = sum(1 for i in range(pairs) if i % 3 == 2 and i < 3 * section[2])
    return [pairs - h - w, h, w]


def vision_from_hf(hf_config: Mapping[str, Any], mm: Multimodal, rotary_dim: int) -> VisionConfig:
    """``ModelConfig.vision`` of a vision-language ``config.json`` (``mm``: its row): ``vision_config`` as
    is, the top level's token ids, ``mrope_section`` from the text config's ``rope_parameters`` /
    ``rope_scaling`` (``transformers``' default when absent; interleaved: fitted to ``rotary_dim`` as
    :func:`interleaved_section`), ``tokens_per_second`` from ``vision_config`` (Qwen2.5-VL)."""
    vision = hf_config.get("vision_config")
    if not isinstance(vision, Mapping):
        raise ValueError(f"vision_config: a {mm.architecture} config.json needs its tower's fields in "
                         "vision_config")
    missing = [k for k in _VISION_TOKENS if not isinstance(hf_config.get(k), int)]
    if missing:
        raise ValueError(f"{missing[0]}: a {mm.architecture} config.json needs the token ids "
                         f"{_VISION_TOKENS} at its top level")
    params = rope_params(text_config(hf_config))
    section = [int(x) for x in params.get("mrope_section") or mm.mrope_default]
    if mm.mrope_interleaved and len(section) == 3:
        section = interleaved_section(section, rotary_dim // 2)
    tps = vision.get("tokens_per_second") if mm.model_type == "qwen2_5_vl" else None
    return VisionConfig(model_type=mm.model_type, vision_config=dict(vision),
                        **{k: int(hf_config[k]) for k in _VISION_TOKENS}, mrope_section=section,
                        mrope_interleaved=mm.mrope_interleaved,
                        tokens_per_second=None if tps is None else float(tps))


def _mrope_keys(text: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in rope_params(text or {}).items() if k in ("mrope_section", "mrope_interleaved")}


def _vision_to_hf(cfg: ModelConfig, out: dict[str, Any], outer: dict[str, Any] | None,
                  base: Mapping[str, Any] | None) -> tuple[dict[str, Any], Multimodal]:
    """The vision-language top level of ``cfg`` (``cfg.vision``) around the text config ``out``: the
    source's (``outer``, text config ``base``) or a new one; mRoPE into ``out``'s ``rope_parameters``
    (the source's ``mrope_section`` / ``mrope_interleaved`` kept when they say the same)."""
    vision, mm = cfg.vision, MULTIMODAL[cfg.vision.model_type]
    if mm.moe_fixed and cfg.moe is not None and cfg.moe.router_pre_softmax:
        raise ValueError(f"MoEConfig.router_pre_softmax: {mm.architecture} always renormalises the top-k "
                         "weights (router_pre_softmax False)")
    source = _mrope_keys(base)
    rope = {**source, **out["rope_parameters"]}
    section = [int(x) for x in source.get("mrope_section") or mm.mrope_default]
    if mm.mrope_interleaved and len(section) == 3:
        section = interleaved_section(section, sum(vision.mrope_section))
    if outer is None or section != list(vision.mrope_section):
        rope["mrope_section"] = list(vision.mrope_section)
    if mm.mrope_interleaved and outer is None:
        rope["mrope_interleaved"] = True
    out["rope_parameters"] = rope
    if outer is None:
        outer = {"architectures": [mm.architecture], "model_type": mm.model_type,
                 "text_config": {"model_type": mm.text_model_type}}
    outer = dict(outer)
    outer.update(vision_config=dict(vision.vision_config), **{k: getattr(vision, k) for k in _VISION_TOKENS})
    return outer, mm


# ---------------------------------------------------------------------------------------- the mapping
def _flag(trait: bool | str, hf_config: Mapping[str, Any]) -> bool:
    return bool(hf_config.get(trait, False)) if isinstance(trait, str) else trait


def from_hf_config(hf_config: Mapping[str, Any], **overrides: Any) -> ModelConfig:
    """``ModelConfig`` from a ``config.json`` dict (``overrides`` set other fields); ``ValueError`` naming
    the field for what this model cannot express (other activations, sliding windows, MLP biases, ...).
    A vision-language config (``families.MULTIMODAL``: Qwen2.5-VL, Qwen3-VL(-MoE), Qwen3.5(-MoE)
    ``*ForConditionalGeneration``) maps its ``text_config`` and fills ``vision`` (:func:`vision_from_hf`;
    ``vision=None`` in ``overrides``: the language model alone, the tower kept out)."""
    family = hf_family_of(hf_config)
    mm, top = multimodal_of(hf_config), hf_config
    hf_config = text_config(hf_config)
    if mm is not None and mm.moe_fixed:
        hf_config = {**hf_config, **mm.moe_fixed}
    hidden, heads = int(hf_config["hidden_size"]), int(hf_config["num_attention_heads"])
    if hf_config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {hf_config['hidden_act']!r} is not supported (expected 'silu')")
    if hf_config.get("mlp_bias"):
        raise ValueError("mlp_bias: MLP biases are not supported")
    if family.qkv_bias is False and not family.biases and hf_config.get("attention_bias"):
        raise ValueError("attention_bias: the output-projection bias it implies is not supported")
    if family.qkv_bias is True and not hf_config.get("qkv_bias", True):
        raise ValueError(f"qkv_bias: {family.model_type} without QKV biases is not supported")
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")
    if family.rope != "partial" and float(hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor: partial RoPE is not supported for {family.model_type}")
    theta, rope_factor = _rope(hf_config, family)
    if family.moe_fixed:  # every layer MoE: no dense MLP width in config.json
        hf_config = {"intermediate_size": hf_config.get("moe_intermediate_size"), **hf_config}
    fields: dict[str, Any] = dict(
        num_layers=int(hf_config["num_hidden_layers"]), hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=int(hf_config.get("num_key_value_heads") or heads),
        ffn_hidden_size=int(hf_config["intermediate_size"]), vocab_size=int(hf_config["vocab_size"]),
        max_sequence_length=int(hf_config["max_position_embeddings"]), rotary_base=theta,
        rope_scaling_factor=rope_factor, normalization="RMSNorm", swiglu=True,
        norm_epsilon=float(hf_config["rms_norm_eps"]),
        tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        add_qkv_bias=_flag(family.qkv_bias, hf_config), qk_layernorm=_flag(family.qk_norm, hf_config),
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
    )
    d = hf_config.get("head_dim") or hidden // heads
    if family.mla:  # head dims are MLAConfig's (head_dim: the RoPE dims)
        fields.update(mla=mla_from_hf(hf_config), num_query_groups=None)
    elif d != hidden // heads or hidden % heads:
        fields["kv_channels"] = int(d)
    if family.rope == "partial":
        fields["rotary_percent"] = partial_rotary_factor(hf_config, 0.25 if family.hybrid else 0.5)
    if family.hybrid:
        fields.update(gdn_from_hf(hf_config, family))
    if family.mtp:
        fields["mtp_num_layers"] = int(hf_config.get("num_nextn_predict_layers") or 0)
    if family.moe is not None:
        fields.update(MOE_DIALECTS[family.moe][0](hf_config, family))
    if is_token_classification(hf_config):
        fields["head"] = "value"
    if mm is not None and "vision" not in overrides:
        rotary = int(int(fields.get("kv_channels") or hidden // heads) * fields.get("rotary_percent", 1.0))
        fields["vision"] = vision_from_hf(top, mm, rotary)
    fields.update(overrides)
    return ModelConfig(**fields)


def to_hf_config(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` dict for ``cfg``; ``base`` (the source config) keeps the fields this mapping does
    not own (token ids, generation settings)."""
    if cfg.normalization != "RMSNorm" or not cfg.swiglu:
        raise ValueError("cfg: only RMSNorm + SwiGLU models map to Llama/Qwen2/Qwen3 and their MoE families")
    family = source_family(cfg, base) if base is not None else family_of(cfg)
    name = family.model_type
    if cfg.rotary_percent != 1.0 and family.rope != "partial":
        raise ValueError(f"ModelConfig.rotary_percent: partial RoPE maps to GLM-4.5 only (MoE with sigmoid "
                         f"scores); this model maps to {name}")
    if cfg.head == "value" and cfg.vision is not None:
        raise ValueError("model.head: a value head on a vision-language model (model.vision) has no Hugging "
                         "Face class here")
    if cfg.head == "value" and not family.value_head:
        raise ValueError(f"model.head: a value head on a {name} model has no Hugging Face class here")
    if base is not None and hf_family(base) != name:
        base = None  # the source describes another family: do not carry its fields over
    if (base is not None and cfg.vision is not None
            and getattr(multimodal_of(base), "model_type", None) != cfg.vision.model_type):
        base = None  # a text (or another vision-language) model's config
    outer = None
    if base is not None and is_multimodal(base):  # the language model goes into text_config
        outer, base = base, text_config(base)
        if "text_config" not in outer:  # the Hub's flat Qwen2.5-VL: the text fields move down
            outer = {k: v for k, v in outer.items() if k in _TOP_KEYS} | {"text_config": {}}
    arch = family.architecture
    if cfg.head == "value":
        arch = arch.replace("ForCausalLM", "ForTokenClassification")
    out = dict(base or {})
    out.update(
        architectures=[arch],
        model_type=name, vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.query_groups,
        head_dim=head_dim(cfg), hidden_act="silu", max_position_embeddings=cfg.max_sequence_length,
        rms_norm_eps=cfg.norm_epsilon, rope_theta=cfg.rotary_base,
        rope_parameters=_rope_parameters(cfg, family),
        tie_word_embeddings=cfg.tie_word_embeddings, initializer_range=cfg.init_method_std,
        dtype=str(dtype).removeprefix("torch."), torch_dtype=str(dtype).removeprefix("torch."),
        **family.export,
    )
    out.pop("rope_scaling", None)
    if cfg.head == "value":  # score = Linear(H, 1) with bias; no lm_head to tie
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0},
                   tie_word_embeddings=False, token_classification_bias=True)
    for trait, value in ((family.qkv_bias, cfg.add_qkv_bias), (family.qk_norm, cfg.qk_layernorm)):
        if isinstance(trait, str):
            out[trait] = value
    if family.rope == "partial":
        out["partial_rotary_factor"] = cfg.rotary_percent
    if family.mtp:
        out["num_nextn_predict_layers"] = cfg.mtp_num_layers
    if family.mla:
        out.update(mla_to_hf(cfg))
    if family.moe is not None:
        out.update(MOE_DIALECTS[family.moe][1](cfg, family, base))
    if out.get("quantization_config", {}) is None:  # written dequantised (gpt_oss's MXFP4 experts)
        out.pop("quantization_config")
    if family.moe_fixed and out.get("intermediate_size") is None:
        out.pop("intermediate_size")
    if family.hybrid:
        out.update(gdn_to_hf(cfg, family, base))
        out["rope_parameters"] = {**(base or {}).get("rope_parameters", {}), **out["rope_parameters"]}
        for key in ("partial_rotary_factor", "rope_theta"):
            if key not in (base or {}):
                out.pop(key)  # transformers keeps them in rope_parameters
    mm = multimodal_of(outer) if outer is not None else None
    if cfg.vision is not None:
        outer, mm = _vision_to_hf(cfg, out, outer, base)
    elif outer is not None:  # the language model of a vision-language folder: its mRoPE as was
        out["rope_parameters"] = {**_mrope_keys(base), **out["rope_parameters"]}
    if outer is not None and mm is not None and base is not None:
        for key in ("rope_theta", *family.export, *mm.moe_fixed):  # fields the source's text config lacks
            if key not in base:
                out.pop(key, None)
    if outer is not None:
        outer_keys = ("architectures", "torch_dtype", "dtype") + (
            ("tie_word_embeddings",) if "tie_word_embeddings" in outer else ())
        for key in outer_keys:  # the outer config's (transformers ties by the outer flag); text_config as was
            out.pop(key)
            if key in outer["text_config"]:
                out[key] = outer["text_config"][key]
        text_type = mm.text_model_type if mm is not None else outer["text_config"].get("model_type", name)
        return {**outer, "text_config": {**out, "model_type": text_type},
                "tie_word_embeddings": cfg.tie_word_embeddings, "dtype": str(dtype).removeprefix("torch.")}
    return out
