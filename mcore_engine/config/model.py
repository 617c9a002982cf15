"""``ModelConfig``: the GPT architecture (Megatron-Core ``TransformerConfig`` + ``GPTModel`` arguments)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mcore_engine.config.checks import Block, is_number
from mcore_engine.config.gdn import GDNConfig
from mcore_engine.config.lora import LoRAConfig
from mcore_engine.config.mla import MLAConfig
from mcore_engine.config.moe import MoEConfig
from mcore_engine.config.mtp import MTP
from mcore_engine.config.rope import YaRNConfig
from mcore_engine.config.vision import VisionConfig

__all__ = ["ModelConfig"]


@dataclass(kw_only=True)
class ModelConfig(Block):
    """GPT architecture (Megatron-Core ``TransformerConfig`` + ``GPTModel`` arguments)."""

    PATH = "model"

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
    yarn: YaRNConfig | None = None
    """YaRN RoPE scaling (a mapping in YAML; gpt-oss); ``None``: no YaRN. Exclusive with
    ``rope_scaling_factor``."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates (GLM-4.5's ``partial_rotary_factor``): the
    first ``int(d * rotary_percent)`` (even) channels, as two halves; the rest pass through."""
    normalization: str = "RMSNorm"
    """``"RMSNorm"`` or ``"LayerNorm"``."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers."""
    swiglu: bool = True
    """Gated MLP ``act(gate) * (up + glu_linear_offset)`` (SwiGLU with the defaults); ``False`` means a
    GeLU MLP."""
    glu_activation: str = "silu"
    """The gated MLP's gate activation: ``"silu"`` or ``"quick_gelu"`` (``x * sigmoid(1.702 x)``,
    gpt-oss)."""
    glu_linear_offset: float = 0.0
    """Added to the gated MLP's up half (gpt-oss: 1.0)."""
    glu_clamp: float | None = None
    """Clamp of the gated MLP's inputs: ``gate.clamp(max=c)``, ``up.clamp(-c, c)`` (gpt-oss: 7.0;
    Megatron's ``activation_func_clamp_value``); ``None``: none."""
    tie_word_embeddings: bool = False
    """Share the input embedding and the output layer weight."""
    add_qkv_bias: bool = False
    """Bias on the QKV projection only (Qwen2 style); other linear layers have none."""
    add_bias_linear: bool = False
    """Bias on every linear layer: QKV and attention output, MLP and expert ``fc1`` / ``fc2``, the MoE
    router (gpt-oss; Megatron's ``add_bias_linear``). Implies the QKV bias."""
    attention_sinks: bool = False
    """A learnable logit per attention head in every softmax denominator (gpt-oss ``sinks``;
    Megatron's ``softmax_type="learnable"``, the core attention's ``softmax_offset``)."""
    sliding_window: int | None = None
    """Sliding-window attention: a query at position ``i`` sees keys ``i - W < j <= i`` (Hugging
    Face's ``sliding_window``, Megatron's ``window_size = (W - 1, 0)``); ``None``: full causal."""
    sliding_window_pattern: list[int] | None = None
    """Which layers use the window: one 0 / 1 per layer (1: windowed; Hugging Face's
    ``layer_types``); ``None``: every layer when ``sliding_window`` is set."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head (Qwen3 style)."""
    attention_output_gate: bool = False
    """Gate each attention head's output: ``o_h * sigmoid(W_g x)_h`` before ``linear_proj`` (Qwen3.5 /
    Qwen3-Next; Megatron's ``attention_output_gate``: per query group ``[q, gate, k, v]`` rows)."""
    zero_centered_norm: bool = False
    """RMSNorms scale by ``1 + w`` (``w`` stored, initialised to 0; Megatron's
    ``layernorm_zero_centered_gamma``): every layer, final, q / k norm, computed in fp32 (Qwen3.5)."""
    linear_attention: GDNConfig | None = None
    """Gated DeltaNet layers of a hybrid decoder (a mapping in YAML); ``None``: every layer attention."""
    make_vocab_size_divisible_by: int = 128
    """The padded vocab is a multiple of this times the tensor-parallel size (Megatron's rule)."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight initialisation."""
    hf_path: str | None = None
    """Optional Hugging Face checkpoint folder to import weights from."""
    fused_lm_head: bool = False
    """Compute the lm-head outputs from hidden states without materialising logits (when supported)."""
    core_attention: str = "sdpa"
    """Core attention of the local spec (TE's when it imports): ``"sdpa"`` (causal
    ``scaled_dot_product_attention`` per sequence, no ``[s, s]`` tensor kept, context parallel) or
    ``"local"`` (Megatron's ``DotProductAttention``; keeps ``[b, heads, s, s]`` scores; CP = 1 only)."""
    moe: MoEConfig | None = None
    """Mixture-of-experts layers (a mapping in YAML); ``None`` means a dense model."""
    lora: LoRAConfig | None = None
    """Low-rank adapters on a frozen base (a mapping in YAML); ``None`` means full fine-tuning."""
    mla: MLAConfig | None = None
    """Multi-latent attention (DeepSeek-V3; a mapping in YAML) instead of grouped-query attention;
    ``None``: GQA."""
    vision: VisionConfig | None = None
    """The vision tower and mRoPE of a vision-language model (a mapping in YAML; filled from a
    vision-language ``hf_path``); ``None``: a text model."""
    freeze_vision_tower: bool = False
    """Keep the vision tower's weights fixed: no gradients, no optimizer state."""
    mtp_num_layers: int = 0
    """Multi-token prediction modules (``num_nextn_predict_layers``; checks: ``config.mtp``): module
    ``i`` predicts token ``t + 1 + i`` from the trunk's hidden state and the embedding of token
    ``t + i``; in Hugging Face folders the decoder layers ``num_layers + i``. 0: none."""
    mtp_loss_scaling_factor: float = 0.0
    """Weight of the MTP cross-entropy (per module: summed over the loss-mask tokens, divided by the
    main loss's global token count; averaged over modules). 0: the modules are kept (loaded,
    exported, checkpointed) but not run, so every output equals a model without them."""
    head: str = "lm"
    """Output layer of the last stage: ``"lm"`` (vocab-parallel lm-head) or ``"value"`` (a scalar
    ``Linear(H, 1)`` with bias, replicated over TP: per-token ``values``, per-sequence ``scores``).
    A value trunk never ties its embeddings."""

    def __post_init__(self) -> None:
        self._ints("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_sequence_length",
                   "make_vocab_size_divisible_by")
        self._ints("num_query_groups", "ffn_hidden_size", "kv_channels", optional=True)
        self._bools("swiglu", "tie_word_embeddings", "add_qkv_bias", "qk_layernorm", "fused_lm_head",
                    "attention_output_gate", "zero_centered_norm", "add_bias_linear", "attention_sinks",
                    "freeze_vision_tower")
        self._check_gpt_oss_fields()
        self._require(self.kv_channels is not None or self.mla is not None
                      or self.hidden_size % self.num_attention_heads == 0,
                      f"ModelConfig.hidden_size ({self.hidden_size}) must be divisible by "
                      f"ModelConfig.num_attention_heads ({self.num_attention_heads}) unless "
                      "ModelConfig.kv_channels is set (or ModelConfig.mla: its head dims are its own)",
                      "hidden_size", "num_attention_heads", "kv_channels")
        self._numbers("rope_scaling_factor", strict=True, optional=True)
        self._require(self.num_attention_heads % self.query_groups == 0,
                      f"ModelConfig.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                      f"ModelConfig.num_query_groups ({self.query_groups})",
                      "num_query_groups", "num_attention_heads")
        self._choice("normalization", ("RMSNorm", "LayerNorm"))
        self._numbers("rotary_base", "norm_epsilon", "init_method_std", strict=True)
        pct, d = self.rotary_percent, self.kv_channels or self.hidden_size // self.num_attention_heads
        self._require(is_number(pct) and 0 < pct <= 1,
                      f"ModelConfig.rotary_percent must be a number in (0, 1], got {pct!r}", "rotary_percent")
        self._require(pct == 1 or (int(d * pct) >= 2 and int(d * pct) % 2 == 0),
                      f"ModelConfig.rotary_percent ({pct}) must rotate an even number >= 2 of the {d} "
                      f"channels per head, got int({d} * {pct}) = {int(d * pct)}", "rotary_percent")
        self._ints("mtp_num_layers", low=0)
        self._numbers("mtp_loss_scaling_factor")
        self._choice("head", ("lm", "value"))
        self._choice("core_attention", ("sdpa", "local"))
        self._require(not (self.head == "value" and self.fused_lm_head), "ModelConfig.fused_lm_head=True "
                      "needs ModelConfig.head='lm' (a value head has no vocabulary)", "fused_lm_head", "head")
        self._block("moe", MoEConfig)
        self._block("lora", LoRAConfig)
        self._block("mla", MLAConfig)
        self._block("linear_attention", GDNConfig)
        self._block("yarn", YaRNConfig)
        self._block("vision", VisionConfig)
        self._require(self.vision is not None or not self.freeze_vision_tower, "ModelConfig."
                      "freeze_vision_tower needs a vision tower (ModelConfig.vision)", "freeze_vision_tower",
                      "vision")
        self._require(self.yarn is None or self.rope_scaling_factor is None, "ModelConfig.yarn and "
                      "ModelConfig.rope_scaling_factor are two RoPE scalings: set one", "yarn",
                      "rope_scaling_factor")
        self._require(self.yarn is None or self.mla is None, "ModelConfig.yarn: multi-latent attention "
                      "has its own YaRN fields (ModelConfig.mla.rope_type)", "yarn", "mla")
        self._require(not self.zero_centered_norm or self.normalization == "RMSNorm",
                      "ModelConfig.zero_centered_norm needs normalization='RMSNorm'", "zero_centered_norm")
        for block in self.blocks():
            block.check(self, None)

    def _check_gpt_oss_fields(self) -> None:
        """The window, its layer pattern and the gated MLP's activation fields."""
        self._ints("sliding_window", optional=True)
        self._choice("glu_activation", ("silu", "quick_gelu"))
        self._numbers("glu_linear_offset", low=-math.inf)
        self._numbers("glu_clamp", strict=True, optional=True)
        pattern = self.sliding_window_pattern
        if pattern is not None:
            self._require(self.sliding_window is not None, "ModelConfig.sliding_window_pattern needs "
                          "ModelConfig.sliding_window", "sliding_window_pattern", "sliding_window")
            self._require(isinstance(pattern, list) and len(pattern) == self.num_layers
                          and all(v in (0, 1) and not isinstance(v, float) for v in pattern),
                          f"ModelConfig.sliding_window_pattern must be a list of {self.num_layers} 0 / 1 "
                          f"values (one per layer), got {pattern!r}", "sliding_window_pattern")
            self.sliding_window_pattern = [int(v) for v in pattern]
        gated_fields = (self.glu_activation != "silu" or self.glu_linear_offset != 0
                        or self.glu_clamp is not None)
        self._require(self.swiglu or not gated_fields, "ModelConfig.glu_activation / glu_linear_offset / "
                      "glu_clamp need the gated MLP (ModelConfig.swiglu=True)", "swiglu")

    def blocks(self) -> list[Any]:
        """The feature blocks this model uses, each with ``check(model, parallel)``."""
        return [b for b in (self.mla, self.lora, self.moe, self.linear_attention, self.vision)
                if b is not None] + [MTP]

    @property
    def query_groups(self) -> int:
        """Resolved number of key/value groups."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        """Resolved MLP width."""
        return self.ffn_hidden_size or 4 * self.hidden_size
