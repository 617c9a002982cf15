"""Megatron-Core's ``TransformerConfig`` from an :class:`~mcore_engine.config.EngineConfig`, with
the MoE and multi-latent attention arguments and the router-loss coefficients per Megatron version."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_config import MLATransformerConfig

from mcore_engine.config import EngineConfig
from mcore_engine.model.spec import has_te, qk_layernorm
from mcore_engine.parallel.compat import apply_mla_compat, apply_moe_compat, mcore_version

__all__ = ["build_transformer_config", "quick_gelu"]


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(1.702 x)`` (gpt-oss's GLU gate activation), eager. Megatron-Core's ``quick_gelu``
    is ``torch.compile``'d: on CPU it compiles on the first call (~4 s per process) and again for new
    sequence lengths, and its C++ build fails under ``ATEN_CPU_CAPABILITY=default``; its fused GLU
    kernels (``bias_activation_fusion``) are not used here."""
    return x * torch.sigmoid(1.702 * x)


def build_transformer_config(cfg: EngineConfig) -> TransformerConfig:
    """Megatron-Core ``TransformerConfig`` for ``cfg`` (no dropout; biases, attention sinks, windows,
    the gated MLP's activation and YaRN as ``model`` says; the recompute fields; a hybrid decoder's
    checkpoint keyed per layer); an ``MLATransformerConfig`` with ``model.mla`` (its latent norms are
    the config's ``qk_layernorm``).
    """
    m, p = cfg.model, cfg.parallel
    on_gpu = torch.cuda.is_available()
    if "layernorm" in (cfg.recompute_modules or ()) and not has_te():
        raise ValueError("EngineConfig.recompute_modules 'layernorm' needs Transformer Engine (GPU): "
                         "Megatron's norm recompute reads its FP8 state; use 'core_attn' / 'mlp'")
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    config_cls = TransformerConfig if m.mla is None else MLATransformerConfig
    config = config_cls(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.kv_channels,  # None: hidden // heads
        ffn_hidden_size=m.ffn_size,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.swiglu,
        activation_func=(quick_gelu if m.glu_activation == "quick_gelu" else F.silu) if m.swiglu else F.gelu,
        glu_linear_offset=m.glu_linear_offset,
        activation_func_clamp_value=m.glu_clamp,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias or m.add_bias_linear,
        softmax_type="learnable" if m.attention_sinks else "vanilla",
        window_size=None if m.sliding_window is None else (m.sliding_window - 1, 0),
        window_attn_skip_freq=m.sliding_window_pattern,
        qk_layernorm=qk_layernorm(cfg),
        attention_output_gate=m.attention_output_gate,
        layernorm_zero_centered_gamma=m.zero_centered_norm,
        # a hybrid block's layers differ (GDN / attention): dist checkpoints key them per layer
        # (decoder.layers.{i}.*), as Megatron does for its own linear_attention_freq
        hetereogenous_dist_checkpoint=m.linear_attention is not None,
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
    _set_yarn(config, cfg)
    return config


def _set_yarn(config: TransformerConfig, cfg: EngineConfig) -> None:
    """``model.yarn`` as the ``yarn_*`` attributes that Megatron-Core's ``GPTModel`` (the rotary
    table) and attention (the cos / sin scale) read from the config; ``TransformerConfig`` has no
    such fields (0.16 - 0.19)."""
    yarn = cfg.model.yarn
    if yarn is None:
        return
    config.yarn_rotary_scaling_factor = yarn.factor
    config.yarn_original_max_position_embeddings = yarn.original_max_position_embeddings
    config.yarn_beta_fast = yarn.beta_fast
    config.yarn_beta_slow = yarn.beta_slow
    config.yarn_mscale = yarn.mscale
    config.yarn_mscale_all_dim = yarn.mscale_all_dim
    config.yarn_correction_range_round_to_int = yarn.truncate


def _moe_config_kwargs(cfg: EngineConfig) -> dict:
    """``TransformerConfig`` MoE arguments for ``cfg.model.moe``. Routing replay is always built
    (idle until :mod:`mcore_engine.model.moe` arms it); routing follows the checkpoints
    (``apply_moe_compat``). The expert bias is a router buffer, updated by
    :mod:`mcore_engine.model.moe` after an applied optimizer step, not by ``finalize_model_grads``."""
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
    """The router's z-loss coefficient. Megatron-Core 0.16 - 0.18 divides it by TP x CP and weights
    the loss by the rank's routed tokens, which makes the z term ``1 / (tp cp)`` of the one-rank
    objective when the tokens are split: ``coeff * tp * cp`` there. From 0.19: ``coeff`` as it is."""
    coeff = cfg.model.moe.z_loss_coeff
    if coeff is None or mcore_version() >= (0, 19):
        return coeff
    return coeff * _token_split(cfg)


def _aux_loss_coeff(cfg: EngineConfig) -> float:
    """The load-balancing loss coefficient. From Megatron-Core 0.19 the router weights that loss by
    the routed tokens times TP x CP (0.16 - 0.18: the routed tokens only, which the engine's ``1 / N``
    step scale expects): ``coeff / (tp cp)`` there, the tokens split as in :func:`_z_loss_coeff`."""
    coeff = cfg.model.moe.aux_loss_coeff
    return coeff / _token_split(cfg) if mcore_version() >= (0, 19) else coeff


def _has_grouped_gemm() -> bool:
    try:
        import grouped_gemm  # noqa: F401
    except Exception:
        return False
    return True
