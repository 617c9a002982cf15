"""One chunked pass over vocab-sharded logits for every per-token output RL needs.

``vocab_parallel_logits_outputs`` computes any subset of {log-probs, entropy, sum-pi-squared,
top-k forward KL} from ONE pass over row chunks with one MAX and one packed SUM all-reduce per pass
under TP (``stats.py`` defines the statistics; ``backend.py`` picks the torch or Triton chunk math
once per call). The public ops and the logits processor are thin wrappers.

Memory: each pass (forward, backward) allocates two fp32 ``[chunk, V_local]`` workspaces ONCE and
reuses them for every chunk (torch backend; the Triton kernels keep none). Forward saves only the
logits (the caller's tensor, no copy) plus O(N (8 + 2k)) fp32 statistics; backward recomputes the
softmax chunk by chunk (no collectives) into one gradient of the logits' shape and dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mcore_engine.ops import _common
from mcore_engine.ops import stats as _stats
from mcore_engine.ops.backend import ChunkBackend, chunk_backend
from mcore_engine.ops.temperature import Temperature, temperature_rows

OUTPUT_KEYS = ("log_probs", "entropy", "sum_pi_squared", "distillation_losses", "student_mass",
               "teacher_mass")
_NO_GRAD_KEYS = ("student_mass", "teacher_mass")


@dataclass(frozen=True, slots=True)
class _Plan:
    """Everything non-tensor the Function needs: shard geometry, rows per chunk, what to compute."""

    shard: _common.Shard
    rows: int
    layout: _stats.StatLayout
    clamp: float | None
    t_scalar: float | None  # host-scalar temperature != 1 (None: unit or per-row tensor)
    backend: ChunkBackend  # the chunk math: torch (the reference) or the Triton kernels

    @property
    def keys(self) -> tuple[str, ...]:
        lay = self.layout
        wanted = {"log_probs": lay.label, "entropy": lay.entropy, "sum_pi_squared": lay.sum_pi_squared,
                  "distillation_losses": lay.k > 0, "student_mass": lay.k > 0, "teacher_mass": lay.k > 0}
        return tuple(k for k in OUTPUT_KEYS if wanted[k])


def _chunks(plan: _Plan, r0: int, r1: int) -> list[tuple[int, int]]:
    """Row ranges ``[a, b)`` of the chunks covering rows ``[r0, r1)``."""
    return [(a, min(a + plan.rows, r1)) for a in range(r0, r1, plan.rows)]


def _blocks(plan: _Plan, n: int) -> list[tuple[int, int]]:
    """Row ranges sharing one MAX and one SUM all-reduce: all rows under TP (one pair per pass, each
    collective a few hundred KB), one chunk on a single shard (no collectives: each chunk is then read
    twice in a row, while it is still in cache)."""
    return [(0, n)] if plan.shard.world > 1 else _chunks(plan, 0, n)


def _chunk_t(plan: _Plan, t_rows: torch.Tensor | None, r0: int, r1: int) -> float | torch.Tensor | None:
    return t_rows[r0:r1] if t_rows is not None else plan.t_scalar


class _VocabParallelLogitsFunction(torch.autograd.Function):
    """Forward (``x = logits.view(N, V_local)[:, :V_valid]``; under TP one block of all N rows, on a
    single shard one block per chunk, see ``_blocks``):

    1. Per chunk of the block: m = row max of x / t (local, ``backend.row_max``) into ``[N]``; then
       ONE all-reduce MAX of the block's rows.
    2. Per chunk: zm = x / t - m; packed statistics (``backend.chunk_stats``) into ``[N, width]``; then
       ONE all-reduce SUM of the block's rows (each chunk is read twice either way).
    3. After the loop: finalize per token (``stats.finalize``).
    Backward: per-token coefficients (``stats.grad_coefficients``); per chunk, recompute zm and
    p = exp(zm) / S and write the gradient divided by t (``backend.chunk_grad``) into one preallocated
    gradient (padded columns get 0). ``backend`` (``plan.backend``) is the torch or Triton chunk math.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor | None, teacher_ids: torch.Tensor | None,
                teacher_log_probs: torch.Tensor | None, t_rows: torch.Tensor | None,
                plan: _Plan) -> tuple[torch.Tensor, ...]:
        shard, lay = plan.shard, plan.layout
        x = _common.flat_rows(logits)
        n = x.shape[0]
        flat_labels = labels.reshape(n) if labels is not None else None
        flat_ids = teacher_ids.reshape(n, lay.k) if teacher_ids is not None else None
        stats = torch.empty(n, lay.width, dtype=torch.float32, device=logits.device)
        row_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        xv = x[:, :shard.v_valid]
        ws = plan.backend.workspace(min(plan.rows, n), shard.v_valid, logits.device)
        for b0, b1 in _blocks(plan, n):
            # --- 1. global row max of the block's rows -> ONE all-reduce MAX ---
            for r0, r1 in _chunks(plan, b0, b1):
                row_max[r0:r1] = plan.backend.row_max(xv[r0:r1], _chunk_t(plan, t_rows, r0, r1))
            _common.all_reduce_(row_max[b0:b1], dist.ReduceOp.MAX, shard)
            # --- 2. packed local statistics of the block's rows -> ONE all-reduce SUM ---
            for r0, r1 in _chunks(plan, b0, b1):
                label = (_stats.local_columns(flat_labels[r0:r1], shard.offset, shard.v_valid)
                         if flat_labels is not None else None)
                teacher = (_stats.local_columns(flat_ids[r0:r1], shard.offset, shard.v_valid)
                           if flat_ids is not None else None)
                plan.backend.chunk_stats(xv[r0:r1], _chunk_t(plan, t_rows, r0, r1), row_max[r0:r1], lay,
                                         stats[r0:r1], label=label, teacher=teacher, ws=ws)
            _common.all_reduce_(stats[b0:b1], dist.ReduceOp.SUM, shard)
        del ws
        # --- 3. finalize per token ---
        tlp = teacher_log_probs.reshape(n, lay.k) if teacher_log_probs is not None else None
        fin = _stats.finalize(stats, lay, teacher_log_probs=tlp, clamp=plan.clamp)
        ctx.plan = plan
        ctx.save_for_backward(logits, flat_labels, flat_ids, t_rows, row_max, fin.inv_s, fin.mu, fin.s2,
                              fin.kl_w, fin.kl_p, fin.tail_r, fin.tail_p, fin.q)
        ctx.set_materialize_grads(False)
        outs = tuple(fin.outputs[k].clone() for k in plan.keys)
        ctx.mark_non_differentiable(*(o for k, o in zip(plan.keys, outs, strict=True) if k in _NO_GRAD_KEYS))
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        plan: _Plan = ctx.plan
        shard = plan.shard
        (logits, labels, ids, t_rows, row_max, inv_s, mu, s2, kl_w, kl_p, tail_r, tail_p,
         q) = ctx.saved_tensors
        none = (None,) * 6
        fin = _stats.Finalized({}, inv_s, mu, s2, kl_w, kl_p, tail_r, tail_p, q)
        coef = _stats.grad_coefficients(fin, dict(zip(plan.keys, grads, strict=True)), labels, ids)
        if coef is None:
            return none
        # --- recompute chunk by chunk into one gradient ---
        n = row_max.shape[0]
        x = _common.flat_rows(logits)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(n, shard.v_local)
        if shard.v_valid < shard.v_local:
            gflat[:, shard.v_valid:].zero_()
        ws = plan.backend.workspace(min(plan.rows, n), shard.v_valid, logits.device)
        for r0, r1 in _chunks(plan, 0, n):
            xc, tc = x[r0:r1, :shard.v_valid], _chunk_t(plan, t_rows, r0, r1)
            plan.backend.chunk_grad(xc, tc, row_max[r0:r1], inv_s[r0:r1],
                                    *coef.chunk(r0, r1, shard.offset, shard.v_valid),
                                    out=gflat[r0:r1, :shard.v_valid], ws=ws)
        return (grad,) + none[1:]


