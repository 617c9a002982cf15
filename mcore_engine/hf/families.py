"""The Hugging Face families, one row of traits each.

``hf_config`` (``config.json`` <-> ``ModelConfig``) and ``mapping`` (tensor names) read these traits
instead of testing family names. A new family is a row here plus, when its MoE layers speak a new
dialect, a block in ``hf_config.MOE_DIALECTS``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ARCHITECTURES", "FAMILIES", "MULTIMODAL", "MULTIMODAL_ARCHITECTURES", "Family", "MoENames",
           "Multimodal", "describes", "family_of", "hf_family", "hf_family_of", "is_multimodal",
           "model_family", "multimodal_of", "partial_rotary_factor", "rope_params", "text_config"]


@dataclass(frozen=True)
class MoENames:
    """Hugging Face names of an MoE layer: ``model.layers.{i}.{block}.experts.{e}.{gate|up|down}``,
    ``{block}.gate`` (router), ``mlp.{shared}`` (shared expert)."""

    block: str = "mlp"
    gate: str = "gate_proj"
    up: str = "up_proj"
    down: str = "down_proj"
    shared: str = "shared_expert"
    router: str = "gate"


@dataclass(frozen=True)
class Multimodal:
    """A vision-language folder (``*ForConditionalGeneration``) whose language model is a family here:
    the tower runs in the engine (``ModelConfig.vision``) and keeps the folder's names."""

    architecture: str
    model_type: str
    """Top-level ``model_type`` (``VisionConfig.model_type``)."""
    text_model_type: str
    """``text_config.model_type``."""
    vision_prefix: str
    """The tower's tensors in the released folders (and ``save_pretrained``'s): ``visual.`` (Qwen2.5-VL)
    or ``model.visual.``."""
    language_prefix: str
    """The decoder's: ``model.`` (Qwen2.5-VL: ``model.layers.*``) or ``model.language_model.``."""
    mrope_interleaved: bool
    """Interleaved mRoPE (Qwen3-VL, Qwen3.5: whatever ``mrope_interleaved`` says) or sectioned."""
    mrope_default: tuple[int, int, int]
    """``transformers``' ``mrope_section`` when the config has none."""
    fused_experts: str | None = None
    """The released folders' expert layout: ``"rows"`` (``gate_up_proj`` ``[E, 2I, H]``), ``"columns"``
    (Qwen3-VL-MoE: ``[E, H, 2I]``, ``down_proj`` ``[E, I, H]``) or None (one tensor per expert)."""
    moe_fixed: Mapping[str, Any] = field(default_factory=dict)
    """MoE ``config.json`` fields ``transformers`` ignores for this model (Qwen3-VL-MoE always
    renormalises the top-k weights: ``norm_topk_prob`` True)."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face family (``model_type``) and what distinguishes it."""

    model_type: str
    architecture: str
    """The ``*ForCausalLM`` class; ``value_head``: its ``*ForTokenClassification`` twin exists."""
    value_head: bool = False
    qkv_bias: bool | str = False
    """Biases on q / k / v (and none on o): always (True), never (False), or the ``config.json`` key
    that says (GLM-4.5's ``attention_bias``). Families without them refuse ``attention_bias``."""
    qk_norm: bool | str = False
    """Per-head q / k RMSNorm: always, never, or the ``config.json`` key that says."""
    rope: str = "llama3"
    """``"llama3"``: default RoPE or Llama-3 scaling; ``"partial"``: default RoPE on the first
    ``partial_rotary_factor`` of each head (default 0.5); ``"mla"``: MLA's (``MLAConfig``, YaRN);
    ``"yarn"``: default RoPE or YaRN (``ModelConfig.yarn``, gpt-oss)."""
    mla: bool = False
    """Multi-latent attention (``MLAConfig``) instead of GQA."""
    moe: str | None = None
    """The MoE dialect of ``config.json`` (``hf_config.MOE_DIALECTS``); None: dense."""
    shared_expert: str | None = None
    """``"gated"`` (Qwen2-MoE: ``sigmoid(x w_g)``), ``"ungated"`` (``n_shared_experts``) or None."""
    moe_names: MoENames | None = None
    mtp: bool = False
    """Multi-token prediction layers (``num_nextn_predict_layers``)."""
    export: Mapping[str, Any] = field(default_factory=dict)
    """``config.json`` fields written as is on export (features the family has and we never use)."""
    hybrid: str | None = None
    """Gated DeltaNet + gated-attention decoder (``ModelConfig.linear_attention``): ``"split"``
    (Qwen3.5: ``in_proj_qkv`` / ``in_proj_z`` / ``in_proj_b`` / ``in_proj_a``) or ``"fused"`` (Qwen3-Next:
    ``in_proj_qkvz`` / ``in_proj_ba`` grouped per key head); None: no GDN layers."""
    moe_fixed: bool = False
    """Every layer MoE with renormalised top-k weights, and ``config.json`` has no field for it
    (Qwen3.5-MoE)."""
    moe_defaults: Mapping[str, Any] = field(default_factory=dict)
    """MoE ``config.json`` fields' values when absent (Qwen3-Next: ``norm_topk_prob`` True)."""
    biases: bool = False
    """Biases on every linear layer, router and experts included, and per-head attention sinks, with
    ``layer_types`` sliding windows (gpt-oss: ``ModelConfig.add_bias_linear`` / ``attention_sinks``)."""
    multimodal: tuple[Multimodal, ...] = ()
    """The vision-language folders whose ``text_config`` is this family."""


