"""Name and layout rules between Hugging Face Llama / Qwen2 / Qwen3 (dense), Qwen2-MoE / Qwen3-MoE /
Mixtral (mixture of experts) and Megatron-Core's GPTModel.

Every Megatron parameter is one unit with a ``TensorRule``: its Hugging Face tensors and its
tensor-parallel layout (``kind``):

- ``"replicated"``: norms, full on every rank.  ``"row"``: ``linear_proj``, ``linear_fc2``, split on dim 1.
- ``"vocab"``: embedding / output layer ``[V_pad, h]``, split on dim 0; rows ``>= vocab_size`` are
  padding (zero on import, dropped on export).
- ``"qkv"``: ``[ng * (q_per_group + 2) * d, h]``, per group ``[q, k, v]`` rows, split on dim 0.
- ``"gate_up"``: SwiGLU ``linear_fc1``; rank ``r`` holds ``cat([gate[r], up[r]])``.

Local-spec and Transformer Engine norm names map to the same units; layer names use the global
layer index (``TransformerLayer.layer_number - 1``), expert names the global expert index
(``MoELayer.local_expert_indices``). An MoE layer's units: the router ``[E, h]`` (replicated), per
expert ``linear_fc1`` (gate_up) and ``linear_fc2`` (row) split over the expert-tensor-parallel group
(``TensorRule.expert``), and Qwen2-MoE's shared expert (gate_up, row, sigmoid gate ``[1, h]``).
On disk the experts are one tensor each (``mlp.experts.{e}.gate_proj.weight``; Mixtral
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``), as ``save_pretrained`` writes them.
"""

from __future__ import annotations

import json
import os
import re
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
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
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
    expert: bool = False
    """A routed expert's weight: split over the expert-tensor-parallel group, held by one
    expert-parallel rank."""

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
# MoE layer units ("{e}": global expert index) -> (kind, Hugging Face suffixes); "{block}", "{gate}",
# "{up}", "{down}" from _MOE_NAMES of the family.
_MOE_UNITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp.router.weight": ("replicated", ("{block}.gate.weight",)),
    "mlp.experts.local_experts.{e}.linear_fc1.weight": (
        "gate_up", ("{block}.experts.{e}.{gate}.weight", "{block}.experts.{e}.{up}.weight")),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": ("row", ("{block}.experts.{e}.{down}.weight",)),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up", ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.shared_expert.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("mlp.shared_expert_gate.weight",)),
}
_QWEN_MOE_NAMES = dict(block="mlp", gate="gate_proj", up="up_proj", down="down_proj")
_MOE_NAMES = {"qwen2_moe": _QWEN_MOE_NAMES, "qwen3_moe": _QWEN_MOE_NAMES,
              "mixtral": dict(block="block_sparse_moe", gate="w1", up="w3", down="w2")}
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)$")
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


def model_family(cfg: ModelConfig) -> str:
    """The Hugging Face family ``cfg`` maps to: QK-norm -> qwen3 / qwen3_moe, QKV bias -> qwen2 /
    qwen2_moe, neither -> llama / mixtral (``*_moe`` and mixtral when ``cfg.moe`` is set)."""
    if cfg.add_qkv_bias and cfg.qk_layernorm:
        raise ValueError("cfg: add_qkv_bias together with qk_layernorm has no Hugging Face family here")
    if cfg.moe is None:
        return "qwen3" if cfg.qk_layernorm else "qwen2" if cfg.add_qkv_bias else "llama"
    return "qwen3_moe" if cfg.qk_layernorm else "qwen2_moe" if cfg.add_qkv_bias else "mixtral"


def canonical_unit(name: str, global_layer: int | None, global_expert: int | None = None) -> str:
    """Unit key of a chunk-local Megatron parameter name (TE names folded to local-spec names, layer
    and local expert index replaced by ``global_layer`` / ``global_expert``); ``ValueError`` for
    names with no Hugging Face counterpart.
    """
    if name in _GLOBAL_UNITS:
        return name
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and global_layer is not None:
        suffix = _TE_ALIASES.get(parts[3], parts[3])
        if suffix in _LAYER_UNITS or suffix in _MOE_UNITS:
            return f"decoder.layers.{global_layer}.{suffix}"
        match = _EXPERT_RE.match(suffix)
        if match and global_expert is not None:
            return f"decoder.layers.{global_layer}.mlp.experts.local_experts.{global_expert}.{match[2]}"
    raise ValueError(f"parameter {name!r} has no Hugging Face counterpart (supported: Llama/Qwen2/Qwen3 "
                     "GPTModel with RMSNorm, SwiGLU, optional QKV bias and QK-norm, and their MoE layers "
                     "with SequentialMLP experts)")


def unit_rule(unit: str, cfg: ModelConfig) -> TensorRule:
    """The ``TensorRule`` of a canonical unit key (see ``canonical_unit``) of a ``cfg`` model."""
    if unit in _GLOBAL_UNITS:
        kind, names = _GLOBAL_UNITS[unit]
        return TensorRule(kind, names)
    _, _, layer, suffix = unit.split(".", 3)
    if suffix in _LAYER_UNITS:
        kind, names = _LAYER_UNITS[suffix]
        return TensorRule(kind, tuple(f"model.layers.{layer}.{n}" for n in names))
    match = _EXPERT_RE.match(suffix)
    key = f"mlp.experts.local_experts.{{e}}.{match[2]}" if match else suffix
    kind, names = _MOE_UNITS[key]
    fmt = dict(_MOE_NAMES[model_family(cfg)], e=match[1] if match else "")
    return TensorRule(kind, tuple(f"model.layers.{layer}.{n.format(**fmt)}" for n in names),
                      expert=match is not None)


