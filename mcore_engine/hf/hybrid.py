"""The Qwen3.5 / Qwen3-Next hybrid decoder on the Hugging Face side: ``config.json`` fields of the Gated
DeltaNet (GDN) layers, their tensor names and tensor-parallel row maps.

GDN layer ``i`` (``ModelConfig.linear_attention.layer_pattern`` True) is
``decoder.layers.{i}.self_attention.*`` <- ``model.layers.{i}.linear_attn.*``; ``nk`` key heads of ``dk``,
``nv`` value heads of ``dv``, ``r = nv / nk``, ``kd = nk dk``, ``vd = nv dv``::

    in_proj_qkv [2kd + vd, h]  Qwen3.5 rows [q; k; v]; TP rank t holds [q_t; k_t; v_t] (heads t*nk/tp ...)
    conv1d.weight [2kd + vd, 1, K]    the same channels, the same split ("gdn_qkv")
    in_proj_z [vd, h], in_proj_b / in_proj_a [nv, h], A_log / dt_bias [nv]   rows split ("column")
    norm.weight [dv] replicated;  out_proj [h, vd] columns split ("row")

Qwen3-Next stores ``in_proj_qkvz [2kd + 2vd, h]`` rows per key head ``[q_h; k_h; v_h (r dv); z_h (r dv)]``
and ``in_proj_ba [2nv, h]`` per key head ``[b_h (r); a_h (r)]``: the engine's ``in_proj_qkv`` / ``_z`` /
``_b`` / ``_a`` read their rows of it ("next_qkv" / "next_z" / "next_b" / "next_a"); on export each unit
yields its part, ``"{name}#{kind}"``, and :func:`assemble_parts` writes the Hugging Face tensor back.
Every such layout is one row map ``perm`` (:func:`row_map`): row ``j`` of the TP-gathered engine tensor
is row ``perm[j]`` of the Hugging Face tensor.

Multi-token prediction (``ModelConfig.mtp_num_layers = 1``; the folders' ``mtp_num_hidden_layers``, one
module whose layer is a full-attention layer, as vLLM's Qwen3-Next / Qwen3.5 MTP reads it)::

    mtp.layers.0.enorm / hnorm            <- mtp.pre_fc_norm_embedding / mtp.pre_fc_norm_hidden
    mtp.layers.0.eh_proj [H, 2H]          <- mtp.fc  (input [embedding; hidden], both sides)
    transformer layer (decoder layer L)   <- mtp.layers.0.*  (attention and MLP / MoE names as a layer's)
    mtp.layers.0.final_layernorm          <- mtp.norm
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from mcore_engine.config.gdn import LAYER_TYPES, GDNConfig

if TYPE_CHECKING:
    from mcore_engine.config import ModelConfig
    from mcore_engine.hf.families import Family

__all__ = ["GDN_KINDS", "GDN_SUFFIXES", "MTP_OWN", "PART_KINDS", "assemble_parts", "config_hint",
           "gdn_from_hf", "gdn_hf_shapes", "gdn_to_hf", "gdn_units", "mtp_own_shapes", "row_map"]

_SPLIT = {
    "self_attention.in_proj_qkv.weight": ("gdn_qkv", "linear_attn.in_proj_qkv.weight"),
    "self_attention.in_proj_z.weight": ("column", "linear_attn.in_proj_z.weight"),
    "self_attention.in_proj_b.weight": ("column", "linear_attn.in_proj_b.weight"),
    "self_attention.in_proj_a.weight": ("column", "linear_attn.in_proj_a.weight"),
}
_FUSED = {
    "self_attention.in_proj_qkv.weight": ("next_qkv", "linear_attn.in_proj_qkvz.weight"),
    "self_attention.in_proj_z.weight": ("next_z", "linear_attn.in_proj_qkvz.weight"),
    "self_attention.in_proj_b.weight": ("next_b", "linear_attn.in_proj_ba.weight"),
    "self_attention.in_proj_a.weight": ("next_a", "linear_attn.in_proj_ba.weight"),
}
_COMMON = {
    "self_attention.conv1d.weight": ("gdn_qkv", "linear_attn.conv1d.weight"),
    "self_attention.A_log": ("column", "linear_attn.A_log"),
    "self_attention.dt_bias": ("column", "linear_attn.dt_bias"),
    "self_attention.norm.weight": ("replicated", "linear_attn.norm.weight"),
    "self_attention.out_proj.weight": ("row", "linear_attn.out_proj.weight"),
}
GDN_SUFFIXES = (*_SPLIT, *_COMMON)
PART_KINDS = ("next_qkv", "next_z", "next_b", "next_a")
GDN_KINDS = ("gdn_qkv", *PART_KINDS)
_PARTS = {"in_proj_qkvz.weight": ("next_qkv", "next_z"), "in_proj_ba.weight": ("next_b", "next_a")}


# the MTP module's own units (Megatron suffix of mtp.layers.0.) -> (kind, Hugging Face name)
MTP_OWN = {"enorm.weight": ("replicated", "mtp.pre_fc_norm_embedding.weight"),
           "hnorm.weight": ("replicated", "mtp.pre_fc_norm_hidden.weight"),
           "eh_proj.weight": ("column", "mtp.fc.weight"),
           "final_layernorm.weight": ("replicated", "mtp.norm.weight")}


def config_hint(name: str, cfg: ModelConfig) -> str:
    """For an error about tensor ``name`` of a hybrid folder: the ``config.json`` fields that decided
    where it goes and its shape (``""`` for other models and tensors)."""
    gdn = cfg.linear_attention
    match = re.match(r"model\.layers\.(\d+)\.(linear_attn|self_attn)\.", name)
    if gdn is None or match is None:
        return ""
    layer = int(match[1])
    hints = []
    if layer < cfg.num_layers:
        kind = LAYER_TYPES[0] if gdn.layer_pattern(cfg.num_layers)[layer] else LAYER_TYPES[1]
        hints.append(f"layer {layer} is {kind!r} in layer_types")
    if match[2] == "linear_attn":
        hints.append(f"linear_num_key_heads={gdn.num_key_heads}, linear_num_value_heads="
                     f"{gdn.num_value_heads}, linear_key_head_dim={gdn.key_head_dim}, "
                     f"linear_value_head_dim={gdn.value_head_dim}")
        if ".conv1d." in name:
            hints.append(f"linear_conv_kernel_dim={gdn.conv_kernel_dim}")
    return f" (config.json: {'; '.join(hints)})"


def mtp_own_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    return {"mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (h,),
            "mtp.fc.weight": (h, 2 * h), "mtp.norm.weight": (h,)}


def gdn_units(family: Family) -> dict[str, tuple[str, str]]:
    """A GDN layer's units: Megatron suffix -> (kind, Hugging Face suffix), in Hugging Face order."""
    return {**(_FUSED if family.hybrid == "fused" else _SPLIT), **_COMMON}


