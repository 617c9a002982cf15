"""Launcher plumbing shared by the kernels: argument checks, temperature modes, Triton helpers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import layout

T_NONE, T_SCALAR, T_ROWS = 0, 1, 2

ZM_FLOOR = tl.constexpr(layout.ZM_FLOOR)


def temperature_args(t: float | torch.Tensor | None, rows: int, device: torch.device
                     ) -> tuple[torch.Tensor | None, float, int]:
    """``t`` None / float / fp32 ``[c]`` -> (t_ptr, t_scalar, T_MODE 0 / 1 / 2) for ``rows`` rows."""
    if t is None:
        return None, 1.0, T_NONE
    if isinstance(t, torch.Tensor):
        if t.shape != (rows,) or t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"t must be a float32 tensor [c] = [{rows}] on {device}, got "
                             f"{t.dtype} {tuple(t.shape)} on {t.device}")
        return t.contiguous(), 1.0, T_ROWS  # e.g. a 0-d temperature broadcast to [c] has stride 0
    return None, float(t), T_SCALAR


def check_chunk(x: torch.Tensor, name: str = "x") -> None:
    """``x`` must be a 2-d floating chunk ``[c, V]`` on a device Triton can address."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point chunk [c, V], got {x.dtype} {tuple(x.shape)}")


def check_rows(v: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype | None) -> None:
    if tuple(v.shape) != shape or (dtype is not None and v.dtype != dtype):
        raise ValueError(f"{name} must be {dtype or 'a tensor'} of shape {shape}, got {v.dtype} "
                         f"{tuple(v.shape)}")


def row_vector(v: torch.Tensor | None, name: str, rows: int) -> torch.Tensor | None:
    """A checked fp32 per-row vector ``[c]`` with unit stride (kernels index it as ``ptr + row``)."""
    if v is None:
        return None
    check_rows(v, name, (rows,), torch.float32)
    return v.contiguous()


@triton.jit
def divide_by_temperature(v, t_ptr, row, t_scalar, T_MODE: tl.constexpr):
    """``v / t`` for this row's temperature (``v`` unchanged when ``T_MODE`` is 0)."""
    if T_MODE == 1:
        v = v / t_scalar
    elif T_MODE == 2:
        v = v / tl.load(t_ptr + row)
    return v


def emulate_rtne(out: torch.Tensor) -> bool:
    """True for bf16 stores under the interpreter, which truncates where GPUs round to nearest-even."""
    from .dispatch import interpreter_enabled

    return out.dtype == torch.bfloat16 and interpreter_enabled()


@triton.jit
def round_to_bf16_rtne(v):
    """fp32 ``v`` rounded to the nearest bf16 (ties to even), still fp32: any later cast is then exact."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
