"""Vocab-parallel sum of squared probabilities (a thin wrapper over the fused pass)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_engine.ops.fused import vocab_parallel_logits_outputs
from mcore_engine.ops.temperature import Temperature


def vocab_parallel_sum_pi_squared(logits: torch.Tensor, *, temperature: Temperature = 1.0,
                                  group: dist.ProcessGroup | None = None, chunk_size: int | None = None,
                                  vocab_size: int | None = None) -> torch.Tensor:
    """``(z.softmax(-1) ** 2).sum(-1)``, ``z = logits / temperature``: logits ``[..., V_local]`` -> fp32
    ``[...]``; gradient ``2 p (p - sum p^2)``; saves the logits and O(N) fp32."""
    return vocab_parallel_logits_outputs(logits, sum_pi_squared=True, temperature=temperature, group=group,
                                         chunk_size=chunk_size, vocab_size=vocab_size)["sum_pi_squared"]
