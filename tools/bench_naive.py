"""The naive lm-head logits path that upstream engines use: the benchmark's baseline.

verl's Megatron engine's processing of one TP rank's logits ``[N, V_local]``, in its order, over
Megatron-Core's TP group (``parallel_state`` initialised, also for TP=1)::

    z = logits.float() / temperature                    # whole-tensor fp32 upcast + scaled copy
    sum_pi2  = sum(softmax(z) ** 2)                     # plain autograd: saves exp(z - m) and p
    entropy  = lse(z) - sum(softmax(z) * z)             # custom Function that saves softmax (+ z)
    kl       = sum_S P (log P - log_softmax(z)[S])      # plain autograd: saves exp(z - m)
    log_prob = -megatron vocab_parallel_cross_entropy(z.clone(), labels)   # overwrites its input

Memory (E = N x V_local fp32): z is 1 E; each output keeps at least one more E until backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import (
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)


def _tp_group():
    return parallel_state.get_tensor_model_parallel_group()


def _global_max(x: torch.Tensor) -> torch.Tensor:
    """Row max over the global vocab, detached: ``[N, V_local] -> [N, 1]``."""
    m = x.detach().max(dim=-1, keepdim=True).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=_tp_group())
    return m


class _SoftmaxSavingEntropy(torch.autograd.Function):
    """``H = m + log S - sum_j p_j z_j``, ``dH/dz_j = -p_j (z_j - sum_i p_i z_i)``; saves softmax and z."""

    @staticmethod
    def forward(ctx, z: torch.Tensor) -> torch.Tensor:
        m = _global_max(z)
        p = (z - m).exp_()
        s = p.sum(dim=-1, keepdim=True)
        dist.all_reduce(s, group=_tp_group())
        p.div_(s)
        pz = (p * z).sum(dim=-1, keepdim=True)
        dist.all_reduce(pz, group=_tp_group())
        ctx.save_for_backward(z, p, pz)
        return (m + s.log() - pz).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor) -> torch.Tensor:
        z, p, pz = ctx.saved_tensors
        z.sub_(pz)
        p.mul_(z).mul_(grad_h.unsqueeze(-1)).neg_()
        z.add_(pz)
        return p


class _AllReduceSumBoth(torch.autograd.Function):
    """All-reduce SUM forward and backward (each rank holds part of a global sum-exp's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=_tp_group())
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad, group=_tp_group())
        return grad


def naive_sum_pi_squared(z: torch.Tensor) -> torch.Tensor:
    """``sum_j softmax(z)_j ** 2`` by plain autograd over a vocab-parallel softmax: [N, V_local] -> [N]."""
    e = torch.exp(z - _global_max(z))
    s = _AllReduceSumBoth.apply(e.sum(dim=-1, keepdim=True))
    p = e / s
    return reduce_from_tensor_model_parallel_region((p * p).sum(dim=-1))


def naive_entropy(z: torch.Tensor) -> torch.Tensor:
    """Softmax-saving vocab-parallel entropy: ``[N, V_local] -> [N]``."""
    return _SoftmaxSavingEntropy.apply(z)


def naive_topk_kl(z: torch.Tensor, teacher_ids: torch.Tensor, teacher_log_probs: torch.Tensor
                  ) -> dict[str, torch.Tensor]:
    """Top-k forward KL via a full vocab-parallel log_softmax; teacher ``[N, k]`` -> three ``[N]`` outputs."""
    v_local = z.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * v_local
    shifted = z - _global_max(z)
    s = _AllReduceSumBoth.apply(shifted.exp().sum(dim=-1, keepdim=True))
    log_q_full = shifted - s.log()
    local = (teacher_ids >= start) & (teacher_ids < start + v_local)
    idx = torch.where(local, teacher_ids - start, torch.zeros_like(teacher_ids))
    log_q = reduce_from_tensor_model_parallel_region(log_q_full.gather(-1, idx) * local)
    p = teacher_log_probs.exp()
    return {
        "distillation_losses": (p * (teacher_log_probs - log_q)).sum(dim=-1),
        "student_mass": log_q.detach().exp().sum(dim=-1),
        "teacher_mass": p.sum(dim=-1),
    }


def naive_process_lm_head_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, *, calculate_entropy: bool,
    calculate_sum_pi_squared: bool, distillation_use_topk: bool, distillation_only: bool,
    teacher_ids: torch.Tensor | None = None, teacher_log_probs: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The upstream processor: same flags and output keys as ``process_lm_head_logits``."""
    z = logits.float()
    if temperature != 1:
        z = z / temperature
    out: dict[str, torch.Tensor] = {}
    if calculate_sum_pi_squared:
        out["sum_pi_squared"] = naive_sum_pi_squared(z)
    if calculate_entropy:
        out["entropy"] = naive_entropy(z)
    if distillation_use_topk:
        out.update(naive_topk_kl(z, teacher_ids, teacher_log_probs))
    if not distillation_only:
        out["log_probs"] = -vocab_parallel_cross_entropy(z.clone(), labels)
    return out
