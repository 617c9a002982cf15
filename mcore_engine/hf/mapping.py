"""Name and layout rules between Hugging Face checkpoints (the families of ``families``) and
Megatron-Core's GPTModel.

Every Megatron parameter is one unit with a ``TensorRule``: its Hugging Face tensors and its
tensor-parallel layout (``kind``):

- ``"replicated"``: norms, full on every rank.  ``"row"``: ``linear_proj``, ``linear_fc2``, split on dim 1.
- ``"vocab"``: embedding / output layer ``[V_pad, h]``, split on dim 0; rows ``>= vocab_size`` are
  padding (zero on import, dropped on export).
- ``"qkv"``: ``[ng * (q_per_group + 2) * d, h]``, per group ``[q, k, v]`` rows, split on dim 0 (with
  ``attention_output_gate``: ``[q, gate, k, v]``, ``layout``).
- ``"gate_up"``: SwiGLU ``linear_fc1``; rank ``r`` holds ``cat([gate[r], up[r]])``.
- ``"column"``: one Hugging Face tensor split on dim 0 (MLA's projections; a parameter not marked
  ``tensor_model_parallel``, as Transformer Engine's replicated down projections, is replicated).
- ``"heads"``: per-head values split on dim 0 (gpt-oss's ``self_attn.sinks`` = the core attention's
  ``softmax_offset``, which Megatron-Core does not mark).

gpt-oss (``cfg.add_bias_linear``) adds the biases: ``linear_qkv.bias`` as the q / k / v biases,
``linear_proj.bias`` (``o_proj.bias``) and an expert's ``linear_fc2.bias`` replicated, an expert's
``linear_fc1.bias`` as ``gate_up``, the router's ``bias``; here its experts are one tensor per projection
like the others' (``experts.{e}.gate_proj.weight`` / ``.bias`` ...); ``folder`` reads and writes its
fused, interleaved (and MXFP4) layout.

Local-spec and Transformer Engine norm names map to the same units. Layer names use the global layer
index, expert names the global expert index; an expert's
``linear_fc1`` / ``linear_fc2`` split over the expert-tensor-parallel group (``TensorRule.expert``).
MLA's projections map one to one (same row layouts; ``rope_interleave=True``). A hybrid model's
(``cfg.linear_attention``) layers have the units of their type: Gated DeltaNet layers those of
``hybrid`` (kinds ``"gdn_qkv"`` and Qwen3-Next's ``"next_*"``), the others the attention units; the
family (Qwen3.5 or Qwen3-Next names) is the source folder's (:func:`source_family`). A vision-language
model (``cfg.vision``) adds its tower first: the first stage's parameter ``vision.{x}`` is the
replicated unit of ``model.visual.{x}`` (the whole tensor on every rank; ``folder``: ``visual.{x}`` in
Qwen2.5-VL folders); the tower's names and shapes are those of ``layers.vision_tower``'s module, built
on the meta device (:func:`vision_shapes`). Here each expert
is one tensor per projection, as ``save_pretrained`` writes them, and names are ``model.*``; a
folder's own prefix and fused experts are ``folder``'s. ``config.json``: ``hf_config``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from mcore_engine.config import ModelConfig
from mcore_engine.config.vision import VisionConfig
from mcore_engine.hf.families import (  # noqa: F401 (model_family: its old home)
    FAMILIES,
    Family,
    describes,
    family_of,
    hf_family_of,
    model_family,
)
from mcore_engine.hf.folder import folder_stream, model_format
from mcore_engine.hf.hybrid import (
    GDN_SUFFIXES,
    MTP_OWN,
    config_hint,
    gdn_hf_shapes,
    gdn_units,
    mtp_own_shapes,
)
from mcore_engine.hf.mtp_names import (
    is_mtp_unit,
    mtp_aliases,
    mtp_hf_shapes,
    mtp_param_name,
    mtp_rule,
    mtp_units,
    skip_mtp_hf_name,
)
from mcore_engine.layers.vision_tower import build_vision_tower


@dataclass(frozen=True)
class TensorRule:
    """How one Megatron parameter relates to Hugging Face tensors."""

    kind: str
    """'replicated' | 'row' | 'vocab' | 'qkv' | 'gate_up' | 'column' (see the module docstring)."""
    hf_names: tuple[str, ...]
    """Hugging Face tensor names, in the order they are fused (q, k, v / gate, up)."""
    expert: bool = False
    """A routed expert's weight: split over the expert-tensor-parallel group, held by one
    expert-parallel rank."""
    fp32: bool = False
    """Kept in fp32 in an exported folder whatever the export dtype (the router's expert bias, as
    DeepSeek-V3's checkpoints and ``transformers`` keep it)."""

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
    "self_attention.linear_proj.bias": ("replicated", ("self_attn.o_proj.bias",)),
    "self_attention.core_attention.softmax_offset": ("heads", ("self_attn.sinks",)),
    "pre_mlp_layernorm.weight": ("replicated", ("post_attention_layernorm.weight",)),
    "mlp.linear_fc1.weight": ("gate_up", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    "mlp.linear_fc2.weight": ("row", ("mlp.down_proj.weight",)),
}
# MLA layer units (``cfg.mla``), replacing the q / k / v ones above.
_MLA_UNITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "self_attention.linear_q_proj.weight": ("column", ("self_attn.q_proj.weight",)),
    "self_attention.linear_q_down_proj.weight": ("column", ("self_attn.q_a_proj.weight",)),
    "self_attention.q_layernorm.weight": ("replicated", ("self_attn.q_a_layernorm.weight",)),
    "self_attention.linear_q_up_proj.weight": ("column", ("self_attn.q_b_proj.weight",)),
    "self_attention.linear_kv_down_proj.weight": ("column", ("self_attn.kv_a_proj_with_mqa.weight",)),
    "self_attention.kv_layernorm.weight": ("replicated", ("self_attn.kv_a_layernorm.weight",)),
    "self_attention.linear_kv_up_proj.weight": ("column", ("self_attn.kv_b_proj.weight",)),
}
# MoE layer units ("{e}": global expert index) -> (kind, Hugging Face suffixes); "{block}", "{gate}",
# "{up}", "{down}", "{shared}" from the family's ``moe_names``.
_MOE_UNITS: dict[str, tuple[str, tuple[str, ...]]] = {
    "mlp.router.weight": ("replicated", ("{block}.{router}.weight",)),
    "mlp.router.bias": ("replicated", ("{block}.{router}.bias",)),
    "mlp.router.expert_bias": ("replicated", ("{block}.{router}.e_score_correction_bias",)),
    "mlp.experts.local_experts.{e}.linear_fc1.weight": (
        "gate_up", ("{block}.experts.{e}.{gate}.weight", "{block}.experts.{e}.{up}.weight")),
    "mlp.experts.local_experts.{e}.linear_fc2.weight": ("row", ("{block}.experts.{e}.{down}.weight",)),
    "mlp.experts.local_experts.{e}.linear_fc1.bias": (
        "gate_up", ("{block}.experts.{e}.{gate}.bias", "{block}.experts.{e}.{up}.bias")),
    "mlp.experts.local_experts.{e}.linear_fc2.bias": ("replicated", ("{block}.experts.{e}.{down}.bias",)),
    "mlp.shared_experts.linear_fc1.weight": (
        "gate_up", ("mlp.{shared}.gate_proj.weight", "mlp.{shared}.up_proj.weight")),
    "mlp.shared_experts.linear_fc2.weight": ("row", ("mlp.{shared}.down_proj.weight",)),
    "mlp.shared_experts.gate_weight": ("replicated", ("mlp.shared_expert_gate.weight",)),
}
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$")
# Transformer Engine spec: norms fused into the following linear layer.
_TE_ALIASES = {
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
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
VISION_UNIT = "vision."
"""The tower's parameters in the first stage's chunk (``MultimodalGPTModel.vision``)."""
VISION_HF = "model.visual."
"""The tower's tensors by the engine's Hugging Face names (``folder`` maps them to the folder's)."""
_TOWER_SHAPES: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}


