"""Triton backward of one chunk: the ``layout.Coefficients`` gradient fused with ``/ t`` and the cast.

    zm = (x.float() / t - m[:, None]).clamp_min(ZM_FLOOR); p = zm.exp() * inv_s[:, None]
    g = p * ((a + a_tail) + b * (zm - mu) + c2 * p)                      # absent terms are 0
    g[row, tail_cols] = (p * (a + b * (zm - mu) + c2 * p))[row, tail_cols]   # no a_tail at the ids
    g[row, cols] += vals;  out = (g / t).to(out.dtype)

Grid ``(c, splits)``; reads ``x`` once, writes ``out`` in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    ZM_FLOOR,
    check_chunk,
    check_rows,
    divide_by_temperature,
    emulate_rtne,
    round_to_bf16_rtne,
    row_vector,
    temperature_args,
)
from .launch import LaunchConfig, get_config, num_splits, split_cols
from .layout import Coefficients


@triton.jit
def _chunk_grad_kernel(
    x_ptr,  # [c, V] logits chunk (any float dtype), strides (stride_xr, stride_xc)
    t_ptr,  # [c] fp32 per-row temperature (T_MODE 2)
    m_ptr,  # [c] fp32 global row max of z
    inv_s_ptr,  # [c] fp32 1 / S
    a_ptr,  # [c] fp32
    b_ptr,  # [c] fp32 (HAS_B)
    mu_ptr,  # [c] fp32 A / S (HAS_B)
    c2_ptr,  # [c] fp32 (HAS_C2)
    pcol_ptr,  # [c, N_PTS] int64 point columns (clamped), strides (stride_pr, stride_pk)
    pval_ptr,  # [c, N_PTS] fp32 point values (0 off-shard), strides (stride_vr, stride_vk)
    a_tail_ptr,  # [c] fp32 (N_TAIL > 0)
    tcol_ptr,  # [c, N_TAIL] int64 tail columns (-1: none), strides (stride_tr, stride_tk)
    out_ptr,  # [c, V] out, any float dtype, strides (stride_or, stride_oc)
    stride_xr, stride_xc, stride_pr, stride_pk, stride_vr, stride_vk, stride_tr, stride_tk,
    stride_or, stride_oc, t_scalar, n_cols, cols_per_split,
    HAS_B: tl.constexpr, HAS_C2: tl.constexpr, N_PTS: tl.constexpr, N_TAIL: tl.constexpr,
    T_MODE: tl.constexpr, EMULATE_RTNE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * cols_per_split
    hi = tl.minimum(lo + cols_per_split, n_cols)
    x_row = x_ptr + row * stride_xr
    out_row = out_ptr + row * stride_or
    m = tl.load(m_ptr + row)
    inv_s = tl.load(inv_s_ptr + row)
    a = tl.load(a_ptr + row)
    a_full = a
    if N_TAIL > 0:
        a_full = a + tl.load(a_tail_ptr + row)
    if HAS_B:
        b = tl.load(b_ptr + row)
        mu = tl.load(mu_ptr + row)
    if HAS_C2:
        c2 = tl.load(c2_ptr + row)
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < hi
        x = tl.load(x_row + cols * stride_xc, mask=valid, other=0.0).to(tl.float32)  # masked: never stored
        zm = tl.maximum(divide_by_temperature(x, t_ptr, row, t_scalar, T_MODE) - m, ZM_FLOOR)
        p = tl.exp(zm) * inv_s
        inner = tl.zeros([BLOCK_V], tl.float32) + a_full
        if HAS_B:
            inner += b * (zm - mu)
        if HAS_C2:
            inner += c2 * p
        g = p * inner  # finite inner at -inf logits (zm floored): p * inner = 0 there
        for i in tl.static_range(N_TAIL):
            tcol_i = tl.load(tcol_ptr + row * stride_tr + i * stride_tk)
            if (tcol_i >= start) & (tcol_i < start + BLOCK_V):  # -1 never matches
                inner0 = tl.zeros([BLOCK_V], tl.float32) + a
                if HAS_B:
                    inner0 += b * (zm - mu)
                if HAS_C2:
                    inner0 += c2 * p
                g = tl.where(cols == tcol_i, p * inner0, g)
        for i in tl.static_range(N_PTS):
            col_i = tl.load(pcol_ptr + row * stride_pr + i * stride_pk)
            if (col_i >= start) & (col_i < start + BLOCK_V):  # scalar test: most tiles skip the compare
                g += tl.where(cols == col_i, tl.load(pval_ptr + row * stride_vr + i * stride_vk), 0.0)
        g = divide_by_temperature(g, t_ptr, row, t_scalar, T_MODE)
        if EMULATE_RTNE:
            g = round_to_bf16_rtne(g)
        tl.store(out_row + cols * stride_oc, g.to(out_ptr.dtype.element_ty), mask=valid)


def chunk_grad(x: torch.Tensor, t: float | torch.Tensor | None, m: torch.Tensor, coef: Coefficients,
               out: torch.Tensor, *, splits: int | None = None,
               config: LaunchConfig | None = None) -> torch.Tensor:
    """Write the gradient w.r.t. ``x [c, V_valid]`` into ``out [c, V_valid]`` (any float dtype; returned)."""
    check_chunk(x)
    rows, n_cols = x.shape
    m = row_vector(m, "m", rows)
    inv_s, a = row_vector(coef.inv_s, "inv_s", rows), row_vector(coef.a, "a", rows)
    b, c2 = row_vector(coef.b, "b", rows), row_vector(coef.c2, "c2", rows)
    mu = row_vector(coef.mu, "mu", rows) if b is not None else None
    if b is not None and mu is None:
        raise ValueError("mu must be given with b (the entropy term)")
    check_chunk(out, "out")
    check_rows(out, "out", (rows, n_cols), None)
    cols, vals = coef.cols, coef.vals
    if (cols is None) != (vals is None):
        raise ValueError("cols and vals must be given together or both be None")
    n_pts = 0
    if cols is not None:
        n_pts = cols.shape[-1] if cols.dim() == 2 else -1
        check_rows(cols, "cols", (rows, n_pts), torch.int64)
        check_rows(vals, "vals", (rows, n_pts), torch.float32)
    tail_cols = coef.tail_cols
    if (coef.a_tail is None) != (tail_cols is None):
        raise ValueError("a_tail and tail_cols must be given together or both be None")
    a_tail = row_vector(coef.a_tail, "a_tail", rows)
    n_tail = 0
    if tail_cols is not None:
        n_tail = tail_cols.shape[-1] if tail_cols.dim() == 2 else -1
        check_rows(tail_cols, "tail_cols", (rows, n_tail), torch.int64)
    t_ptr, t_scalar, t_mode = temperature_args(t, rows, x.device)
    if rows == 0 or n_cols == 0:
        return out
    cfg = config or get_config("chunk_grad")
    splits = splits or num_splits(rows, n_cols, cfg.block_v, x.device)
    pr, pk = cols.stride() if n_pts else (0, 0)
    vr, vk = vals.stride() if n_pts else (0, 0)
    tr, tk = tail_cols.stride() if n_tail else (0, 0)
    _chunk_grad_kernel[(rows, splits)](
        x_ptr=x, t_ptr=t_ptr, m_ptr=m, inv_s_ptr=inv_s, a_ptr=a, b_ptr=b, mu_ptr=mu, c2_ptr=c2,
        pcol_ptr=cols, pval_ptr=vals, a_tail_ptr=a_tail if n_tail else None,
        tcol_ptr=tail_cols if n_tail else None, out_ptr=out,
        stride_xr=x.stride(0), stride_xc=x.stride(1), stride_pr=pr, stride_pk=pk, stride_vr=vr, stride_vk=vk,
        stride_tr=tr, stride_tk=tk, stride_or=out.stride(0), stride_oc=out.stride(1), t_scalar=t_scalar,
        n_cols=n_cols, cols_per_split=split_cols(n_cols, splits, cfg.block_v),
        HAS_B=b is not None, HAS_C2=c2 is not None, N_PTS=n_pts, N_TAIL=n_tail,
        T_MODE=t_mode, EMULATE_RTNE=emulate_rtne(out), BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
    )
    return out
