"""The last pipeline stage's output layer for the fused lm-head: its weight shard, the layer applied
to given hidden states, and a switch that makes the model return hidden states instead of logits."""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from mcore_engine.layers.value_head import ValueHead

__all__ = ["apply_output_layer", "is_last_stage_chunk", "lm_head_weight", "output_hidden_states"]


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The lm-head weight shard ``[V_local, H]`` of a last-stage ``GPTModel`` (the tied embedding
    when shared)."""
    gpt = _unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def is_last_stage_chunk(model: torch.nn.Module) -> bool:
    """True for a (wrapped) ``GPTModel`` chunk that holds the output layer."""
    return getattr(_unwrap(model), "output_layer", None) is not None and _unwrap(model).post_process


def apply_output_layer(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """The last stage's output layer on ``hidden`` ``[..., H]`` (3-d), also while
    :func:`output_hidden_states` is on: logits ``[..., V_local]`` or, with a value head, fp32 values
    ``[..., 1]``; differentiable. Under sequence parallelism ``hidden`` is the gathered hidden of
    :func:`output_hidden_states` and the lm-head runs as under plain TP; a value head refuses."""
    gpt = _unwrap(model)
    layer = gpt.output_layer
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    if not getattr(layer, "sequence_parallel", False):
        return type(layer).forward(layer, hidden, weight=weight)[0]
    if isinstance(layer, ValueHead):
        raise ValueError("apply_output_layer: a value head under sequence_parallel=True needs the "
                         "sequence-sharded hidden states (run the model with its own output layer)")
    layer.sequence_parallel = False
    try:
        return type(layer).forward(layer, hidden, weight=weight)[0]
    finally:
        layer.sequence_parallel = True


def _hidden_passthrough(input_: torch.Tensor, weight: torch.Tensor | None = None,
                        runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
    """The output layer's forward under :func:`output_hidden_states`: ``(hidden, None)``."""
    return input_, None


def _gathered_hidden(input_: torch.Tensor, weight: torch.Tensor | None = None,
                     runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
    """:func:`_hidden_passthrough` under sequence parallelism: ``[s / tp, b, H]`` all-gathered to
    ``[s, b, H]``; backward keeps this rank's slice of the gradient, which its consumers (the fused
    lm-head, :func:`apply_output_layer`) have summed over TP, as under plain TP."""
    return gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=False), None


def output_hidden_states(model: torch.nn.Module, enable: bool = True) -> None:
    """Make a last-stage ``GPTModel`` return its final hidden states ``[b, s, H]`` instead of logits
    (``enable=False`` restores them); parameters and state dict untouched. Under sequence parallelism
    the hidden states are all-gathered over the sequence (memory ``[s, b, H]``)."""
    gpt = _unwrap(model)
    layer = getattr(gpt, "output_layer", None)
    if layer is None:
        raise ValueError("model must be a GPTModel on the last pipeline stage (it has no output_layer)")
    if not enable:
        layer.__dict__.pop("forward", None)
        return
    layer.forward = _gathered_hidden if getattr(layer, "sequence_parallel", False) else _hidden_passthrough
