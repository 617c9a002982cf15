"""All per-token outputs of vocab-sharded logits from one chunked pass. Memory: saves the logits (no
copy) and O(N (8 + 2k)) fp32; backward writes one gradient of the logits' shape and dtype.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from mcore_engine.ops import _common, driver
from mcore_engine.ops.plan import TEACHER_ARG_NAMES, Plan, Rows, make_plan
from mcore_engine.ops.temperature import Temperature


class _VocabParallelLogitsFunction(torch.autograd.Function):
    """Forward: ``forward_stats`` on logits slices, then ``finalize``. Backward: per chunk, the recomputed
    softmax's gradient / t (padded columns 0)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor | None, teacher_ids: torch.Tensor | None,
                teacher_log_probs: torch.Tensor | None, t_rows: torch.Tensor | None,
                plan: Plan) -> tuple[torch.Tensor, ...]:
        rows = Rows(labels, teacher_ids, teacher_log_probs, t_rows)
        n = math.prod(logits.shape[:-1])
        stats, row_max = driver.forward_stats(plan, driver.LogitsSource(logits, plan), rows, n, logits.device)
        return driver.save_and_output(ctx, plan, (logits,), rows, row_max, stats)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        plan: Plan = ctx.plan
        (logits,), t_rows, row_max, coef = driver.saved_and_coefficients(ctx, grads)
        if coef is None:
            return (None,) * 6
        shard = plan.shard
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gflat = grad.view(row_max.shape[0], shard.v_local)
        if shard.v_valid < shard.v_local:
            gflat[:, shard.v_valid:].zero_()
        driver.backward_grads(plan, driver.LogitsSource(logits, plan), coef, row_max, t_rows,
                              out=gflat[:, :shard.v_valid])
        return (grad,) + (None,) * 5


def vocab_parallel_logits_outputs(
    logits: torch.Tensor, *, labels: torch.Tensor | None = None, teacher_ids: torch.Tensor | None = None,
    teacher_log_probs: torch.Tensor | None = None, entropy: bool = False, sum_pi_squared: bool = False,
    kl_tail: bool = False, log_prob_min_clamp: float | None = None, temperature: Temperature = 1.0,
    group: dist.ProcessGroup | None = None, chunk_size: int | None = None, vocab_size: int | None = None,
    teacher_arg_names: tuple[str, str] = TEACHER_ARG_NAMES,
) -> dict[str, torch.Tensor]:
    """Every requested per-token output of ``z = logits / temperature`` from one chunked pass.

    Equivalent torch math on the gathered logits ``L [..., V]`` (padded ids >= vocab_size dropped)::

        z = L / t; lse = z.logsumexp(-1); p = z.softmax(-1)
        "log_probs"      = z.gather(-1, labels[..., None])[..., 0] - lse          (iff labels)
        "entropy"        = lse - (p * z).sum(-1)                                  (iff entropy)
        "sum_pi_squared" = (p ** 2).sum(-1)                                       (iff sum_pi_squared)
        log_q = z.gather(-1, teacher_ids) - lse[..., None]; P = teacher_log_probs.exp()   (iff teacher_*)
        "distillation_losses" = (P * (teacher_log_probs.clamp_min(c) - log_q.clamp_min(c))).sum(-1)
                                [+ p_t * log(p_t / q_t), p_t = 1 - P.sum(-1), q_t = 1 - log_q.exp().sum(-1)
                                 when kl_tail; both floored at TAIL_EPS, a repeated id counted once]
        "student_mass" = log_q.exp().sum(-1); "teacher_mass" = P.sum(-1)         (no gradient)

    logits ``[..., V_local]`` (this rank's shard), labels ``[...]``, teacher_* ``[..., k]`` -> fp32 ``[...]``.
    """
    group = _common.resolve_group(group)
    shard = _common.make_shard(logits, group, vocab_size)
    lead = tuple(logits.shape[:-1])
    plan, rows = make_plan(shard, lead, logits.device, labels=labels, teacher_ids=teacher_ids,
                           teacher_log_probs=teacher_log_probs, entropy=entropy,
                           sum_pi_squared=sum_pi_squared, kl_tail=kl_tail,
                           log_prob_min_clamp=log_prob_min_clamp, temperature=temperature,
                           chunk_size=chunk_size, teacher_arg_names=teacher_arg_names)
    if not plan.keys:
        return {}
    outs = _VocabParallelLogitsFunction.apply(logits, rows.labels, rows.teacher_ids, rows.teacher_log_probs,
                                              rows.t_rows, plan)
    return {key: o.view(lead) for key, o in zip(plan.keys, outs, strict=True)}