_QWEN_DENSE = {"use_sliding_window": False}
_QWEN3 = {"use_sliding_window": False, "attention_bias": False}
_DEEPSEEK_NAMES = MoENames(shared="shared_experts")

_HYBRID = {"attention_bias": False}
_LM = "model.language_model."
_QWEN3_5_MM = (Multimodal("Qwen3_5ForConditionalGeneration", "qwen3_5", "qwen3_5_text", "model.visual.", _LM,
                          True, (11, 11, 10)),)
_QWEN3_5_MOE_MM = (Multimodal("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe", "qwen3_5_moe_text",
                              "model.visual.", _LM, True, (11, 11, 10), fused_experts="rows"),)
_QWEN2_5_VL = (Multimodal("Qwen2_5_VLForConditionalGeneration", "qwen2_5_vl", "qwen2_5_vl_text", "visual.",
                          "model.", False, (16, 24, 24)),)
_QWEN3_VL = (Multimodal("Qwen3VLForConditionalGeneration", "qwen3_vl", "qwen3_vl_text", "model.visual.", _LM,
                        True, (24, 20, 20)),)
_QWEN3_VL_MOE = (Multimodal("Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe", "qwen3_vl_moe_text",
                            "model.visual.", _LM, True, (24, 20, 20), fused_experts="columns",
                            moe_fixed={"norm_topk_prob": True}),)

