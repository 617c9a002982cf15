"""Reshardable checkpoints of a Gated DeltaNet layer's block-laid-out tensors.

``in_proj_qkv.weight`` and ``conv1d.weight`` hold on TP rank ``r`` the rows ``[q_r; k_r; v_r]``: not
one contiguous slice of the full tensor, so Megatron's default "rows split over TP" description would
put rank 1's q rows where the full tensor's k rows are, and a checkpoint written at TP=2 would load
wrong at TP=1. :func:`split_blocks` describes each block as its own sharded tensor
(``<key>.q``, ``<key>.k``, ``<key>.v``; each one rows-split over TP), so any TP cut loads it; the
optimizer's states go through the same factory. No copies: the blocks are views.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

__all__ = ["split_blocks"]


def split_blocks(sharded: ShardedTensor, sections: Sequence[int], names: Sequence[str],
                 dim: int = 0) -> ShardedTensorFactory:
    """A factory that saves ``sharded`` (this rank's ``[b_0; b_1; ...]`` along ``dim``, block ``i`` of
    ``sections[i]`` rows, each block TP-split like the whole) as one sharded tensor per block, keyed
    ``<key>.<names[i]>``, and concatenates them again on load."""
    if sum(sections) != sharded.local_shape[dim]:
        raise ValueError(f"sections: {list(sections)} must add up to the local size "
                         f"{sharded.local_shape[dim]} of {sharded.key!r} along dim {dim}")
    template = sharded.without_data()

    @torch.no_grad()
    def build(key: str, data: torch.Tensor, replica_id, flattened_range) -> list[ShardedTensor]:
        if flattened_range is not None:
            raise ValueError(f"{key}: a flattened (distributed-optimizer bucket) view cannot be split into "
                             "blocks; save the model-space optimizer state")
        whole = replace(template, key=key, data=data, dtype=data.dtype, replica_id=replica_id)
        out, start = [], 0
        for size, name in zip(sections, names, strict=True):
            for part in whole.narrow(dim, start, size):
                part.key = f"{key}.{name}"
                out.append(part)
            start += size
        return out

    @torch.no_grad()
    def merge(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts, dim=dim)

    return ShardedTensorFactory(sharded.key, sharded.data, build, merge, sharded.replica_id)
