"""The decoder's layer spec: Transformer Engine's when it imports, else Megatron's local spec with
the project's own modules (:mod:`mcore_engine.layers`): torch norms, the core attention of
``model.core_attention``, with MLA the TP-exact attention and its latent norms, and in a hybrid
decoder (``model.linear_attention``) the Gated DeltaNet layers where its layer pattern says."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from mcore_engine.config import EngineConfig
from mcore_engine.layers.attention import SDPACoreAttention
from mcore_engine.layers.expert_linear import BiasedExpertRowParallelLinear
from mcore_engine.layers.gated_attention import GatedSelfAttention
from mcore_engine.layers.mla import LatentNorm, MLASelfAttention
from mcore_engine.layers.norm import TorchNorm, with_torch_norms
from mcore_engine.layers.packed_attention import PackedDotProductAttention

__all__ = ["decoder_spec", "has_te", "mtp_source_spec", "qk_layernorm", "uses_te_spec"]


def has_te() -> bool:
    """True when Transformer Engine imports (never on CPU-only machines)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


def uses_te_spec(cfg: EngineConfig) -> bool:
    """Transformer Engine's layer spec: when it imports, except for attention sinks or sliding windows
    (gpt-oss), which always take the local spec and the engine's own core attention (packed thd and
    CP with sinks; Transformer Engine's attention has no packed path for them on many versions)."""
    return has_te() and not (cfg.model.attention_sinks or cfg.model.sliding_window is not None)


def qk_layernorm(cfg: EngineConfig) -> bool:
    """Megatron's ``qk_layernorm``: ``model.qk_layernorm``; with MLA the latent norms, always on with
    Transformer Engine (fused into the up projections) and on the local spec with q LoRA. Without q
    LoRA the local spec leaves it off and :class:`~mcore_engine.layers.mla.MLASelfAttention` builds its
    kv latent norm itself (Megatron-Core 0.19 reads the flag as "a query norm too")."""
    m = cfg.model
    return m.qk_layernorm or (m.mla is not None and (m.mla.q_lora_rank is not None or has_te()))


def decoder_spec(cfg: EngineConfig, config: TransformerConfig, vp_stage: int | None):
    """The layer spec (Transformer Engine, dense) or this stage's block spec: the local layer spec
    repeated (dense) or Megatron's ``get_gpt_decoder_block_spec`` (MoE, by ``moe.layer_freq``), with
    the local modules of the module docstring; a hybrid decoder's GDN layers replace their mixer."""
    te = uses_te_spec(cfg)
    hybrid = cfg.model.linear_attention is not None
    if cfg.model.moe is None:
        if te and not hybrid:
            return _layer_spec(cfg)
        block = TransformerBlockSubmodules(
            layer_specs=[_layer_spec(cfg)] * get_num_layers_to_build(config, vp_stage),
            layer_norm=WrappedTorchNorm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                           normalization=cfg.model.normalization, vp_stage=vp_stage)
        if te and not hybrid:
            return block
        if cfg.model.add_bias_linear:
            _biased_experts(block.layer_specs)
    if hybrid:
        block.layer_specs = _with_gdn_layers(cfg, config, vp_stage, block.layer_specs)
        if te:
            return block
    for spec in {id(s): s for s in block.layer_specs}.values():
        if "gdn" in spec.submodules.self_attention.params:
            continue  # a Gated DeltaNet layer
        attention = spec.submodules.self_attention.submodules
        attention.core_attention = _core_attention(cfg)
        if cfg.model.attention_output_gate:  # Megatron's gate is torch.compile'd: eager here
            spec.submodules.self_attention.module = GatedSelfAttention
        if cfg.model.mla is not None:
            spec.submodules.self_attention.module = MLASelfAttention
            # without q LoRA the kv latent norm is MLASelfAttention's own (see qk_layernorm)
            norm = IdentityOp if cfg.model.mla.q_lora_rank is None else LatentNorm
            attention.q_layernorm = attention.kv_layernorm = norm
    return with_torch_norms(block)


def mtp_source_spec(cfg: EngineConfig, config: TransformerConfig, vp_stage: int | None):
    """The decoder spec whose last layer Megatron's MTP block copies: the decoder's own, but for a
    hybrid decoder the same stage without GDN mixers (Qwen3.5's MTP layer is full attention,
    whatever the stage's last layer is)."""
    if cfg.model.linear_attention is None:
        return decoder_spec(cfg, config, vp_stage)
    attention_only = dataclasses.replace(cfg.model, linear_attention=None)
    return decoder_spec(dataclasses.replace(cfg, model=attention_only), config, vp_stage)


def _biased_experts(layer_specs: list[ModuleSpec]) -> None:
    """The local experts' ``linear_fc2`` that lets Megatron add their bias (see the class)."""
    for spec in layer_specs:
        experts = getattr(_submodules(spec.submodules.mlp), "experts", None)
        experts = _submodules(experts) if experts is not None else None
        if experts is not None:
            experts.linear_fc2 = BiasedExpertRowParallelLinear


def _submodules(spec: Any) -> Any:
    """A spec's submodules: a ``ModuleSpec``'s field (Megatron-Core 0.16) or a ``functools.partial``'s
    ``submodules`` keyword (0.19's MoE specs)."""
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return getattr(spec, "submodules", None)


def _gdn_module() -> type:
    from mcore_engine.layers.gated_delta_net import GatedDeltaNet

    return GatedDeltaNet


def _with_gdn_layers(cfg: EngineConfig, config: TransformerConfig, vp_stage: int | None,
                     layer_specs: list[ModuleSpec]) -> list[ModuleSpec]:
    """This stage's layer specs with a Gated DeltaNet mixer (and its own input norm: the attention
    spec may fuse it into ``linear_qkv``) at the global layers ``model.linear_attention`` marks."""
    pattern = cfg.model.linear_attention.layer_pattern(cfg.model.num_layers)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    mixer = ModuleSpec(module=_gdn_module(), params={"gdn": cfg.model.linear_attention})
    out = []
    for i, spec in enumerate(layer_specs):
        if pattern[offset + i]:
            sub = dataclasses.replace(spec.submodules, input_layernorm=TorchNorm, self_attention=mixer)
            spec = ModuleSpec(module=spec.module, params=dict(spec.params), submodules=sub)
        out.append(spec)
    return out


def _core_attention(cfg: EngineConfig) -> type:
    """The local spec's core attention: ``model.core_attention`` ("sdpa" or Megatron's "local")."""
    return SDPACoreAttention if cfg.model.core_attention == "sdpa" else PackedDotProductAttention


def _layer_spec(cfg: EngineConfig) -> ModuleSpec:
    """One decoder layer's spec (Transformer Engine's when it imports, else the local one), MLA when
    ``model.mla`` is set."""
    m = cfg.model
    kwargs = dict(qk_layernorm=qk_layernorm(cfg), multi_latent_attention=m.mla is not None)
    if uses_te_spec(cfg):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(**kwargs)
    return get_gpt_layer_local_spec(normalization=m.normalization, **kwargs)
