"""The plan of a chunked pass and the one validator of both lm-head paths (one set of messages)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from mcore_engine_kernels.layout import StatLayout

from mcore_engine.ops import _common
from mcore_engine.ops.backend import ChunkBackend, chunk_backend
from mcore_engine.ops.temperature import Temperature, temperature_rows

OUTPUT_KEYS = ("log_probs", "entropy", "sum_pi_squared", "distillation_losses", "student_mass",
               "teacher_mass")
NO_GRAD_KEYS = frozenset({"student_mass", "teacher_mass"})
TEACHER_ARG_NAMES = ("teacher_ids", "teacher_log_probs")


@dataclass(frozen=True, slots=True)
class Plan:
    """A pass's non-tensor state: shard, rows per chunk, layout, clamp, host-scalar t != 1, backend."""

    shard: _common.Shard
    rows: int
    layout: StatLayout
    clamp: float | None
    t_scalar: float | None
    backend: ChunkBackend

    @property
    def keys(self) -> tuple[str, ...]:
        """The requested outputs in ``OUTPUT_KEYS`` order."""
        lay = self.layout
        wanted = {"log_probs": lay.label, "entropy": lay.entropy, "sum_pi_squared": lay.sum_pi_squared,
                  "distillation_losses": lay.k > 0, "student_mass": lay.k > 0, "teacher_mass": lay.k > 0}
        return tuple(k for k in OUTPUT_KEYS if wanted[k])

    def chunks(self, r0: int, r1: int) -> list[tuple[int, int]]:
        return [(a, min(a + self.rows, r1)) for a in range(r0, r1, self.rows)]

    def blocks(self, n: int, rereadable: bool) -> list[tuple[int, int]]:
        """Rows sharing one MAX and one SUM all-reduce: all rows for logits slices under TP, else a chunk."""
        return [(0, n)] if rereadable and self.shard.world > 1 else self.chunks(0, n)

    def chunk_t(self, t_rows: torch.Tensor | None, r0: int, r1: int) -> float | torch.Tensor | None:
        return t_rows[r0:r1] if t_rows is not None else self.t_scalar


@dataclass(frozen=True, slots=True)
class Rows:
    """The per-token tensors as rows: labels ``[N]``, teacher ids / log-probs ``[N, k]``, t ``[N]``."""

    labels: torch.Tensor | None
    teacher_ids: torch.Tensor | None
    teacher_log_probs: torch.Tensor | None
    t_rows: torch.Tensor | None


def _check_teacher(teacher_ids: object, teacher_log_probs: object, lead: tuple[int, ...], vocab_size: int,
                   names: tuple[str, str]) -> int:
    """Both teacher tensors or neither, shaped ``lead + (k,)``; returns k (0: none)."""
    ids_name, lp_name = names
    if (teacher_ids is None) != (teacher_log_probs is None):
        raise ValueError(f"{ids_name} and {lp_name} must be given together (shape [..., k])")
    if teacher_ids is None:
        return 0
    if not isinstance(teacher_ids, torch.Tensor) or teacher_ids.dim() != len(lead) + 1 \
            or teacher_ids.shape[-1] == 0:
        raise ValueError(f"{ids_name} must be an integer tensor of shape {lead} + (k,) with k >= 1, got "
                         f"{type(teacher_ids).__name__} {tuple(getattr(teacher_ids, 'shape', ()))}")
    k = teacher_ids.shape[-1]
    _common.check_ids(teacher_ids, ids_name, lead + (k,), vocab_size)
    if not isinstance(teacher_log_probs, torch.Tensor) or not teacher_log_probs.is_floating_point() \
            or tuple(teacher_log_probs.shape) != lead + (k,):
        raise ValueError(f"{lp_name} must be a floating tensor of shape {lead + (k,)}, got "
                         f"{getattr(teacher_log_probs, 'dtype', type(teacher_log_probs).__name__)} "
                         f"{tuple(getattr(teacher_log_probs, 'shape', ()))}")
    return k


def make_plan(
    shard: _common.Shard, lead: tuple[int, ...], device: torch.device, *, labels: torch.Tensor | None,
    teacher_ids: torch.Tensor | None, teacher_log_probs: torch.Tensor | None, entropy: bool,
    sum_pi_squared: bool, kl_tail: bool, log_prob_min_clamp: float | None, temperature: Temperature,
    chunk_size: int | None, teacher_arg_names: tuple[str, str] = TEACHER_ARG_NAMES,
    default_elements: Callable[[ChunkBackend], int] = lambda backend: backend.chunk_elements,
) -> tuple[Plan, Rows]:
    """Check a pass's arguments (ValueError naming each) and flatten its tensors to rows of ``lead``."""
    n = math.prod(lead)
    if labels is not None:
        _common.check_ids(labels, "labels", lead, shard.vocab_size)
        labels = labels.reshape(n).long()
    k = _check_teacher(teacher_ids, teacher_log_probs, lead, shard.vocab_size, teacher_arg_names)
    if k:
        teacher_ids = teacher_ids.reshape(n, k).long()
        teacher_log_probs = teacher_log_probs.detach().reshape(n, k)
    if kl_tail and not k:
        raise ValueError(f"kl_tail=True requires {teacher_arg_names[0]} and {teacher_arg_names[1]}")
    clamp = _common.check_clamp(log_prob_min_clamp)
    backend = chunk_backend(device)
    rows = _common.check_chunk_size(chunk_size, shard.v_local, default_elements=default_elements(backend))
    t = temperature_rows(temperature, lead, device)
    layout = StatLayout(entropy=bool(entropy), sum_pi_squared=bool(sum_pi_squared), label=labels is not None,
                        k=k, tail=bool(kl_tail))
    plan = Plan(shard=shard, rows=rows, layout=layout, clamp=clamp,
                t_scalar=t if isinstance(t, float) else None, backend=backend)
    return plan, Rows(labels, teacher_ids, teacher_log_probs, t if isinstance(t, torch.Tensor) else None)
