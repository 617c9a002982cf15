"""Loss aggregation over tokens and sequences, normalised by global counts.

One micro-batch's contribution, summing to the global loss over micro-batches and DP ranks. With
``m = loss_mask``, ``N = ctx.global_num_tokens``, ``B = ctx.global_num_seqs``::

    "token-mean":          (v * m).sum() / N
    "seq-mean-token-sum":  (v * m).sum() / B
    "seq-mean-token-mean": sum_j (v * m)[seq == j].sum() / m[seq == j].sum() / B   # 0/0 -> 0

Masked slots give exact zeros (value and gradient) even when not finite; no host sync.
"""

from __future__ import annotations

from typing import Literal

import torch

from mcore_engine.losses.context import LossContext

AggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
AGG_MODES: tuple[str, ...] = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")


def _check(values: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor | None, mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {mode!r}")
    if not values.is_floating_point():
        raise ValueError(f"values must be a floating tensor, got dtype {values.dtype}")
    if loss_mask.shape != values.shape:
        raise ValueError(f"loss_mask must have the shape of values {tuple(values.shape)}, "
                         f"got {tuple(loss_mask.shape)}")
    if mode == "seq-mean-token-mean":
        if seq_ids is None:
            raise ValueError("seq_ids is required for loss_agg_mode='seq-mean-token-mean'")
        if seq_ids.shape != values.shape or seq_ids.is_floating_point() or seq_ids.is_complex():
            raise ValueError(f"seq_ids must be an integer tensor of shape {tuple(values.shape)}, "
                             f"got {seq_ids.dtype} {tuple(seq_ids.shape)}")


def tokens_per_sequence(loss_mask: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
    """``[T]`` loss-token count of each token's sequence, ``m[seq == seq[t]].sum()``; sync-free."""
    mask = loss_mask.reshape(-1)
    mask = mask if mask.is_floating_point() else mask.float()
    ids = seq_ids.reshape(-1)
    if ids.numel() == 0:
        return mask.new_zeros(loss_mask.shape)
    sorted_ids, order = torch.sort(ids, stable=True)
    run = torch.zeros_like(sorted_ids)
    run[1:] = torch.cumsum(sorted_ids[1:] != sorted_ids[:-1], dim=0)
    dense = torch.empty_like(run).scatter_(0, order, run)        # dense sequence index per token
    counts = mask.new_zeros(ids.numel()).index_add_(0, dense, mask)
    return counts[dense].reshape(loss_mask.shape)


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``values * mask`` with exact zeros where ``mask == 0`` (non-finite padding never leaks)."""
    return torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype, device=values.device))


def agg_loss(values: torch.Tensor, loss_mask: torch.Tensor, seq_ids: torch.Tensor | None, mode: str,
             ctx: LossContext) -> torch.Tensor:
    """The module docstring's formula; ``values``, ``loss_mask``, ``seq_ids`` share one shape -> 0-d."""
    _check(values, loss_mask, seq_ids, mode)
    acc = torch.promote_types(values.dtype, torch.float32)
    mask = loss_mask.to(acc)
    masked = _masked(values.to(acc), mask)
    if mode == "token-mean":
        total = masked.sum() / ctx.global_num_tokens.to(acc)
    elif mode == "seq-mean-token-sum":
        total = masked.sum() / ctx.global_num_seqs.to(acc)
    else:
        counts = tokens_per_sequence(mask, seq_ids)
        counts = torch.where(counts > 0, counts, torch.ones((), dtype=acc, device=counts.device))  # 0/0 -> 0
        total = (masked / counts).sum() / ctx.global_num_seqs.to(acc)
    return total.to(values.dtype)


def token_mean_metric(values: torch.Tensor, loss_mask: torch.Tensor, ctx: LossContext) -> torch.Tensor:
    """Detached float32 ``(values * m).sum() / N``: a metric contribution that sums to the global mean."""
    values = values.detach().float()
    return _masked(values, loss_mask.to(values.dtype)).sum() / ctx.global_num_tokens.float()


def constants_like(ref: torch.Tensor, ref_name: str, **tensors: torch.Tensor) -> list[torch.Tensor]:
    """``tensors`` detached and cast to ``ref.dtype`` (loss inputs that get no gradient); ValueError
    naming the first whose shape is not ``ref``'s."""
    for name, t in tensors.items():
        if t.shape != ref.shape:
            raise ValueError(f"{name} must have the shape of {ref_name} {tuple(ref.shape)}, "
                             f"got {tuple(t.shape)}")
    return [t.detach().to(ref.dtype) for t in tensors.values()]