def gdn_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the GDN tensors by Hugging Face layer suffix (both layouts)."""
    g, h = cfg.linear_attention, cfg.hidden_size
    kd, vd, nv = g.key_dim, g.value_dim, g.num_value_heads
    return {"linear_attn.in_proj_qkv.weight": (2 * kd + vd, h), "linear_attn.in_proj_z.weight": (vd, h),
            "linear_attn.in_proj_b.weight": (nv, h), "linear_attn.in_proj_a.weight": (nv, h),
            "linear_attn.in_proj_qkvz.weight": (2 * kd + 2 * vd, h),
            "linear_attn.in_proj_ba.weight": (2 * nv, h),
            "linear_attn.conv1d.weight": (2 * kd + vd, 1, g.conv_kernel_dim), "linear_attn.A_log": (nv,),
            "linear_attn.dt_bias": (nv,), "linear_attn.norm.weight": (g.value_head_dim,),
            "linear_attn.out_proj.weight": (h, vd)}


@lru_cache(maxsize=64)
def _row_map(kind: str, nk: int, nv: int, dk: int, dv: int, tp: int) -> torch.Tensor:
    kd, vd, r = nk * dk, nv * dv, nv // nk
    natural_qkv = torch.cat([torch.cat([torch.arange(t * kd // tp, (t + 1) * kd // tp),
                                        kd + torch.arange(t * kd // tp, (t + 1) * kd // tp),
                                        2 * kd + torch.arange(t * vd // tp, (t + 1) * vd // tp)])
                             for t in range(tp)])
    if kind == "gdn_qkv":
        return natural_qkv
    block = 2 * dk + 2 * r * dv  # one key head's rows of in_proj_qkvz
    c_k, c_v = torch.arange(kd), torch.arange(vd)
    if kind == "next_qkv":
        q = c_k // dk * block + c_k % dk
        v = c_v // (r * dv) * block + 2 * dk + c_v % (r * dv)
        return torch.cat([q, q + dk, v])[natural_qkv]
    if kind == "next_z":
        return c_v // (r * dv) * block + 2 * dk + r * dv + c_v % (r * dv)
    c = torch.arange(nv)
    return c // r * 2 * r + c % r + (r if kind == "next_a" else 0)  # next_b / next_a


def row_map(kind: str, cfg: ModelConfig, tp_size: int) -> torch.Tensor:
    """``perm`` (int64): row ``j`` of the TP-gathered engine tensor is Hugging Face row ``perm[j]``."""
    g = cfg.linear_attention
    return _row_map(kind, g.num_key_heads, g.num_value_heads, g.key_head_dim, g.value_head_dim,
                    tp_size if kind in ("gdn_qkv", "next_qkv") else 1)


def assemble_parts(stream: Iterator[tuple[str, torch.Tensor]], cfg: ModelConfig,
                   tp_size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass ``stream`` through, writing the Qwen3-Next parts ``"{name}#{kind}"`` (TP-gathered engine
    rows of ``tp_size`` ranks) into their Hugging Face tensor, yielded when its last part arrives.
    Memory: one ``in_proj_qkvz``."""
    pending: dict[str, tuple[torch.Tensor, set[str]]] = {}
    for name, t in stream:
        if "#" not in name:
            yield name, t
            continue
        hf_name, kind = name.split("#")
        if hf_name not in pending:
            kinds = _PARTS[hf_name.rsplit(".", 2)[-2] + ".weight"]
            rows = sum(row_map(k, cfg, tp_size).numel() for k in kinds)
            pending[hf_name] = (t.new_empty((rows, *t.shape[1:])), set(kinds))
        full, missing = pending[hf_name]
        full[row_map(kind, cfg, tp_size).to(t.device)] = t
        missing.discard(kind)
        if not missing:
            yield hf_name, pending.pop(hf_name)[0]
    if pending:
        raise ValueError(f"stream: parts of {sorted(pending)} missing (the model lacks some in_proj units)")


