"""Top-k forward-KL distillation as logits processors, and the top-k overlap metric.

``fn(student_logits [..., V_local], data, data_format) -> {key: fp32 [...]}`` on this rank's
temperature-scaled shard, ``data["teacher_ids"]`` / ``data["teacher_logprobs"]`` ``[..., K]``; with S
the teacher's ids, p their probabilities and q = softmax over the full vocab::

    distillation_losses = sum_S p * (log p - log q)                   # forward_kl_topk
                        + p_tail * log(p_tail / q_tail)               # forward_kl_topk_tail
    p_tail = 1 - sum_S p,  q_tail = sum_{i not in S} q_i              # both floored at 1e-20
    student_mass = sum_S q,  teacher_mass = sum_S p,  topk_overlap = |S & top-k(q)| / K  (no grad)

``log_prob_min_clamp = c`` clamps log p and log q at c. Memory: O(T K) beyond the logits
(``ops.vocab_parallel_forward_kl_topk``, chunked).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine import ops

LogitsProcessor = Callable[..., dict[str, torch.Tensor]]
DATA_FORMATS: tuple[str, ...] = ("thd", "bshd")


def topk_overlap(teacher_ids: torch.Tensor, student_ids: torch.Tensor) -> torch.Tensor:
    """``(teacher_ids[..., :, None] == student_ids[..., None, :]).any(-1).float().mean(-1)``; O(T K)."""
    if teacher_ids.shape[:-1] != student_ids.shape[:-1]:
        raise ValueError(f"student_ids must have leading dims {tuple(teacher_ids.shape[:-1])}, "
                         f"got {tuple(student_ids.shape)}")
    lead = teacher_ids.shape[:-1]
    k_t, k_s = teacher_ids.shape[-1], student_ids.shape[-1]
    if k_t == 0 or k_s == 0:
        raise ValueError(f"teacher_ids and student_ids need a non-empty last dim, got {k_t} and {k_s}")
    teacher = teacher_ids.reshape(-1, k_t).contiguous()
    student = torch.sort(student_ids.reshape(-1, k_s), dim=-1).values
    pos = torch.searchsorted(student, teacher).clamp_max(k_s - 1)
    hit = student.gather(-1, pos) == teacher
    return hit.float().mean(-1).reshape(lead)


def _teacher_tensors(student_logits: torch.Tensor, data: Mapping[str, Any],
                     data_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {DATA_FORMATS}, got {data_format!r}")
    for key in ("teacher_ids", "teacher_logprobs"):
        if key not in data.keys():
            raise ValueError(f"data must hold {key!r} ([..., K] per token) for top-k distillation")
    ids, logprobs = data["teacher_ids"], data["teacher_logprobs"]
    lead = student_logits.shape[:-1]
    if ids.shape[:-1] != lead and ids.dim() >= 1 and ids.shape[:-1].numel() == lead.numel():
        ids = ids.reshape(*lead, ids.shape[-1])                    # e.g. [T, K] for [1, T, V] logits
        logprobs = logprobs.reshape(*lead, logprobs.shape[-1])
    return ids, logprobs


def _topk_distillation(student_logits: torch.Tensor, data: Mapping[str, Any], data_format: str = "thd", *,
                       kl_tail: bool, log_prob_min_clamp: float | None, compute_overlap: bool,
                       vocab_size: int | None, chunk_size: int | None,
                       group: dist.ProcessGroup | None) -> dict[str, torch.Tensor]:
    teacher_ids, teacher_logprobs = _teacher_tensors(student_logits, data, data_format)
    out = ops.vocab_parallel_forward_kl_topk(
        student_logits, teacher_ids, teacher_logprobs, temperature=1.0, group=group, chunk_size=chunk_size,
        log_prob_min_clamp=log_prob_min_clamp, kl_tail=kl_tail, vocab_size=vocab_size)
    out = dict(out)
    if compute_overlap:
        with torch.no_grad():
            _, student_ids = ops.vocab_parallel_topk(student_logits, teacher_ids.shape[-1], temperature=1.0,
                                                     group=group, vocab_size=vocab_size)
            out["topk_overlap"] = topk_overlap(teacher_ids, student_ids)
    return out


def forward_kl_topk(student_logits: torch.Tensor, data: Mapping[str, Any], data_format: str = "thd", *,
                    log_prob_min_clamp: float | None = None, compute_overlap: bool = True,
                    vocab_size: int | None = None, chunk_size: int | None = None,
                    group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """Top-k forward KL without the tail term (module docstring); ``topk_overlap`` iff ``compute_overlap``."""
    return _topk_distillation(student_logits, data, data_format, kl_tail=False,
                              log_prob_min_clamp=log_prob_min_clamp, compute_overlap=compute_overlap,
                              vocab_size=vocab_size, chunk_size=chunk_size, group=group)


def forward_kl_topk_tail(student_logits: torch.Tensor, data: Mapping[str, Any], data_format: str = "thd", *,
                         log_prob_min_clamp: float | None = None, compute_overlap: bool = True,
                         vocab_size: int | None = None, chunk_size: int | None = None,
                         group: dist.ProcessGroup | None = None) -> dict[str, torch.Tensor]:
    """``forward_kl_topk`` plus the tail bucket ``p_tail * log(p_tail / q_tail)``."""
    return _topk_distillation(student_logits, data, data_format, kl_tail=True,
                              log_prob_min_clamp=log_prob_min_clamp, compute_overlap=compute_overlap,
                              vocab_size=vocab_size, chunk_size=chunk_size, group=group)


def make_forward_kl_topk(*, tail: bool = False, log_prob_min_clamp: float | None = None,
                         compute_overlap: bool = True, vocab_size: int | None = None,
                         chunk_size: int | None = None,
                         group: dist.ProcessGroup | None = None) -> LogitsProcessor:
    """``forward_kl_topk_tail`` if ``tail`` else ``forward_kl_topk``, the other arguments bound."""
    if log_prob_min_clamp is not None and not (isinstance(log_prob_min_clamp, int | float)
                                               and log_prob_min_clamp < 0):
        raise ValueError(f"log_prob_min_clamp must be None or a negative number, got {log_prob_min_clamp!r}")
    fn = forward_kl_topk_tail if tail else forward_kl_topk
    return functools.partial(fn, log_prob_min_clamp=log_prob_min_clamp, compute_overlap=compute_overlap,
                             vocab_size=vocab_size, chunk_size=chunk_size, group=group)
