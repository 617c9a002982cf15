"""Recipes on the engine's public API (the job of ``tools/train.py``): ``corpus``, ``sampling``,
``distill``, ``logging``, ``job_config``."""

from mcore_engine.recipes.corpus import MarkovCorpus
from mcore_engine.recipes.distill import JobSummary, run_job
from mcore_engine.recipes.job_config import (
    CorpusConfig,
    DistillationConfig,
    JobConfig,
    TeacherTrainingConfig,
)

__all__ = ["CorpusConfig", "DistillationConfig", "JobConfig", "JobSummary", "MarkovCorpus",
           "TeacherTrainingConfig", "run_job"]
