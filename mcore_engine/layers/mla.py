"""Megatron-Core's multi-latent attention (``MLASelfAttention``) made exact under tensor parallelism on
the local layer spec, and its latent norms.

On the local spec the down projections are ``ColumnParallelLinear``: each TP rank computes a column
slice of ``[c_q]`` and of ``[c_kv | k_pe]`` (``kv_lora_rank + qk_pos_emb_head_dim`` wide) and MLA
all-gathers them (``gather_from_tensor_model_parallel_region``, backward: keep this rank's columns).
Megatron-Core 0.16 - 0.19 get two TP > 1 gradients wrong there:

1. ``k_pe`` is one key per token shared by every head, but each rank feeds it to its own heads only,
   so the gathered tensor's ``k_pe`` gradient holds this rank's heads' part; the split keeps it for
   the owning rank's columns and drops the rest. :class:`MLASelfAttention` sums that gradient over TP
   before the split (all-reduce of ``[s, b, qk_pos_emb_head_dim]`` per layer; the ``c_kv`` columns are
   already whole: ``linear_kv_up_proj``'s input gradient is reduced).
2. ``finalize_model_grads`` sums the gradient of every parameter named ``*q_layernorm*`` over TP
   (meant for per-head QK-norms); MLA's query latent norm sees the gathered latent on every rank
   (without sequence parallelism), so that sum is ``tp`` x the gradient. :class:`LatentNorm` marks its
   weight ``average_gradients_across_tp_domain`` (an average of equal gradients) unless sequence
   parallelism makes the gradient a partial sum (then it is summed, as Megatron does).

Transformer Engine's spec replicates the down projections (no gather) and fuses the latent norms into
the up projections: nothing here applies to it.
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
