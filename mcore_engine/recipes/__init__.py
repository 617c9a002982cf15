"""Recipes on the engine's public API: the main job of ``tools/train.py`` (``corpus``, ``sampling``,
``distill``, ``logging``, ``job_config``) and the GRPO recipe of ``tools/grpo.py`` (``grpo``,
``grpo_config``, ``toy_task``)."""

from mcore_engine.recipes.corpus import MarkovCorpus
from mcore_engine.recipes.distill import JobSummary, run_job
from mcore_engine.recipes.grpo import GRPOSummary, run_grpo
from mcore_engine.recipes.grpo_config import GRPOConfig, GRPOJobConfig
from mcore_engine.recipes.job_config import (
    CorpusConfig,
    DistillationConfig,
    JobConfig,
    TeacherTrainingConfig,
)

__all__ = ["CorpusConfig", "DistillationConfig", "GRPOConfig", "GRPOJobConfig", "GRPOSummary", "JobConfig",
           "JobSummary", "MarkovCorpus", "TeacherTrainingConfig", "run_grpo", "run_job"]
