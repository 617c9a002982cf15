"""Configuration of the main job (``tools/train.py``): one dataclass per phase, filled from YAML::

    cfg = JobConfig.from_yaml("configs/demo_tiny_tp2.yaml", overrides=["distillation.steps=10"])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mcore_engine.config import EngineConfig
from mcore_engine.config.checks import _positive_int as _positive_ints
from mcore_engine.config.checks import _require

__all__ = ["CorpusConfig", "DistillationConfig", "JobConfig", "TeacherTrainingConfig", "apply_overrides"]


@dataclass(kw_only=True)
class CorpusConfig:
    """The embedded synthetic corpus: a seeded sparse Markov chain over the model's vocabulary."""

    branching: int = 12
    """Successors per token (every other transition has probability 0)."""
    zipf_exponent: float = 1.0
    """Successor j (j = 1..branching) gets probability proportional to ``j ** -zipf_exponent``."""
    seed: int = 0
    """Seed of the chain (its transition table); sequences draw from per-rank generators."""

    def __post_init__(self) -> None:
        _positive_ints(self, "branching")
        _require(isinstance(self.zipf_exponent, int | float) and self.zipf_exponent >= 0,
                 f"CorpusConfig.zipf_exponent must be a number >= 0, got {self.zipf_exponent!r}")
        _require(isinstance(self.seed, int) and self.seed >= 0, f"CorpusConfig.seed must be an int >= 0, "
                 f"got {self.seed!r}")


@dataclass(kw_only=True)
class TeacherTrainingConfig:
    """Phase 1: next-token cross-entropy on corpus sequences."""

    steps: int = 60
    """Optimizer steps."""
    batch_size: int = 16
    """Sequences per step on each data-parallel rank."""
    seq_len: int = 64
    """Tokens per sequence."""
    micro_batch_size: int = 8
    """Sequences per micro-batch."""

    def __post_init__(self) -> None:
        _positive_ints(self, "steps", "batch_size", "seq_len", "micro_batch_size")
        _require(self.seq_len >= 2, f"TeacherTrainingConfig.seq_len must be >= 2, got {self.seq_len}")


@dataclass(kw_only=True)
class DistillationConfig:
    """Phase 2: on-policy top-k distillation (student samples, teacher scores its top-k)."""

    steps: int = 40
    """Optimizer steps of the student."""
    batch_size: int = 16
    """Prompts per step on each data-parallel rank."""
    prompt_len: int = 4
    """Prompt tokens (drawn from the corpus)."""
    gen_len: int = 28
    """Tokens the student samples after each prompt (the distilled positions)."""
    top_k: int = 8
    """Teacher top-k ids and log-probs per position."""
    temperature: float = 1.0
    """Sampling temperature of the student's rollouts."""
    kl_tail: bool = True
    """Use the k+1-bucket top-k KL (adds the tail term; a proper KL >= 0) instead of the plain top-k sum."""
    micro_batch_size: int = 8
    """Sequences per micro-batch of the student update."""
    inference_micro_batch_size: int = 16
    """Sequences per micro-batch of the forward-only passes (rollouts and teacher scoring)."""

    def __post_init__(self) -> None:
        _positive_ints(self, "steps", "batch_size", "prompt_len", "gen_len", "top_k", "micro_batch_size",
                       "inference_micro_batch_size")
        _require(isinstance(self.temperature, int | float) and 0 < self.temperature < float("inf"),
                 f"DistillationConfig.temperature must be a finite number > 0, got {self.temperature!r}")


