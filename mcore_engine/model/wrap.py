"""Model wrapping: the built ``GPTModel`` chunks -> the chunks the schedule and the optimizer see.

Training: one Megatron ``DistributedDataParallel`` per chunk (fp32 grad buffers, bucketing on the
first only), parameters broadcast from each data-parallel group's first rank. ``forward_only``: a
:class:`ForwardOnlyChunk` per chunk (no grad buffers: memory is the parameters), the same
broadcast done by hand. Every chunk's config gets per-token loss (no ``1 / num_microbatches``, no
DP averaging) and the grad finaliser below; ``fused_lm_head`` makes the last stage return hidden
states.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)

from mcore_engine.config import EngineConfig
from mcore_engine.layers.lora import sum_partial_adapter_grads
from mcore_engine.model.build import output_hidden_states

__all__ = ["ForwardOnlyChunk", "broadcast_params", "wrap_model"]


def _finalize_grads_without_token_rescale(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """``finalize_model_grads`` with ``num_tokens=None`` (the loss is already globally normalised),
    then the TP sum of LoRA's partial adapter gradients."""
    finalize_model_grads(model, None, pg_collection=pg_collection, force_all_reduce=force_all_reduce)
    sum_partial_adapter_grads(model)


class ForwardOnlyChunk(torch.nn.Module):
    """A ``forward_only`` model chunk: the ``GPTModel`` as ``.module``, as under DDP, without grad
    buffers or gradient hooks."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def broadcast_params(chunks: list[torch.nn.Module]) -> None:
    """DDP's ``broadcast_params`` without DDP: every parameter from the first rank of its
    data-parallel group (the expert data-parallel group for expert parameters)."""
    for chunk in chunks:
        for param in chunk.parameters():
            if getattr(param, "allreduce", True):
                group = parallel_state.get_data_parallel_group(with_context_parallel=True)
            else:
                group = parallel_state.get_expert_data_parallel_group()
            if dist.get_world_size(group) > 1:
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)


def wrap_model(chunks: list[torch.nn.Module], cfg: EngineConfig) -> list[torch.nn.Module]:
    """The wrapped chunks (module docstring); collective over the data-parallel groups."""
    par = cfg.parallel
    interleaved = (par.virtual_pipeline_model_parallel_size or 1) > 1
    for chunk in chunks:
        tcfg = chunk.config
        tcfg.calculate_per_token_loss = True
        tcfg.finalize_model_grads_func = _finalize_grads_without_token_rescale
        # 1F1B exchanges each micro-batch's shape; the interleaved schedule gets equally shaped
        # micro-batches instead (StepLayout.common_shape)
        tcfg.variable_seq_lengths = par.pipeline_model_parallel_size > 1 and not interleaved
    if cfg.forward_only:  # parameters keep requires_grad: Megatron's frozen-weight matmul differs
        broadcast_params(chunks)
        wrapped = [ForwardOnlyChunk(chunk) for chunk in chunks]
    else:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False,
            use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer)
        wrapped = [DistributedDataParallel(config=chunk.config, ddp_config=ddp_config, module=chunk,
                                           disable_bucketing=i > 0)
                   for i, chunk in enumerate(chunks)]
        for chunk in wrapped:
            chunk.broadcast_params()
        no_sync = [chunk.no_sync for chunk in wrapped]
        for chunk in chunks:
            chunk.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
    if cfg.model.fused_lm_head:  # the last stage returns hidden states (step/lm_head.py)
        for chunk in chunks:
            if getattr(chunk, "post_process", False):
                output_hidden_states(chunk)
    return wrapped
