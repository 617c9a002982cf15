"""Vocab-parallel forward KL from a teacher's top-k log-probs (a thin wrapper over the fused pass)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_engine.ops.fused import vocab_parallel_logits_outputs
from mcore_engine.ops.temperature import Temperature


def vocab_parallel_forward_kl_topk(student_logits: torch.Tensor, teacher_topk_ids: torch.Tensor,
                                   teacher_topk_log_probs: torch.Tensor, *, temperature: Temperature = 1.0,
                                   group: dist.ProcessGroup | None = None, chunk_size: int | None = None,
                                   log_prob_min_clamp: float | None = None, vocab_size: int | None = None,
                                   kl_tail: bool = False) -> dict[str, torch.Tensor]:
    """Top-k forward KL of the teacher against ``softmax(student_logits / temperature)``: the
    ``distillation_losses`` / ``student_mass`` / ``teacher_mass`` of ``vocab_parallel_logits_outputs``
    (math there), student_logits ``[..., V_local]``, ids / log-probs ``[..., k]`` -> fp32 ``[...]``."""
    return vocab_parallel_logits_outputs(
        student_logits, teacher_ids=teacher_topk_ids, teacher_log_probs=teacher_topk_log_probs,
        kl_tail=kl_tail, log_prob_min_clamp=log_prob_min_clamp, temperature=temperature, group=group,
        chunk_size=chunk_size, vocab_size=vocab_size,
        teacher_arg_names=("teacher_topk_ids", "teacher_topk_log_probs"))