def vision_shapes(vision: VisionConfig) -> dict[str, tuple[int, ...]]:
    """``{parameter name: shape}`` of ``vision``'s tower (names without the ``vision.`` prefix, in module
    order), from the module built on the meta device (no memory); cached per tower config."""
    key = (vision.model_type, json.dumps(vision.vision_config, sort_keys=True, default=str))
    if key not in _TOWER_SHAPES:
        with torch.device("meta"):
            tower = build_vision_tower(vision)
        _TOWER_SHAPES[key] = {n: tuple(p.shape) for n, p in tower.named_parameters()}
    return _TOWER_SHAPES[key]


@lru_cache(maxsize=32)
def _folder_config(path: str, stamp: tuple[int, int]) -> dict[str, Any] | None:
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None


def folder_config(path: str | None) -> dict[str, Any] | None:
    """``config.json`` of ``path`` (cached while the file is unchanged); None when absent or invalid."""
    file = Path(path) / "config.json" if path else None
    if file is None or not file.is_file():
        return None
    st = file.stat()
    return _folder_config(str(path), (st.st_mtime_ns, st.st_size))


def source_family(cfg: ModelConfig, base: Mapping[str, Any] | None = None) -> Family:
    """The family a hybrid ``cfg`` keeps: that of ``base`` (default: ``cfg.hf_path``'s ``config.json``) when
    it describes ``cfg`` (a Qwen3-Next folder stays Qwen3-Next), else ``family_of(cfg)``."""
    if cfg.linear_attention is not None:
        base = base if base is not None else folder_config(cfg.hf_path)
        try:
            family = hf_family_of(base) if base is not None else None
        except ValueError:
            family = None
        if family is not None and describes(family, cfg):
            return family
    return family_of(cfg)


