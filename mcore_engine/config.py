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
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = ["EngineConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig"]


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive_int(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{type(obj).__name__}.{name} must be an int >= 1, got {value!r}")


@dataclass(kw_only=True)
class ModelConfig:
    """GPT architecture (Megatron-Core ``TransformerConfig`` + ``GPTModel`` arguments)."""

    num_layers: int
    """Transformer layers of the whole model (all pipeline stages)."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Query heads; must divide ``hidden_size`` unless ``kv_channels`` is set."""
    num_query_groups: int | None = None
    """Key/value heads for GQA; ``None`` means multi-head attention (one group per head)."""
    ffn_hidden_size: int | None = None
    """MLP width; ``None`` means ``4 * hidden_size``."""
    kv_channels: int | None = None
    """Channels per attention head d (queries ``heads * d`` wide, keys / values ``groups * d``);
    ``None`` means ``hidden_size // num_attention_heads``. Set it for models such as Qwen3-0.6B
    where ``heads * d != hidden_size``."""
    vocab_size: int
    """True vocabulary size (before Megatron pads it; ids >= vocab_size never get probability)."""
    max_sequence_length: int
    """Longest sequence the model accepts (RoPE table size)."""
    rotary_base: int = 10000
    """RoPE base theta."""
    rope_scaling_factor: float | None = None
    """Llama-3.x RoPE frequency scaling with this factor (Megatron's ``rope_scaling``, whose other
    parameters are fixed: ``low_freq_factor=1``, ``high_freq_factor=4``,
    ``original_max_position_embeddings=8192``); ``None`` means unscaled RoPE."""
    normalization: str = "RMSNorm"
    """``"RMSNorm"`` or ``"LayerNorm"``."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers."""
    swiglu: bool = True
    """SwiGLU MLP (gated SiLU); ``False`` means a GeLU MLP."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output layer weight."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2 style); other linear layers have none."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head (Qwen3 style)."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocab is a multiple of this times the tensor-parallel size (Megatron's rule)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    hf_path: str | None = None
    """Optional Hugging Face checkpoint folder to import weights from."""
    fused_lm_head: bool = False
    """Compute the lm-head outputs from hidden states without materialising logits (when supported)."""

    def __post_init__(self) -> None:
        _positive_int(self, "num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                      "max_sequence_length", "make_vocab_size_divisible_by")
        for name in ("num_query_groups", "ffn_hidden_size", "kv_channels"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        _require(self.kv_channels is not None or self.hidden_size % self.num_attention_heads == 0,
                 f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                 f"ModelConfig.num_attention_heads ({self.num_attention_heads}) unless "
                 "ModelConfig.kv_channels is set")
        factor = self.rope_scaling_factor
        _require(factor is None or (isinstance(factor, (int, float)) and not isinstance(factor, bool)
                                    and math.isfinite(factor) and factor > 0),
                 f"ModelConfig.rope_scaling_factor must be None or a finite number > 0, got {factor!r}")
        groups = self.num_query_groups or self.num_attention_heads
        _require(self.num_attention_heads % groups == 0,
                 f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                 f"ModelConfig.num_query_groups ({groups})")
        _require(self.normalization in ("RMSNorm", "LayerNorm"),
                 f"ModelConfig.normalization must be 'RMSNorm' or 'LayerNorm', got {self.normalization!r}")
        _require(self.rotary_base > 0, f"ModelConfig.rotary_base must be > 0, got {self.rotary_base!r}")
        _require(self.norm_epsilon > 0, f"ModelConfig.norm_epsilon must be > 0, got {self.norm_epsilon!r}")
        _require(self.init_method_std > 0,
                 f"ModelConfig.init_method_std must be > 0, got {self.init_method_std!r}")

    @property
    def query_groups(self) -> int:
        """Resolved number of key/value groups."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """Resolved MLP width."""
        return self.ffn_hidden_size or 4 * self.hidden_size


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout; the data-parallel size is what is left of the world size."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that shard each layer (and the vocab)."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """VPP: model chunks per pipeline rank for the interleaved schedule (>= 2, needs PP > 1)."""
    batch_p2p_comm: bool = False
    """Batch the pipeline's send/recv pairs. Must stay off with VPP (results are silently wrong)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1 and the Transformer Engine / apex norms: GPU only)."""

    def __post_init__(self) -> None:
        _positive_int(self, "tensor_model_parallel_size", "pipeline_model_parallel_size")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            _positive_int(self, "virtual_pipeline_model_parallel_size")
            _require(vpp >= 2, "ParallelConfig.virtual_pipeline_model_parallel_size must be None or >= 2, "
                               f"got {vpp}")
            _require(self.pipeline_model_parallel_size > 1,
                     "ParallelConfig.virtual_pipeline_model_parallel_size needs "
                     "ParallelConfig.pipeline_model_parallel_size > 1, got "
                     f"{self.pipeline_model_parallel_size}")
            _require(not self.batch_p2p_comm,
                     "ParallelConfig.batch_p2p_comm must be False with "
                     "ParallelConfig.virtual_pipeline_model_parallel_size (interleaved schedule): "
                     "batched send/recv to one peer swaps directions and gives wrong results")
        _require(not (self.sequence_parallel and self.tensor_model_parallel_size == 1),
                 "ParallelConfig.sequence_parallel needs ParallelConfig.tensor_model_parallel_size > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size // (tp * pp)``; ``ValueError`` unless ``world_size`` is a multiple of tp * pp."""
        tp, pp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        _require(isinstance(world_size, int) and world_size >= 1 and world_size % (tp * pp) == 0,
                 f"world_size ({world_size}) must be a positive multiple of "
                 f"ParallelConfig.tensor_model_parallel_size ({tp}) x "
                 f"ParallelConfig.pipeline_model_parallel_size ({pp})")
        return world_size // (tp * pp)


@dataclass(kw_only=True)
class OptimizerConfig:
    """Adam(W) through Megatron's ``get_megatron_optimizer``, with warm-up and a decay schedule."""

    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay (cosine / linear)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW); biases and norms are excluded by Megatron."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Linear warm-up steps from 0 to ``lr``."""
    lr_decay_style: str = "constant"
    """``"constant"``, ``"cosine"`` or ``"linear"`` after the warm-up."""
    lr_decay_steps: int | None = None
    """Steps (warm-up included) until ``min_lr``; required for cosine / linear decay."""
    use_distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (Megatron DistributedOptimizer)."""

    def __post_init__(self) -> None:
        _require(self.lr > 0, f"OptimizerConfig.lr must be > 0, got {self.lr!r}")
        _require(0 <= self.min_lr <= self.lr,
                 f"OptimizerConfig.min_lr must be in [0, OptimizerConfig.lr={self.lr}], got {self.min_lr!r}")
        for name in ("adam_beta1", "adam_beta2"):
            _require(0 <= getattr(self, name) < 1,
                     f"OptimizerConfig.{name} must be in [0, 1), got {getattr(self, name)!r}")
        _require(self.adam_eps > 0, f"OptimizerConfig.adam_eps must be > 0, got {self.adam_eps!r}")
        _require(self.weight_decay >= 0,
                 f"OptimizerConfig.weight_decay must be >= 0, got {self.weight_decay!r}")
        _require(self.clip_grad >= 0, f"OptimizerConfig.clip_grad must be >= 0, got {self.clip_grad!r}")
        _require(isinstance(self.lr_warmup_steps, int) and self.lr_warmup_steps >= 0,
                 f"OptimizerConfig.lr_warmup_steps must be an int >= 0, got {self.lr_warmup_steps!r}")
        _require(self.lr_decay_style in ("constant", "cosine", "linear"),
                 "OptimizerConfig.lr_decay_style must be 'constant', 'cosine' or 'linear', "
                 f"got {self.lr_decay_style!r}")
        if self.lr_decay_style != "constant":
            _require(isinstance(self.lr_decay_steps, int) and self.lr_decay_steps > self.lr_warmup_steps,
                     f"OptimizerConfig.lr_decay_steps must be an int > OptimizerConfig.lr_warmup_steps "
                     f"({self.lr_warmup_steps}) with lr_decay_style={self.lr_decay_style!r}, "
                     f"got {self.lr_decay_steps!r}")


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

    def validate_world_size(self, world_size: int) -> int:
        """Check ``world_size % (tp * pp) == 0`` (``ValueError`` naming the fields); return the DP size."""
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


def _check_keys(cls: type, d: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    _require(not unknown, f"{where}: unknown field(s) {unknown}; expected some of {sorted(known)}")
