"""Megatron-Core's ``SelfAttention`` with its output gate in eager torch (Qwen3.5 / Qwen3-Next).

With ``attention_output_gate`` Megatron computes ``o * sigmoid(gate)`` per head before
``linear_proj`` in a method wrapped by its ``jit_fuser`` (``torch.compile``). On CPU that compiles a
C++ kernel per new sequence length (dynamo recompiles, then gives up after its limit), and under
``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 machine the compiled kernel returned non-finite values
from finite inputs (measured with torch 2.13). :class:`GatedSelfAttention` is the same module with
that method eager: the same math (``gate`` to fp32 for the sigmoid, the product cast back).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.attention import SelfAttention

__all__ = ["GatedSelfAttention"]


class GatedSelfAttention(SelfAttention):
    """``SelfAttention`` whose output gate runs eagerly (see the module docstring)."""

    def _apply_output_gate(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        gate = gate.contiguous().view(*x.shape)
        return (x * torch.sigmoid(gate.float())).to(x.dtype)
