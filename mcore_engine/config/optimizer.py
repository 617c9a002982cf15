"""``OptimizerConfig``: Adam(W) with warm-up and a decay schedule."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_engine.config.checks import _bools, _require

__all__ = ["OptimizerConfig"]


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
