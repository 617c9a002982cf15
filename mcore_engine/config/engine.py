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

from mcore_engine.config.checks import _bools, _positive_int, _require
from mcore_engine.config.lora import LoRAConfig
from mcore_engine.config.mla import MLAConfig, _validate_mla_layout, _validate_mla_model
from mcore_engine.config.moe import MoEConfig, _validate_moe_layout
from mcore_engine.config.mtp import validate_mtp

__all__ = ["EngineConfig", "ModelConfig", "OptimizerConfig", "ParallelConfig"]


_RECOMPUTE_MODULES = ("core_attn", "layernorm", "mlp")


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
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates (GLM-4.5's ``partial_rotary_factor``): the
    first ``int(d * rotary_percent)`` (even) channels, as two halves; the rest pass through."""
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
    core_attention: str = "sdpa"
    """Core attention of the local layer spec (without Transformer Engine; TE's is used when it
    imports): ``"sdpa"`` (:class:`~mcore_engine.layers.attention.SDPACoreAttention`: causal
    ``scaled_dot_product_attention`` per sequence, no ``[s, s]`` tensor kept for backward, context
    parallel) or ``"local"`` (Megatron's ``DotProductAttention`` + packed sequences; keeps
    ``[b, heads, s, s]`` scores; CP = 1 only)."""
    moe: MoEConfig | None = None
    """Mixture-of-experts layers (a mapping in YAML); ``None`` means a dense model."""
    lora: LoRAConfig | None = None
    """Low-rank adapters on a frozen base (a mapping in YAML); ``None`` means full fine-tuning."""
    mla: MLAConfig | None = None
    """Multi-latent attention (DeepSeek-V3; a mapping in YAML) instead of grouped-query attention;
    ``None``: GQA."""
    mtp_num_layers: int = 0
    """Multi-token prediction modules (DeepSeek-V3's ``num_nextn_predict_layers``): module ``i``
    predicts token ``t + 1 + i`` from the main trunk's hidden state and the embedding of token
    ``t + i``. Loaded from and exported to the Hugging Face folder (as extra decoder layers
    ``model.layers.{num_layers + i}``); 0: none."""
    mtp_loss_scaling_factor: float = 0.0
    """Weight of the MTP cross-entropy in the training loss, each module's loss summed over the
    loss-mask tokens and divided by the same global token count as the main loss, then averaged over
    modules. 0 (default): the MTP modules are kept (loaded, exported, checkpointed) but are not run
    and do not train, so every output equals a model without them."""
    head: str = "lm"
    """Output layer of the last stage: ``"lm"`` (vocab-parallel lm-head: log-probs, entropy, ...) or
    ``"value"`` (a scalar head ``Linear(H, 1)`` with bias, replicated over tensor-parallel ranks:
    per-token ``values`` and per-sequence ``scores``; a critic or reward model). The value trunk
    never ties its embeddings (``tie_word_embeddings`` only describes the source checkpoint)."""

    def __post_init__(self) -> None:
        _positive_int(self, "num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                      "max_sequence_length", "make_vocab_size_divisible_by")
        _bools(self, "swiglu", "tie_word_embeddings", "add_qkv_bias", "qk_layernorm", "fused_lm_head")
        for name in ("num_query_groups", "ffn_hidden_size", "kv_channels"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        _require(self.kv_channels is not None or self.mla is not None
                 or self.hidden_size % self.num_attention_heads == 0,
                 f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                 f"ModelConfig.num_attention_heads ({self.num_attention_heads}) unless "
                 "ModelConfig.kv_channels is set (or ModelConfig.mla: its head dims are its own)")
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
        if isinstance(self.moe, dict):
            _check_keys(MoEConfig, self.moe, "ModelConfig.moe")
            self.moe = MoEConfig(**self.moe)
        _require(self.moe is None or isinstance(self.moe, MoEConfig),
                 f"ModelConfig.moe must be None, a MoEConfig or a mapping, got {type(self.moe).__name__}")
        if isinstance(self.lora, dict):
            _check_keys(LoRAConfig, self.lora, "ModelConfig.lora")
            self.lora = LoRAConfig(**self.lora)
        _require(self.lora is None or isinstance(self.lora, LoRAConfig),
                 f"ModelConfig.lora must be None, a LoRAConfig or a mapping, got {type(self.lora).__name__}")
        self._check_rope_and_mla()
        if self.lora is not None:
            targets = self.lora.targets(self.swiglu)
            _require(self.moe is None or not {"linear_fc1", "linear_fc2"} & set(targets),
                     "ModelConfig.lora.target_modules: the MLP linears of a MoE model are its experts' "
                     "(not supported: target the attention linears q_proj / k_proj / v_proj / o_proj)")
            _require(self.head == "lm", "ModelConfig.lora needs ModelConfig.head='lm' (no LoRA critic)")
            _require(self.lora.adapter_path is None or self.hf_path is not None,
                     "ModelConfig.lora.adapter_path needs ModelConfig.hf_path (the base the adapters were "
                     "trained on)")
        if self.moe is not None and isinstance(self.moe.layer_freq, list):
            _require(len(self.moe.layer_freq) == self.num_layers,
                     f"MoEConfig.layer_freq has {len(self.moe.layer_freq)} entries, "
                     f"ModelConfig.num_layers is {self.num_layers}")
        _require(isinstance(self.mtp_num_layers, int) and not isinstance(self.mtp_num_layers, bool)
                 and self.mtp_num_layers >= 0,
                 f"ModelConfig.mtp_num_layers must be an int >= 0, got {self.mtp_num_layers!r}")
        f = self.mtp_loss_scaling_factor
        _require(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f >= 0,
                 f"ModelConfig.mtp_loss_scaling_factor must be a finite number >= 0, got {f!r}")
        _require(f == 0 or self.mtp_num_layers > 0,
                 "ModelConfig.mtp_loss_scaling_factor > 0 needs ModelConfig.mtp_num_layers > 0")
        _require(self.head in ("lm", "value"), f"ModelConfig.head must be 'lm' or 'value', got {self.head!r}")
        _require(self.core_attention in ("sdpa", "local"),
                 f"ModelConfig.core_attention must be 'sdpa' or 'local', got {self.core_attention!r}")
        _require(not (self.head == "value" and self.fused_lm_head),
                 "ModelConfig.fused_lm_head=True needs ModelConfig.head='lm' (a value head has no "
                 "vocabulary)")

    def _check_rope_and_mla(self) -> None:
        """``rotary_percent`` and ``mla`` (a mapping becomes an ``MLAConfig``)."""
        pct = self.rotary_percent
        _require(isinstance(pct, (int, float)) and not isinstance(pct, bool) and 0 < pct <= 1,
                 f"ModelConfig.rotary_percent must be a number in (0, 1], got {pct!r}")
        d = self.kv_channels or self.hidden_size // self.num_attention_heads
        _require(pct == 1 or (int(d * pct) >= 2 and int(d * pct) % 2 == 0),
                 f"ModelConfig.rotary_percent ({pct}) must rotate an even number >= 2 of the {d} channels "
                 f"per head, got int({d} * {pct}) = {int(d * pct)}")
        if isinstance(self.mla, dict):
            _check_keys(MLAConfig, self.mla, "ModelConfig.mla")
            self.mla = MLAConfig(**self.mla)
        _require(self.mla is None or isinstance(self.mla, MLAConfig),
                 f"ModelConfig.mla must be None, an MLAConfig or a mapping, got {type(self.mla).__name__}")
        _validate_mla_model(self)

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
    """Megatron sequence parallelism (needs TP > 1): norms, dropout and the MoE router see ``s / tp``
    tokens; micro-batches are padded to a multiple of TP. CPU (gloo) and GPU."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split each MoE layer's experts (carved out of TP x DP, as Megatron does)."""
    expert_tensor_parallel_size: int | None = None
    """ETP: ranks that shard each expert's FFN; ``None`` means ``tensor_model_parallel_size``.
    Per pipeline stage ``tp * cp * dp == etp * ep * edp`` (edp: the experts' data-parallel size)."""
    context_parallel_size: int = 1
    """CP: ranks that split every sequence (load-balanced: 2 x CP chunks, rank r holds r and
    2CP-1-r); each receives the whole batch, like TP ranks. World = TP x PP x CP x DP."""
    cp_comm_type: str = "p2p"
    """Transformer Engine's CP exchange (GPU with TE): ``p2p``, ``all_gather`` or ``a2a``. Without TE
    the engine's own attention all-gathers K / V."""

    def __post_init__(self) -> None:
        _positive_int(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "expert_model_parallel_size", "context_parallel_size")
        _require(self.cp_comm_type in ("p2p", "all_gather", "a2a"),
                 "ParallelConfig.cp_comm_type must be 'p2p', 'all_gather' or 'a2a', "
                 f"got {self.cp_comm_type!r}")
        _bools(self, "batch_p2p_comm", "sequence_parallel")
        if self.expert_tensor_parallel_size is not None:
            _positive_int(self, "expert_tensor_parallel_size")
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

    @property
    def expert_tensor_size(self) -> int:
        """Resolved ETP."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size // (tp * pp * cp)``; ``ValueError`` unless ``world_size`` is a multiple of it."""
        tp, pp, cp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                      self.context_parallel_size)
        _require(isinstance(world_size, int) and world_size >= 1 and world_size % (tp * pp * cp) == 0,
                 f"world_size ({world_size}) must be a positive multiple of "
                 f"ParallelConfig.tensor_model_parallel_size ({tp}) x "
                 f"ParallelConfig.pipeline_model_parallel_size ({pp}) x "
                 f"ParallelConfig.context_parallel_size ({cp})")
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_size
        _require(world_size % (etp * ep * pp) == 0,
                 f"world_size ({world_size}) must be a multiple of "
                 f"ParallelConfig.expert_tensor_parallel_size ({etp}) x "
                 f"ParallelConfig.expert_model_parallel_size ({ep}) x "
                 f"ParallelConfig.pipeline_model_parallel_size ({pp})")
        return world_size // (tp * pp * cp)


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
        _bools(self, "use_distributed_optimizer")
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


def _check_keys(cls: type, d: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    _require(not unknown, f"{where}: unknown field(s) {unknown}; expected some of {sorted(known)}")