# Order matters for ``family_of``: the first row that describes a ModelConfig is its family.
FAMILIES: tuple[Family, ...] = (
    Family("gpt_oss", "GptOssForCausalLM", rope="yarn", moe="gpt_oss", moe_names=MoENames(router="router"),
           biases=True),
    Family("qwen3_5_text", "Qwen3_5ForCausalLM", qk_norm=True, rope="partial", hybrid="split",
           multimodal=_QWEN3_5_MM, export=_HYBRID),
    Family("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", qk_norm=True, rope="partial", moe="qwen",
           shared_expert="gated", moe_names=MoENames(), hybrid="split", moe_fixed=True,
           multimodal=_QWEN3_5_MOE_MM, export=_HYBRID),
    Family("qwen3_next", "Qwen3NextForCausalLM", qk_norm=True, rope="partial", moe="qwen",
           shared_expert="gated", moe_names=MoENames(), hybrid="fused",
           moe_defaults={"norm_topk_prob": True}, export=_HYBRID),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", rope="mla", mla=True, moe="deepseek",  # Kimi-K2, Moonlight
           shared_expert="ungated", moe_names=_DEEPSEEK_NAMES, mtp=True),
    Family("glm4_moe", "Glm4MoeForCausalLM", qkv_bias="attention_bias", qk_norm="use_qk_norm", rope="partial",
           moe="deepseek", shared_expert="ungated", moe_names=_DEEPSEEK_NAMES, mtp=True),
    Family("qwen3", "Qwen3ForCausalLM", value_head=True, qk_norm=True, export=_QWEN3, multimodal=_QWEN3_VL),
    Family("qwen2", "Qwen2ForCausalLM", value_head=True, qkv_bias=True, export=_QWEN_DENSE,
           multimodal=_QWEN2_5_VL),
    Family("llama", "LlamaForCausalLM", value_head=True, export={"attention_bias": False, "mlp_bias": False}),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm=True, moe="qwen", moe_names=MoENames(), export=_QWEN3,
           multimodal=_QWEN3_VL_MOE),
    Family("qwen2_moe", "Qwen2MoeForCausalLM", qkv_bias=True, moe="qwen", shared_expert="gated",
           moe_names=MoENames(), export={**_QWEN_DENSE, "qkv_bias": True}),
    Family("mixtral", "MixtralForCausalLM", moe="mixtral",
           moe_names=MoENames(block="block_sparse_moe", gate="w1", up="w3", down="w2")),
)
_BY_TYPE = {f.model_type: f for f in FAMILIES}
# vision-language model_type -> its row; architecture -> model_type of its text family
MULTIMODAL: dict[str, Multimodal] = {m.model_type: m for f in FAMILIES for m in f.multimodal}
MULTIMODAL_ARCHITECTURES: dict[str, str] = {m.architecture: f.model_type
                                            for f in FAMILIES for m in f.multimodal}
ARCHITECTURES: dict[str, str] = {
    **{f.architecture: f.model_type for f in FAMILIES},
    **{f.architecture.replace("ForCausalLM", "ForTokenClassification"): f.model_type
       for f in FAMILIES if f.value_head},
    **MULTIMODAL_ARCHITECTURES,
}
_MULTIMODAL_TYPES = {m.model_type: f.model_type for f in FAMILIES for m in f.multimodal}
_MULTIMODAL_BY_ARCH = {m.architecture: m for m in MULTIMODAL.values()}


def hf_family_of(hf_config: Mapping[str, Any]) -> Family:
    """The row of a ``config.json``: from ``architectures`` (or ``model_type``); ValueError otherwise."""
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in ARCHITECTURES:
            return _BY_TYPE[ARCHITECTURES[arch]]
    model_type = hf_config.get("model_type")
    if not archs and model_type in _BY_TYPE:
        return _BY_TYPE[model_type]
    if not archs and model_type in _MULTIMODAL_TYPES:
        return _BY_TYPE[_MULTIMODAL_TYPES[model_type]]
    raise ValueError(f"architectures: unknown architecture {archs or model_type!r}; supported: "
                     f"{sorted(ARCHITECTURES)}")


def hf_family(hf_config: Mapping[str, Any]) -> str:
    return hf_family_of(hf_config).model_type


def is_multimodal(hf_config: Mapping[str, Any]) -> bool:
    """A vision-language ``config.json`` (``text_config`` nested) of a family here."""
    archs = hf_config.get("architectures") or []
    return (any(a in MULTIMODAL_ARCHITECTURES for a in archs)
            or (not archs and hf_config.get("model_type") in _MULTIMODAL_TYPES))


def multimodal_of(hf_config: Mapping[str, Any]) -> Multimodal | None:
    """The vision-language row of a ``config.json`` (by ``architectures``, else ``model_type``); None for
    a text model."""
    for arch in hf_config.get("architectures") or []:
        if arch in _MULTIMODAL_BY_ARCH:
            return _MULTIMODAL_BY_ARCH[arch]
    if not hf_config.get("architectures"):
        return MULTIMODAL.get(hf_config.get("model_type"))
    return None


