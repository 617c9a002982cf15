"""The collectives Megatron-Core's MoE / sequence-parallel code calls in forms gloo does not take.

:func:`apply_gloo_collectives` (CPU only; idempotent) wraps two ``torch.distributed`` functions:

1. ``all_to_all_single`` with tensor / array split sizes: gloo's binding wants lists of ints
   (the alltoall token dispatcher passes tensors).
2. ``all_gather`` into a list of unequal sizes along dim 0 (``gather_from_sequence_parallel_region``
   with ``output_split_sizes``: the MoE dispatcher gathers each TP rank's routed tokens): gloo
   requires equal sizes, so every rank's input is padded to the largest, gathered, and each
   entry copied out of its padded slot. Memory: ``tp x max_rows`` of the input's row size.

Equal sizes and every other call go straight to torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["apply_gloo_collectives"]

_ALL_TO_ALL_SINGLE = dist.all_to_all_single
_ALL_GATHER = dist.all_gather
_APPLIED = False


def _split_sizes(sizes: Any) -> Any:
    """Split sizes as the gloo binding wants them: a list of ints (Megatron passes tensors / arrays)."""
    if sizes is None or isinstance(sizes, list):
        return sizes
    if isinstance(sizes, torch.Tensor):
        return [int(v) for v in sizes.tolist()]
    return [int(v) for v in sizes]


def _all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                       async_op=False):
    return _ALL_TO_ALL_SINGLE(output, input, output_split_sizes=_split_sizes(output_split_sizes),
                              input_split_sizes=_split_sizes(input_split_sizes), group=group,
                              async_op=async_op)


def _all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None, async_op: bool = False):
    """``dist.all_gather`` that also takes entries of unequal sizes along dim 0 (module docstring)."""
    shapes = {tuple(t.shape) for t in tensor_list}
    if len(shapes) <= 1 or any(t.shape[1:] != tensor.shape[1:] for t in tensor_list):
        return _ALL_GATHER(tensor_list, tensor, group=group, async_op=async_op)
    rows = max(t.shape[0] for t in tensor_list)
    padded = tensor.new_zeros((rows, *tensor.shape[1:]))
    padded[: tensor.shape[0]] = tensor
    slots = list(padded.new_empty((len(tensor_list) * rows, *tensor.shape[1:])).split(rows))
    work = _ALL_GATHER(slots, padded, group=group, async_op=async_op)
    if work is not None:
        work.wait()
    for out, slot in zip(tensor_list, slots, strict=True):
        out.copy_(slot[: out.shape[0]])
    return _DoneWork() if async_op else None


class _DoneWork:
    """The handle of an async call that has already completed."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def apply_gloo_collectives() -> None:
    """Install the wrappers above on ``torch.distributed`` (no-op with CUDA; idempotent)."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    dist.all_to_all_single = _all_to_all_single
    dist.all_gather = _all_gather
    _APPLIED = True
