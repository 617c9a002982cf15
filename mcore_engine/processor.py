"""The lm-head processors: RL flags -> one chunked pass of ``mcore_engine.ops``, on the logits
(``process_lm_head_logits``) or on hidden states + the lm-head shard (``process_lm_head_hidden``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.ops import _common
from mcore_engine.ops.fused import vocab_parallel_logits_outputs
from mcore_engine.ops.lm_head import fused_lm_head_outputs
from mcore_engine.ops.temperature import Temperature, scale_checked

BATCH_TEACHER_NAMES = ('batch["teacher_ids"]', 'batch["teacher_logprobs"]')


class RowSelection:
    """The ``n`` rows of a model-layout ``[b, s]`` grid where ``mask`` is nonzero::

        index = mask.reshape(-1).nonzero()[:, 0]                         # [n]; one host sync
        take(t) = t.reshape(b * s, *tail)[index][None]                   # [b, s, *tail] -> [1, n, *tail]
        put(v)  = zeros(b * s, *tail).index_copy(0, index, v[0]).view(b, s, *tail)   # differentiable

    ``take`` passes through anything not led by ``[b, s]`` (None, scalars). Memory: the index and the
    copies (none when every row is selected)."""

    def __init__(self, mask: torch.Tensor) -> None:
        if mask.dim() != 2:
            raise ValueError(f"mask must be a [b, s] tensor, got shape {tuple(mask.shape)}")
        self.shape = tuple(mask.shape)
        self.index = mask.reshape(-1).nonzero()[:, 0]
        self.all_rows = self.index.numel() == mask.numel()

    def take(self, t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != self.shape:
            return t
        flat = t.reshape(self.shape[0] * self.shape[1], *t.shape[2:])
        if self.all_rows:
            return flat.unsqueeze(0)
        return flat.index_select(0, self.index.to(flat.device)).unsqueeze(0)

    def put(self, values: torch.Tensor) -> torch.Tensor:
        rows = values.reshape(self.index.numel(), *values.shape[2:])
        if self.all_rows:
            return rows.view(*self.shape, *rows.shape[1:])
        flat = rows.new_zeros((self.shape[0] * self.shape[1], *rows.shape[1:]))
        flat = flat.index_copy(0, self.index.to(rows.device), rows)
        return flat.view(*self.shape, *rows.shape[1:])


def _builtin_inputs(label: torch.Tensor | None, batch: Mapping[str, Any] | None, *,
                    distillation_use_topk: bool, distillation_only: bool, builtin_kl: bool) -> dict[str, Any]:
    """The op's labels (None under ``distillation_only``) and, for the built-in KL, the teacher
    tensors of ``batch`` (errors name the batch keys)."""
    if distillation_only and not distillation_use_topk:
        raise ValueError("distillation_only=True requires distillation_use_topk=True")
    if not distillation_only and label is None:
        raise ValueError("label must be a tensor of global vocab ids shaped logits.shape[:-1] "
                         "unless distillation_only=True")
    teacher_ids = teacher_log_probs = None
    if builtin_kl:
        keys = set(batch.keys()) if batch is not None else set()
        if not {"teacher_ids", "teacher_logprobs"} <= keys:
            raise ValueError("batch must hold 'teacher_ids' and 'teacher_logprobs' (shape logits.shape[:-1] "
                             "+ (K,)) when distillation_use_topk=True without a logits_processor_func")
        teacher_ids, teacher_log_probs = batch["teacher_ids"], batch["teacher_logprobs"]
    return dict(labels=None if distillation_only else label, teacher_ids=teacher_ids,
                teacher_log_probs=teacher_log_probs, teacher_arg_names=BATCH_TEACHER_NAMES)


def process_lm_head_logits(
    logits: torch.Tensor, label: torch.Tensor | None, temperature: Temperature, *,
    calculate_sum_pi_squared: bool, calculate_entropy: bool, distillation_use_topk: bool,
    distillation_only: bool, logits_processor_func: Callable[..., dict[str, torch.Tensor]] | None = None,
    batch: Mapping[str, Any] | None = None, data_format: str = "thd", vocab_size: int | None = None,
    chunk_size: int | None = None, group: dist.ProcessGroup | None = None,
    log_prob_min_clamp: float | None = None,
) -> dict[str, torch.Tensor]:
    """Per-token fp32 outputs ``logits.shape[:-1]`` from one pass over this rank's shard
    ``[..., V_local]`` (not modified): "log_probs" unless ``distillation_only``; "entropy" iff
    ``calculate_entropy``; "sum_pi_squared" iff ``calculate_sum_pi_squared``; under
    ``distillation_use_topk`` either ``logits_processor_func(student_logits=logits / temperature,
    data=batch, data_format=data_format)``'s outputs or the built-in top-k forward KL on
    ``teacher_ids`` / ``teacher_logprobs``: "distillation_losses", "student_mass", "teacher_mass".
    The only full-size copy: the scaled logits for a custom func (temperature not a host 1)."""
    group = _common.resolve_group(group)
    custom = distillation_use_topk and logits_processor_func is not None
    inputs = _builtin_inputs(label, batch, distillation_use_topk=distillation_use_topk,
                             distillation_only=distillation_only,
                             builtin_kl=distillation_use_topk and not custom)
    out = vocab_parallel_logits_outputs(
        logits, **inputs, entropy=calculate_entropy, sum_pi_squared=calculate_sum_pi_squared,
        log_prob_min_clamp=log_prob_min_clamp, temperature=temperature, group=group, chunk_size=chunk_size,
        vocab_size=vocab_size)
    if custom:
        student_logits = scale_checked(logits, temperature)  # values checked by the pass above
        out.update(logits_processor_func(student_logits=student_logits, data=batch, data_format=data_format))
    return out


def process_lm_head_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, label: torch.Tensor | None, temperature: Temperature, *,
    calculate_sum_pi_squared: bool, calculate_entropy: bool, distillation_use_topk: bool,
    distillation_only: bool, logits_processor_func: Callable[..., dict[str, torch.Tensor]] | None = None,
    batch: Mapping[str, Any] | None = None, data_format: str = "thd", vocab_size: int | None = None,
    chunk_size: int | None = None, group: dist.ProcessGroup | None = None,
    log_prob_min_clamp: float | None = None,
) -> dict[str, torch.Tensor]:
    """``process_lm_head_logits(hidden @ weight.T, ...)`` without materialising the logits:
    ``hidden [..., H]``, ``weight [V_local, H]``; a custom ``logits_processor_func`` is a ValueError."""
    if logits_processor_func is not None:
        raise ValueError("logits_processor_func needs the logits; the fused lm-head never builds them "
                         "(set fused_lm_head: false to use a custom logits processor)")
    inputs = _builtin_inputs(label, batch, distillation_use_topk=distillation_use_topk,
                             distillation_only=distillation_only, builtin_kl=distillation_use_topk)
    return fused_lm_head_outputs(
        hidden, weight, **inputs, entropy=calculate_entropy, sum_pi_squared=calculate_sum_pi_squared,
        log_prob_min_clamp=log_prob_min_clamp, temperature=temperature, group=group, chunk_size=chunk_size,
        vocab_size=vocab_size)
