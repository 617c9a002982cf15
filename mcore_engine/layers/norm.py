"""Torch norms for the local layer spec that also run under sequence parallelism.

Megatron-Core's ``WrappedTorchNorm`` refuses ``sequence_parallel``. Under it a norm sees this rank's
``[s / tp, b, H]`` slice, so its weight gradient is a partial sum, which ``finalize_model_grads``
sums over TP for parameters marked ``sequence_parallel``: :class:`TorchNorm` is ``torch.nn.LayerNorm``
/ ``RMSNorm`` with that mark, and :func:`with_torch_norms` puts it wherever a spec names
``WrappedTorchNorm``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm

__all__ = ["TorchNorm", "with_torch_norms"]

_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


class TorchNorm:
    """``WrappedTorchNorm``'s constructor signature; returns ``torch.nn.LayerNorm`` / ``RMSNorm`` with
    every parameter's ``sequence_parallel`` attribute set to ``config.sequence_parallel``."""

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5,
                persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                normalization: str = "LayerNorm") -> torch.nn.Module:
        if config.normalization not in _NORMS:
            raise ValueError(f"normalization must be one of {sorted(_NORMS)} without Transformer Engine, "
                             f"got {config.normalization!r}")
        if config.layernorm_zero_centered_gamma or config.persist_layer_norm \
                or config.memory_efficient_layer_norm:
            raise ValueError("zero-centred gamma, persist_layer_norm and memory_efficient_layer_norm need "
                             "Transformer Engine / Apex norms")
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
