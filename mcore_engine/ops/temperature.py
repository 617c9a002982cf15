"""Temperature handling: the unit check, out-of-place scaling, and per-row normalisation.

``z = logits / temperature``; a host scalar equal to 1 never divides (no copy, no device sync);
any tensor temperature (even ``tensor(1.0)``) takes the general path, per token.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

Temperature = float | int | torch.Tensor


def is_scalar_unit_temperature(t: object) -> bool:
    """True only for a non-tensor real number equal to 1 (``1``, ``1.0``); bool is not a number here."""
    return isinstance(t, Real) and not isinstance(t, bool) and not isinstance(t, torch.Tensor) and t == 1


def _check_temperature(t: object, lead_shape: tuple[int, ...]) -> None:
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.bool or t.dtype.is_complex:
            raise ValueError(f"temperature must be a real-valued tensor, got dtype {t.dtype}")
        try:
            torch.broadcast_shapes(tuple(t.shape), lead_shape)
        except RuntimeError:
            raise ValueError(f"temperature must be a number, a 0-d tensor or a tensor broadcastable to "
                             f"logits.shape[:-1] = {lead_shape}, got shape {tuple(t.shape)}") from None
        if t.numel() and not bool(torch.isfinite(t).all() & (t > 0).all()):
            raise ValueError("temperature must be finite and > 0 everywhere")
        return
    if isinstance(t, bool) or not isinstance(t, Real):
        raise ValueError(f"temperature must be a number or a tensor, got {type(t).__name__}")
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {t!r}")


def scale_logits_by_temperature(logits: torch.Tensor, t: Temperature) -> torch.Tensor:
    """``logits`` itself when ``t`` is a host-scalar 1, else ``logits / t`` out of place.

    A tensor ``t`` of shape broadcastable to ``logits.shape[:-1]`` applies per token
    (``logits / t[..., None]``); a 0-d tensor or number applies to all. Differentiable.
    Memory: one logits-sized copy unless unit.
    """
    _check_temperature(t, tuple(logits.shape[:-1]))
    if is_scalar_unit_temperature(t):
        return logits
    if isinstance(t, torch.Tensor) and t.dim() > 0:
        t = t.unsqueeze(-1)
    return logits / t


def temperature_rows(t: Temperature, lead_shape: tuple[int, ...],
                     device: torch.device) -> float | torch.Tensor | None:
    """Normalise a checked temperature for the chunk loop.

    Returns None for a host-scalar 1 (never divide), a float for any other host scalar, or a
    detached float32 tensor ``[N]`` (N = prod(lead_shape)) for a tensor temperature.
    """
    _check_temperature(t, lead_shape)
    if is_scalar_unit_temperature(t):
        return None
    if not isinstance(t, torch.Tensor):
        return float(t)
    n = math.prod(lead_shape)
    return t.detach().to(device=device, dtype=torch.float32).broadcast_to(lead_shape).reshape(n)
