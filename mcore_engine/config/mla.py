"""``MLAConfig`` (``ModelConfig.mla``): DeepSeek's multi-latent attention, and its checks against the
model and the parallel layout.

Megatron-Core's ``MLASelfAttention`` per token ``x [h]``, ``n`` heads (field names as Megatron's
``MLATransformerConfig``)::

    c_q = rmsnorm(W_qd x)                     # [q_lora_rank]   (q_lora_rank=None: q = W_q x)
    q = W_qu c_q                              # [n, qk_head_dim + qk_pos_emb_head_dim]
    c_kv, k_pe = split(W_kvd x)               # [kv_lora_rank], [qk_pos_emb_head_dim] (one per token)
    k_nope, v = split(W_kvu rmsnorm(c_kv))    # [n, qk_head_dim], [n, v_head_dim]
    q = [q_nope, rope(q_pe)]; k = [k_nope, rope(k_pe)]
    out = W_o softmax(m^2 q k^T / sqrt(qk_head_dim + qk_pos_emb_head_dim)) v

``rope`` rotates the (interleaved) pairs of the ``qk_pos_emb_head_dim`` position dims, ``rope_type``
``"rope"`` or YaRN (``"yarn"``: frequencies blended between ``1 / rotary_scaling_factor`` and 1 by
``beta_fast`` / ``beta_slow``, cos / sin scaled by ``mscale(f, mscale) / mscale(f, mscale_all_dim)``);
``m = mscale(f, mscale_all_dim)`` with ``mscale(f, a) = 0.1 a ln f + 1`` (1 for ``f <= 1``). The two
latent norms use epsilon ``mcore_engine.layers.mla.LATENT_NORM_EPS`` (1e-6: DeepSeek's and
``transformers``', whatever the layers' ``rms_norm_eps``) on the local spec; Transformer Engine's
spec fuses them into the up projections with ``ModelConfig.norm_epsilon``. KV-cache-free training
memory per layer: the latents ``[s, q_lora_rank + kv_lora_rank + qk_pos_emb_head_dim]`` plus the
expanded ``q, k, v``.

This module does not import ``config`` (``config`` imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mcore_engine.config.checks import _positive_int, _require

__all__ = ["MLAConfig"]

_ROPE_TYPES = ("rope", "yarn")
_YARN_DEFAULTS = dict(rotary_scaling_factor=1.0, original_max_position_embeddings=4096, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)


@dataclass(kw_only=True)
class MLAConfig:
    """Multi-latent attention (Megatron-Core ``MLASelfAttention``; see the module docstring)."""

    q_lora_rank: int | None = None
    """Rank of the query latent ``c_q`` (``linear_q_down_proj`` / ``q_layernorm`` /
    ``linear_q_up_proj``); ``None``: one full query projection ``linear_q_proj`` (DeepSeek-V2-Lite,
    Moonlight)."""
    kv_lora_rank: int
    """Rank of the key / value latent ``c_kv``."""
    qk_head_dim: int
    """Per-head query / key channels without position embedding (``qk_nope_head_dim``)."""
    qk_pos_emb_head_dim: int
    """Per-head query / key channels with RoPE (``qk_rope_head_dim``); the key's are shared by all heads."""
    v_head_dim: int
    """Per-head value channels."""
    rope_type: str = "rope"
    """``"rope"`` (plain RoPE, ``ModelConfig.rotary_base``) or ``"yarn"`` (the fields below)."""
    rotary_scaling_factor: float = 1.0
    """YaRN: context extension factor ``f``."""
    original_max_position_embeddings: int = 4096
    """YaRN: the pre-extension context length."""
    beta_fast: float = 32.0
    """YaRN: rotations above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """YaRN: rotations below which a frequency is divided by ``f`` (interpolated)."""
    mscale: float = 1.0
    """YaRN: numerator coefficient of the cos / sin scale
    ``mscale(f, mscale) / mscale(f, mscale_all_dim)``."""
    mscale_all_dim: float = 0.0
    """YaRN: denominator coefficient of that scale, and of the softmax scale ``mscale(f, mscale_all_dim)^2``
    (0: no softmax rescaling)."""

    def __post_init__(self) -> None:
        _positive_int(self, "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                      "original_max_position_embeddings")
        if self.q_lora_rank is not None:
            _positive_int(self, "q_lora_rank")
        _require(self.qk_pos_emb_head_dim % 2 == 0,
                 "MLAConfig.qk_pos_emb_head_dim must be even (RoPE rotates pairs), got "
                 f"{self.qk_pos_emb_head_dim}")
        _require(self.rope_type in _ROPE_TYPES,
                 f"MLAConfig.rope_type must be one of {_ROPE_TYPES}, got {self.rope_type!r}")
        for name in ("rotary_scaling_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0,
                     f"MLAConfig.{name} must be a finite number >= 0, got {v!r}")
        _require(self.rotary_scaling_factor > 0,
                 f"MLAConfig.rotary_scaling_factor must be > 0, got {self.rotary_scaling_factor!r}")
        if self.rope_type == "rope":
            changed = sorted(k for k, v in _YARN_DEFAULTS.items() if getattr(self, k) != v)
            _require(not changed, f"MLAConfig.{', '.join(changed)}: YaRN fields apply to rope_type='yarn' "
                                  f"only; with rope_type='rope' they stay at {_YARN_DEFAULTS}")

    @property
    def q_head_dim(self) -> int:
        """Query / key channels per head, ``qk_head_dim + qk_pos_emb_head_dim``."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim


