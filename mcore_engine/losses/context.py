"""Per-step context the engine hands to every loss function call.

A loss function returns the micro-batch's CONTRIBUTION to the loss of the whole global batch, so it
needs the global normalisers: the number of loss tokens and of sequences over every micro-batch and
every data-parallel rank. The engine computes them once per step (one all-reduce, kept on device)
and passes this frozen context to each call ``loss_fn(outputs, data, ctx)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class LossContext:
    """Global normalisers and step flags for one optimizer step."""

    global_num_tokens: torch.Tensor
    """0-d tensor on the compute device: ``loss_mask.sum()`` over the whole global batch (all
    micro-batches, all data-parallel ranks)."""

    global_num_seqs: torch.Tensor
    """0-d tensor on the compute device: number of sequences in the whole global batch (all
    micro-batches, all data-parallel ranks); the divisor of the ``seq-mean-*`` aggregation modes.
    (verl counts only sequences with at least one loss token; counting all is also consistent.)"""

    dp_size: int = 1
    """Data-parallel world size (informational: contributions are already globally normalised)."""

    distillation_only: bool = False
    """True when neither task rewards nor the policy gradient are used: the loss then never computes
    the policy loss, and the processor never computes log-probs."""

    def __post_init__(self) -> None:
        for name in ("global_num_tokens", "global_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, torch.Tensor) or value.dim() != 0:
                raise ValueError(f"LossContext.{name} must be a 0-d tensor, got {value!r}")
        if not isinstance(self.dp_size, int) or self.dp_size < 1:
            raise ValueError(f"LossContext.dp_size must be an int >= 1, got {self.dp_size!r}")

    @classmethod
    def from_counts(cls, num_tokens: float | torch.Tensor, num_seqs: float | torch.Tensor, *,
                    dp_size: int = 1, distillation_only: bool = False,
                    device: torch.device | str | None = None) -> LossContext:
        """Build a context from plain numbers or tensors (float32 0-d tensors on ``device``)."""
        return cls(global_num_tokens=torch.as_tensor(num_tokens, dtype=torch.float32, device=device),
                   global_num_seqs=torch.as_tensor(num_seqs, dtype=torch.float32, device=device),
                   dp_size=dp_size, distillation_only=distillation_only)
