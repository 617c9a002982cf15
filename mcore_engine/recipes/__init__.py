"""Recipes built on the engine's public API: the main job of ``tools/train.py``.

``corpus`` (embedded synthetic data), ``sampling`` (rollouts and teacher top-k over vocab-parallel
logits), ``distill`` (teacher pre-training, then top-k on-policy distillation), ``logging``
(progress bar, JSON lines, plot), ``job_config`` (the job's dataclasses).
"""

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
