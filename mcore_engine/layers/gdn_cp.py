"""Context-parallel exchange of :class:`~mcore_engine.layers.gated_delta_net.GatedDeltaNet`: token
shards <-> head shards with one all-to-all over the CP group each way.

CP rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of every sequence (Megatron's load-balanced
layout, :func:`mcore_engine.layers.attention.cp_local_index`). The recurrence needs whole sequences,
so the layer trades tokens for heads::

    x [n, b, cp, w]  --tokens_to_heads-->  [T = cp n, b, w]   # all tokens, head group r, global order
    y [T, b, w]      --heads_to_tokens-->  [n, b, cp, w]      # local tokens, every head group

Slot ``j`` of the ``cp`` axis is head group ``j`` (the heads CP rank ``j`` works on). Each direction
moves ``(cp - 1) / cp`` of its input; the reorder is one ``index_select`` (cached index). The
all-to-all is its own adjoint, so its backward is the same exchange of the gradient.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from mcore_engine.layers.attention import cp_local_index

__all__ = ["heads_to_tokens", "tokens_to_heads"]


class _AllToAll(torch.autograd.Function):
    """forward: ``x [cp, ...]``, slot ``j`` sent to CP rank ``j``, slot ``i`` of the result received
    from rank ``i``; backward: the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        out = torch.empty_like(grad)
        dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


@functools.lru_cache(maxsize=16)
def _orders(lengths: tuple[int, ...], cp: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(gathered, order)``: ``gathered[i]`` is the global position of row ``i`` of the ranks' local
    packs concatenated rank by rank; ``order`` its inverse (``rows[order]`` is in global order)."""
    gathered = torch.cat([cp_local_index(lengths, cp, r) for r in range(cp)])
    order = torch.empty_like(gathered)
    order[gathered] = torch.arange(gathered.numel())
    return gathered.to(device), order.to(device)


def tokens_to_heads(x: Tensor, lengths: list[int], group: dist.ProcessGroup) -> Tensor:
    """``x [n, b, cp, w]`` (local tokens, head groups) -> ``[cp n, b, w]``: every token of the global
    pack (``lengths``: its padded sequence lengths, or ``[S]`` for bshd rows) in global order, this
    rank's head group only. Autograd: the backward is :func:`heads_to_tokens` of the gradient."""
    n, b, cp, w = x.shape
    y = _AllToAll.apply(x.permute(2, 0, 1, 3), group)  # [cp (source rank), n, b, w]
    _, order = _orders(tuple(lengths), cp, x.device)
    return y.reshape(cp * n, b, w).index_select(0, order)


def heads_to_tokens(y: Tensor, lengths: list[int], group: dist.ProcessGroup, cp: int) -> Tensor:
    """``y [T, b, w]`` (global order, this rank's head group) -> ``[T / cp, b, cp, w]``: the local
    tokens of every head group. The inverse of :func:`tokens_to_heads`."""
    t, b, w = y.shape
    gathered, _ = _orders(tuple(lengths), cp, y.device)
    y = y.index_select(0, gathered).reshape(cp, t // cp, b, w)  # slot j: rank j's tokens
    return _AllToAll.apply(y, group).permute(1, 2, 0, 3)  # [n, b, cp (head group), w]