def vocab_parallel_logits_outputs(
    logits: torch.Tensor, *, labels: torch.Tensor | None = None, teacher_ids: torch.Tensor | None = None,
    teacher_log_probs: torch.Tensor | None = None, entropy: bool = False, sum_pi_squared: bool = False,
    kl_tail: bool = False, log_prob_min_clamp: float | None = None, temperature: Temperature = 1.0,
    group: dist.ProcessGroup | None = None, chunk_size: int | None = None, vocab_size: int | None = None,
    teacher_arg_names: tuple[str, str] = ("teacher_ids", "teacher_log_probs"),
) -> dict[str, torch.Tensor]:
    """Every requested per-token output of ``z = logits / temperature`` from ONE chunked pass.

    Equivalent torch math on the gathered logits ``L [..., V]`` (padded ids >= vocab_size dropped)::

        z = L / t; lse = z.logsumexp(-1); p = z.softmax(-1)
        "log_probs"      = z.gather(-1, labels[..., None])[..., 0] - lse          (iff labels)
        "entropy"        = lse - (p * z).sum(-1)                                  (iff entropy)
        "sum_pi_squared" = (p ** 2).sum(-1)                                       (iff sum_pi_squared)
        log_q = z.gather(-1, teacher_ids) - lse[..., None]; P = teacher_log_probs.exp()   (iff teacher_*)
        "distillation_losses" = (P * (teacher_log_probs.clamp_min(c) - log_q.clamp_min(c))).sum(-1)
                                [+ p_t * log(p_t / q_t), p_t = 1 - P.sum(-1), q_t = 1 - log_q.exp().sum(-1)
                                 when kl_tail]
        "student_mass" = log_q.exp().sum(-1); "teacher_mass" = P.sum(-1)         (no gradient)

    The tail masses are floored at ``stats.TAIL_EPS`` (1e-20; q_t is summed over the ids outside the
    top-k set, no ``1 - sum``): no tail gradient once q_t < 1e-20, and the tail term vanishes when
    P.sum(-1) >= 1. The tail gradient is exact as q_t -> 0 (``stats.grad_coefficients``).

    Shapes: logits ``[..., V_local]`` (this rank's shard); labels ``[...]``; teacher_* ``[..., k]``;
    outputs fp32 ``[...]``. Differentiable w.r.t. ``logits`` (not the temperature or the teacher).
    Memory: O(N (8 + 2k)) saved fp32 + two fp32 ``[chunk_size, V_local]`` workspaces per pass
    (torch backend; on CUDA with Triton, none, and ``chunk_size=None`` then means larger chunks).
    ``teacher_arg_names``: how ValueErrors name the teacher tensors (wrappers pass their own names).
    """
    group = _common.resolve_group(group)
    shard = _common.make_shard(logits, group, vocab_size)
    lead = tuple(logits.shape[:-1])
    if labels is not None:
        _common.check_ids(labels, "labels", lead, shard.vocab_size)
        labels = labels.long()
    ids_name, lp_name = teacher_arg_names
    if (teacher_ids is None) != (teacher_log_probs is None):
        raise ValueError(f"{ids_name} and {lp_name} must be given together (shape [..., k])")
    k = 0
    if teacher_ids is not None:
        if not isinstance(teacher_ids, torch.Tensor) or teacher_ids.dim() != len(lead) + 1 \
                or teacher_ids.shape[-1] == 0:
            raise ValueError(f"{ids_name} must have shape logits.shape[:-1] + (k,) = {lead} + (k,) "
                             f"with k >= 1, got {tuple(getattr(teacher_ids, 'shape', ()))}")
        k = teacher_ids.shape[-1]
        _common.check_ids(teacher_ids, ids_name, lead + (k,), shard.vocab_size)
        teacher_ids = teacher_ids.long()
        if not isinstance(teacher_log_probs, torch.Tensor) or not teacher_log_probs.is_floating_point() \
                or tuple(teacher_log_probs.shape) != lead + (k,):
            raise ValueError(f"{lp_name} must be a floating tensor of shape {lead + (k,)}, got "
                             f"{getattr(teacher_log_probs, 'dtype', type(teacher_log_probs).__name__)} "
                             f"{tuple(getattr(teacher_log_probs, 'shape', ()))}")
        teacher_log_probs = teacher_log_probs.detach()
    if kl_tail and not k:
        raise ValueError(f"kl_tail=True requires {ids_name} and {lp_name}")
    clamp = _common.check_clamp(log_prob_min_clamp)
    backend = chunk_backend(logits.device)
    rows = _common.check_chunk_size(chunk_size, shard.v_local, default_elements=backend.chunk_elements)
    t = temperature_rows(temperature, lead, logits.device)
    layout = _stats.StatLayout(entropy=bool(entropy), sum_pi_squared=bool(sum_pi_squared),
                               label=labels is not None, k=k, tail=bool(kl_tail))
    plan = _Plan(shard=shard, rows=rows, layout=layout, clamp=clamp,
                 t_scalar=t if isinstance(t, float) else None, backend=backend)
    if not plan.keys:
        return {}
    outs = _VocabParallelLogitsFunction.apply(logits, labels, teacher_ids, teacher_log_probs,
                                              t if isinstance(t, torch.Tensor) else None, plan)
    return {key: o.view(lead) for key, o in zip(plan.keys, outs, strict=True)}
