"""Vocab-parallel entropy of the softmax (a thin wrapper over the fused pass)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_engine.ops.fused import vocab_parallel_logits_outputs
from mcore_engine.ops.temperature import Temperature


def vocab_parallel_entropy(logits: torch.Tensor, *, temperature: Temperature = 1.0,
                           group: dist.ProcessGroup | None = None, chunk_size: int | None = None,
                           vocab_size: int | None = None) -> torch.Tensor:
    """``z.logsumexp(-1) - (z.softmax(-1) * z).sum(-1)``, ``z = logits / temperature``: logits
    ``[..., V_local]`` (this rank's shard) -> fp32 ``[...]``; saves the logits and O(N) fp32."""
    return vocab_parallel_logits_outputs(logits, entropy=True, temperature=temperature, group=group,
                                         chunk_size=chunk_size, vocab_size=vocab_size)["entropy"]
