"""``GDNConfig`` (``ModelConfig.linear_attention``): the Gated DeltaNet layers of a hybrid model
(Qwen3.5 / Qwen3-Next), which of the decoder layers they are, and their checks against the layout.

One GDN layer, per token ``x [h]``, ``nk`` key heads of ``dk`` channels, ``nv`` value heads of ``dv``
(each key head serves ``nv / nk`` consecutive value heads)::

    q, k, v = silu(causal_conv1d(W_qkv x))       # depthwise, kernel conv_kernel_dim, per sequence
    q, k = l2norm(q), l2norm(k)                  # per head, then q * dk ** -0.5
    beta = sigmoid(W_b x);  g = -exp(A_log) * softplus(W_a x + dt_bias)       # [nv]
    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T      # [dk, dv] per head
    o_t = S_t^T q_t;  out = W_o (w * rmsnorm(o) * silu(W_z x))

The state is reset at every sequence boundary. Memory per layer: the projections, ``[s, nv, dv]``
outputs, and (``recompute: false``) one ``[chunk, chunk]`` block per head and chunk
(``ops.gated_delta``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_engine.config.checks import Block, require

__all__ = ["GDNConfig", "LAYER_TYPES"]

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(kw_only=True)
class GDNConfig(Block):
    """Gated DeltaNet linear attention in a hybrid decoder (see the module docstring)."""

    PATH = "model.linear_attention"

    num_key_heads: int
    """Query / key heads ``nk`` (``linear_num_key_heads``)."""
    num_value_heads: int
    """Value heads ``nv``, a multiple of ``num_key_heads`` (``linear_num_value_heads``)."""
    key_head_dim: int
    """Channels per query / key head ``dk`` (``linear_key_head_dim``)."""
    value_head_dim: int
    """Channels per value head ``dv`` (``linear_value_head_dim``)."""
    conv_kernel_dim: int = 4
    """Width of the causal depthwise convolution over q, k, v (``linear_conv_kernel_dim``)."""
    full_attention_interval: int = 4
    """Every ``n``-th layer (1-based) is full attention, the others GDN, unless ``layer_types``."""
    layer_types: list[str] | None = None
    """Per decoder layer ``"linear_attention"`` or ``"full_attention"``; ``None``: from
    ``full_attention_interval``."""
    chunk_size: int = 64
    """Tokens per chunk of the chunked delta rule (``ops.gated_delta``): ``[chunk, chunk]`` blocks."""
    recompute: bool = True
    """Recompute the conv and the chunked rule in the backward (kept: their inputs, about an attention
    layer's q, k, v); ``False`` keeps the rule's intermediates (~19x its output) and skips one
    forward of the rule."""

    def __post_init__(self) -> None:
        self._ints("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel_dim",
                   "full_attention_interval", "chunk_size")
        self._bools("recompute")
        self._require(self.num_value_heads % self.num_key_heads == 0,
                      f"GDNConfig.num_value_heads ({self.num_value_heads}) must be a multiple of "
                      f"GDNConfig.num_key_heads ({self.num_key_heads})", "num_value_heads", "num_key_heads")
        types = self.layer_types
        ok = types is None or (isinstance(types, list | tuple) and all(t in LAYER_TYPES for t in types))
        self._require(ok,
                      f"GDNConfig.layer_types must be None or a list of {LAYER_TYPES}, got {types!r}",
                      "layer_types")
        if types is not None:
            self.layer_types = list(types)

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def layer_pattern(self, num_layers: int) -> list[bool]:
        """Per decoder layer: True for GDN, False for full attention."""
        if self.layer_types is not None:
            return [t == "linear_attention" for t in self.layer_types]
        return [(i + 1) % self.full_attention_interval != 0 for i in range(num_layers)]

    def check(self, model: Any, parallel: Any) -> None:
        """``layer_types`` as long as the model; heads split evenly over TP (and over TP x CP: context
        parallelism hands each CP rank whole heads of the full sequences)."""
        if self.layer_types is not None:
            require(len(self.layer_types) == model.num_layers,
                    f"GDNConfig.layer_types has {len(self.layer_types)} entries for ModelConfig.num_layers "
                    f"= {model.num_layers}", "model.linear_attention.layer_types", "model.num_layers")
        require(model.mla is None, "ModelConfig.linear_attention with ModelConfig.mla: a hybrid decoder has "
                "grouped-query attention layers", "model.linear_attention", "model.mla")
        if parallel is None:
            return
        split = parallel.tensor_model_parallel_size * parallel.context_parallel_size
        for name in ("num_key_heads", "num_value_heads"):
            heads = getattr(self, name)
            require(heads % split == 0,
                    f"GDNConfig.{name} ({heads}) must be divisible by tensor_model_parallel_size x "
                    f"context_parallel_size ({split}): each rank holds whole GDN heads",
                    f"model.linear_attention.{name}", "parallel.tensor_model_parallel_size",
                    "parallel.context_parallel_size")
