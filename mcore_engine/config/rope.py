"""``YaRNConfig`` (``ModelConfig.yarn``): YaRN RoPE scaling of a GPT model's attention (gpt-oss).

Per rotary channel pair ``i`` of ``d`` (base frequency ``b_i = theta^(-2i/d)``)::

    r_i = L_orig * b_i / (2 pi)                      # rotations over the original context
    ramp_i = clamp((i - low) / (high - low), 0, 1)    # low, high: pairs with r_i = beta_fast, beta_slow
    freq_i = b_i / f * ramp_i + b_i * (1 - ramp_i)    # slow pairs interpolated, fast ones kept
    cos, sin *= mscale(f, mscale) / mscale(f, mscale_all_dim),   mscale(f, a) = 0.1 a ln f + 1

``truncate`` rounds ``low`` down and ``high`` up (Megatron's ``correction_range_round_to_int``;
gpt-oss keeps them fractional). Megatron-Core's ``YarnRotaryEmbedding``; no memory beyond the
``[max_sequence_length, d]`` table.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcore_engine.config.checks import Block

__all__ = ["YaRNConfig"]


@dataclass(kw_only=True)
class YaRNConfig(Block):
    """YaRN RoPE (see the module docstring); Hugging Face ``rope_scaling`` with ``rope_type: yarn``."""

    PATH = "model.yarn"

    factor: float
    """Context extension factor ``f`` (> 0)."""
    original_max_position_embeddings: int
    """The pre-extension context length ``L_orig``."""
    beta_fast: float = 32.0
    """Rotations above which a frequency is kept (extrapolated)."""
    beta_slow: float = 1.0
    """Rotations below which a frequency is divided by ``f`` (interpolated)."""
    truncate: bool = True
    """Round the correction range to whole channel pairs (False: gpt-oss)."""
    mscale: float = 1.0
    """Numerator coefficient of the cos / sin scale."""
    mscale_all_dim: float = 0.0
    """Denominator coefficient of the cos / sin scale."""

    def __post_init__(self) -> None:
        self._numbers("factor", strict=True)
        self._ints("original_max_position_embeddings")
        self._numbers("beta_fast", "beta_slow", "mscale", "mscale_all_dim")
        self._bools("truncate")
        self._require(self.beta_fast > self.beta_slow, f"YaRNConfig.beta_fast ({self.beta_fast}) must "
                      f"exceed YaRNConfig.beta_slow ({self.beta_slow})", "beta_fast", "beta_slow")
