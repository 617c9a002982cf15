"""Sampled-token estimators of KL(pi || ref), ``logp = log pi(x)``, ``logr = log ref(x)``::

    k1 = logp - logr                                   # unbiased, high variance
    d  = (logr - logp).clamp(-20, 20)
    k3 = (torch.expm1(d) - d).clamp(max=10)            # == exp(d) - 1 - d >= 0, low variance

Elementwise, in the inputs' dtype; tokens beyond a clamp get no gradient.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS: tuple[str, ...] = ("k1", "k3")
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def kl_estimator(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token ``k1`` or ``k3`` (module docstring); ``ref_log_probs`` is a constant."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kind must be one of {KL_ESTIMATORS}, got {kind!r}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(f"ref_log_probs must have the shape of log_probs {tuple(log_probs.shape)}, "
                         f"got {tuple(ref_log_probs.shape)}")
    if kind == "k1":
        return log_probs - ref_log_probs
    d = (ref_log_probs - log_probs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.expm1(d) - d).clamp(max=K3_VALUE_CLAMP)
