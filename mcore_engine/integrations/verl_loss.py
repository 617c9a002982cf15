"""verl's losses on the core's ``loss_convention="micro_batch"``: :class:`VerlLossBridge` (verl's
normalisation), :func:`verl_results` (verl's result dict), a verl distillation loss's top-k clamp."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from tensordict import TensorDict
from verl.utils.py_functional import append_to_dict

from mcore_engine.losses.context import LossContext

__all__ = ["VerlLossBridge", "verl_results"]


class VerlLossBridge:
    """A verl loss on the core's ``loss_convention="micro_batch"``: called once per micro-batch with
    jagged ``[b, j]`` outputs and the core's copy of verl's rows, on which it sets ``batch_num_tokens``
    (``ctx.global_num_tokens``, a 0-d device tensor: no host sync), ``dp_size`` and ``sp_size``;
    returns ``L_i / dp_size`` and verl's metrics."""

    def __init__(self, loss_function: Callable, *, dp_group: Any) -> None:
        self.loss_function = loss_function
        self.dp_group = dp_group
        self.losses: list[torch.Tensor] = []

    def __call__(self, model_output: dict[str, torch.Tensor], data: TensorDict, ctx: LossContext
                 ) -> tuple[torch.Tensor, dict[str, Any]]:
        data.set_non_tensor("batch_num_tokens", ctx.global_num_tokens)  # data: the core's micro-batch copy
        data.set_non_tensor("dp_size", ctx.dp_size)
        data.set_non_tensor("sp_size", 1)
        loss, metrics = self.loss_function(model_output=model_output, data=data, dp_group=self.dp_group)
        if not isinstance(loss, torch.Tensor):
            loss = torch.as_tensor(float(loss), dtype=torch.float32)
        self.losses.append(loss.detach().float().reshape(()))
        return loss / ctx.dp_size, metrics


def verl_results(out: TensorDict, losses: list[torch.Tensor] | None,
                 keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """verl's ``{"model_output": {key: jagged [B, j]}, "loss": [...], "metrics": {key: [...]}}`` from
    the core's result (``keys``: only those outputs); ``losses`` None (no loss function): 1.0 per
    micro-batch, as verl's Megatron engine reports."""
    per_micro_batch = out.get_non_tensor("micro_batch_metrics")
    metrics: dict[str, list] = {}
    for entry in per_micro_batch:
        append_to_dict(metrics, entry)
    names = [k for k in out.keys() if k not in ("loss", "metrics", "micro_batch_metrics")]
    model_output = {key: out.get(key) for key in names if keys is None or key in keys}
    if losses is None:
        loss = [1.0] * len(per_micro_batch)
    else:
        loss = torch.stack(losses).tolist() if losses else []  # the step's one host sync for them
    return {"model_output": model_output, "loss": loss, "metrics": metrics}


def _topk_clamp(loss_function: Callable | None) -> float | None:
    """``log_prob_min_clamp`` of a ``partial(distillation_ppo_loss, distillation_config=...)``."""
    is_partial = isinstance(loss_function, functools.partial)
    cfg = loss_function.keywords.get("distillation_config") if is_partial else None
    loss_cfg = getattr(cfg, "distillation_loss", None)
    return getattr(loss_cfg, "log_prob_min_clamp", None)
