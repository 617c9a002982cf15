"""``OptimizerConfig``: Adam(W) with warm-up and a decay schedule."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_engine.config.checks import Block, is_int, is_number

__all__ = ["OptimizerConfig"]


@dataclass(kw_only=True)
class OptimizerConfig(Block):
    """Adam(W) through Megatron's ``get_megatron_optimizer``, with warm-up and a decay schedule."""

    PATH = "optimizer"

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
        self._bools("use_distributed_optimizer")
        self._numbers("lr", "adam_eps", strict=True)
        self._numbers("weight_decay", "clip_grad")
        self._require(is_number(self.min_lr) and 0 <= self.min_lr <= self.lr,
                      f"OptimizerConfig.min_lr must be in [0, OptimizerConfig.lr={self.lr}], "
                      f"got {self.min_lr!r}",
                      "min_lr", "lr")
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            self._require(is_number(v) and 0 <= v < 1, f"OptimizerConfig.{name} must be in [0, 1), got {v!r}",
                          name)
        self._ints("lr_warmup_steps", low=0)
        self._choice("lr_decay_style", ("constant", "cosine", "linear"))
        if self.lr_decay_style != "constant":
            steps = self.lr_decay_steps
            warmup = self.lr_warmup_steps
            self._require(is_int(steps) and steps > warmup,
                          f"OptimizerConfig.lr_decay_steps must be an int > OptimizerConfig.lr_warmup_steps "
                          f"({warmup}) with lr_decay_style={self.lr_decay_style!r}, got {steps!r}",
                          "lr_decay_steps", "lr_warmup_steps")
