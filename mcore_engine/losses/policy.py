"""PPO clipped policy loss with dual clip, as verl computes it. Per token, advantage ``A``::

    r = exp((logp - old_logp).clamp(-20, 20))
    l1, l2 = -A * r, -A * r.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(l1, l2)
    l3 = -A * clip_ratio_c                                           # dual clip, A < 0 only
    loss = agg_loss(torch.where(A < 0, torch.minimum(clipped, l3), clipped), loss_mask, ...)

Metrics: ``pg_loss``, ``pg_clipfrac`` (``l2 > l1``), ``pg_clipfrac_lower`` (``A < 0`` and
``clipped > l3``), ``ppo_kl`` (``old_logp - logp``).
"""

from __future__ import annotations

import torch

from mcore_engine.losses.aggregation import agg_loss, constants_like, token_mean_metric
from mcore_engine.losses.context import LossContext

LOG_RATIO_CLAMP = 20.0


def check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    """ValueError unless ``0 <= clip_ratio_low < 1``, ``clip_ratio_high >= 0``, ``clip_ratio_c > 1``."""
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low}")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high}")
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual clip), got {clip_ratio_c}")


def ppo_policy_loss(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, seq_ids: torch.Tensor | None, ctx: LossContext, *,
                    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float = 3.0,
                    loss_agg_mode: str = "token-mean") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)`` of one micro-batch (module docstring), inputs ``[T]``; old log-probs constant."""
    check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    old_log_probs, advantages = constants_like(log_probs, "log_probs", old_log_probs=old_log_probs,
                                               advantages=advantages)

    log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    clipped = torch.maximum(l1, l2)
    l3 = -advantages * clip_ratio_c
    negative = advantages < 0
    pg_losses = torch.where(negative, torch.minimum(clipped, l3), clipped)

    loss = agg_loss(pg_losses, loss_mask, seq_ids, loss_agg_mode, ctx)
    with torch.no_grad():
        metrics = {
            "pg_loss": loss.detach().float(),
            "pg_clipfrac": token_mean_metric((l2 > l1).float(), loss_mask, ctx),
            "pg_clipfrac_lower": token_mean_metric((negative & (clipped > l3)).float(), loss_mask, ctx),
            "ppo_kl": token_mean_metric(-log_ratio, loss_mask, ctx),
        }
    return loss, metrics
