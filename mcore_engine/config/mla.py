"""``MLAConfig`` (``ModelConfig.mla``): DeepSeek's multi-latent attention, its checks against the model
and the layout.

Megatron-Core's ``MLASelfAttention`` per token ``x [h]``, ``n`` heads::

    c_q = rmsnorm(W_qd x)                     # [q_lora_rank]   (q_lora_rank=None: q = W_q x)
    q = W_qu c_q                              # [n, qk_head_dim + qk_pos_emb_head_dim]
    c_kv, k_pe = split(W_kvd x)               # [kv_lora_rank], [qk_pos_emb_head_dim] (one per token)
    k_nope, v = split(W_kvu rmsnorm(c_kv))    # [n, qk_head_dim], [n, v_head_dim]
    q = [q_nope, rope(q_pe)]; k = [k_nope, rope(k_pe)]
    out = W_o softmax(m^2 q k^T / sqrt(qk_head_dim + qk_pos_emb_head_dim)) v

``rope``: plain or YaRN (frequencies blended between ``1 / rotary_scaling_factor`` and 1 by
``beta_fast`` / ``beta_slow``, cos / sin scaled by ``mscale(f, mscale) / mscale(f, mscale_all_dim)``);
``m = mscale(f, mscale_all_dim)``, ``mscale(f, a) = 0.1 a ln f + 1`` (1 for ``f <= 1``). The latent
norms use epsilon ``layers.mla.LATENT_NORM_EPS`` on the local spec. Training memory per layer: the
latents ``[s, q_lora_rank + kv_lora_rank + qk_pos_emb_head_dim]`` plus the expanded ``q, k, v``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_engine.config.checks import Block, require

__all__ = ["MLAConfig"]

_ROPE_TYPES = ("rope", "yarn")
_YARN_DEFAULTS = dict(rotary_scaling_factor=1.0, original_max_position_embeddings=4096, beta_fast=32.0,
                      beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0)


@dataclass(kw_only=True)
class MLAConfig(Block):
    """Multi-latent attention (Megatron-Core ``MLASelfAttention``; see the module docstring)."""

    PATH = "model.mla"

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
        self._ints("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim",
                   "original_max_position_embeddings")
        self._ints("q_lora_rank", optional=True)
        self._require(self.qk_pos_emb_head_dim % 2 == 0, "MLAConfig.qk_pos_emb_head_dim must be even (RoPE "
                      f"rotates pairs), got {self.qk_pos_emb_head_dim}", "qk_pos_emb_head_dim")
        self._choice("rope_type", _ROPE_TYPES)
        self._numbers("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        self._numbers("rotary_scaling_factor", strict=True)
        if self.rope_type == "rope":
            changed = sorted(k for k, v in _YARN_DEFAULTS.items() if getattr(self, k) != v)
            self._require(not changed, f"MLAConfig.{', '.join(changed)}: YaRN fields apply to "
                          f"rope_type='yarn' only; with rope_type='rope' they stay at {_YARN_DEFAULTS}",
                          *changed)

    @property
    def q_head_dim(self) -> int:
        """Query / key channels per head, ``qk_head_dim + qk_pos_emb_head_dim``."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim

    def check(self, model: Any, parallel: Any) -> None:
        """GQA fields left at their defaults, no LoRA, SDPA core attention; the down projections'
        rows (``q_lora_rank``, ``kv_lora_rank + qk_pos_emb_head_dim``: the local spec's
        ``ColumnParallelLinear``) divisible by TP."""
        m = model
        wrong = {
            "num_query_groups": m.num_query_groups is not None,  # every head has its own k / v
            "kv_channels": m.kv_channels is not None,  # head dims come from MLAConfig
            "add_qkv_bias": m.add_qkv_bias,
            "qk_layernorm": m.qk_layernorm,  # the latent norms are always on
            "rope_scaling_factor": m.rope_scaling_factor is not None,  # MLA's RoPE scaling is YaRN
            "rotary_percent": m.rotary_percent != 1.0,
        }
        bad = [name for name, hit in wrong.items() if hit]
        require(not bad, f"ModelConfig.{', '.join(bad)}: not used with ModelConfig.mla (multi-latent "
                "attention has per-head k / v from its latents, MLAConfig head dims, latent norms and "
                "MLAConfig RoPE); leave them at their defaults (None / False / 1.0)",
                *(f"model.{b}" for b in bad), "model.mla")
        require(m.lora is None, "ModelConfig.lora with ModelConfig.mla: adapters on the MLA projections "
                "(linear_q_*_proj / linear_kv_*_proj) are not supported yet", "model.lora", "model.mla")
        require(m.core_attention == "sdpa", "ModelConfig.core_attention must be 'sdpa' with ModelConfig.mla "
                "(Megatron's local DotProductAttention does not take MLA's key / value head dims), got "
                f"{m.core_attention!r}", "model.core_attention", "model.mla")
        if parallel is None:
            return
        tp = parallel.tensor_model_parallel_size
        require(self.q_lora_rank is None or self.q_lora_rank % tp == 0,
                f"MLAConfig.q_lora_rank ({self.q_lora_rank}) must be divisible by "
                f"ParallelConfig.tensor_model_parallel_size ({tp})",
                "parallel.tensor_model_parallel_size", "model.mla.q_lora_rank")
        kv_down = self.kv_lora_rank + self.qk_pos_emb_head_dim
        require(kv_down % tp == 0, f"MLAConfig.kv_lora_rank + qk_pos_emb_head_dim ({kv_down}) must be "
                f"divisible by ParallelConfig.tensor_model_parallel_size ({tp})",
                "parallel.tensor_model_parallel_size", "model.mla.kv_lora_rank")
