"""Torch norms for the local layer spec that also run under sequence parallelism.

Megatron-Core's ``WrappedTorchNorm`` refuses ``sequence_parallel``. Under it a norm sees this rank's
``[s / tp, b, H]`` slice, so its weight gradient is a partial sum, which ``finalize_model_grads``
sums over TP for parameters marked ``sequence_parallel``: :class:`TorchNorm` is ``torch.nn.LayerNorm``
/ ``RMSNorm`` with that mark, and :func:`with_torch_norms` puts it wherever a spec names
``WrappedTorchNorm``. With ``layernorm_zero_centered_gamma`` (Qwen3.5) an RMSNorm is
:class:`ZeroCenteredRMSNorm`: ``rmsnorm(x) * (1 + w)`` in fp32, ``w`` stored and initialised to 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

__all__ = ["TorchNorm", "ZeroCenteredRMSNorm", "with_torch_norms"]

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class ZeroCenteredRMSNorm(torch.nn.Module):
    """``y = x * rsqrt(mean(x^2) + eps) * (1 + w)`` over the last dimension, computed in fp32 (at least) and
    returned in ``x``'s dtype (``transformers``' Qwen3-Next / Qwen3.5 ``RMSNorm``). Saves ``x`` for
    backward (autograd)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)  # fp32, or float64 for references
        xf = x.to(dtype)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.to(dtype))).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero-centred"


class TorchNorm:
    """``WrappedTorchNorm``'s constructor signature; returns ``torch.nn.LayerNorm`` / ``RMSNorm`` with
    every parameter's ``sequence_parallel`` attribute set to ``config.sequence_parallel``."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.normalization not in _NORMS:
            raise ValueError(f"normalization must be one of {sorted(_NORMS)} without Transformer Engine, "
                             f"got {config.normalization!r}")
        zero_centered = config.layernorm_zero_centered_gamma
        if (zero_centered and config.normalization != "RMSNorm") or config.persist_layer_norm \
                or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred LayerNorm, persist_layer_norm and memory_efficient_layer_norm "
                             "need Transformer Engine / Apex norms")
        if zero_centered:
            norm = ZeroCenteredRMSNorm(hidden_size, eps=eps)
        else:
            norm = _NORMS[config.normalization](normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm


def with_torch_norms(spec: Any) -> Any:
    """``spec`` (a ``ModuleSpec``, block submodules, or a list of them) with every ``WrappedTorchNorm``
    replaced by :class:`TorchNorm`, in place; returns ``spec``."""
    if isinstance(spec, list | tuple):
        for item in {id(s): s for s in spec}.values():
            with_torch_norms(item)
        return spec
    if isinstance(spec, ModuleSpec):
        if spec.module is WrappedTorchNorm:
            spec.module = TorchNorm
        if spec.submodules is not None:
            with_torch_norms(spec.submodules)
        return spec
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for field in dataclasses.fields(spec):
            value = getattr(spec, field.name)
            if value is WrappedTorchNorm:
                setattr(spec, field.name, TorchNorm)
            elif isinstance(value, ModuleSpec | list | tuple) or (
                    dataclasses.is_dataclass(value) and not isinstance(value, type)):
                with_torch_norms(value)
    return spec
