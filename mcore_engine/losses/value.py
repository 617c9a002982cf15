"""PPO clipped value loss (the critic's), as verl computes it. Per token, prediction ``v``, the
rollout's value ``v_old`` and return ``R``::

    v_clipped = v.clamp(v_old - cliprange_value, v_old + cliprange_value)   # v itself when in range
    l1, l2 = (v - R) ** 2, (v_clipped - R) ** 2
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), loss_mask, seq_ids, loss_agg_mode, ctx)

``agg_loss`` normalises by the global counts (``token-mean`` / ``seq-mean-token-sum`` /
``seq-mean-token-mean``), so the micro-batch contributions sum to the global loss whatever the split.
Metrics (detached float32 contributions): ``vf_loss``, ``vf_clipfrac`` (verl's: the clipped loss is
the larger, ``l2 > l1``; only tokens outside the bounds can count, in-range ones are bit-exact),
``vpred_mean``.
Memory: a few ``[T]`` temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mcore_engine.losses.aggregation import AGG_MODES, agg_loss, constants_like, token_mean_metric
from mcore_engine.losses.context import LossContext

__all__ = ["ppo_value_loss", "value_loss"]


def _check_cliprange(cliprange_value: float) -> None:
    if isinstance(cliprange_value, bool) or not isinstance(cliprange_value, (int, float)) \
            or not math.isfinite(cliprange_value) or cliprange_value < 0:
        raise ValueError(f"cliprange_value must be a finite number >= 0, got {cliprange_value!r}")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor,
               seq_ids: torch.Tensor | None, ctx: LossContext, *, cliprange_value: float = 0.5,
               loss_agg_mode: str = "token-mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of one micro-batch (module docstring); every input ``[T]``.

    ``old_values`` and ``returns`` are constants; the loss is 0-d of ``values.dtype``.
    """
    _check_cliprange(cliprange_value)
    old_values, returns = constants_like(values, "values", old_values=old_values, returns=returns)
    low, high = old_values - cliprange_value, old_values + cliprange_value
    clipped = values.clamp(low, high)  # bit-exact ``values`` in range (verl's clip_by_value)
    l1, l2 = (values - returns) ** 2, (clipped - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(l1, l2), loss_mask, seq_ids, loss_agg_mode, ctx)
    with torch.no_grad():
        metrics = {
            "vf_loss": loss.detach().float(),
            "vf_clipfrac": token_mean_metric(((values < low) | (values > high)) & (l2 > l1), loss_mask, ctx),
            "vpred_mean": token_mean_metric(values, loss_mask, ctx),
        }
    return loss, metrics


def ppo_value_loss(*, cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean",
                   old_values_key: str = "values", returns_key: str = "returns"
                   ) -> Callable[[Mapping[str, torch.Tensor], Mapping[str, Any], LossContext],
                                 tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """The engine loss function ``loss_fn(outputs, data, ctx)`` of a critic: :func:`value_loss` on
    ``outputs["values"]``, ``data[old_values_key]`` (verl's batch key ``values``),
    ``data[returns_key]``, ``data["loss_mask"]`` and ``data["seq_ids"]``. Metrics gain ``loss``."""
    _check_cliprange(cliprange_value)
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {loss_agg_mode!r}")

    def loss_fn(outputs: Mapping[str, torch.Tensor], data: Mapping[str, Any],
                ctx: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        for where, mapping, key in (("outputs", outputs, "values"), ("data", data, old_values_key),
                                    ("data", data, returns_key), ("data", data, "loss_mask")):
            if key not in mapping.keys():
                raise ValueError(f"{where} must hold {key!r} (the value loss reads it; model.head='value' "
                                 "gives outputs['values'])")
        seq_ids = data["seq_ids"] if "seq_ids" in data.keys() else None
        loss, metrics = value_loss(outputs["values"], data[old_values_key], data[returns_key],
                                   data["loss_mask"], seq_ids, ctx, cliprange_value=cliprange_value,
                                   loss_agg_mode=loss_agg_mode)
        metrics["loss"] = loss.detach().float()
        return loss, metrics

    return loss_fn
