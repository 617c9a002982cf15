"""Temperature ``z = logits / t`` (a host scalar 1 never divides). A tensor ``t`` broadcasts to
``logits.shape[:-1]`` without growing it, optionally with a trailing 1 (``[N]``, ``[N, 1]``, ``[B, 1]``).
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from mcore_engine.ops._common import DEFAULT_CHUNK_ELEMENTS

Temperature = float | int | torch.Tensor


def is_scalar_unit_temperature(t: object) -> bool:
    """True only for a non-tensor real number equal to 1 (``1``, ``1.0``); bool is not a number here."""
    return isinstance(t, Real) and not isinstance(t, bool) and not isinstance(t, torch.Tensor) and t == 1


def per_token(t: torch.Tensor, lead_shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` broadcasting exactly to ``lead_shape`` (trailing 1 dropped); shape-only check."""
    given = shape = tuple(t.shape)
    if len(shape) == len(lead_shape) + 1 and shape[-1] == 1:
        t, shape = t.squeeze(-1), shape[:-1]
    try:
        ok = torch.broadcast_shapes(shape, lead_shape) == torch.Size(lead_shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"temperature must be a number, a 0-d tensor, or a tensor that broadcasts to "
                         f"logits.shape[:-1] = {lead_shape} (optionally with a trailing 1), got shape "
                         f"{given}")
    return t


def _check_temperature(t: object, lead_shape: tuple[int, ...]) -> Temperature:
    """Validate ``t`` (one device sync for a tensor) and return its per-token form."""
    if isinstance(t, torch.Tensor):
        if t.dtype == torch.bool or t.dtype.is_complex:
            raise ValueError(f"temperature must be a real-valued tensor, got dtype {t.dtype}")
        t = per_token(t, lead_shape)
        if t.numel() and not bool(torch.isfinite(t).all() & (t > 0).all()):
            raise ValueError("temperature must be finite and > 0 everywhere")
        return t
    if isinstance(t, bool) or not isinstance(t, Real):
        raise ValueError(f"temperature must be a number or a tensor, got {type(t).__name__}")
    if not math.isfinite(t) or t <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {t!r}")
    return t


def scale_logits_by_temperature(logits: torch.Tensor, t: Temperature) -> torch.Tensor:
    """``logits`` itself for a host-scalar 1, else ``logits / t`` out of place in ``logits.dtype``
    (one copy; a wider ``t`` divides chunk by chunk, rounded once)."""
    return scale_checked(logits, _check_temperature(t, tuple(logits.shape[:-1])))


def scale_checked(logits: torch.Tensor, t: Temperature) -> torch.Tensor:
    """:func:`scale_logits_by_temperature` for an already checked ``t`` (no device sync)."""
    if is_scalar_unit_temperature(t):
        return logits
    if not isinstance(t, torch.Tensor) or t.dim() == 0:
        return logits / (t.detach() if isinstance(t, torch.Tensor) else t)  # a scalar never promotes
    lead = tuple(logits.shape[:-1])
    t_col = per_token(t, lead).detach().unsqueeze(-1)
    if torch.promote_types(logits.dtype, t.dtype) == logits.dtype:
        return logits / t_col
    rows_t = t_col.to(logits.device).broadcast_to(lead + (1,)).reshape(-1, 1)
    return _DivRowsKeepDtype.apply(logits, rows_t)


def _div_rows(x: torch.Tensor, t_rows: torch.Tensor) -> torch.Tensor:
    """``(x / t_rows).to(x.dtype)`` for ``x [..., V]``, ``t_rows [N, 1]``, chunk by chunk."""
    flat = x.reshape(t_rows.shape[0], x.shape[-1])
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    oflat = out.view(flat.shape)
    rows = max(1, DEFAULT_CHUNK_ELEMENTS // max(x.shape[-1], 1))
    for r0 in range(0, flat.shape[0], rows):
        oflat[r0:r0 + rows] = flat[r0:r0 + rows] / t_rows[r0:r0 + rows]  # promoted chunk, one rounding
    return out


class _DivRowsKeepDtype(torch.autograd.Function):
    """``logits / t_rows`` computed in the promoted dtype; output and gradient in ``logits.dtype``."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, t_rows: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(t_rows)
        return _div_rows(logits, t_rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (t_rows,) = ctx.saved_tensors
        return _div_rows(grad, t_rows), None


def temperature_rows(t: Temperature, lead_shape: tuple[int, ...],
                     device: torch.device) -> float | torch.Tensor | None:
    """Check ``t``: None for a host-scalar 1, a float, or a detached fp32 ``[N]`` tensor."""
    t = _check_temperature(t, lead_shape)
    if is_scalar_unit_temperature(t):
        return None
    if not isinstance(t, torch.Tensor):
        return float(t)
    n = math.prod(lead_shape)
    return t.detach().to(device=device, dtype=torch.float32).broadcast_to(lead_shape).reshape(n)
