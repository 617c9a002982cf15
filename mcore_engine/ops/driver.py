"""The chunk driver of both lm-head paths over a source of ``x [c, V_valid]`` chunks (logits slices,
or ``hidden @ weight.T``). Forward per block: row max -> MAX all-reduce; statistics -> SUM all-reduce.
Backward per chunk, no collectives.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from mcore_engine.ops import _common
from mcore_engine.ops import stats as _stats
from mcore_engine.ops.plan import NO_GRAD_KEYS, Plan, Rows


class LogitsSource:
    """Row slices of the logits ``[N, V_local]`` (views)."""

    rereadable = True

    def __init__(self, logits: torch.Tensor, plan: Plan) -> None:
        self.x = _common.flat_rows(logits)[:, :plan.shard.v_valid]

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        return self.x[r0:r1]


class MatmulSource:
    """``h[r0:r1] @ w.T`` into one ``[rows, V_valid]`` buffer (overwritten by the next chunk)."""

    rereadable = False

    def __init__(self, h: torch.Tensor, w: torch.Tensor, plan: Plan) -> None:
        self.h, self.w = h, w
        self.buf = torch.empty(min(plan.rows, h.shape[0]), w.shape[0], dtype=torch.result_type(h, w),
                               device=h.device)

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        return torch.matmul(self.h[r0:r1], self.w.T, out=self.buf[:r1 - r0])


Source = LogitsSource | MatmulSource


def forward_stats(plan: Plan, source: Source, rows: Rows, n: int,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Global packed statistics fp32 ``[N, width]`` and row max fp32 ``[N]``."""
    shard, lay, backend = plan.shard, plan.layout, plan.backend
    stats = torch.empty(n, lay.width, dtype=torch.float32, device=device)
    row_max = torch.empty(n, dtype=torch.float32, device=device)
    ws = backend.workspace(min(plan.rows, n), shard.v_valid, device)
    for b0, b1 in plan.blocks(n, source.rereadable):
        chunks = plan.chunks(b0, b1)
        # --- 1. global row max of the block's rows -> one all-reduce MAX ---
        for r0, r1 in chunks:
            x = source.rows(r0, r1)
            row_max[r0:r1] = backend.row_max(x, plan.chunk_t(rows.t_rows, r0, r1))
        _common.all_reduce_(row_max[b0:b1], dist.ReduceOp.MAX, shard)
        # --- 2. packed local statistics of the block's rows -> one all-reduce SUM ---
        for r0, r1 in chunks:
            if len(chunks) > 1:  # a one-chunk block reuses the x of step 1
                x = source.rows(r0, r1)
            label = (_stats.local_columns(rows.labels[r0:r1], shard.offset, shard.v_valid)
                     if rows.labels is not None else None)
            teacher = (_stats.local_columns(rows.teacher_ids[r0:r1], shard.offset, shard.v_valid)
                       if rows.teacher_ids is not None else None)
            backend.chunk_stats(x, plan.chunk_t(rows.t_rows, r0, r1), row_max[r0:r1], lay, stats[r0:r1],
                                label=label, teacher=teacher, ws=ws)
        _common.all_reduce_(stats[b0:b1], dist.ReduceOp.SUM, shard)
    return stats, row_max


def backward_grads(plan: Plan, source: Source, coef: _stats.Coefficients, row_max: torch.Tensor,
                   t_rows: torch.Tensor | None, out: torch.Tensor | None = None,
                   take: Callable[[int, int, torch.Tensor], None] | None = None) -> None:
    """Per chunk, the gradient w.r.t. ``x`` into ``out[r0:r1]`` or handed to ``take(r0, r1, gx)`` (fp32)."""
    shard, backend = plan.shard, plan.backend
    n = row_max.shape[0]
    ws = backend.workspace(min(plan.rows, n), shard.v_valid, row_max.device)
    for r0, r1 in plan.chunks(0, n):
        gx = backend.chunk_grad(source.rows(r0, r1), plan.chunk_t(t_rows, r0, r1), row_max[r0:r1],
                                _stats.chunk_coefficients(coef, r0, r1, shard.offset, shard.v_valid),
                                out=None if out is None else out[r0:r1], ws=ws)
        if take is not None:
            take(r0, r1, gx)


def save_and_output(ctx, plan: Plan, inputs: tuple[torch.Tensor, ...], rows: Rows, row_max: torch.Tensor,
                    stats: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Finalize, save the inputs (no copies) and per-token tensors, return the outputs."""
    fin = _stats.finalize(stats, plan.layout, teacher_log_probs=rows.teacher_log_probs, clamp=plan.clamp)
    ctx.plan, ctx.n_inputs = plan, len(inputs)
    ctx.save_for_backward(*inputs, rows.labels, rows.teacher_ids, rows.t_rows, row_max, fin.inv_s, fin.mu,
                          fin.s2, fin.kl_w, fin.kl_p, fin.tail_r, fin.tail_p, fin.q)
    ctx.set_materialize_grads(False)
    outs = tuple(fin.outputs[k].clone() for k in plan.keys)
    ctx.mark_non_differentiable(*(o for k, o in zip(plan.keys, outs, strict=True) if k in NO_GRAD_KEYS))
    return outs


def saved_and_coefficients(ctx, grads: tuple[torch.Tensor | None, ...]):
    """``(inputs, t_rows, row_max, coef)`` back from the ctx; coef None without gradient."""
    saved = ctx.saved_tensors
    inputs, (labels, ids, t_rows, row_max, *fin_tensors) = saved[:ctx.n_inputs], saved[ctx.n_inputs:]
    fin = _stats.Finalized({}, *fin_tensors)
    coef = _stats.grad_coefficients(fin, dict(zip(ctx.plan.keys, grads, strict=True)), labels, ids)
    return inputs, t_rows, row_max, coef