def _validate_mla_model(m: Any) -> None:
    """MLA x ``ModelConfig`` rules (``ValueError`` naming the fields); ``m`` is a ``ModelConfig``."""
    if m.mla is None:
        return
    wrong = {
        "num_query_groups": m.num_query_groups is not None,  # every head has its own k / v
        "kv_channels": m.kv_channels is not None,  # head dims come from MLAConfig
        "add_qkv_bias": m.add_qkv_bias,
        "qk_layernorm": m.qk_layernorm,  # the latent norms are always on
        "rope_scaling_factor": m.rope_scaling_factor is not None,  # MLA's RoPE scaling is YaRN
        "rotary_percent": m.rotary_percent != 1.0,
    }
    bad = [name for name, hit in wrong.items() if hit]
    _require(not bad, f"ModelConfig.{', '.join(bad)}: not used with ModelConfig.mla (multi-latent "
                      "attention has per-head k / v from its latents, MLAConfig head dims, latent norms and "
                      "MLAConfig RoPE); leave them at their defaults (None / False / 1.0)")
    _require(m.lora is None, "ModelConfig.lora with ModelConfig.mla: adapters on the MLA projections "
                             "(linear_q_*_proj / linear_kv_*_proj) are not supported yet")
    _require(m.core_attention == "sdpa",
             "ModelConfig.core_attention must be 'sdpa' with ModelConfig.mla (Megatron's local "
             f"DotProductAttention does not take MLA's key / value head dims), got {m.core_attention!r}")


def _validate_mla_layout(m: Any, p: Any) -> None:
    """MLA x parallel-layout rules: the local spec's ``ColumnParallelLinear`` down projections split
    ``q_lora_rank`` and ``kv_lora_rank + qk_pos_emb_head_dim`` rows over TP (the heads are checked with
    every model). ``m`` is a ``ModelConfig``, ``p`` a ``ParallelConfig``."""
    if m.mla is None:
        return
    tp, mla = p.tensor_model_parallel_size, m.mla
    _require(mla.q_lora_rank is None or mla.q_lora_rank % tp == 0,
             f"MLAConfig.q_lora_rank ({mla.q_lora_rank}) must be divisible by "
             f"ParallelConfig.tensor_model_parallel_size ({tp})")
    kv_down = mla.kv_lora_rank + mla.qk_pos_emb_head_dim
    _require(kv_down % tp == 0,
             f"MLAConfig.kv_lora_rank + qk_pos_emb_head_dim ({kv_down}) must be divisible by "
             f"ParallelConfig.tensor_model_parallel_size ({tp})")
