"""Plumbing of the vocab-parallel ops: process group, shard geometry, input checks, chunking (O(N))."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Rows per chunk are chosen so that rows * V_local is about this many elements: a few fp32 chunk
# workspaces then cost tens of MB whatever the vocab size.
DEFAULT_CHUNK_ELEMENTS = 2**21


@dataclass(frozen=True, slots=True)
class Shard:
    """This rank's vocab shard: ``v_local`` columns of which ``v_valid`` are ids ``< vocab_size``."""

    group: dist.ProcessGroup | None
    rank: int
    world: int
    v_local: int
    v_valid: int
    vocab_size: int

    @property
    def offset(self) -> int:
        """Global id of this shard's first column."""
        return self.rank * self.v_local


def resolve_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """``group``; else Megatron-Core's TP group if initialised (never imported); else None."""
    if group is not None:
        return group
    if not (dist.is_available() and dist.is_initialized()):
        return None
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_model_parallel_group()


def make_shard(logits: torch.Tensor, group: dist.ProcessGroup | None, vocab_size: int | None) -> Shard:
    """Check ``logits`` and ``vocab_size`` and describe this rank's shard (``group`` already resolved)."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor [..., V_local], got "
                         f"{type(logits).__name__} {getattr(logits, 'dtype', '')}")
    if logits.dim() < 1 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V_local] with V_local > 0 (empty vocab shard), "
                         f"got {tuple(logits.shape)}")
    if group is None:
        rank, world = 0, 1
    else:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
    v_local = logits.shape[-1]
    v_global = v_local * world
    if vocab_size is None:
        vocab_size = v_global
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not 0 < vocab_size <= v_global:
        raise ValueError(f"vocab_size must be an int in [1, V_local * world = {v_global}], "
                         f"got {vocab_size!r}")
    v_valid = min(max(vocab_size - rank * v_local, 0), v_local)
    return Shard(group=group, rank=rank, world=world, v_local=v_local, v_valid=v_valid,
                 vocab_size=vocab_size)


def check_ids(ids: torch.Tensor, name: str, shape: tuple[int, ...], vocab_size: int) -> None:
    """``ids`` must be an integer tensor of ``shape`` with values in ``[0, vocab_size)``."""
    if not isinstance(ids, torch.Tensor) or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor of global vocab ids, got "
                         f"{type(ids).__name__} {getattr(ids, 'dtype', '')}")
    if tuple(ids.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(ids.shape)}")
    if ids.numel():
        lo, hi = torch.stack(torch.aminmax(ids)).tolist()  # one device sync
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"{name} must hold global vocab ids in [0, {vocab_size}), got values in "
                             f"[{lo}, {hi}]")


def check_chunk_size(chunk_size: int | None, v_local: int,
                     default_elements: int = DEFAULT_CHUNK_ELEMENTS) -> int:
    """Rows per chunk: ``chunk_size`` if a positive int, else about ``default_elements / V_local``."""
    if chunk_size is None:
        return max(1, default_elements // v_local)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int (rows per chunk) or None, got {chunk_size!r}")
    return chunk_size


def check_clamp(log_prob_min_clamp: float | None) -> float | None:
    """``log_prob_min_clamp`` must be None or a finite number; returned as float."""
    if log_prob_min_clamp is None:
        return None
    if isinstance(log_prob_min_clamp, bool) or not isinstance(log_prob_min_clamp, (int, float)) \
            or not math.isfinite(log_prob_min_clamp):
        raise ValueError(f"log_prob_min_clamp must be None or a finite number, got {log_prob_min_clamp!r}")
    return float(log_prob_min_clamp)


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """``x[..., V]`` as ``[N, V]``: a view whenever the leading dims can be merged without a copy."""
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        # Leading dims not mergeable (exotic strides): a copy is unavoidable without a per-dim loop.
        return x.reshape(-1, x.shape[-1])


def all_reduce_(buf: torch.Tensor, op: dist.ReduceOp, shard: Shard) -> torch.Tensor:
    """In-place all-reduce over the shard group; a no-op for a single shard."""
    if shard.world > 1:
        dist.all_reduce(buf, op=op, group=shard.group)
    return buf
