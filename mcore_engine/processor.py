"""The lm-head logits processor: RL flags -> one chunked pass of ``mcore_engine.ops``.

``process_lm_head_logits`` is what ``MegatronEngine._lm_head_logits_processor`` delegates to. All
built-in outputs (log-probs, entropy, sum-pi^2, top-k forward KL) come out of ONE call of
``vocab_parallel_logits_outputs``; only a custom ``logits_processor_func`` sees temperature-scaled
logits (the caller's tensor itself when the temperature is a host-scalar 1).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.ops import _common
from mcore_engine.ops.fused import vocab_parallel_logits_outputs
from mcore_engine.ops.temperature import Temperature, scale_checked


def _log_prob_labels(label: torch.Tensor | None, distillation_only: bool) -> torch.Tensor | None:
    """The only place labels reach the fused pass: None under ``distillation_only`` (no log-prob work)."""
    if distillation_only:
        return None
    if label is None:
        raise ValueError("label must be a tensor of global vocab ids shaped logits.shape[:-1] "
                         "unless distillation_only=True")
    return label


def _teacher_tensors(batch: Mapping[str, Any] | None) -> tuple[torch.Tensor, torch.Tensor]:
    keys = set(batch.keys()) if batch is not None else set()
    if not {"teacher_ids", "teacher_logprobs"} <= keys:
        raise ValueError("batch must hold 'teacher_ids' and 'teacher_logprobs' (shape logits.shape[:-1] + "
                         "(K,)) when distillation_use_topk=True without a logits_processor_func")
    return batch["teacher_ids"], batch["teacher_logprobs"]


def process_lm_head_logits(
    logits: torch.Tensor, label: torch.Tensor | None, temperature: Temperature, *,
    calculate_sum_pi_squared: bool, calculate_entropy: bool, distillation_use_topk: bool,
    distillation_only: bool, logits_processor_func: Callable[..., dict[str, torch.Tensor]] | None = None,
    batch: Mapping[str, Any] | None = None, data_format: str = "thd", vocab_size: int | None = None,
    chunk_size: int | None = None, group: dist.ProcessGroup | None = None,
    log_prob_min_clamp: float | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token fp32 outputs ``logits.shape[:-1]`` for the requested flags, from one pass.

    Keys: "log_probs" unless ``distillation_only`` (never computed then); "entropy" iff
    ``calculate_entropy``; "sum_pi_squared" iff ``calculate_sum_pi_squared``; with
    ``distillation_use_topk`` either ``logits_processor_func(student_logits=logits / temperature,
    data=batch, data_format=data_format)`` merged in, or (no func) the built-in top-k forward KL on
    ``batch["teacher_ids"]`` / ``batch["teacher_logprobs"]``: "distillation_losses", "student_mass",
    "teacher_mass". ``logits`` is this rank's vocab shard ``[..., V_local]``; nothing is modified in
    place or cloned; the only full-size copy ever made is the scaled logits handed to a custom func
    when the temperature is not a host-scalar 1.
    """
    if distillation_only and not distillation_use_topk:
        raise ValueError("distillation_only=True requires distillation_use_topk=True")
    group = _common.resolve_group(group)
    builtin_kl = distillation_use_topk and logits_processor_func is None
    teacher_ids, teacher_log_probs = _teacher_tensors(batch) if builtin_kl else (None, None)
    out = vocab_parallel_logits_outputs(
        logits, labels=_log_prob_labels(label, distillation_only), teacher_ids=teacher_ids,
        teacher_log_probs=teacher_log_probs, entropy=calculate_entropy,
        sum_pi_squared=calculate_sum_pi_squared, log_prob_min_clamp=log_prob_min_clamp,
        temperature=temperature, group=group, chunk_size=chunk_size, vocab_size=vocab_size,
        teacher_arg_names=('batch["teacher_ids"]', 'batch["teacher_logprobs"]'))
    if distillation_use_topk and logits_processor_func is not None:
        student_logits = scale_checked(logits, temperature)  # checked by the fused pass above
        out.update(logits_processor_func(student_logits=student_logits, data=batch, data_format=data_format))
    return out
