"""Megatron-Core ``GPTModel`` from an :class:`~mcore_engine.config.EngineConfig` (no process-group code).

Transformer Engine's layer spec when it imports, else the local one with the engine's own
:class:`~mcore_engine.layers.attention.SDPACoreAttention` (``model.core_attention: sdpa``,
context parallel) or :class:`PackedDotProductAttention` (``local``); vocab padded as Megatron
does; logits vocab-sharded ``[b, s, V_padded / tp]`` in the parameters' dtype. On CPU a TP shard
is an exact slice of the TP=1 weight. :func:`output_hidden_states` and :func:`lm_head_weight` serve
the fused lm-head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import MLATransformerConfig
from torch import Tensor

from mcore_engine.config import EngineConfig
from mcore_engine.layers.attention import SDPACoreAttention
from mcore_engine.layers.mla import LatentNorm, MLASelfAttention
from mcore_engine.layers.mtp import MTPGPTModel, freeze_untrained_mtp, mtp_block_spec
from mcore_engine.layers.norm import with_torch_norms
from mcore_engine.layers.value_head import ValueHead, attach_value_head
from mcore_engine.parallel.platform import (
    apply_cpu_device_layer,
    apply_mla_compat,
    apply_moe_compat,
    mcore_version,
)

__all__ = ["PackedDotProductAttention", "build_model_chunks", "build_transformer_config", "has_te",
           "apply_output_layer", "is_last_stage_chunk", "lm_head_weight", "output_hidden_states",
           "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by * tp`` (``(250, 128, 2) -> 256``)."""
    for name, value in (("vocab_size", vocab_size), ("divisible_by", divisible_by), ("tp", tp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"padded_vocab_size: {name} must be an int >= 1, got {value!r}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def has_te() -> bool:
    """True when Transformer Engine imports (never on CPU-only machines)."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        return False
    return True


class PackedDotProductAttention(DotProductAttention):
    """Megatron-Core's local ``DotProductAttention`` that also takes packed ``thd`` sequences.

    With ``packed_seq_params`` (``qkv_format='thd'``; ``query [t, np, hn]``, ``key``/``value [t, ng, hn]``)::

        seq = searchsorted(cu_seqlens[1:], arange(t), right=True)           # [t]
        masked[i, j] = (seq[i] != seq[j]) | (j > i)                         # [t, t]
        out = softmax(q k^T / sqrt(hn) masked by -10000) v                  # [t, 1, np * hn]

    ``attention_mask`` is ignored for ``thd``. Memory: the ``[np, t, t]`` scores of the whole pack.
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        if packed_seq_params is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError("packed_seq_params.qkv_format must be 'thd', "
                             f"got {packed_seq_params.qkv_format!r}")
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        t = query.size(0)
        positions = torch.arange(t, device=query.device)
        seq = torch.searchsorted(cu[1:].to(device=query.device, dtype=torch.int64), positions, right=True)
        masked = (seq[:, None] != seq[None, :]) | (positions[None, :] > positions[:, None])
        return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                               masked[None, None], attn_mask_type=AttnMaskType.arbitrary,
                               attention_bias=attention_bias)


def build_transformer_config(cfg: EngineConfig) -> TransformerConfig:
    """Megatron-Core ``TransformerConfig`` for ``cfg`` (no dropout, no bias but QKV's, RoPE, the
    recompute fields); an ``MLATransformerConfig`` with ``model.mla`` (its latent norms are the
    config's ``qk_layernorm``).
    """
    m, p = cfg.model, cfg.parallel
    on_gpu = torch.cuda.is_available()
    if "layernorm" in (cfg.recompute_modules or ()) and not has_te():
        raise ValueError("EngineConfig.recompute_modules 'layernorm' needs Transformer Engine (GPU): "
                         "Megatron's norm recompute reads its FP8 state; use 'core_attn' / 'mlp'")
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    config_cls = TransformerConfig if m.mla is None else MLATransformerConfig
    return config_cls(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.kv_channels,  # None: hidden // heads
        ffn_hidden_size=m.ffn_size,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=False,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=_qk_layernorm(cfg),
        init_method_std=m.init_method_std,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        sequence_parallel=p.sequence_parallel,
        context_parallel_size=p.context_parallel_size,
        cp_comm_type=p.cp_comm_type,
        batch_p2p_comm=p.batch_p2p_comm,
        # free each stage's sent activations right after the send (Megatron's training default)
        deallocate_pipeline_outputs=p.pipeline_model_parallel_size > 1,
        # pipeline p2p sends shapes: micro-batches differ in length (the allgather dispatcher, allowed
        # only without PP / EP, rejects the flag)
        variable_seq_lengths=m.moe is None or m.moe.token_dispatcher != "allgather",
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_size,
        **_moe_config_kwargs(cfg),
        **_mla_config_kwargs(cfg),
        recompute_granularity=cfg.recompute_granularity,  # EngineConfig has resolved "full"'s defaults
        recompute_method=cfg.recompute_method,
        recompute_num_layers=cfg.recompute_num_layers,
        recompute_modules=list(cfg.recompute_modules or ["core_attn"]),
        mtp_num_layers=m.mtp_num_layers or None,  # the loss: mcore_engine.step.mtp (Megatron's is not run)
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        bf16=cfg.precision == "bf16",
        params_dtype=dtype,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )


def _moe_config_kwargs(cfg: EngineConfig) -> dict:
    """``TransformerConfig`` MoE arguments for ``cfg.model.moe``. Routing
    replay is always built (``RouterReplay`` per router; idle until ``mcore_engine.model.moe`` arms it).
    Routing follows the checkpoints (``apply_moe_compat``: grouped top-k by each group's top-2 scores,
    sigmoid weights renormalised unless ``router_pre_softmax``). The expert bias is a router buffer;
    its update (``moe_router_bias_update_rate``) is run by ``mcore_engine.model.moe`` after an optimizer step
    that updated the weights, not by Megatron's ``finalize_model_grads``."""
    moe = cfg.model.moe
    if moe is None:  # unused; the default dispatcher rejects variable lengths
        return {"moe_token_dispatcher_type": "alltoall"}
    apply_moe_compat()
    if moe.grouped_gemm and not (has_te() or _has_grouped_gemm()):
        raise ValueError("MoEConfig.grouped_gemm needs Transformer Engine or the grouped_gemm package; "
                         "neither imports here (use grouped_gemm: false for SequentialMLP experts)")
    return dict(
        num_moe_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size or cfg.model.ffn_size,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn_hidden_size,
        moe_shared_expert_gate=moe.shared_expert_gate,
        moe_layer_freq=moe.layer_pattern(cfg.model.num_layers),
        moe_router_score_function=moe.router_score_function,
        moe_router_pre_softmax=moe.router_pre_softmax,
        moe_router_topk_scaling_factor=moe.router_topk_scaling_factor,
        moe_router_dtype=moe.router_dtype,
        moe_router_num_groups=moe.router_num_groups,
        moe_router_group_topk=moe.router_group_topk,
        moe_router_enable_expert_bias=moe.router_expert_bias,
        moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_router_load_balancing_type=moe.aux_loss_type,
        moe_aux_loss_coeff=_aux_loss_coeff(cfg),
        moe_z_loss_coeff=_z_loss_coeff(cfg),
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_drop_policy=moe.token_drop_policy,
        moe_pad_expert_input_to_capacity=moe.pad_expert_input_to_capacity,
        moe_token_dispatcher_type=moe.token_dispatcher,
        moe_grouped_gemm=moe.grouped_gemm,
        moe_enable_routing_replay=True,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def _mla_config_kwargs(cfg: EngineConfig) -> dict:
    """``MLATransformerConfig`` arguments for ``cfg.model.mla`` (none without it). The softmax scale
    ``mscale(rotary_scaling_factor, mscale_all_dim)^2 / sqrt(q_head_dim)`` is Megatron's for both RoPE
    types: ``MLAConfig`` keeps the YaRN fields at their neutral defaults for ``rope``."""
    mla = cfg.model.mla
    if mla is None:
        return {}
    apply_mla_compat()
    return dict(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_head_dim,
        qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
        v_head_dim=mla.v_head_dim,
        rope_type=mla.rope_type,
        rotary_base=cfg.model.rotary_base,
        rotary_percent=1.0,
        rotary_scaling_factor=mla.rotary_scaling_factor,
        original_max_position_embeddings=mla.original_max_position_embeddings,
        beta_fast=mla.beta_fast,
        beta_slow=mla.beta_slow,
        mscale=mla.mscale,
        mscale_all_dim=mla.mscale_all_dim,
    )


def _token_split(cfg: EngineConfig) -> int:
    """How many ranks share a micro-batch's routed tokens: ``tp`` under sequence parallelism, times
    ``cp``."""
    par = cfg.parallel
    return (par.tensor_model_parallel_size if par.sequence_parallel else 1) * par.context_parallel_size


def _z_loss_coeff(cfg: EngineConfig) -> float | None:
    """The router's z-loss coefficient. Megatron-Core 0.16 - 0.18's router divides it by the TP x CP
    size and, with ``calculate_per_token_loss``, weights the loss by the rank's routed tokens; with
    the tokens split (``s / tp`` a rank under sequence parallelism, ``s / cp`` under context
    parallelism) that makes the z term ``1 / (tp cp)`` of the one-rank objective, so it gets
    ``coeff * tp * cp`` (the logged z-loss is unchanged). From 0.19 the router weights it by the
    routed tokens times the TP x CP size itself: ``coeff`` as it is."""
    coeff = cfg.model.moe.z_loss_coeff
    if coeff is None or mcore_version() >= (0, 19):
        return coeff
    return coeff * _token_split(cfg)


def _aux_loss_coeff(cfg: EngineConfig) -> float:
    """The load-balancing loss coefficient. From Megatron-Core 0.19 the router weights that loss by
    the rank's routed tokens times the TP x CP size (0.16 - 0.18: the routed tokens only, which the
    engine's ``1 / N`` step scale, :mod:`mcore_engine.model.moe`, expects), so it gets ``coeff / (tp cp)``
    there, with the tokens split as in :func:`_z_loss_coeff` (the logged loss is unchanged)."""
    coeff = cfg.model.moe.aux_loss_coeff
    return coeff / _token_split(cfg) if mcore_version() >= (0, 19) else coeff


def _has_grouped_gemm() -> bool:
    try:
        import grouped_gemm  # noqa: F401
    except Exception:
        return False
    return True


def _decoder_spec(cfg: EngineConfig, config: TransformerConfig, vp_stage: int | None):
    """The layer spec (Transformer Engine, dense) or this stage's block spec: the local layer spec
    repeated (dense) or Megatron's ``get_gpt_decoder_block_spec`` (MoE: dense and ``MoELayer`` layers
    by ``moe.layer_freq``; ``MLASelfAttention`` layers when ``config.multi_latent_attention``); local
    specs get :class:`~mcore_engine.layers.norm.TorchNorm` norms (sequence parallel capable), the core
    attention of ``model.core_attention`` and, with MLA, the TP-exact
    :class:`~mcore_engine.layers.mla.MLASelfAttention` and its
    :class:`~mcore_engine.layers.mla.LatentNorm` latent norms."""
    te = has_te()
    if cfg.model.moe is None:
        if te:
            return _layer_spec(cfg)
        block = TransformerBlockSubmodules(
            layer_specs=[_layer_spec(cfg)] * get_num_layers_to_build(config, vp_stage),
            layer_norm=WrappedTorchNorm)
    else:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

        block = get_gpt_decoder_block_spec(config, use_transformer_engine=te,
                                           normalization=cfg.model.normalization, vp_stage=vp_stage)
        if te:
            return block
    for spec in {id(s): s for s in block.layer_specs}.values():
        attention = spec.submodules.self_attention.submodules
        attention.core_attention = _core_attention(cfg)
        if cfg.model.mla is not None:
            spec.submodules.self_attention.module = MLASelfAttention
            # without q LoRA the kv latent norm is MLASelfAttention's own (see _qk_layernorm)
            norm = IdentityOp if cfg.model.mla.q_lora_rank is None else LatentNorm
            attention.q_layernorm = attention.kv_layernorm = norm
    return with_torch_norms(block)


def _core_attention(cfg: EngineConfig) -> type:
    """The local spec's core attention: ``model.core_attention`` ("sdpa" or Megatron's "local")."""
    return SDPACoreAttention if cfg.model.core_attention == "sdpa" else PackedDotProductAttention


def _qk_layernorm(cfg: EngineConfig) -> bool:
    """Megatron's ``qk_layernorm``: ``model.qk_layernorm``; with MLA the latent norms, always on with
    Transformer Engine (fused into the up projections) and on the local spec with q LoRA. Without q
    LoRA the local spec leaves it off and :class:`~mcore_engine.layers.mla.MLASelfAttention` builds its
    kv latent norm itself: Megatron-Core 0.19 reads ``qk_layernorm`` as "a query norm too", which MLA
    without q LoRA does not have (0.16 builds the kv norm from the spec either way)."""
    m = cfg.model
    return m.qk_layernorm or (m.mla is not None and (m.mla.q_lora_rank is not None or has_te()))


def _layer_spec(cfg: EngineConfig) -> ModuleSpec:
    """One decoder layer's spec (Transformer Engine's when it imports, else the local one), MLA when
    ``model.mla`` is set (its latent norms are Megatron's ``qk_layernorm``)."""
    m = cfg.model
    kwargs = dict(qk_layernorm=_qk_layernorm(cfg), multi_latent_attention=m.mla is not None)
    if has_te():
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(**kwargs)
    return get_gpt_layer_local_spec(normalization=m.normalization, **kwargs)


def build_model_chunks(cfg: EngineConfig) -> list[GPTModel]:
    """One unwrapped ``GPTModel`` per virtual pipeline stage of this rank (embedding on the first
    stage, output layer on the last). Memory: the parameters (on CPU plus one fp32 copy of the largest
    weight while it is drawn).
    """
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("build_model_chunks: parallel_state is not initialised; call "
                         "mcore_engine.parallel.platform.init_distributed(cfg.parallel, cfg.seed) first")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if (tp, pp) != (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size):
        raise ValueError(f"build_model_chunks: parallel_state has tp={tp}, pp={pp} but cfg.parallel asks "
                         f"tensor_model_parallel_size={cfg.parallel.tensor_model_parallel_size}, "
                         f"pipeline_model_parallel_size={cfg.parallel.pipeline_model_parallel_size}")
    apply_cpu_device_layer()
    config = build_transformer_config(cfg)
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp is not None else None
        spec = _decoder_spec(cfg, config, vp_stage)
        mtp_spec = mtp_block_spec(config, spec, vp_stage, te=has_te())  # None but on the last stage
        model = (GPTModel if mtp_spec is None else MTPGPTModel)(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=cfg.model.max_sequence_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            parallel_output=True,
            share_embeddings_and_output_weights=cfg.model.tie_word_embeddings and cfg.model.head == "lm",
            position_embedding_type="rope",
            rotary_base=cfg.model.rotary_base,
            rope_scaling=cfg.model.rope_scaling_factor is not None,
            rope_scaling_factor=cfg.model.rope_scaling_factor or 8.0,  # 8.0: GPTModel's unused default
            rotary_percent=cfg.model.rotary_percent,
            vp_stage=vp_stage,
            mtp_block_spec=mtp_spec,
        )
        freeze_untrained_mtp(model, cfg.model.mtp_loss_scaling_factor)
        if cfg.model.head == "value" and model.post_process:
            attach_value_head(model, cfg)  # mcore_engine.layers.value_head: replicated Linear(H, 1)
        _cast_params(model, config.params_dtype)
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def _cast_params(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Every floating-point parameter in ``dtype``: the local spec's torch norms ignore
    ``params_dtype`` (fp32 under bf16), and Megatron's optimizers index state through the float16
    params only when all of them are float16 (what ``Float16Module`` would otherwise ensure)."""
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The lm-head weight shard ``[V_local, H]`` of a (last-stage) ``GPTModel``: the tied embedding
    when embeddings are shared, else ``output_layer.weight``.
    """
    gpt = _unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def is_last_stage_chunk(model: torch.nn.Module) -> bool:
    """True for a (wrapped) ``GPTModel`` chunk that holds the output layer."""
    return getattr(_unwrap(model), "output_layer", None) is not None and _unwrap(model).post_process


def apply_output_layer(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The last stage's output layer on hidden states ``[..., H]`` (3-d, e.g. ``[1, n, H]``), also
    while :func:`output_hidden_states` is on: logits ``[..., V_local]`` (the tied embedding when
    shared) or, with a value head, fp32 values ``[..., 1]``. Differentiable as the layer itself.
    Under sequence parallelism ``hidden`` is the gathered (replicated) hidden of
    :func:`output_hidden_states`: the lm-head runs as under plain TP (no sequence gather; its input
    gradient summed over TP); a value head (its weight gradient is summed over TP) refuses."""
    gpt = _unwrap(model)
    layer = gpt.output_layer
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    if not getattr(layer, "sequence_parallel", False):
        return type(layer).forward(layer, hidden, weight=weight)[0]
    if isinstance(layer, ValueHead):
        raise ValueError("apply_output_layer: a value head under sequence_parallel=True needs the "
                         "sequence-sharded hidden states (run the model with its own output layer)")
    layer.sequence_parallel = False
    try:
        return type(layer).forward(layer, hidden, weight=weight)[0]
    finally:
        layer.sequence_parallel = True


def _hidden_passthrough(input_: torch.Tensor, weight: torch.Tensor | None = None,
                        runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
    """The output layer's forward under :func:`output_hidden_states`: ``(hidden, None)``."""
    return input_, None


def _gathered_hidden(input_: torch.Tensor, weight: torch.Tensor | None = None,
                     runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
    """:func:`_hidden_passthrough` under sequence parallelism: ``[s / tp, b, H]`` all-gathered to
    ``[s, b, H]``; backward keeps this rank's slice of the gradient, which its consumers (the fused
    lm-head, :func:`apply_output_layer`) have summed over TP, as under plain TP."""
    return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False), None


def output_hidden_states(model: torch.nn.Module, enable: bool = True) -> None:
    """Make a last-stage ``GPTModel`` return its final hidden states ``[b, s, H]`` instead of logits
    (for ``processor.process_lm_head_hidden`` with :func:`lm_head_weight`); ``enable=False`` restores
    the logits. Parameters and state dict are untouched. Under sequence parallelism the hidden
    states are all-gathered over the sequence (:func:`_gathered_hidden`; memory ``[s, b, H]``).
    """
    gpt = _unwrap(model)
    layer = getattr(gpt, "output_layer", None)
    if layer is None:
        raise ValueError("model must be a GPTModel on the last pipeline stage (it has no output_layer)")
    if not enable:
        layer.__dict__.pop("forward", None)
        return
    layer.forward = _gathered_hidden if getattr(layer, "sequence_parallel", False) else _hidden_passthrough
