"""Triton forward of the chunk statistics, on ``x [c, V_valid]`` around the ops' MAX all-reduce::

    m_local = x.amax(-1).float() / t                                # row_max -> [c]
    zm = (x.float() / t - m[:, None]).clamp_min(ZM_FLOOR); e = zm.exp()
    out[:, col_sum_e] = e.sum(-1); out[:, col_sum_ez] = (e * zm).sum(-1); out[:, col_sum_e2] = (e * e).sum(-1)
    out[:, col_label] = zm[row, y]; out[:, col_teacher + i] = zm[row, id_i]   # 0 off-shard
    out[:, col_tail] = e.sum(-1) without the in-shard teacher ids   # chunk_stats -> [c, width]

Grid ``(c, splits)``; split partials summed in torch; reads ``x`` once, no workspace.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import ZM_FLOOR, check_chunk, check_rows, divide_by_temperature, row_vector, temperature_args
from .launch import LaunchConfig, get_config, num_splits, split_cols
from .layout import StatLayout


@triton.jit
def _row_max_kernel(
    x_ptr,  # [c, V] logits chunk (any float dtype), strides (stride_xr, stride_xc)
    t_ptr,  # [c] fp32 per-row temperature (T_MODE 2)
    part_ptr,  # [c, splits] fp32 out: partial row maxima of z
    stride_xr, stride_xc, t_scalar, n_cols, cols_per_split,
    T_MODE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * cols_per_split
    hi = tl.minimum(lo + cols_per_split, n_cols)
    x_row = x_ptr + row * stride_xr
    acc = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(x_row + cols * stride_xc, mask=cols < hi, other=float("-inf"))
        acc = tl.maximum(acc, x.to(tl.float32))
    # t > 0 and a correctly rounded division is monotone: max(x) / t == max(x / t).
    m = divide_by_temperature(tl.max(acc, axis=0), t_ptr, row, t_scalar, T_MODE)
    tl.store(part_ptr + row * tl.num_programs(1) + split, m)


@triton.jit
def _shifted_point(x_row, stride_xc, col, inside, lo, hi, m, t_ptr, row, t_scalar, T_MODE: tl.constexpr):
    """``z[col] - m`` if ``col`` is in this shard and in this program's range [lo, hi), else 0."""
    own = inside & (col >= lo) & (col < hi)
    x = tl.load(x_row + col * stride_xc, mask=own, other=0.0).to(tl.float32)
    zm = tl.maximum(divide_by_temperature(x, t_ptr, row, t_scalar, T_MODE) - m, ZM_FLOOR)
    return tl.where(own, zm, 0.0)


