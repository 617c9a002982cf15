"""Per-step flags: a batch's non-tensor entries (Python or NumPy scalars), parsed once into a frozen
:class:`StepFlags` of Python values; nothing below the engine reads string keys from the batch."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from tensordict import TensorDictBase, is_non_tensor

__all__ = ["StepFlags", "parse_step_flags", "per_sample_temperature"]

_BOOL_FLAGS = ("calculate_entropy", "calculate_sum_pi_squared", "distillation_use_topk",
               "distillation_only", "use_dynamic_bsz", "outputs_on_loss_mask_only")
_INT_FLAGS = ("micro_batch_size_per_gpu", "max_token_len_per_gpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFlags:
    """Per-step switches, parsed from a batch by :func:`parse_step_flags`."""

    temperature: float | None = 1.0
    """Host number; ``None`` when the batch holds a per-sample tensor (:func:`per_sample_temperature`)."""
    calculate_entropy: bool = False
    """Return the per-token entropy of ``softmax(logits / temperature)``."""
    calculate_sum_pi_squared: bool = False
    """Return the per-token ``sum_j p_j**2``."""
    distillation_use_topk: bool = False
    """Run the top-k forward-KL distillation against ``teacher_ids`` / ``teacher_logprobs``."""
    distillation_only: bool = False
    """Skip log-probs entirely (requires ``distillation_use_topk``)."""
    micro_batch_size_per_gpu: int | None = None
    """Sequences per micro-batch; ``None``: the engine's default. Ignored under ``use_dynamic_bsz``."""
    use_dynamic_bsz: bool = False
    """Split into micro-batches by a token budget instead of a sequence count."""
    max_token_len_per_gpu: int | None = None
    """Token budget of one micro-batch under ``use_dynamic_bsz`` (required then)."""
    outputs_on_loss_mask_only: bool = False
    """Output layer and per-token outputs only on rows with a nonzero packed ``loss_mask`` (0 elsewhere)."""
    distillation_log_prob_min_clamp: float | None = None
    """The built-in top-k KL's lower clamp ``c`` on the teacher and student log-probs (entries with a
    student log-prob below ``c`` get no gradient); verl's ``distillation_loss.log_prob_min_clamp``."""

    def __post_init__(self) -> None:
        if self.distillation_only and not self.distillation_use_topk:
            raise ValueError("distillation_only=True requires distillation_use_topk=True")
        if self.use_dynamic_bsz and self.max_token_len_per_gpu is None:
            raise ValueError("use_dynamic_bsz=True requires max_token_len_per_gpu (a positive int)")
        if self.temperature is not None:
            check_temperature_number(self.temperature)
        for name in _INT_FLAGS:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value}")


def check_temperature_number(value: float) -> None:
    """``ValueError`` unless ``value`` is finite and > 0."""
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {value}")


def per_sample_temperature(batch: TensorDictBase) -> torch.Tensor:
    """The batch's tensor ``temperature`` as float32 ``[B]``: ``[B]`` or ``[B, 1]`` (verl's column),
    floating, finite and > 0, else ``ValueError``. One host sync."""
    temp, size = batch.get("temperature"), list(batch.batch_size)
    if temp.is_nested or temp.shape not in (torch.Size(size), torch.Size([*size, 1])) \
            or not temp.is_floating_point():
        raise ValueError(f"temperature must be a floating per-sample tensor [B] or [B, 1] (B={size[0]}) "
                         f"or a non-tensor number, got {temp.dtype} {tuple(temp.shape)}")
    if not bool((torch.isfinite(temp) & (temp > 0)).all()):
        raise ValueError(f"temperature must be finite and > 0, got {temp.reshape(-1).tolist()}")
    return temp.reshape(size).to(torch.float32)


def _non_tensor_value(batch: TensorDictBase, key: str) -> Any:
    """The Python value of a non-tensor entry; a stack of equal values collapses to one."""
    value = batch.get_non_tensor(key)
    if isinstance(value, list):
        if any(v != value[0] for v in value[1:]):
            raise ValueError(f"{key} must be one value for the whole batch, got {value}")
        value = value[0] if value else None
    return value.item() if isinstance(value, np.generic) else value


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ValueError(f"{key} must be a bool, got {type(value).__name__} {value!r}")


def _as_positive_int(key: str, value: Any) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise ValueError(f"{key} must be a positive int, got {type(value).__name__} {value!r}")


def parse_step_flags(batch: TensorDictBase) -> StepFlags:
    """The step flags of ``batch`` (absent ones: defaults; a tensor ``temperature``: ``None``, checked
    by :func:`per_sample_temperature`). ``ValueError`` naming the key for a flag stored as a tensor, a
    wrong type (``1`` for a bool, ``2.0`` for a size), a size <= 0, a non-finite or non-positive
    temperature, a non-finite clamp,
    ``distillation_only`` without ``distillation_use_topk``, ``use_dynamic_bsz`` without
    ``max_token_len_per_gpu``."""
    if not isinstance(batch, TensorDictBase):
        raise ValueError(f"batch must be a tensordict.TensorDict, got {type(batch).__name__}")
    kwargs: dict[str, Any] = {}
    for key in (*_BOOL_FLAGS, *_INT_FLAGS):
        if key not in batch.keys():
            continue
        if not is_non_tensor(batch.get(key)):
            raise ValueError(f"{key} must be a non-tensor entry (batch.set_non_tensor), got a tensor")
        value = _non_tensor_value(batch, key)
        if value is None:
            continue
        kwargs[key] = _as_bool(key, value) if key in _BOOL_FLAGS else _as_positive_int(key, value)
    key = "distillation_log_prob_min_clamp"
    if key in batch.keys():
        if not is_non_tensor(batch.get(key)):
            raise ValueError(f"{key} must be a non-tensor entry (batch.set_non_tensor), got a tensor")
        value = _non_tensor_value(batch, key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"{key} must be a finite number or None, got "
                                 f"{type(value).__name__} {value!r}")
            kwargs[key] = float(value)
    if "temperature" in batch.keys():
        if is_non_tensor(batch.get("temperature")):
            value = _non_tensor_value(batch, "temperature")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"temperature must be a number, got {type(value).__name__} {value!r}")
            check_temperature_number(float(value))
            kwargs["temperature"] = value  # as given: an int 1 stays a unit temperature (never divided)
        else:
            per_sample_temperature(batch)
            kwargs["temperature"] = None
    return StepFlags(**kwargs)
