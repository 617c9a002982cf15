"""Step metrics of the recipes: the engine's metrics as global floats, and the peak memory."""

from __future__ import annotations

import torch
import torch.distributed as dist
from tensordict import TensorDict

__all__ = ["global_metrics", "peak_memory_gib"]

_GIB = float(2**30)


def global_metrics(out: TensorDict, dp_group: dist.ProcessGroup | None) -> dict[str, float]:
    """Engine metrics -> floats summed over micro-batches and DP (one all-reduce; scalars pass through),
    broadcast from the last pipeline stage first."""
    from megatron.core import parallel_state

    metrics = out.get_non_tensor("metrics")
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        holder = [metrics]
        dist.broadcast_object_list(holder, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        metrics = holder[0]
    summed = {k: sum(v) for k, v in metrics.items() if isinstance(v, list)}
    keys = sorted(summed)
    if keys and dp_group is not None and dist.get_world_size(dp_group) > 1:
        packed = torch.tensor([summed[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(packed, group=dp_group)
        summed = dict(zip(keys, packed.tolist(), strict=True))
    scalars = {k: float(v) for k, v in metrics.items() if not isinstance(v, list)}
    return {**summed, **scalars}


def peak_memory_gib() -> float:
    """This process's peak device memory (CPU: peak RSS) in GiB."""
    from mcore_engine.parallel.platform import get_device

    return get_device().max_memory_allocated() / _GIB
