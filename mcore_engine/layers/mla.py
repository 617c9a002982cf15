"""Megatron-Core's multi-latent attention (``MLASelfAttention``) made exact under tensor parallelism on
the local layer spec, and its latent norms.

On the local spec each TP rank computes a column slice of the down projections' ``[c_q]`` and
``[c_kv | k_pe]`` (``kv_lora_rank + qk_pos_emb_head_dim`` wide) and MLA all-gathers them (backward:
keep this rank's columns). Two TP > 1 gradients are fixed here (wrong in Megatron-Core 0.16 - 0.19):

1. ``k_pe``, one key per token shared by every head, gets a gradient from this rank's heads only:
   :class:`MLASelfAttention` sums it over TP before the split (an all-reduce of
   ``[s, b, qk_pos_emb_head_dim]`` per layer; the ``c_kv`` columns are already whole).
2. ``finalize_model_grads`` sums every ``*q_layernorm*`` gradient over TP; the query latent norm sees
   the whole latent on every rank, so that is ``tp`` x its gradient. :class:`LatentNorm` averages it
   instead (summed under sequence parallelism, where it is a partial sum).

Transformer Engine's spec replicates the down projections and fuses the latent norms: nothing here
applies to it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.transformer import multi_latent_attention as megatron_mla
from megatron.core.transformer.transformer_config import TransformerConfig

from mcore_engine.layers.norm import TorchNorm

__all__ = ["LATENT_NORM_EPS", "LatentNorm", "MLASelfAttention"]

LATENT_NORM_EPS = 1e-6
"""Epsilon of the q / kv latent RMSNorms (DeepSeek-V3's reference code and ``transformers`` fix it)."""


class LatentNorm:
    """MLA's q / kv latent RMSNorm on the local spec: :class:`~mcore_engine.layers.norm.TorchNorm` at
    :data:`LATENT_NORM_EPS` (DeepSeek's fixed epsilon; Megatron passes the
    layers' ``layernorm_epsilon``), its gradient averaged, not summed, over TP (module docstring, 2.)."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = LATENT_NORM_EPS,
                **kwargs: Any) -> torch.nn.Module:
        norm = TorchNorm(config, hidden_size, eps=LATENT_NORM_EPS, **kwargs)
        for param in norm.parameters():
            param.average_gradients_across_tp_domain = not config.sequence_parallel
        return norm


class _SumTailGradOverTP(torch.autograd.Function):
    """forward: identity; backward: the last ``width`` channels of the gradient summed over ``group``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, width: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.width, ctx.group = width, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.clone()
        tail = grad[..., -ctx.width:].contiguous()
        dist.all_reduce(tail, group=ctx.group)
        grad[..., -ctx.width:] = tail
        return grad, None, None


class MLASelfAttention(megatron_mla.MLASelfAttention):
    """Megatron-Core's ``MLASelfAttention`` whose gathered ``[c_kv | k_pe]`` gets the whole ``k_pe``
    gradient under TP (module docstring, 1.); otherwise unchanged (same parameters and state dict).
    With ``config.qk_layernorm`` off (the local spec without q LoRA: ``mcore_engine.model.spec``) it builds
    its kv latent :class:`LatentNorm` itself."""

    def __init__(self, config: TransformerConfig, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        if not config.qk_layernorm:
            self.kv_layernorm = LatentNorm(config=config, hidden_size=config.kv_lora_rank)

    def get_query_key_value_tensors(self, *args: Any, **kwargs: Any):
        if self.tp_group is None or self.tp_group.size() == 1:
            return super().get_query_key_value_tensors(*args, **kwargs)
        with self._kv_gather_sums_rope_grad():
            return super().get_query_key_value_tensors(*args, **kwargs)

    @contextlib.contextmanager
    def _kv_gather_sums_rope_grad(self) -> Iterator[None]:
        """Rebind Megatron's MLA module's TP all-gather for one call: its call on the kv latent (the
        second, after the query latent's, with ``q_lora_rank``; else the first) gets
        :class:`_SumTailGradOverTP`."""
        cfg, original = self.config, megatron_mla.gather_from_tensor_model_parallel_region
        kv_call, calls = (0 if cfg.q_lora_rank is None else 1), []
        width = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim

        def gather(input_: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
            out = original(input_, group)
            calls.append(out.size(-1))
            if len(calls) - 1 == kv_call:
                if out.size(-1) != width:
                    raise RuntimeError(f"MLASelfAttention: expected the kv latent gather to give {width} "
                                       f"channels, got {out.size(-1)} (Megatron-Core's MLA changed)")
                out = _SumTailGradOverTP.apply(out, cfg.qk_pos_emb_head_dim, group or self.tp_group)
            return out

        megatron_mla.gather_from_tensor_model_parallel_region = gather
        try:
            yield
        finally:
            megatron_mla.gather_from_tensor_model_parallel_region = original