def text_config(hf_config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's fields: a vision-language config's ``text_config`` (with the top level's
    ``tie_word_embeddings``, which ``transformers`` ties by; a flat Qwen2.5-VL ``config.json`` as the Hub's:
    its top level less ``vision_config``), else ``hf_config`` itself."""
    if not is_multimodal(hf_config):
        return hf_config
    text = hf_config.get("text_config")
    if text is None and "hidden_size" in hf_config:  # the Hub's flat Qwen2.5-VL config.json
        return {k: v for k, v in hf_config.items() if k != "vision_config"}
    if not isinstance(text, Mapping):
        raise ValueError(f"text_config: a {hf_config.get('architectures')} config needs its language model's "
                         "fields in text_config")
    out = dict(text)
    if "tie_word_embeddings" in hf_config:
        out["tie_word_embeddings"] = hf_config["tie_word_embeddings"]
    return out


def describes(f: Family, cfg: Any) -> bool:
    """Whether row ``f`` can express ``cfg`` (a ``ModelConfig``) in its kind: MLA claims every MLA
    model, sigmoid routing every sigmoid-routed MoE, gpt-oss every model with linear biases or sinks;
    the rest by MoE or not, QKV bias and QK-norm."""
    if f.biases or cfg.add_bias_linear or cfg.attention_sinks:
        return (f.biases and cfg.add_bias_linear and cfg.attention_sinks and cfg.moe is not None
                and cfg.mla is None and cfg.linear_attention is None)
    if f.mla or cfg.mla is not None:
        return f.mla and cfg.mla is not None
    if f.hybrid or cfg.linear_attention is not None:
        if not (f.hybrid and cfg.linear_attention is not None and (f.moe is None) == (cfg.moe is None)):
            return False
        moe = cfg.moe
        return not f.moe_fixed or (all(moe.layer_pattern(cfg.num_layers)) and not moe.router_pre_softmax)
    sigmoid = cfg.moe is not None and cfg.moe.router_score_function == "sigmoid"
    if f.moe == "deepseek" or sigmoid:
        return f.moe == "deepseek" and sigmoid
    return ((f.moe is None) == (cfg.moe is None) and _expresses(f.qkv_bias, cfg.add_qkv_bias)
            and _expresses(f.qk_norm, cfg.qk_layernorm))


def _expresses(trait: bool | str, value: bool) -> bool:
    """A fixed trait expresses its own value; a ``config.json`` key either."""
    return trait == value if isinstance(trait, bool) else True


def family_of(cfg: Any) -> Family:
    """The row ``cfg`` (a ``ModelConfig``) maps to: the first that describes it; with ``cfg.vision`` the
    text family of that vision-language model, which must describe it."""
    vision = getattr(cfg, "vision", None)
    if vision is not None:
        f = next(f for f in FAMILIES if any(m.model_type == vision.model_type for m in f.multimodal))
        if not describes(f, cfg):
            raise ValueError(f"model.vision.model_type: a {vision.model_type} language model is "
                             f"{f.model_type} (add_qkv_bias, qk_layernorm, MoE, hybrid layers as "
                             f"{f.architecture}); this model config differs")
        return f
    for f in FAMILIES:
        if describes(f, cfg):
            return f
    raise ValueError(f"cfg: add_qkv_bias={cfg.add_qkv_bias} with qk_layernorm={cfg.qk_layernorm} "
                     f"({'MoE' if cfg.moe is not None else 'dense'}) has no Hugging Face family here")


def model_family(cfg: Any) -> str:
    """The Hugging Face ``model_type`` a ``ModelConfig`` maps to."""
    return family_of(cfg).model_type


def rope_params(hf_config: Mapping[str, Any]) -> dict[str, Any]:
    """``rope_scaling`` (legacy) updated by ``rope_parameters``."""
    return {**(hf_config.get("rope_scaling") or {}), **(hf_config.get("rope_parameters") or {})}


def partial_rotary_factor(hf_config: Mapping[str, Any], default: float) -> float:
    """From ``rope_parameters`` or the top level."""
    top = hf_config.get("partial_rotary_factor", default)
    return float(rope_params(hf_config).get("partial_rotary_factor", top))
