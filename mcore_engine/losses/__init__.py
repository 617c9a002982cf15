"""RL and distillation losses ``loss_fn(outputs, data, ctx) -> (loss, metrics)`` and top-k processors."""

from mcore_engine.losses.aggregation import AGG_MODES, agg_loss, token_mean_metric, tokens_per_sequence
from mcore_engine.losses.context import LossContext
from mcore_engine.losses.distillation import (
    forward_kl_topk,
    forward_kl_topk_tail,
    make_forward_kl_topk,
    topk_overlap,
)
from mcore_engine.losses.distillation_ppo import distillation_ppo_loss
from mcore_engine.losses.kl import KL_ESTIMATORS, kl_estimator
from mcore_engine.losses.policy import ppo_policy_loss
from mcore_engine.losses.value import ppo_value_loss, value_loss

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "LossContext",
    "agg_loss",
    "distillation_ppo_loss",
    "forward_kl_topk",
    "forward_kl_topk_tail",
    "kl_estimator",
    "make_forward_kl_topk",
    "ppo_policy_loss",
    "ppo_value_loss",
    "token_mean_metric",
    "tokens_per_sequence",
    "topk_overlap",
    "value_loss",
]