def _mlp_suffixes(cfg: ModelConfig, layer: int) -> list[str]:
    moe = cfg.moe
    if moe is None or not moe.layer_pattern(cfg.num_layers)[layer]:
        return ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    out = ["mlp.router.weight"]
    out += [f"mlp.experts.local_experts.{e}.linear_fc{i}.weight"
            for e in range(moe.num_experts) for i in (1, 2)]
    if moe.shared_expert_ffn_hidden_size is not None:
        out += ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"]
        if moe.shared_expert_gate:
            out.append("mlp.shared_experts.gate_weight")
    return out


def model_units(cfg: ModelConfig) -> list[str]:
    """All units of the full model, in Hugging Face order (embedding, layers, norm, lm_head)."""
    attn = ["input_layernorm.weight", "self_attention.linear_qkv.weight"]
    if cfg.add_qkv_bias:
        attn.append("self_attention.linear_qkv.bias")
    if cfg.qk_layernorm:
        attn += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    attn += ["self_attention.linear_proj.weight", "pre_mlp_layernorm.weight"]
    units = ["embedding.word_embeddings.weight"]
    units += [f"decoder.layers.{i}.{s}" for i in range(cfg.num_layers) for s in attn + _mlp_suffixes(cfg, i)]
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
    if cfg.moe is not None:
        fe = cfg.moe.ffn_hidden_size or ffn
        fs = cfg.moe.shared_expert_ffn_hidden_size
        for names in _MOE_NAMES.values():
            by_suffix[f"{names['block']}.gate.weight"] = (cfg.moe.num_experts, h)
            for part in ("gate", "up"):
                by_suffix[f"{names['block']}.experts.*.{names[part]}.weight"] = (fe, h)
            by_suffix[f"{names['block']}.experts.*.{names['down']}.weight"] = (h, fe)
        by_suffix.update({"mlp.shared_expert.gate_proj.weight": (fs, h),
                          "mlp.shared_expert.up_proj.weight": (fs, h),
                          "mlp.shared_expert.down_proj.weight": (h, fs),
                          "mlp.shared_expert_gate.weight": (1, h)})
    shapes = {}
    for unit in model_units(cfg):
        for name in unit_rule(unit, cfg).hf_names:
            key = name.split(".", 3)[3] if name.startswith("model.layers.") else name
            shapes[name] = by_suffix[re.sub(r"\.experts\.\d+\.", ".experts.*.", key)]
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
        global_layer = global_expert = None
        if name.startswith("decoder.layers."):
            parts = name.split(".")
            layer = model.decoder.layers[int(parts[2])]
            global_layer = layer.layer_number - 1
            if parts[3:6] == ["mlp", "experts", "local_experts"]:
                global_expert = layer.mlp.local_expert_indices[int(parts[6])]
        unit = canonical_unit(name, global_layer, global_expert)
        rule = unit_rule(unit, cfg) if unit in expected else None
        if unit == "output_layer.weight" and cfg.tie_word_embeddings:
            rule = TensorRule("vocab", ("model.embed_tokens.weight",))
        elif rule is None:
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
    """'llama' | 'qwen2' | 'qwen3' | 'qwen2_moe' | 'qwen3_moe' | 'mixtral' from ``architectures`` (or
    ``model_type``); ValueError otherwise."""
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


def _moe_from_hf(hf_config: Mapping[str, Any], family: str) -> dict[str, Any]:
    """``ModelConfig`` fields of an MoE family: ``moe`` (a ``MoEConfig``) and the dense FFN size.

    MoE layers: Mixtral all; Qwen ``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``.
    Routing ``softmax -> top-k (-> renormalise if norm_topk_prob)`` is ``router_pre_softmax =
    not norm_topk_prob`` (Mixtral always renormalises).
    """
    from mcore_engine.config import MoEConfig

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
    if family not in ("qwen2", "qwen2_moe") and hf_config.get("attention_bias"):
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
        add_qkv_bias=family in ("qwen2", "qwen2_moe"),
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        init_method_std=float(hf_config.get("initializer_range", 0.02)),
    )
    d = hf_config.get("head_dim") or hidden // heads
    if d != hidden // heads or hidden % heads:
        fields["kv_channels"] = int(d)
    if family in _MOE_NAMES:
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
    elif family != "mixtral":
        out.update(use_sliding_window=False,
                   **({"attention_bias": False} if family in ("qwen3", "qwen3_moe") else {}))
    if cfg.moe is not None:
        if cfg.head == "value":
            raise ValueError("model.head: a value head on an MoE model has no Hugging Face class here")
        out.update(_moe_to_hf(cfg, family, base))
    return out


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    if cfg.rope_scaling_factor is None:
        return {"rope_type": "default", "rope_theta": cfg.rotary_base}
    return {"rope_type": "llama3", "rope_theta": cfg.rotary_base, "factor": cfg.rope_scaling_factor,
            **_LLAMA3_FIXED}
