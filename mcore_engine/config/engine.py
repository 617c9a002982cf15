"""``EngineConfig``: everything ``MegatronEngine`` needs; YAML only fills the dataclasses.

Every block checks its own fields on construction and then, here, its rules against the model and
the layout (``Block.check``), so a bad combination fails before any process-group work with a
``ConfigError`` naming its fields. The world size is checked by ``validate_world_size``.

    cfg = EngineConfig.from_yaml("configs/tiny_cpu_tp2.yaml")
    cfg.validate_world_size(2)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mcore_engine.config.checks import Block, build, require
from mcore_engine.config.model import ModelConfig
from mcore_engine.config.optimizer import OptimizerConfig
from mcore_engine.config.parallel import ParallelConfig
from mcore_engine.config.recompute import check_recompute

__all__ = ["EngineConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig"]


@dataclass(kw_only=True)
class EngineConfig(Block):
    """Everything ``MegatronEngine`` needs: model, layout, optimizer, precision, batching, checkpoints."""

    model: ModelConfig
    """Architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and learning-rate schedule."""
    precision: str = "fp32"
    """``"fp32"`` or ``"bf16"`` (bf16 parameters with fp32 main weights in the optimizer)."""
    seed: int = 1234
    """Base seed (Megatron's layout: + 100 * pp_rank; tensor-parallel stream + 2718 + tp_rank)."""
    micro_batch_size: int = 1
    """Sequences per micro-batch when the batch does not say otherwise."""
    logits_chunk_size: int | None = None
    """Tokens per chunk of the lm-head logits pass; ``None`` picks the ops' default."""
    data_format: str = "thd"
    """``"thd"`` (packed sequences) or ``"bshd"`` (padded)."""
    checkpoint_dir: str | None = None
    """Default folder for ``save_checkpoint`` / ``load_checkpoint``."""
    forward_only: bool = False
    """Inference only (a reference policy, a teacher): no grad buffers, optimizer or scheduler; the
    training calls raise ``RuntimeError``; checkpoints hold the model only."""
    recompute_granularity: str | None = None
    """Activation recompute in training passes (Megatron's; checks: ``config.recompute``): ``None``
    keeps every activation; ``"full"`` keeps the input ``[s, b, h]`` of each unit of layers and
    reruns its forward in the backward (about one extra forward; memory: one ``[s, b, h]`` per unit
    plus one unit's activations); ``"selective"`` reruns only ``recompute_modules``."""
    recompute_method: str | None = None
    """With ``"full"``: ``"uniform"`` (every model chunk in units of ``recompute_num_layers``
    consecutive layers) or ``"block"`` (the first ``recompute_num_layers`` layers of each chunk, one
    per unit; the others keep their activations); ``None`` means ``"uniform"``. ``None`` otherwise."""
    recompute_num_layers: int | None = None
    """With ``"full"``: layers per unit (uniform; divides the layers of a model chunk) or recomputed
    layers per chunk (block; at most the layers of a chunk); ``None`` means 1. ``None`` otherwise."""
    recompute_modules: list[str] | None = None
    """With ``"selective"``: a non-empty subset of ``("core_attn", "layernorm", "mlp")`` (the
    attention core ``softmax(q k^T) v``, the two norms of each layer, the dense MLP); ``None`` means
    ``["core_attn"]``. ``None`` otherwise."""

    def __post_init__(self) -> None:
        for name, cls in (("model", ModelConfig), ("parallel", ParallelConfig),
                          ("optimizer", OptimizerConfig)):
            setattr(self, name, build(cls, getattr(self, name), f"EngineConfig.{name}", name, optional=False))
        self._choice("precision", ("fp32", "bf16"))
        self._choice("data_format", ("thd", "bshd"))
        self._ints("seed", low=0)
        self._ints("micro_batch_size")
        self._ints("logits_chunk_size", optional=True)
        self._bools("forward_only")
        m, p = self.model, self.parallel
        if p.expert_tensor_parallel_size is None and m.moe is not None and m.add_bias_linear:
            # Megatron-Core splits no expert bias: biased experts (gpt-oss) default to ETP = 1
            self.parallel = p = dataclasses.replace(p, expert_tensor_parallel_size=1)
        for block in (p, *m.blocks()):
            block.check(m, p)
        check_recompute(self)

    def validate_world_size(self, world_size: int) -> int:
        """The DP size; ``ConfigError`` naming the fields unless ``world_size`` fits the layout."""
        return self.parallel.data_parallel_size(world_size)

    # --- (de)serialisation: YAML only fills the dataclasses
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        """Build from nested dicts (keys as the field names); unknown keys raise ``ConfigError``."""
        require(not isinstance(d, dict) or "model" in d, "EngineConfig.model is required", "model")
        return build(cls, d, "EngineConfig", "", optional=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> EngineConfig:
        """Load a YAML file whose top-level keys are this dataclass's fields."""
        with open(path) as f:
            return cls.from_dict(yaml.safe_load(f))

    def to_dict(self) -> dict[str, Any]:
        """Nested plain dicts; ``from_dict(to_dict())`` gives an equal config."""
        return dataclasses.asdict(self)

    def to_yaml(self, path: str | Path) -> None:
        """Write ``to_dict()`` as YAML."""
        with open(path, "w") as f:
            yaml.safe_dump(self.to_dict(), f, sort_keys=False)
