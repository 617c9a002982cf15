"""Configuration of the GRPO recipe (``tools/grpo.py``): the algorithm and the job, filled from YAML::

    cfg = GRPOJobConfig.from_yaml("configs/grpo_tiny_tp2.yaml", overrides=["grpo.steps=10"])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mcore_engine.config import EngineConfig
from mcore_engine.config.checks import _positive_int, _require
from mcore_engine.losses import AGG_MODES, KL_ESTIMATORS
from mcore_engine.recipes.job_config import apply_overrides

__all__ = ["GRPOConfig", "GRPOJobConfig"]


@dataclass(kw_only=True)
class GRPOConfig:
    """GRPO (verl's ``adv_estimator=grpo``) on the successor task (``recipes/toy_task.py``)."""

    steps: int = 60
    """Rollout steps (each followed by ``mini_batches`` optimizer steps)."""
    prompts_per_step: int = 16
    """Prompts per rollout step on each data-parallel rank."""
    group_size: int = 8
    """Responses sampled per prompt (G); advantages are normalised within each group."""
    prompt_len: int = 4
    """Prompt tokens (uniform random ids)."""
    response_len: int = 8
    """Tokens sampled after each prompt (fixed length, no end-of-sequence token)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts (the log-probs of the update use the same)."""
    mini_batches: int = 2
    """Optimizer steps per rollout on contiguous slices of whole groups (verl's ``ppo_mini_batch_size``
    = rollouts / mini_batches); with more than one, the later ones are off-policy and the clip acts."""
    clip_ratio_low: float = 0.2
    """PPO ratio clip below 1."""
    clip_ratio_high: float = 0.2
    """PPO ratio clip above 1."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages."""
    loss_agg_mode: str = "token-mean"
    """Aggregation of the per-token losses (``mcore_engine.losses.AGG_MODES``)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL-to-reference loss; 0: no reference (and no logged KL)."""
    kl_loss_type: str = "k3"
    """KL estimator of that loss and of the logged ``kl`` (``k1`` or ``k3``)."""
    adv_epsilon: float = 1e-6
    """``A = (r - mean_group) / (std_group + adv_epsilon)``."""
    micro_batch_size: int = 32
    """Sequences per micro-batch of the policy update."""
    inference_micro_batch_size: int = 64
    """Sequences per micro-batch of the forward-only passes (rollouts, old and reference log-probs)."""
    seed: int = 0
    """Seed of the prompt stream (per data-parallel rank)."""

    def __post_init__(self) -> None:
        _positive_int(self, "steps", "prompts_per_step", "group_size", "prompt_len", "response_len",
                      "mini_batches", "micro_batch_size", "inference_micro_batch_size")
        _require(self.group_size >= 2, f"GRPOConfig.group_size must be >= 2 (a group baseline), "
                 f"got {self.group_size}")
        _require(self.prompts_per_step % self.mini_batches == 0,
                 f"GRPOConfig.mini_batches ({self.mini_batches}) must divide prompts_per_step "
                 f"({self.prompts_per_step}): every mini-batch holds whole groups")
        _require(isinstance(self.temperature, int | float) and 0 < self.temperature < float("inf"),
                 f"GRPOConfig.temperature must be a finite number > 0, got {self.temperature!r}")
        _require(self.loss_agg_mode in AGG_MODES,
                 f"GRPOConfig.loss_agg_mode must be one of {AGG_MODES}, got {self.loss_agg_mode!r}")
        _require(self.kl_loss_type in KL_ESTIMATORS,
                 f"GRPOConfig.kl_loss_type must be one of {KL_ESTIMATORS}, got {self.kl_loss_type!r}")
        _require(self.kl_loss_coef >= 0, f"GRPOConfig.kl_loss_coef must be >= 0, got {self.kl_loss_coef!r}")
        _require(self.adv_epsilon > 0, f"GRPOConfig.adv_epsilon must be > 0, got {self.adv_epsilon!r}")
        _require(isinstance(self.seed, int) and self.seed >= 0,
                 f"GRPOConfig.seed must be an int >= 0, got {self.seed!r}")


@dataclass(kw_only=True)
class GRPOJobConfig:
    """The whole GRPO job; cross-field checks in ``__post_init__`` (ValueError naming the fields)."""

    name: str = "grpo"
    """Run name: outputs go to ``<output_dir>/<name>/``."""
    output_dir: str = "runs"
    """Parent folder of the run folders."""
    policy: EngineConfig
    """The trained policy. The KL reference (``kl_loss_coef > 0``, ``recipes.grpo.build_reference``):
    with ``model.lora`` this engine with its adapters disabled (the frozen base), otherwise a second
    engine of :meth:`reference_config` (the same seed, hence the same initial weights)."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """The algorithm and the rollout sizes."""

    def __post_init__(self) -> None:
        _require(isinstance(self.name, str) and self.name and "/" not in self.name,
                 f"GRPOJobConfig.name must be a non-empty string without '/', got {self.name!r}")
        p, g = self.policy, self.grpo
        _require(not p.forward_only, "GRPOJobConfig.policy.forward_only must be false (it is trained)")
        _require(not p.model.fused_lm_head, "GRPOJobConfig.policy.model.fused_lm_head must be false: the "
                 "rollouts run a custom logits processor, which needs the logits")
        _require(p.model.head == "lm", f"GRPOJobConfig.policy.model.head must be 'lm', got {p.model.head!r}")
        total = g.prompt_len + g.response_len
        _require(total <= p.model.max_sequence_length,
                 f"grpo.prompt_len + response_len ({total}) exceeds policy.model.max_sequence_length "
                 f"({p.model.max_sequence_length})")

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name

    def reference_config(self) -> EngineConfig:
        """The reference engine of full fine-tuning: ``policy`` with ``forward_only=True`` (with LoRA the
        recipe uses the policy's frozen base instead and builds none)."""
        return dataclasses.replace(self.policy, forward_only=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GRPOJobConfig:
        """Build from nested dicts; unknown keys raise ``ValueError``."""
        _require(isinstance(d, dict), f"GRPOJobConfig.from_dict expects a dict, got {type(d).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        _require(not unknown, f"GRPOJobConfig: unknown field(s) {unknown}; expected some of {sorted(known)}")
        _require("policy" in d, "GRPOJobConfig.policy is required (an EngineConfig mapping)")
        kwargs = dict(d)
        kwargs["policy"] = EngineConfig.from_dict(d["policy"])
        if "grpo" in d:
            value = d["grpo"]
            _require(isinstance(value, dict), f"GRPOJobConfig.grpo must be a mapping, got {value!r}")
            names = {f.name for f in dataclasses.fields(GRPOConfig)}
            bad = sorted(set(value) - names)
            _require(not bad, f"GRPOJobConfig.grpo: unknown field(s) {bad}; expected some of {sorted(names)}")
            kwargs["grpo"] = GRPOConfig(**value)
        return cls(**kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> GRPOJobConfig:
        """Load a YAML job file, apply ``dotted.key=value`` overrides, validate."""
        with open(path) as f:
            d = yaml.safe_load(f)
        return cls.from_dict(apply_overrides(d, overrides or []))

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts; ``from_dict(to_dict())`` gives an equal config."""
        return dataclasses.asdict(self)
