"""``distillation_ppo_loss``: top-k distillation plus the PPO policy loss, per micro-batch.

Per micro-batch, on ``[T]`` tensors, with ``agg = agg_loss(., loss_mask, seq_ids, loss_agg_mode, ctx)``::

    loss = distillation_loss_coef * agg(outputs["distillation_losses"])     # if present
         + ppo_policy_loss(outputs["log_probs"], data["old_log_probs"], data["advantages"], ...)
         + kl_loss_coef * agg(kl_estimator(outputs["log_probs"], data["ref_log_probs"], kl_loss_type))

Under ``ctx.distillation_only`` only the first term runs. ``old_log_probs`` defaults to
``log_probs.detach()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from mcore_engine.losses import policy as _policy
from mcore_engine.losses.aggregation import AGG_MODES, agg_loss, token_mean_metric
from mcore_engine.losses.context import LossContext
from mcore_engine.losses.kl import KL_ESTIMATORS, kl_estimator

LossFn = Callable[[Mapping[str, torch.Tensor], Mapping[str, Any], LossContext],
                  tuple[torch.Tensor, dict[str, torch.Tensor]]]
DISTILLATION_METRICS: tuple[str, ...] = ("student_mass", "teacher_mass", "topk_overlap")


def _required(mapping: Mapping[str, Any], key: str, where: str, why: str) -> torch.Tensor:
    if key not in mapping.keys():
        raise ValueError(f"{where} must hold {key!r} ({why})")
    return mapping[key]


def distillation_ppo_loss(*, distillation_loss_coef: float = 1.0, loss_agg_mode: str = "token-mean",
                          clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
                          clip_ratio_c: float = 3.0, kl_loss_coef: float = 0.0,
                          kl_loss_type: str = "k3") -> LossFn:
    """Build the combined loss function (module docstring); arguments are validated here."""
    if loss_agg_mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {AGG_MODES}, got {loss_agg_mode!r}")
    if kl_loss_type not in KL_ESTIMATORS:
        raise ValueError(f"kl_loss_type must be one of {KL_ESTIMATORS}, got {kl_loss_type!r}")
    if distillation_loss_coef < 0 or kl_loss_coef < 0:
        raise ValueError(f"distillation_loss_coef and kl_loss_coef must be >= 0, got "
                         f"{distillation_loss_coef} and {kl_loss_coef}")
    _policy.check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    clips = dict(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c)

    def loss_fn(outputs: Mapping[str, torch.Tensor], data: Mapping[str, Any],
                ctx: LossContext) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss_mask = _required(data, "loss_mask", "data", "[T] per-token loss mask")
        seq_ids = data["seq_ids"] if "seq_ids" in data.keys() else None
        terms: list[torch.Tensor] = []
        metrics: dict[str, torch.Tensor] = {}

        if "distillation_losses" in outputs.keys():
            distill = agg_loss(outputs["distillation_losses"], loss_mask, seq_ids, loss_agg_mode, ctx)
            terms.append(distillation_loss_coef * distill)
            metrics["distillation_loss"] = distill.detach().float()
            for key in DISTILLATION_METRICS:
                if key in outputs.keys():
                    metrics[key] = token_mean_metric(outputs[key], loss_mask, ctx)
        elif ctx.distillation_only:
            raise ValueError("distillation_only is set but outputs has no 'distillation_losses' "
                             "(run the processor with distillation_use_topk=True)")

        if not ctx.distillation_only:
            log_probs = _required(outputs, "log_probs", "outputs", "needed by the policy loss")
            advantages = _required(data, "advantages", "data", "[T] per-token advantages")
            old = data["old_log_probs"] if "old_log_probs" in data.keys() else log_probs.detach()
            pg_loss, pg_metrics = _policy.ppo_policy_loss(log_probs, old, advantages, loss_mask, seq_ids, ctx,
                                                          loss_agg_mode=loss_agg_mode, **clips)
            terms.append(pg_loss)
            metrics.update(pg_metrics)
            if kl_loss_coef > 0:
                ref = _required(data, "ref_log_probs", "data", "needed when kl_loss_coef > 0")
                kl = agg_loss(kl_estimator(log_probs, ref.to(log_probs.dtype), kl_loss_type), loss_mask,
                              seq_ids, loss_agg_mode, ctx)
                terms.append(kl_loss_coef * kl)
                metrics["kl_loss"] = kl.detach().float()

        loss = sum(terms[1:], start=terms[0])
        metrics["loss"] = loss.detach().float()
        return loss, metrics

    return loss_fn
