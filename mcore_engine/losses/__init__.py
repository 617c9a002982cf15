"""RL and distillation losses: aggregation, PPO clip, KL estimators, top-k distillation."""

from mcore_engine.losses.context import LossContext

__all__ = ["LossContext"]