@triton.jit
def _chunk_stats_kernel(
    x_ptr,  # [c, V] logits chunk (any float dtype), strides (stride_xr, stride_xc)
    t_ptr,  # [c] fp32 per-row temperature (T_MODE 2)
    m_ptr,  # [c] fp32 global row max of z
    ycol_ptr,  # [c] int64 label column in this shard (clamped)   (LABEL)
    yin_ptr,  # [c] bool label lies in this shard                 (LABEL)
    tcol_ptr,  # [c, K] int64 teacher columns (clamped), strides (stride_tr, stride_tk)
    tin_ptr,  # [c, K] bool teacher id lies in this shard, same strides as tcol
    out_ptr,  # [c, splits, width] fp32 out, strides (stride_or, stride_os, 1 per column)
    stride_xr, stride_xc, stride_tr, stride_tk, stride_or, stride_os,
    t_scalar, n_cols, cols_per_split,
    COL_SUM_EZ: tl.constexpr, COL_SUM_E2: tl.constexpr, COL_LABEL: tl.constexpr,  # -1: not requested
    COL_TEACHER: tl.constexpr, K: tl.constexpr, COL_TAIL: tl.constexpr,
    T_MODE: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    lo = split * cols_per_split
    hi = tl.minimum(lo + cols_per_split, n_cols)
    x_row = x_ptr + row * stride_xr
    m = tl.load(m_ptr + row)
    s_acc = tl.zeros([BLOCK_V], tl.float32)
    a_acc = tl.zeros([BLOCK_V], tl.float32)
    b_acc = tl.zeros([BLOCK_V], tl.float32)
    tail_acc = tl.zeros([BLOCK_V], tl.float32)
    # --- 1. stream the row: e = exp(z - m) and its sums ---
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < hi
        x = tl.load(x_row + cols * stride_xc, mask=valid, other=float("-inf")).to(tl.float32)
        # floored (ZM_FLOOR): e = 0 and e * zm = 0 on -inf logits and masked columns
        zm = tl.maximum(divide_by_temperature(x, t_ptr, row, t_scalar, T_MODE) - m, ZM_FLOOR)
        e = tl.exp(zm)
        s_acc += e
        if COL_SUM_EZ >= 0:
            a_acc += e * zm
        if COL_SUM_E2 >= 0:
            b_acc += e * e
        if COL_TAIL >= 0:
            in_teacher = cols < 0
            for i in tl.static_range(K):
                col_i = tl.load(tcol_ptr + row * stride_tr + i * stride_tk)
                in_i = tl.load(tin_ptr + row * stride_tr + i * stride_tk) != 0
                if in_i & (col_i >= start) & (col_i < start + BLOCK_V):  # scalar test: most tiles skip
                    in_teacher = in_teacher | (cols == col_i)
            tail_acc += tl.where(in_teacher, 0.0, e)
    # --- 2. write this program's partial statistics ---
    out_row = out_ptr + row * stride_or + split * stride_os
    tl.store(out_row, tl.sum(s_acc, axis=0))
    if COL_SUM_EZ >= 0:
        tl.store(out_row + COL_SUM_EZ, tl.sum(a_acc, axis=0))
    if COL_SUM_E2 >= 0:
        tl.store(out_row + COL_SUM_E2, tl.sum(b_acc, axis=0))
    if COL_TAIL >= 0:
        tl.store(out_row + COL_TAIL, tl.sum(tail_acc, axis=0))
    # --- 3. point values z_i - m, each written by the split that owns its column ---
    if COL_LABEL >= 0:
        y_in = tl.load(yin_ptr + row) != 0
        y = _shifted_point(x_row, stride_xc, tl.load(ycol_ptr + row), y_in, lo, hi, m, t_ptr, row, t_scalar,
                           T_MODE)
        tl.store(out_row + COL_LABEL, y)
    for i in tl.static_range(K):
        col_i = tl.load(tcol_ptr + row * stride_tr + i * stride_tk)
        in_i = tl.load(tin_ptr + row * stride_tr + i * stride_tk) != 0
        zi = _shifted_point(x_row, stride_xc, col_i, in_i, lo, hi, m, t_ptr, row, t_scalar, T_MODE)
        tl.store(out_row + COL_TEACHER + i, zi)


def row_max(x: torch.Tensor, t: float | torch.Tensor | None, *, splits: int | None = None,
            config: LaunchConfig | None = None) -> torch.Tensor:
    """``x.amax(-1).float() / t`` for ``x [c, V]`` (-inf for V = 0): fp32 ``[c]``."""
    check_chunk(x)
    rows, cols = x.shape
    t_ptr, t_scalar, t_mode = temperature_args(t, rows, x.device)
    if rows == 0:
        return torch.empty(0, dtype=torch.float32, device=x.device)
    cfg = config or get_config("row_max")
    splits = splits or num_splits(rows, cols, cfg.block_v, x.device)
    part = torch.empty(rows, splits, dtype=torch.float32, device=x.device)
    _row_max_kernel[(rows, splits)](
        x_ptr=x, t_ptr=t_ptr, part_ptr=part, stride_xr=x.stride(0), stride_xc=x.stride(1), t_scalar=t_scalar,
        n_cols=cols, cols_per_split=split_cols(cols, splits, cfg.block_v), T_MODE=t_mode,
        BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
    )
    return part[:, 0] if splits == 1 else part.amax(1)


def chunk_stats(x: torch.Tensor, t: float | torch.Tensor | None, m: torch.Tensor, layout: StatLayout,
                out: torch.Tensor, *,
                label: tuple[torch.Tensor, torch.Tensor] | None = None,
                teacher: tuple[torch.Tensor, torch.Tensor] | None = None, splits: int | None = None,
                config: LaunchConfig | None = None) -> torch.Tensor:
    """Fill ``out [c, layout.width]`` with the statistics of ``x [c, V_valid]``; ``label`` = (cols, inside)
    ``[c]``, ``teacher`` = (cols, inside) ``[c, k]``."""
    check_chunk(x)
    rows, cols = x.shape
    m = row_vector(m, "m", rows)
    check_rows(out, "out", (rows, layout.width), torch.float32)
    if out.stride(1) != 1:
        raise ValueError("out must have unit column stride")
    t_ptr, t_scalar, t_mode = temperature_args(t, rows, x.device)
    if layout.label:
        check_rows(label[0], "label cols", (rows,), torch.int64)
        check_rows(label[1], "label inside", (rows,), torch.bool)
    if layout.k:
        check_rows(teacher[0], "teacher cols", (rows, layout.k), torch.int64)
        check_rows(teacher[1], "teacher inside", (rows, layout.k), torch.bool)
    if rows == 0:
        return out
    cfg = config or get_config("chunk_stats")
    splits = splits or num_splits(rows, cols, cfg.block_v, x.device)
    part = out if splits == 1 else out.new_empty(rows, splits, layout.width)
    stride_or, stride_os = (out.stride(0), 0) if splits == 1 else (part.stride(0), part.stride(1))
    # [c] / [c, k] index tensors, made contiguous (O(c k), a no-op for the ops' fresh local_columns).
    ycol, yin = (label[0].contiguous(), label[1].contiguous()) if layout.label else (None, None)
    tcol, tin = (teacher[0].contiguous(), teacher[1].contiguous()) if layout.k else (None, None)
    stride_tr, stride_tk = (layout.k, 1) if layout.k else (0, 0)
    _chunk_stats_kernel[(rows, splits)](
        x_ptr=x, t_ptr=t_ptr, m_ptr=m, ycol_ptr=ycol, yin_ptr=yin, tcol_ptr=tcol, tin_ptr=tin, out_ptr=part,
        stride_xr=x.stride(0), stride_xc=x.stride(1), stride_tr=stride_tr, stride_tk=stride_tk,
        stride_or=stride_or, stride_os=stride_os, t_scalar=t_scalar, n_cols=cols,
        cols_per_split=split_cols(cols, splits, cfg.block_v),
        COL_SUM_EZ=layout.col_sum_ez if layout.entropy else -1,
        COL_SUM_E2=layout.col_sum_e2 if layout.sum_pi_squared else -1,
        COL_LABEL=layout.col_label if layout.label else -1, COL_TEACHER=layout.col_teacher, K=layout.k,
        COL_TAIL=layout.col_tail if layout.tail and layout.k else -1,
        T_MODE=t_mode, BLOCK_V=cfg.block_v, num_warps=cfg.num_warps,
    )
    if splits > 1:
        out.copy_(part.sum(1))
    return out
