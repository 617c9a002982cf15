"""Name and layout rules between Hugging Face Llama / Qwen2 / Qwen3 and Megatron-Core's GPTModel.

Every Megatron parameter is one unit with a ``TensorRule``: its Hugging Face tensors and its
tensor-parallel layout (``kind``):

- ``"replicated"``: norms, full on every rank.  ``"row"``: ``linear_proj``, ``linear_fc2``, split on dim 1.
- ``"vocab"``: embedding / output layer ``[V_pad, h]``, split on dim 0; rows ``>= vocab_size`` are
  padding (zero on import, dropped on export).
- ``"qkv"``: ``[ng * (q_per_group + 2) * d, h]``, per group ``[q, k, v]`` rows, split on dim 0.
- ``"gate_up"``: SwiGLU ``linear_fc1``; rank ``r`` holds ``cat([gate[r], up[r]])``.

Local-spec and Transformer Engine norm names map to the same units; layer names use the global
layer index (``TransformerLayer.layer_number - 1``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcore_engine.config import ModelConfig

ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForTokenClassification": "llama",
    "Qwen2ForTokenClassification": "qwen2",
    "Qwen3ForTokenClassification": "qwen3",
}


@dataclass(frozen=True)
class TensorRule:
    """How one Megatron parameter relates to Hugging Face tensors."""

    kind: str
    """'replicated' | 'row' | 'vocab' | 'qkv' | 'gate_up' (see the module docstring)."""
    hf_names: tuple[str, ...]
    """Hugging Face tensor names, in the order they are fused (q, k, v / gate, up)."""

    @property
    def tp_dim(self) -> int | None:
        """Dimension split over tensor-parallel ranks (None: replicated)."""
        return {"replicated": None, "row": 1}.get(self.kind, 0)


# Per-layer units: canonical (local-spec) Megatron suffix -> (kind, Hugging Face suffixes).
_LAYER_UNITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "input_layernorm.weight": ("replicated", ("input_layernorm.weight",)),
    "self_attention.linear_qkv.weight": (
        "qkv", ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight")),
    "self_attention.linear_qkv.bias": (
        "qkv", ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_norm.weight",)),
    "self_attention.k_layernorm.weight": ("replicated", ("self_attn.k_norm.weight",)),
    "self_attention.linear_proj.weight": ("row", ("self_attn.o_proj.weight",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
# Transformer Engine spec: norms fused into the following linear layer.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
}
_GLOBAL_UNITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "embedding.word_embeddings.weight": ("vocab", ("model.embed_tokens.weight",)),
    "decoder.final_layernorm.weight": ("replicated", ("model.norm.weight",)),
    "output_layer.weight": ("vocab", ("lm_head.weight",)),
    # model.head == "value": the replicated Linear(H, 1) as *ForTokenClassification's ``score``
    "value_head.weight": ("replicated", ("score.weight",)),
    "value_head.bias": ("replicated", ("score.bias",)),
}
# Tensors some Hugging Face checkpoints carry that the model does not need.
_IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)


def head_dim(cfg: ModelConfig) -> int:
    """Per-head channels ``d`` (``cfg.kv_channels`` when set, else hidden / heads)."""
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def canonical_unit(name: str, global_layer: int | None) -> str:
    """Unit key of a chunk-local Megatron parameter name (TE names folded to local-spec names, layer
    index replaced by ``global_layer``); ``ValueError`` for names with no Hugging Face counterpart.
    """
    if name in _GLOBAL_UNITS:
        return name
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and global_layer is not None:
        suffix = _TE_ALIASES.get(parts[3], parts[3])
        if suffix in _LAYER_UNITS:
            return f"decoder.layers.{global_layer}.{suffix}"
    raise ValueError(f"parameter {name!r} has no Hugging Face counterpart (supported: Llama/Qwen2/Qwen3 "
                     "GPTModel with RMSNorm, SwiGLU, optional QKV bias and QK-norm)")


def unit_rule(unit: str) -> TensorRule:
    """The ``TensorRule`` of a canonical unit key (see ``canonical_unit``)."""
    if unit in _GLOBAL_UNITS:
        kind, names = _GLOBAL_UNITS[unit]
        return TensorRule(kind, names)
    _, _, layer, suffix = unit.split(".", 3)
    kind, names = _LAYER_UNITS[suffix]
    return TensorRule(kind, tuple(f"model.layers.{layer}.{n}" for n in names))


def model_units(cfg: ModelConfig) -> list[str]:
    """All units of the full model, in Hugging Face order (embedding, layers, norm, lm_head)."""
    layer_suffixes = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    if cfg.add_qkv_bias:
        layer_suffixes.append("self_attention.linear_qkv.bias")
    if cfg.qk_layernorm:
        layer_suffixes += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    layer_suffixes += ["self_attention.linear_proj.weight", "pre_mlp_layernorm.weight",
                       "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    units = ["embedding.word_embeddings.weight"]
    units += [f"decoder.layers.{i}.{s}" for i in range(cfg.num_layers) for s in layer_suffixes]
    units.append("decoder.final_layernorm.weight")
    if cfg.head == "value":
        units += ["value_head.weight", "value_head.bias"]
    elif not cfg.tie_word_embeddings:
        units.append("output_layer.weight")
    return units


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full shape of every Hugging Face tensor the model is made of, in checkpoint order."""
    h, d, ng = cfg.hidden_size, head_dim(cfg), cfg.query_groups
    q_out, kv_out = cfg.num_attention_heads * d, ng * d
    ffn = cfg.ffn_size
    by_suffix = {
        "model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_out, h), "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h), "self_attn.q_proj.bias": (q_out,),
        "self_attn.k_proj.bias": (kv_out,), "self_attn.v_proj.bias": (kv_out,),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, q_out), "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn),
        "score.weight": (1, h), "score.bias": (1,),
    }
    shapes = {}
    for unit in model_units(cfg):
        for name in unit_rule(unit).hf_names:
            key = name.split(".", 3)[3] if name.startswith("model.layers.") else name
            shapes[name] = by_suffix[key]
    return shapes


