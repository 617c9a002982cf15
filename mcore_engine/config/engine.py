"""Dataclass configs for the engine; YAML only fills them.

``EngineConfig`` nests ``ModelConfig``, ``ParallelConfig`` and ``OptimizerConfig``. Every dataclass
validates itself in ``__post_init__`` and raises ``ValueError`` naming the offending fields, so a bad
combination (heads or query groups not divisible by tp, layers not divisible by pp x vpp, the
interleaved schedule with ``batch_p2p_comm``) fails before any process-group work. The world-size
check (``world % (tp * pp) == 0``) needs the world size and lives in
``EngineConfig.validate_world_size`` / ``ParallelConfig.data_parallel_size``.

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

from mcore_engine.config.checks import _bools, _check_keys, _positive_int, _require
from mcore_engine.config.mla import _validate_mla_layout
from mcore_engine.config.model import ModelConfig
from mcore_engine.config.moe import _validate_moe_layout
from mcore_engine.config.mtp import validate_mtp
from mcore_engine.config.optimizer import OptimizerConfig
from mcore_engine.config.parallel import ParallelConfig

__all__ = ["EngineConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig"]

_RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


@dataclass(kw_only=True)
class EngineConfig:
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
    """Inference only (a reference policy, a teacher): no DDP grad buffers, optimizer or scheduler
    (device memory: the parameters); the training calls raise ``RuntimeError``, checkpoints hold
    the model only and the model of any checkpoint loads."""
    recompute_granularity: str | None = None
    """Activation recompute in training passes (Megatron's): ``None`` keeps every activation;
    ``"full"`` keeps only the input ``[s, b, h]`` of each unit of layers and reruns the unit's forward
    in the backward (about one extra forward of the transformer layers; activation memory: one
    ``[s, b, h]`` per unit plus one unit's activations); ``"selective"`` reruns only
    ``recompute_modules``."""
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
        _require(isinstance(self.model, ModelConfig), "EngineConfig.model must be a ModelConfig")
        _require(isinstance(self.parallel, ParallelConfig), "EngineConfig.parallel must be a ParallelConfig")
        _require(isinstance(self.optimizer, OptimizerConfig),
                 "EngineConfig.optimizer must be an OptimizerConfig")
        _require(self.precision in ("fp32", "bf16"),
                 f"EngineConfig.precision must be 'fp32' or 'bf16', got {self.precision!r}")
        _require(self.data_format in ("thd", "bshd"),
                 f"EngineConfig.data_format must be 'thd' or 'bshd', got {self.data_format!r}")
        _require(isinstance(self.seed, int) and self.seed >= 0,
                 f"EngineConfig.seed must be an int >= 0, got {self.seed!r}")
        _positive_int(self, "micro_batch_size")
        _bools(self, "forward_only")
        if self.logits_chunk_size is not None:
            _positive_int(self, "logits_chunk_size")
        m, p = self.model, self.parallel
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        vpp = p.virtual_pipeline_model_parallel_size or 1
        _require(m.num_attention_heads % tp == 0,
                 f"ModelConfig.num_attention_heads ({m.num_attention_heads}) must be divisible by "
                 f"ParallelConfig.tensor_model_parallel_size ({tp})")
        _require(m.query_groups % tp == 0,
                 f"ModelConfig.num_query_groups ({m.query_groups}) must be divisible by "
                 f"ParallelConfig.tensor_model_parallel_size ({tp})")
        _require(m.ffn_size % tp == 0,
                 f"ModelConfig.ffn_hidden_size ({m.ffn_size}) must be divisible by "
                 f"ParallelConfig.tensor_model_parallel_size ({tp})")
        _require(m.num_layers % (pp * vpp) == 0,
                 f"ModelConfig.num_layers ({m.num_layers}) must be divisible by "
                 f"ParallelConfig.pipeline_model_parallel_size ({pp}) x "
                 f"ParallelConfig.virtual_pipeline_model_parallel_size ({vpp})")
        _validate_moe_layout(m, p)
        _validate_mla_layout(m, p)
        _require(p.context_parallel_size == 1 or m.core_attention == "sdpa",
                 "ParallelConfig.context_parallel_size > 1 needs ModelConfig.core_attention='sdpa' (or "
                 "Transformer Engine): Megatron's local DotProductAttention ('local') cannot split sequences")
        self._validate_recompute(m.num_layers // (pp * vpp))
        validate_mtp(self)

    def _validate_recompute(self, chunk_layers: int) -> None:
        """Recompute fields (``ValueError`` naming them); fills the ``None`` defaults of ``"full"``."""
        gran, method, n, modules = (self.recompute_granularity, self.recompute_method,
                                    self.recompute_num_layers, self.recompute_modules)
        _require(gran in (None, "full", "selective"),
                 f"EngineConfig.recompute_granularity must be None, 'full' or 'selective', got {gran!r}")
        if gran != "full":
            for name in ("recompute_method", "recompute_num_layers"):
                _require(getattr(self, name) is None,
                         f"EngineConfig.{name} needs EngineConfig.recompute_granularity='full', got "
                         f"{name}={getattr(self, name)!r} with recompute_granularity={gran!r}")
        if gran != "selective":
            _require(modules is None,
                     f"EngineConfig.recompute_modules needs EngineConfig.recompute_granularity="
                     f"'selective', got {modules!r} with recompute_granularity={gran!r}")
        if gran is None:
            return
        _require(self.model.moe is None,
                 f"EngineConfig.recompute_granularity={gran!r} with ModelConfig.moe: MoE layers are not "
                 "recomputed here (routing replay follows one forward per micro-batch)")
        if gran == "selective":
            _require(modules is None or (isinstance(modules, list) and modules
                                         and set(modules) <= set(_RECOMPUTE_MODULES)),
                     f"EngineConfig.recompute_modules must be None or a non-empty list of "
                     f"{_RECOMPUTE_MODULES}, got {modules!r}")
            return
        self.recompute_method = method = "uniform" if method is None else method
        _require(method in ("uniform", "block"),
                 f"EngineConfig.recompute_method must be None, 'uniform' or 'block', got {method!r}")
        self.recompute_num_layers = n = 1 if n is None else n
        _positive_int(self, "recompute_num_layers")
        _require(chunk_layers % n == 0 if method == "uniform" else n <= chunk_layers,
                 f"EngineConfig.recompute_num_layers ({n}) must "
                 f"{'divide' if method == 'uniform' else 'be at most'} the layers of one model chunk "
                 f"({chunk_layers}: ModelConfig.num_layers / (pipeline_model_parallel_size x "
                 f"virtual_pipeline_model_parallel_size)) with recompute_method={method!r}")

    def validate_world_size(self, world_size: int) -> int:
        """``ValueError`` naming the fields unless ``world_size % (tp * pp * cp) == 0``; the DP size."""
        return self.parallel.data_parallel_size(world_size)

    # --- (de)serialisation: YAML only fills the dataclasses ---
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        """Build from nested dicts (keys as the field names); unknown keys raise ``ValueError``."""
        _require(isinstance(d, dict), f"EngineConfig.from_dict expects a dict, got {type(d).__name__}")
        _check_keys(cls, d, "EngineConfig")
        _require("model" in d, "EngineConfig.model is required")
        kwargs = dict(d)
        for name, sub in (("model", ModelConfig), ("parallel", ParallelConfig),
                          ("optimizer", OptimizerConfig)):
            if name in kwargs:
                value = kwargs[name]
                _require(isinstance(value, dict), f"EngineConfig.{name} must be a mapping, got {value!r}")
                _check_keys(sub, value, f"EngineConfig.{name}")
                kwargs[name] = sub(**value)
        return cls(**kwargs)

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