def is_gdn_layer(cfg: ModelConfig, layer: int) -> bool:
    """Whether decoder layer ``layer`` is a Gated DeltaNet layer."""
    g = cfg.linear_attention
    return g is not None and layer < cfg.num_layers and g.layer_pattern(cfg.num_layers)[layer]


def head_dim(cfg: ModelConfig) -> int:
    """Per-head channels ``d`` (``cfg.kv_channels`` when set, else hidden / heads)."""
    return cfg.kv_channels or cfg.hidden_size // cfg.num_attention_heads


def canonical_unit(name: str, global_layer: int | None, global_expert: int | None = None) -> str:
    """Unit key of a chunk-local Megatron parameter name (TE names folded to local-spec names, layer
    and local expert index replaced by ``global_layer`` / ``global_expert``); ``ValueError`` for
    names with no Hugging Face counterpart.
    """
    if name in _GLOBAL_UNITS or is_mtp_unit(name) or name.startswith(VISION_UNIT):
        return name
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["decoder", "layers"] and global_layer is not None:
        suffix = _TE_ALIASES.get(parts[3], parts[3])
        if suffix in _LAYER_UNITS or suffix in _MOE_UNITS or suffix in _MLA_UNITS or suffix in GDN_SUFFIXES:
            return f"decoder.layers.{global_layer}.{suffix}"
        match = _EXPERT_RE.match(suffix)
        if match and global_expert is not None:
            return f"decoder.layers.{global_layer}.mlp.experts.local_experts.{global_expert}.{match[2]}"
    raise ValueError(f"parameter {name!r} has no Hugging Face counterpart (supported: Llama/Qwen2/Qwen3 "
                     "GPTModel with RMSNorm, SwiGLU, optional QKV bias and QK-norm, and their MoE layers "
                     "with SequentialMLP experts; DeepSeek-V3 MLA; GLM-4.5)")


