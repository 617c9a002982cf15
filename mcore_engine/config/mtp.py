"""What multi-token prediction (``ModelConfig.mtp_num_layers``) combines with: the layouts and
features Megatron-Core 0.16's MTP supports (TP, SP, PP with the modules on the last stage, VPP, CP,
EP, MoE, the fused lm-head, thd and bshd); ``ValueError`` naming the fields for the rest.

This module does not import ``config`` (``config`` imports it), not even for types."""

from __future__ import annotations

from typing import Any

from mcore_engine.config.checks import _require

__all__ = ["validate_mtp"]


def validate_mtp(cfg: Any) -> None:
    """``ValueError`` for an MTP model this engine cannot build or train; ``cfg`` is an ``EngineConfig``
    whose recompute fields are resolved."""
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers == 0:
        return
    _require(m.head == "lm", f"ModelConfig.mtp_num_layers ({m.mtp_num_layers}) needs ModelConfig.head='lm' "
             f"(the MTP modules share the vocabulary head), got head={m.head!r}: set mtp_num_layers: 0 for a "
             "value model (the checkpoint's MTP tensors are then ignored)")
    _require(not m.tie_word_embeddings or p.pipeline_model_parallel_size == 1,
             "ModelConfig.mtp_num_layers > 0 with ModelConfig.tie_word_embeddings needs "
             "ParallelConfig.pipeline_model_parallel_size == 1, got "
             f"{p.pipeline_model_parallel_size}: Megatron-Core 0.16 keeps an unused output layer on the MTP "
             "stage, whose checkpoint tying fails")
    if m.mtp_loss_scaling_factor == 0:  # the modules never run
        return
    _require(m.lora is None, "ModelConfig.mtp_loss_scaling_factor > 0 with ModelConfig.lora: the MTP modules "
             "are part of the frozen base; set mtp_loss_scaling_factor: 0")
    if cfg.recompute_granularity == "full" and cfg.recompute_method == "uniform":
        _require(cfg.recompute_num_layers == 1 and cfg.data_format == "bshd",
                 "ModelConfig.mtp_loss_scaling_factor > 0 with EngineConfig.recompute_granularity='full', "
                 "recompute_method='uniform' needs recompute_num_layers=1 and "
                 f"EngineConfig.data_format='bshd' (got {cfg.recompute_num_layers} and {cfg.data_format!r}): "
                 "Megatron-Core 0.16 recomputes an MTP module only so (packed-sequence parameters break its "
                 "checkpoint); recompute_method='block' leaves the MTP modules un-recomputed")
