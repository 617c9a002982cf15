"""Hugging Face names of the multi-token prediction modules, in DeepSeek-V3's layout (which
``transformers``' causal LMs ignore and its ``MtpModel``, vLLM and SGLang read): module ``i`` of
``D = ModelConfig.mtp_num_layers`` is the extra decoder layer ``model.layers.{L + i}``,
``L = num_layers``::

    enorm.weight, hnorm.weight [H]     <- mtp.layers.{i}.enorm / hnorm             replicated
    eh_proj.weight [H, 2H]             <- mtp.layers.{i}.eh_proj                   column (rows over TP)
    shared_head.norm.weight [H]        <- mtp.layers.{i}.final_layernorm           replicated
    input_layernorm, self_attn.*, post_attention_layernorm, mlp.*
                                       <- mtp.layers.{i}.transformer_layer.*       as decoder layer L + i
    embed_tokens.weight, shared_head.head.weight   copies of model.embed_tokens / lm_head (shared)

The module's transformer layer (Megatron-Core >= 0.17: ``mtp_model_layer``) is the unit
``decoder.layers.{L + i}.*`` (the rules of any decoder layer: GQA or MLA, dense or MoE like the last
decoder layer). The copies are written on export and, when present, only shape-checked on import
(the modules use the trunk's embedding and output layer).
A checkpoint's modules beyond ``D`` are ignored (all of them with ``D = 0``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mcore_engine.config import ModelConfig

__all__ = ["check_mtp_present", "is_mtp_unit", "mtp_aliases", "mtp_alias_shapes", "mtp_hf_shapes",
           "mtp_param_name", "mtp_rule", "mtp_units", "skip_mtp_hf_name"]

# module-level units: Megatron suffix -> (kind, Hugging Face suffix)
_OWN_UNITS = {"enorm.weight": ("replicated", "enorm.weight"), "hnorm.weight": ("replicated", "hnorm.weight"),
              "eh_proj.weight": ("column", "eh_proj.weight"),
              "final_layernorm.weight": ("replicated", "shared_head.norm.weight")}
_OWN_RE = re.compile(r"^mtp\.layers\.(\d+)\.((?:enorm|hnorm|eh_proj|final_layernorm)\.weight)$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_ALIASES = ("embed_tokens.weight", "shared_head.head.weight")
_LAYER_ATTRS = ("transformer_layer", "mtp_model_layer")  # the module's layer: Megatron-Core 0.16 / >= 0.17


def is_mtp_unit(unit: str) -> bool:
    """Whether ``unit`` is an MTP module's own unit (``mtp.layers.{i}.enorm.weight`` ...)."""
    return _OWN_RE.match(unit) is not None


def mtp_rule(unit: str, cfg: ModelConfig) -> tuple[str, tuple[str, ...]]:
    """``(kind, Hugging Face names)`` of an MTP module's own unit."""
    match = _OWN_RE.match(unit)
    kind, suffix = _OWN_UNITS[match[2]]
    return kind, (f"model.layers.{cfg.num_layers + int(match[1])}.{suffix}",)


def mtp_param_name(model: torch.nn.Module, name: str) -> tuple[str, int | None, int | None]:
    """A chunk's MTP parameter name as ``canonical_unit`` takes it: ``(name, global layer, global expert)``;
    a transformer-layer parameter as ``decoder.layers.{i}.<suffix>`` of global layer ``L + i``."""
    parts = name.split(".")
    layer = model.mtp.layers[int(parts[2])]
    if parts[3] not in _LAYER_ATTRS:
        return name, None, None
    block = getattr(layer, parts[3])
    expert = None
    if parts[4:7] == ["mlp", "experts", "local_experts"]:
        expert = block.mlp.local_expert_indices[int(parts[7])]
    # the module's own number (1-based); its layer's layer_number is L + i + 1 in 0.16, i + 1 from 0.17
    global_layer = model.config.num_layers + layer.layer_number - 1
    return ".".join(["decoder", "layers", parts[2], *parts[4:]]), global_layer, expert


def mtp_units(cfg: ModelConfig, layer_suffixes: list[str]) -> list[str]:
    """The units of the ``D`` modules in Hugging Face order; ``layer_suffixes``: a decoder layer's units
    (those of the last decoder layer: the module's transformer layer is built from its spec)."""
    units = []
    for i in range(cfg.mtp_num_layers):
        units += [f"mtp.layers.{i}.{s}" for s in ("enorm.weight", "hnorm.weight", "eh_proj.weight")]
        units += [f"decoder.layers.{cfg.num_layers + i}.{s}" for s in layer_suffixes]
        units.append(f"mtp.layers.{i}.final_layernorm.weight")
    return units


def mtp_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the modules' own tensors by Hugging Face layer suffix."""
    h = cfg.hidden_size
    return {"enorm.weight": (h,), "hnorm.weight": (h,), "eh_proj.weight": (h, 2 * h),
            "shared_head.norm.weight": (h,)}


def mtp_aliases(name: str, cfg: ModelConfig) -> list[str]:
    """The modules' copies of the exported tensor ``name`` (``model.embed_tokens.weight`` /
    ``lm_head.weight``; with tied embeddings the embedding is the head too); none for the hybrid
    (Qwen3.5) families, whose ``mtp.*`` module shares them."""
    if cfg.linear_attention is not None:
        return []
    layers = range(cfg.num_layers, cfg.num_layers + cfg.mtp_num_layers)
    out = []
    if name == "model.embed_tokens.weight":
        out += [f"model.layers.{n}.embed_tokens.weight" for n in layers]
    if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and cfg.tie_word_embeddings):
        out += [f"model.layers.{n}.shared_head.head.weight" for n in layers]
    return out


def mtp_alias_shapes(cfg: ModelConfig, names: list[str]) -> dict[str, tuple[int, ...]]:
    """Expected shapes of the copies present in a checkpoint's ``names`` (``[vocab_size, H]``)."""
    present = set(names)
    shape = (cfg.vocab_size, cfg.hidden_size)
    return {alias: shape for source in ("model.embed_tokens.weight", "lm_head.weight")
            for alias in mtp_aliases(source, cfg) if alias in present}


def check_mtp_present(cfg: ModelConfig, names: list[str]) -> None:
    """``ValueError`` when ``cfg`` asks for MTP modules and the checkpoint's ``names`` hold no tensor of
    the first (``transformers`` writes ``num_nextn_predict_layers`` into folders without them)."""
    first = "mtp." if cfg.linear_attention is not None else f"model.layers.{cfg.num_layers}."
    if cfg.mtp_num_layers and not any(n.startswith(first) for n in names):
        raise ValueError(f"ModelConfig.mtp_num_layers: {cfg.mtp_num_layers} MTP module(s) (the config's "
                         f"num_nextn_predict_layers) but the checkpoint has no {first}* tensors "
                         "(transformers writes num_nextn_predict_layers without them): build with "
                         "mtp_num_layers=0")


def skip_mtp_hf_name(name: str, cfg: ModelConfig) -> bool:
    """A checkpoint tensor the model does not load: a module beyond ``D`` or a copy (see
    :func:`mtp_alias_shapes`)."""
    match = _LAYER_RE.match(name)
    if match is None or int(match[1]) < cfg.num_layers:
        return False
    return int(match[1]) >= cfg.num_layers + cfg.mtp_num_layers or match[2] in _ALIASES
