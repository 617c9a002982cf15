"""The ``ctx`` of ``loss_fn(outputs, data, ctx)``: global normalisers (one all-reduce per step) and flags."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class LossContext:
    """Global normalisers and step flags for one optimizer step (frozen)."""

    global_num_tokens: torch.Tensor
    """0-d, on the compute device: ``loss_mask.sum()`` over the global batch."""

    global_num_seqs: torch.Tensor
    """0-d, on the compute device: sequences with a loss token in the global batch."""

    dp_size: int = 1
    """Data-parallel world size (informational)."""

    distillation_only: bool = False
    """No policy gradient this step: neither the policy loss nor the log-probs are computed."""

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
