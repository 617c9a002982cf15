"""Split a batch into micro-batches (by count or by token budget) and put outputs back in order.

Both modes return ``(micro_batches, order)``, ``order[i]`` the batch index of the i-th concatenated
sample: ``restored = concatenated[torch.argsort(torch.tensor(order))]``. Micro-batches are
``batch[idx]`` (one copy of each selected tensor; the input is never modified).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from tensordict import TensorDictBase

from mcore_engine.data.flags import StepFlags
from mcore_engine.data.layout import is_jagged, sequence_lengths

__all__ = ["balanced_partition", "merge_micro_batches", "restore_order", "split_micro_batches"]


def balanced_partition(lengths: Sequence[int], budget: int, *, min_parts: int = 1) -> list[list[int]]:
    """Indices of ``lengths`` in the fewest groups (>= ``min_parts``) of sum <= ``budget``: for
    ``k = max(min_parts, ceil(sum / budget)), k + 1, ...`` place indices longest first into the
    lightest group; stop at the first ``k`` where all fit. Groups sorted, ordered by first index.
    A length over ``budget`` raises ``ValueError`` naming ``max_token_len_per_gpu``."""
    n = len(lengths)
    if budget <= 0:
        raise ValueError(f"max_token_len_per_gpu must be a positive int, got {budget}")
    too_long = [i for i, length in enumerate(lengths) if length > budget]
    if too_long:
        raise ValueError(f"max_token_len_per_gpu={budget} is smaller than sequence {too_long[0]} of "
                         f"{lengths[too_long[0]]} tokens")
    if min_parts > n:
        raise ValueError(f"min_num_micro_batches={min_parts} exceeds the {n} sequences of the batch")
    by_length = sorted(range(n), key=lambda i: (-lengths[i], i))
    k = max(min_parts, math.ceil(sum(lengths) / budget), 1)
    while True:
        loads, groups = [0] * k, [[] for _ in range(k)]
        for i in by_length:
            g = min(range(k), key=lambda j: (loads[j], j))
            if loads[g] + lengths[i] > budget:
                break
            loads[g] += lengths[i]
            groups[g].append(i)
        else:
            groups = [sorted(g) for g in groups if g]
            return sorted(groups, key=lambda g: g[0])
        k += 1


def split_micro_batches(batch: TensorDictBase, flags: StepFlags, *, default_micro_batch_size: int,
                        min_num_micro_batches: int = 1, pad_multiple: int = 1,
                        num_micro_batches: int | None = None) -> tuple[list[TensorDictBase], list[int]]:
    """Split ``batch [B]`` into micro-batches and ``order``. By count: ``micro_batch_size_per_gpu`` (or
    ``default_micro_batch_size``) consecutive sequences each. By token budget (``use_dynamic_bsz``,
    :func:`balanced_partition`): at most ``max_token_len_per_gpu`` tokens each, lengths rounded up to
    packing's ``pad_multiple``, at least ``min_num_micro_batches``. ``num_micro_batches``: exactly that
    many instead (by count: consecutive runs whose sizes differ by at most one; by budget: balanced;
    ``ValueError`` when the batch cannot give them). Non-tensor entries go with each."""
    size = batch.batch_size[0]
    if num_micro_batches is not None:
        if num_micro_batches > size:
            raise ValueError(f"num_micro_batches: {num_micro_batches} micro-batches (another data-parallel "
                             f"rank's count) from this rank's {size} sequences; give the ranks batches that "
                             "split alike (micro_batch_size_per_gpu / max_token_len_per_gpu)")
        if not flags.use_dynamic_bsz:
            bounds = [size * i // num_micro_batches for i in range(num_micro_batches + 1)]
            groups = [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
            order = [i for g in groups for i in g]
            return [batch[torch.tensor(g, dtype=torch.int64)] for g in groups], order
        min_num_micro_batches = num_micro_batches
    if flags.use_dynamic_bsz:
        if not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise ValueError(f"pad_multiple must be a positive int, got {pad_multiple!r}")
        lengths = (-(-sequence_lengths(batch) // pad_multiple) * pad_multiple).tolist()
        groups = balanced_partition(lengths, flags.max_token_len_per_gpu, min_parts=min_num_micro_batches)
        if num_micro_batches is not None and len(groups) != num_micro_batches:
            raise ValueError(f"num_micro_batches: max_token_len_per_gpu={flags.max_token_len_per_gpu} splits "
                             f"this rank's batch into {len(groups)} micro-batches, another data-parallel "
                             f"rank's into {num_micro_batches}")
    else:
        mbs = flags.micro_batch_size_per_gpu or default_micro_batch_size
        if not isinstance(mbs, int) or mbs <= 0:
            raise ValueError(f"micro_batch_size_per_gpu must be a positive int, got {mbs!r}")
        groups = [list(range(start, min(start + mbs, size))) for start in range(0, size, mbs)]
    order = [i for g in groups for i in g]
    micro_batches = [batch[torch.tensor(g, dtype=torch.int64)] for g in groups]
    return micro_batches, order


def restore_order(items: Sequence, order: Sequence[int]) -> list:
    """Put per-sample ``items`` (listed in micro-batch order) back in the batch's original order."""
    if sorted(order) != list(range(len(items))):
        raise ValueError(f"order must be a permutation of range({len(items)}), got {list(order)}")
    restored = [None] * len(items)
    for item, index in zip(items, order, strict=True):
        restored[index] = item
    return restored


def merge_micro_batches(outputs: Sequence[torch.Tensor], order: Sequence[int]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (jagged ``[b, j, ...]`` or dense ``[b, ...]``) into
    ``[B, ...]`` in the original sample order. Differentiable; one copy of the outputs."""
    if not outputs:
        raise ValueError("outputs must hold at least one micro-batch output")
    inverse = torch.argsort(torch.tensor(list(order), dtype=torch.int64))
    if is_jagged(outputs[0]):
        rows = restore_order([row for out in outputs for row in out.unbind()], order)
        lengths = torch.tensor([0] + [row.shape[0] for row in rows], dtype=torch.int64)
        offsets = lengths.cumsum(0).to(rows[0].device)
        return torch.nested.nested_tensor_from_jagged(torch.cat(rows), offsets=offsets)
    merged = torch.cat(list(outputs), dim=0)
    if merged.shape[0] != len(order):
        raise ValueError(f"outputs hold {merged.shape[0]} samples, order has {len(order)}")
    return merged[inverse.to(merged.device)]
