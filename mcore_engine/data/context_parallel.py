"""Context parallelism on the data side: one CP rank's share of a packed micro-batch, and the
per-token outputs put back together.

Every sequence (thd) or row (bshd) of the packed micro-batch is padded to a multiple of ``2 cp``
(``2 cp tp`` under sequence parallelism) and cut into ``2 cp`` chunks; rank ``r`` keeps chunks
``r`` and ``2 cp - 1 - r`` (:func:`~mcore_engine.layers.attention.cp_local_index`, the load-balanced
layout of Megatron-Core and Transformer Engine)::

    slots[r]     = global flat slots of rank r's tokens                  # [cp, n_local]
    local        = packed.reshape(-1, *tail)[slots[r]]                   # split_inputs
    out.reshape(-1, *tail)[slots.flatten()] = all_gather(local_outputs)  # gather_tokens

Everything per token is cut AFTER packing with the same index: next-token labels and the loss mask
were shifted on the whole sequence, teacher top-k and per-token temperature follow their tokens.
``packed_seq_params`` keeps the GLOBAL padded ``cu_seqlens`` (what RoPE and the attention read).
The gathered outputs feed the loss function exactly as at CP = 1 (global counts, global layout); the
gather's backward hands each rank the gradient of its own tokens only, so the DP x CP gradient sum
counts every token once. Memory: O(T / cp) per cut field; the gathered outputs O(T).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.data.packing import ModelInputs
from mcore_engine.layers.attention import cp_local_index

__all__ = ["ContextParallelSplit", "context_parallel_split", "gather_tokens", "split_inputs"]


@dataclass(frozen=True)
class ContextParallelSplit:
    """Where each CP rank's tokens sit in one packed micro-batch."""

    size: int
    rank: int
    group: Any
    slots: torch.Tensor
    """int64 ``[cp, n_local]``: the global flat slots (in ``input_ids.reshape(-1)``) of every rank's
    local tokens, in local order."""
    local_shape: tuple[int, int]
    """``[1, T / cp]`` (thd) or ``[b, S / cp]`` (bshd)."""


def context_parallel_split(inputs: ModelInputs, size: int, rank: int, group: Any) -> ContextParallelSplit:
    """The split of ``inputs`` (packed with every sequence / row a multiple of ``2 size`` long)."""
    rows, cols = inputs.input_ids.shape
    if inputs.data_format == "thd":
        lengths = inputs.cu_seqlens_padded.diff().tolist()
        slots = torch.stack([cp_local_index(lengths, size, r) for r in range(size)])
    else:
        base = torch.arange(rows)[:, None] * cols
        slots = torch.stack([(base + cp_local_index([cols], size, r)[None]).reshape(-1) for r in range(size)])
    return ContextParallelSplit(size=size, rank=rank, group=group, slots=slots.to(inputs.input_ids.device),
                                local_shape=(rows, cols // size))


def _take(t: torch.Tensor | None, split: ContextParallelSplit) -> torch.Tensor | None:
    if t is None:
        return None
    flat = t.reshape(-1, *t.shape[2:])
    return flat.index_select(0, split.slots[split.rank]).reshape(*split.local_shape, *t.shape[2:])


def split_inputs(inputs: ModelInputs, split: ContextParallelSplit) -> ModelInputs:
    """This rank's model inputs: ids, positions, labels, loss mask, per-token temperature and teacher
    top-k cut to ``split.local_shape``; ``packed_seq_params`` global; no attention mask (the CP
    attention masks causally by global position). The unpacking fields (``token_index``, ...) stay
    the global pack's: unpack gathered outputs with the full inputs."""
    temperature = inputs.temperature
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 2:
        temperature = _take(temperature, split)
    return dataclasses.replace(
        inputs, input_ids=_take(inputs.input_ids, split), position_ids=_take(inputs.position_ids, split),
        labels=_take(inputs.labels, split), loss_mask=_take(inputs.loss_mask, split), attention_mask=None,
        temperature=temperature, teacher_ids=_take(inputs.teacher_ids, split),
        teacher_logprobs=_take(inputs.teacher_logprobs, split))


class _GatherTokens(torch.autograd.Function):
    """forward: all-gather every rank's ``[n_local, *tail]`` into the global slot order; backward:
    this rank's slots of the gradient (no communication: each rank owns its tokens' gradient)."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, split: ContextParallelSplit) -> torch.Tensor:
        ctx.split = split
        ctx.tail = local.shape[2:]
        return _gather(local, split)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _take(grad, ctx.split), None


def _gather(local: torch.Tensor, split: ContextParallelSplit) -> torch.Tensor:
    tail = local.shape[2:]
    flat = local.detach().reshape(-1, *tail).contiguous()
    gathered = flat.new_empty((split.size * flat.shape[0], *tail))
    dist.all_gather_into_tensor(gathered, flat, group=split.group)
    rows, cols = split.local_shape
    out = flat.new_empty((rows * cols * split.size, *tail))
    out[split.slots.reshape(-1)] = gathered
    return out.reshape(rows, cols * split.size, *tail)


def gather_tokens(local: torch.Tensor, split: ContextParallelSplit) -> torch.Tensor:
    """Per-token ``local [*split.local_shape, *tail]`` of every CP rank -> the global pack's layout
    ``[rows, cols * cp, *tail]``. Differentiable (floating dtypes): the backward keeps this rank's
    tokens of the gradient. One all-gather."""
    if local.shape[:2] != split.local_shape:
        raise ValueError(f"gather_tokens: local must have shape {split.local_shape} (+ trailing dims), "
                         f"got {tuple(local.shape)}")
    if local.requires_grad:
        return _GatherTokens.apply(local, split)
    return _gather(local, split)
