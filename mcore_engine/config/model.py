"""``ModelConfig``: the GPT architecture (Megatron-Core ``TransformerConfig`` + ``GPTModel`` arguments)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcore_engine.config.checks import _bools, _check_keys, _positive_int, _require
from mcore_engine.config.lora import LoRAConfig
from mcore_engine.config.mla import MLAConfig, _validate_mla_model
from mcore_engine.config.moe import MoEConfig

__all__ = ["ModelConfig"]


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