@dataclass(kw_only=True)
class JobConfig:
    """The whole job; cross-field checks in ``__post_init__`` (ValueError naming the fields)."""

    name: str = "demo"
    """Run name: outputs go to ``<output_dir>/<name>/``."""
    output_dir: str = "runs"
    """Parent folder of the run folders."""
    teacher: EngineConfig
    """Teacher engine (model, layout, optimizer for its pre-training)."""
    student: EngineConfig
    """Student engine; same vocabulary and parallel layout as the teacher."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    """The synthetic corpus."""
    teacher_training: TeacherTrainingConfig = field(default_factory=TeacherTrainingConfig)
    """Phase 1."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """Phase 2."""

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name and "/" not in self.name,
                 f"JobConfig.name must be a non-empty string without '/', got {self.name!r}")
        t, s = self.teacher, self.student
        _require(t.model.vocab_size == s.model.vocab_size,
                 f"teacher.model.vocab_size ({t.model.vocab_size}) must equal student.model.vocab_size "
                 f"({s.model.vocab_size})")
        _require(t.parallel == s.parallel, "teacher.parallel and student.parallel must be equal (both "
                 "engines share the process groups)")
        _require(self.teacher_training.seq_len <= t.model.max_sequence_length,
                 f"teacher_training.seq_len ({self.teacher_training.seq_len}) exceeds "
                 f"teacher.model.max_sequence_length ({t.model.max_sequence_length})")
        for who, cfg in (("teacher", t), ("student", s)):
            _require(not cfg.model.fused_lm_head,
                     f"{who}.model.fused_lm_head must be false: rollouts, teacher top-k and the overlap "
                     "metric run custom logits processors, which need the logits")
        d = self.distillation
        total = d.prompt_len + d.gen_len
        for who, cfg in (("teacher", t), ("student", s)):
            _require(total <= cfg.model.max_sequence_length,
                     f"distillation.prompt_len + gen_len ({total}) exceeds {who}.model.max_sequence_length "
                     f"({cfg.model.max_sequence_length})")
        _require(d.top_k <= s.model.vocab_size,
                 f"distillation.top_k ({d.top_k}) must be <= vocab_size ({s.model.vocab_size})")
        _require(self.corpus.branching <= s.model.vocab_size,
                 f"corpus.branching ({self.corpus.branching}) must be <= vocab_size ({s.model.vocab_size})")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> JobConfig:
        """Build from nested dicts; unknown keys raise ``ValueError``."""
        _require(isinstance(d, dict), f"JobConfig.from_dict expects a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        _require(not unknown, f"JobConfig: unknown field(s) {unknown}; expected some of {sorted(known)}")
        for key in ("teacher", "student"):
            _require(key in d, f"JobConfig.{key} is required (an EngineConfig mapping)")
        kwargs = dict(d)
        kwargs["teacher"] = EngineConfig.from_dict(d["teacher"])
        kwargs["student"] = EngineConfig.from_dict(d["student"])
        for key, sub in (("corpus", CorpusConfig), ("teacher_training", TeacherTrainingConfig),
                         ("distillation", DistillationConfig)):
            if key in d:
                value = d[key]
                _require(isinstance(value, dict), f"JobConfig.{key} must be a mapping, got {value!r}")
                names = {f.name for f in dataclasses.fields(sub)}
                bad = sorted(set(value) - names)
                _require(not bad, f"JobConfig.{key}: unknown field(s) {bad}; expected some of "
                         f"{sorted(names)}")
                kwargs[key] = sub(**value)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> JobConfig:
        """Load a YAML job file, apply ``dotted.key=value`` overrides, validate."""
        with open(path) as f:
            d = yaml.safe_load(f)
        return cls.from_dict(apply_overrides(d, overrides or []))

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts; ``from_dict(to_dict())`` gives an equal config."""
        return dataclasses.asdict(self)


def apply_overrides(d: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """A copy of nested dict ``d`` with each ``"a.b.c=value"`` set (value parsed as YAML)."""
    import copy

    out = copy.deepcopy(d)
    for item in overrides:
        key, sep, raw = item.partition("=")
        _require(bool(sep) and bool(key), f"override must look like dotted.key=value, got {item!r}")
        parts = key.split(".")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            _require(isinstance(node, dict), f"override {item!r}: {part!r} is not a mapping")
        node[parts[-1]] = _parse_value(raw)
    return out


def _parse_value(raw: str) -> Any:
    """YAML scalar, plus the ``1e-3`` floats that YAML 1.1 leaves as strings."""
    value = yaml.safe_load(raw)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value