def check_hf_names(names: list[str], cfg: ModelConfig) -> None:
    """Refuse a checkpoint that carries tensors this model config has no place for."""
    expected = hf_shapes(cfg)
    for name in names:
        if name in expected or name.endswith(_IGNORED_HF_SUFFIXES):
            continue
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or cfg.head == "value"):
            continue  # tied checkpoints may store it anyway; a value trunk from a causal LM drops it
        raise ValueError(f"tensor {name!r} in the checkpoint has no place in the model built from its "
                         "config (config and weights do not match)")


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (their ``.module`` attribute)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def iter_units(chunk: torch.nn.Module,
               cfg: ModelConfig) -> Iterator[tuple[str, torch.nn.Parameter, TensorRule]]:
    """``(unit, parameter, rule)`` per parameter of one (possibly wrapped) chunk; a tied output layer
    on the last stage (PP > 1) reads ``model.embed_tokens``; ``ValueError`` for undescribed parameters.
    """
    expected = set(model_units(cfg))
    model = unwrap_chunk(chunk)
    for name, param in model.named_parameters():
        if cfg.head == "value" and name.startswith("output_layer."):
            name = name.replace("output_layer.", "value_head.", 1)
        global_layer = None
        if name.startswith("decoder.layers."):
            global_layer = model.decoder.layers[int(name.split(".")[2])].layer_number - 1
        unit = canonical_unit(name, global_layer)
        rule = unit_rule(unit)
        if unit == "output_layer.weight" and cfg.tie_word_embeddings:
            rule = TensorRule("vocab", ("model.embed_tokens.weight",))
        elif unit not in expected:
            raise ValueError(f"parameter {name!r} of the model is not part of the model that cfg.model "
                             "describes (model and config do not match)")
        yield unit, param, rule


# ----------------------------------------------------------------------------------------- config
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
    """'llama' | 'qwen2' | 'qwen3' from ``architectures`` (or ``model_type``); ValueError otherwise."""
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


def _rope(hf_config: Mapping[str, Any]) -> tuple[float, float | None]:
    """(rope theta, Llama-3 scaling factor or None) from ``rope_parameters`` or the legacy keys;
    ``ValueError`` for what Megatron cannot do.
    """
    params = {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"rope_scaling: rope type {rope_type!r} is not supported (only 'default' and "
                         "'llama3' RoPE)")
    wrong = {k: params.get(k) for k, v in _LLAMA3_FIXED.items() if params.get(k) != v}
    if wrong or not isinstance(params.get("factor"), (int, float)) or params["factor"] <= 0:
        raise ValueError(f"rope_scaling: llama3 RoPE needs a factor > 0 (got {params.get('factor')!r}) and "
                         f"Megatron-Core's fixed {_LLAMA3_FIXED}; the checkpoint has {wrong}")
    return theta, float(params["factor"])


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
    if family != "qwen2" and hf_config.get("attention_bias"):
        raise ValueError("attention_bias: the output-projection bias it implies is not supported")
    if hf_config.get("use_sliding_window"):
        raise ValueError("use_sliding_window: sliding-window attention is not supported")
    theta, rope_factor = _rope(hf_config)
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
        add_qkv_bias=family == "qwen2",
        qk_layernorm=family == "qwen3",
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
    )
    d = hf_config.get("head_dim") or hidden // heads
    if d != hidden // heads or hidden % heads:
        fields["kv_channels"] = int(d)
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
        raise ValueError("cfg: only RMSNorm + SwiGLU models map to Llama/Qwen2/Qwen3")
    if cfg.add_qkv_bias and cfg.qk_layernorm:
        raise ValueError("cfg: add_qkv_bias together with qk_layernorm has no Hugging Face family here")
    family = "qwen3" if cfg.qk_layernorm else "qwen2" if cfg.add_qkv_bias else "llama"
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
    else:
        out.update(use_sliding_window=False, **({"attention_bias": False} if family == "qwen3" else {}))
    return out


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {"rope_type": "llama3", "rope_theta": cfg.rotary_base, "factor": cfg.rope_scaling_factor,
            **_LLAMA3_FIXED}