def unit_rule(unit: str, cfg: ModelConfig) -> TensorRule:
    """The ``TensorRule`` of a canonical unit key (see ``canonical_unit``) of a ``cfg`` model."""
    if unit in _GLOBAL_UNITS:
        kind, names = _GLOBAL_UNITS[unit]
        return TensorRule(kind, names)
    if unit.startswith(VISION_UNIT):
        return TensorRule("replicated", (VISION_HF + unit[len(VISION_UNIT):],))
    if is_mtp_unit(unit) and cfg.linear_attention is not None:  # Qwen3.5's mtp.* (hybrid)
        kind, name = MTP_OWN[unit.split(".", 3)[3]]
        return TensorRule(kind, (name,))
    if is_mtp_unit(unit):  # multi-token prediction modules: mcore_engine.hf.mtp_names
        return TensorRule(*mtp_rule(unit, cfg))
    _, _, layer, suffix = unit.split(".", 3)
    family = source_family(cfg)
    if suffix in GDN_SUFFIXES and is_gdn_layer(cfg, int(layer)):
        kind, name = gdn_units(family)[suffix]
        return TensorRule(kind, (f"model.layers.{layer}.{name}",))
    if cfg.linear_attention is not None and int(layer) >= cfg.num_layers:  # the MTP module's layer
        rule = unit_rule(f"decoder.layers.{cfg.num_layers - 1}.{suffix}", cfg)
        prefix = f"model.layers.{cfg.num_layers - 1}."
        names = tuple(f"mtp.layers.{int(layer) - cfg.num_layers}." + n[len(prefix):] for n in rule.hf_names)
        return dataclasses.replace(rule, hf_names=names)
    layer_units = {**_LAYER_UNITS, **_MLA_UNITS} if cfg.mla is not None else _LAYER_UNITS
    if suffix in layer_units:
        kind, names = layer_units[suffix]
        return TensorRule(kind, tuple(f"model.layers.{layer}.{n}" for n in names))
    match = _EXPERT_RE.match(suffix)
    key = f"mlp.experts.local_experts.{{e}}.{match[2]}" if match else suffix
    kind, names = _MOE_UNITS[key]
    fmt = dict(dataclasses.asdict(family.moe_names), e=match[1] if match else "")
    return TensorRule(kind, tuple(f"model.layers.{layer}.{n.format(**fmt)}" for n in names),
                      expert=match is not None, fp32=suffix == "mlp.router.expert_bias")