# ------------------------------------------------------------------------------------- config.json
def gdn_from_hf(hf_config: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """``ModelConfig`` fields of a hybrid ``config.json`` (its text part): ``linear_attention``, the gated,
    zero-centred attention; ``ValueError`` naming the field the engine cannot honour."""
    num_layers = int(hf_config["num_hidden_layers"])
    types = hf_config.get("layer_types")
    if types is not None:
        if not isinstance(types, list | tuple) or len(types) != num_layers:
            raise ValueError(f"layer_types: expected a list of {num_layers} entries (num_hidden_layers), got "
                             f"{types!r}")
        unknown = sorted({str(t) for t in types} - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types: unknown layer type(s) {unknown}; supported: {list(LAYER_TYPES)}")
    interval = int(hf_config.get("full_attention_interval", 4))
    if types is None:  # transformers' rule, written out as transformers writes it
        types = [LAYER_TYPES[1] if (i + 1) % interval == 0 else LAYER_TYPES[0] for i in range(num_layers)]
    for key in ("attn_output_gate", "use_qk_norm"):
        if not hf_config.get(key, True):
            raise ValueError(f"{key}: {family.model_type} without it is not supported")
    try:
        gdn = GDNConfig(num_key_heads=int(hf_config["linear_num_key_heads"]),
                        num_value_heads=int(hf_config["linear_num_value_heads"]),
                        key_head_dim=int(hf_config["linear_key_head_dim"]),
                        value_head_dim=int(hf_config["linear_value_head_dim"]),
                        conv_kernel_dim=int(hf_config.get("linear_conv_kernel_dim", 4)),
                        full_attention_interval=interval, layer_types=list(types))
    except KeyError as e:
        raise ValueError(f"{e.args[0]}: a {family.model_type} config needs it") from e
    except ValueError as e:
        raise ValueError(f"linear_num_key_heads / linear_num_value_heads / linear_*_head_dim: {e}") from e
    return {"linear_attention": gdn, "attention_output_gate": True, "zero_centered_norm": True}


def gdn_to_hf(cfg: ModelConfig, family: Family, base: Mapping[str, Any] | None) -> dict[str, Any]:
    """The GDN fields of a hybrid ``config.json``; ``ValueError`` for a model its family cannot express."""
    g = cfg.linear_attention
    if not (cfg.attention_output_gate and cfg.zero_centered_norm and cfg.qk_layernorm):
        raise ValueError("ModelConfig.attention_output_gate / zero_centered_norm / qk_layernorm: "
                         f"{family.model_type} has all three")
    if cfg.add_qkv_bias:
        raise ValueError(f"ModelConfig.add_qkv_bias: {family.model_type} has no QKV biases")
    if cfg.mtp_num_layers > 1:
        raise ValueError(f"ModelConfig.mtp_num_layers: {family.model_type} has one MTP module "
                         f"(mtp_num_hidden_layers), got {cfg.mtp_num_layers}")
    out = {"linear_num_key_heads": g.num_key_heads, "linear_num_value_heads": g.num_value_heads,
           "linear_key_head_dim": g.key_head_dim, "linear_value_head_dim": g.value_head_dim,
           "linear_conv_kernel_dim": g.conv_kernel_dim,
           "layer_types": [LAYER_TYPES[0] if p else LAYER_TYPES[1] for p in g.layer_pattern(cfg.num_layers)]}
    if base is not None and "full_attention_interval" in base:
        out["full_attention_interval"] = g.full_attention_interval
    if cfg.mtp_num_layers and not (base or {}).get("mtp_num_hidden_layers"):
        out["mtp_num_hidden_layers"] = cfg.mtp_num_layers
    return out