def _mlp_suffixes(cfg: ModelConfig, layer: int) -> list[str]:
    moe = cfg.moe
    if moe is None or not moe.layer_pattern(cfg.num_layers)[layer]:
        return ["mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    out = ["mlp.router.weight"] + (["mlp.router.bias"] if cfg.add_bias_linear else [])
    out += ["mlp.router.expert_bias"] if moe.router_expert_bias else []
    params = ("weight", "bias") if cfg.add_bias_linear else ("weight",)
    out += [f"mlp.experts.local_experts.{e}.linear_fc{i}.{p}"
            for e in range(moe.num_experts) for i in (1, 2) for p in params]
    if moe.shared_expert_ffn_hidden_size is not None:
        out += ["mlp.shared_experts.linear_fc1.weight", "mlp.shared_experts.linear_fc2.weight"]
        if moe.shared_expert_gate:
            out.append("mlp.shared_experts.gate_weight")
    return out


def _attention_suffixes(cfg: ModelConfig) -> list[str]:
    """The q / k / v units of a layer (GQA or MLA), in Hugging Face order."""
    if cfg.mla is not None:
        q = (["linear_q_proj.weight"] if cfg.mla.q_lora_rank is None else
             ["linear_q_down_proj.weight", "q_layernorm.weight", "linear_q_up_proj.weight"])
        kv = ["linear_kv_down_proj.weight", "kv_layernorm.weight", "linear_kv_up_proj.weight"]
        return [f"self_attention.{s}" for s in q + kv]
    out = ["self_attention.linear_qkv.weight"]
    if cfg.add_qkv_bias or cfg.add_bias_linear:
        out.append("self_attention.linear_qkv.bias")
    if cfg.attention_sinks:
        out.append("self_attention.core_attention.softmax_offset")
    if cfg.qk_layernorm:
        out += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    return out


def model_units(cfg: ModelConfig) -> list[str]:
    """All units of the full model, in Hugging Face order (vision tower, embedding, layers, norm,
    lm_head)."""
    attn = ["input_layernorm.weight"] + _attention_suffixes(cfg)
    attn += ["self_attention.linear_proj.weight"]
    attn += ["self_attention.linear_proj.bias"] if cfg.add_bias_linear else []
    attn += ["pre_mlp_layernorm.weight"]
    gdn = (["input_layernorm.weight", *gdn_units(source_family(cfg)), "pre_mlp_layernorm.weight"]
           if cfg.linear_attention is not None else [])
    units = [VISION_UNIT + n for n in vision_shapes(cfg.vision)] if cfg.vision is not None else []
    units += ["embedding.word_embeddings.weight"]
    units += [f"decoder.layers.{i}.{s}" for i in range(cfg.num_layers)
              for s in (gdn if is_gdn_layer(cfg, i) else attn) + _mlp_suffixes(cfg, i)]
    units.append("decoder.final_layernorm.weight")
    if cfg.head == "value":
        units += ["value_head.weight", "value_head.bias"]
    elif not cfg.tie_word_embeddings:
        units.append("output_layer.weight")
    return units + mtp_units(cfg, attn + _mlp_suffixes(cfg, cfg.num_layers - 1))


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Full shape of every Hugging Face tensor the model is made of, in checkpoint order."""
    h, d, ng, n = cfg.hidden_size, head_dim(cfg), cfg.query_groups, cfg.num_attention_heads
    q_out, kv_out, o_in = n * d * (2 if cfg.attention_output_gate else 1), ng * d, n * d
    ffn = cfg.ffn_size
    by_suffix = {
        "model.embed_tokens.weight": (cfg.vocab_size, h), "lm_head.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_out, h), "self_attn.k_proj.weight": (kv_out, h),
        "self_attn.v_proj.weight": (kv_out, h), "self_attn.q_proj.bias": (q_out,),
        "self_attn.k_proj.bias": (kv_out,), "self_attn.v_proj.bias": (kv_out,),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (h, o_in), "mlp.gate_proj.weight": (ffn, h),
        "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn),
        "score.weight": (1, h), "score.bias": (1,), "self_attn.o_proj.bias": (h,), "self_attn.sinks": (n,),
    }
    if cfg.mla is not None:
        by_suffix.update(_mla_shapes(cfg))
    if cfg.moe is not None:
        fe = cfg.moe.ffn_hidden_size or ffn
        fs = cfg.moe.shared_expert_ffn_hidden_size
        for names in {f.moe_names for f in FAMILIES if f.moe_names is not None}:
            by_suffix[f"{names.block}.{names.router}.weight"] = (cfg.moe.num_experts, h)
            by_suffix[f"{names.block}.{names.router}.bias"] = (cfg.moe.num_experts,)
            by_suffix[f"{names.block}.{names.router}.e_score_correction_bias"] = (cfg.moe.num_experts,)
            for proj in (names.gate, names.up):
                by_suffix[f"{names.block}.experts.*.{proj}.weight"] = (fe, h)
                by_suffix[f"{names.block}.experts.*.{proj}.bias"] = (fe,)
            by_suffix[f"{names.block}.experts.*.{names.down}.weight"] = (h, fe)
            by_suffix[f"{names.block}.experts.*.{names.down}.bias"] = (h,)
            by_suffix.update({f"mlp.{names.shared}.gate_proj.weight": (fs, h),
                              f"mlp.{names.shared}.up_proj.weight": (fs, h),
                              f"mlp.{names.shared}.down_proj.weight": (h, fs)})
        by_suffix["mlp.shared_expert_gate.weight"] = (1, h)
    by_suffix.update(mtp_hf_shapes(cfg))
    if cfg.vision is not None:
        by_suffix.update({VISION_HF + n: shape for n, shape in vision_shapes(cfg.vision).items()})
    if cfg.linear_attention is not None:
        by_suffix.update(gdn_hf_shapes(cfg))
        by_suffix.update(mtp_own_shapes(cfg))
    shapes = {}
    for unit in model_units(cfg):
        for name in unit_rule(unit, cfg).hf_names:
            key = name.split(".", 3)[3] if name.startswith(("model.layers.", "mtp.layers.")) else name
            shapes[name] = by_suffix[re.sub(r"\.experts\.\d+\.", ".experts.*.", key)]
    return shapes


def hf_stream_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """``hf_shapes`` in the order ``export.iter_hf_tensors`` yields them, with the MTP modules' copies
    of the embedding / output layer right after their source, in the names and expert layout of the
    folder ``cfg.hf_path`` (``hf.folder``; what a weight-sync stream carries)."""
    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in hf_shapes(cfg).items():
            yield name, torch.empty(shape, device="meta")
            for alias in mtp_aliases(name, cfg):
                yield alias, torch.empty(shape, device="meta")

    experts = cfg.moe.num_experts if cfg.moe is not None else 0
    return {name: tuple(t.shape) for name, t in folder_stream(stream(), model_format(cfg), experts)}


def hf_fp32_names(cfg: ModelConfig) -> set[str]:
    """Hugging Face tensors exported in fp32 whatever the export dtype (``TensorRule.fp32``)."""
    rules = (unit_rule(unit, cfg) for unit in model_units(cfg))
    return {name for rule in rules if rule.fp32 for name in rule.hf_names}


def _mla_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the MLA projections (``q_proj`` and ``o_proj`` replace the GQA ones)."""
    mla, h, n = cfg.mla, cfg.hidden_size, cfg.num_attention_heads
    q_out = n * mla.q_head_dim
    return {"self_attn.q_proj.weight": (q_out, h), "self_attn.q_a_proj.weight": (mla.q_lora_rank, h),
            "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
            "self_attn.q_b_proj.weight": (q_out, mla.q_lora_rank),
            "self_attn.kv_a_proj_with_mqa.weight": (mla.kv_lora_rank + mla.qk_pos_emb_head_dim, h),
            "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (n * (mla.qk_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            "self_attn.o_proj.weight": (h, n * mla.v_head_dim)}


def check_hf_names(names: list[str], cfg: ModelConfig) -> None:
    """Refuse a checkpoint that carries tensors this model config has no place for."""
    expected = hf_shapes(cfg)
    for name in names:
        if name in expected or name.endswith(_IGNORED_HF_SUFFIXES) or skip_mtp_hf_name(name, cfg):
            continue
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or cfg.head == "value"):
            continue  # tied checkpoints may store it anyway; a value trunk from a causal LM drops it
        raise ValueError(f"tensor {name!r} in the checkpoint has no place in the model built from its "
                         f"config (config and weights do not match){config_hint(name, cfg)}")


def unwrap_chunk(chunk: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers (their ``.module`` attribute)."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def iter_units(chunk: torch.nn.Module,
               cfg: ModelConfig) -> Iterator[tuple[str, torch.nn.Parameter, TensorRule]]:
    """``(unit, parameter, rule)`` per parameter of one (possibly wrapped) chunk, and per router expert
    bias (a buffer); a tied output layer on the last stage (PP > 1) reads ``model.embed_tokens``;
    ``ValueError`` for undescribed parameters. LoRA adapters (``.lora_A.`` / ``.lora_B.``) are not
    Hugging Face weights: skipped (``hf.peft``).
    """
    expected = set(model_units(cfg))
    model = unwrap_chunk(chunk)
    biases = [(n, b) for n, b in model.named_buffers() if n.endswith(".mlp.router.expert_bias")]
    for name, param in [*model.named_parameters(), *biases]:
        if ".lora_A." in name or ".lora_B." in name:
            continue
        if cfg.head == "value" and name.startswith("output_layer."):
            name = name.replace("output_layer.", "value_head.", 1)
        global_layer = global_expert = None
        if name.startswith("mtp."):  # an MTP module's transformer layer is decoder layer L + i (hf.mtp_names)
            name, global_layer, global_expert = mtp_param_name(model, name)
        elif name.startswith("decoder.layers."):
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
        elif rule.kind == "column" and not getattr(param, "tensor_model_parallel", False):
            rule = TensorRule("replicated", rule.hf_names)  # Transformer Engine's duplicated TELinear
        yield unit, param, rule
