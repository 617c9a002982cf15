"""TensorDict batches at the engine boundary: per-step flags and batch validation.

The RL framework hands the engine a ``tensordict.TensorDict`` (API.md "The engine"). Its non-tensor
entries are the step's flags; they are read ONCE here into the frozen :class:`StepFlags` and nothing
below the engine reads string keys from the batch. :func:`validate_batch` rejects a malformed batch
with a ``ValueError`` naming the key before any model work starts.

Micro-batching (:mod:`mcore_engine.micro_batching`) and packing into model inputs
(:mod:`mcore_engine.packing`) are re-exported here, so ``mcore_engine.data`` is the one import.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase, is_non_tensor

from mcore_engine.batch_layout import (
    INPUT_KEYS,
    TEACHER_KEYS,
    is_jagged,
    jagged_lengths,
    per_token_keys,
    sequence_lengths,
    token_values,
)
from mcore_engine.micro_batching import merge_micro_batches, restore_order, split_micro_batches
from mcore_engine.packing import ModelInputs, flatten_per_token, pack_micro_batch, unpack_per_token

__all__ = [
    "ModelInputs",
    "StepFlags",
    "flatten_per_token",
    "merge_micro_batches",
    "pack_micro_batch",
    "parse_step_flags",
    "restore_order",
    "split_micro_batches",
    "unpack_per_token",
    "validate_batch",
]

_BOOL_FLAGS = ("calculate_entropy", "calculate_sum_pi_squared", "distillation_use_topk",
               "distillation_only", "use_dynamic_bsz")
_INT_FLAGS = ("micro_batch_size_per_gpu", "max_token_len_per_gpu")


@dataclass(frozen=True, kw_only=True, slots=True)
class StepFlags:
    """Per-step switches, parsed once from a batch's non-tensor entries by :func:`parse_step_flags`."""

    temperature: float | None = 1.0
    """Sampling temperature as a host number; ``None`` when the batch holds a per-sample ``[B]`` tensor
    ``temperature`` instead (then :func:`pack_micro_batch` expands it per token)."""
    calculate_entropy: bool = False
    """Return the per-token entropy of ``softmax(logits / temperature)``."""
    calculate_sum_pi_squared: bool = False
    """Return the per-token ``sum_j p_j**2``."""
    distillation_use_topk: bool = False
    """Run the top-k forward-KL distillation against ``teacher_ids`` / ``teacher_logprobs``."""
    distillation_only: bool = False
    """Skip log-probs entirely (requires ``distillation_use_topk``)."""
    micro_batch_size_per_gpu: int | None = None
    """Sequences per micro-batch; ``None`` uses the engine's default. Ignored under ``use_dynamic_bsz``."""
    use_dynamic_bsz: bool = False
    """Split into micro-batches by a token budget instead of a sequence count."""
    max_token_len_per_gpu: int | None = None
    """Token budget of one micro-batch under ``use_dynamic_bsz`` (required then)."""

    def __post_init__(self) -> None:
        if self.distillation_only and not self.distillation_use_topk:
            raise ValueError("distillation_only=True requires distillation_use_topk=True")
        if self.use_dynamic_bsz and self.max_token_len_per_gpu is None:
            raise ValueError("use_dynamic_bsz=True requires max_token_len_per_gpu (a positive int)")
        if self.temperature is not None:
            _check_temperature_number(self.temperature)
        for name in _INT_FLAGS:
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value}")


def _check_temperature_number(value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"temperature must be finite and > 0, got {value}")


def _non_tensor_value(batch: TensorDictBase, key: str) -> Any:
    """The Python value of a non-tensor entry; a stack of equal values collapses to one."""
    value = batch.get_non_tensor(key)
    if isinstance(value, list):
        if any(v != value[0] for v in value[1:]):
            raise ValueError(f"{key} must be one value for the whole batch, got {value}")
        value = value[0] if value else None
    return value


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool) or type(value).__name__ == "bool_":  # numpy.bool_ without importing numpy
        return bool(value)
    raise ValueError(f"{key} must be a bool, got {type(value).__name__} {value!r}")


def _as_positive_int(key: str, value: Any) -> int:
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > 0:
        return int(value)
    raise ValueError(f"{key} must be a positive int, got {type(value).__name__} {value!r}")


def parse_step_flags(batch: TensorDictBase) -> StepFlags:
    """Read the step flags from ``batch``'s non-tensor entries into a frozen :class:`StepFlags`.

    Absent flags take their defaults. ``temperature`` is a non-tensor number, or a per-sample tensor
    key (then ``StepFlags.temperature is None``), or absent (1.0). A flag stored as a tensor, a
    value of the wrong type (``"yes"``, ``1`` for a bool, ``2.0`` for a size), a size <= 0, a
    non-finite or non-positive temperature, ``distillation_only`` without ``distillation_use_topk``
    and ``use_dynamic_bsz`` without ``max_token_len_per_gpu`` raise ``ValueError`` naming the key.
    """
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
    if "temperature" in batch.keys():
        entry = batch.get("temperature")
        if is_non_tensor(entry):
            value = _non_tensor_value(batch, "temperature")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ValueError(f"temperature must be a number, got {type(value).__name__} {value!r}")
            _check_temperature_number(float(value))
            # Keep the host number as given: an int 1 stays a unit temperature (never divided).
            kwargs["temperature"] = value
        else:
            kwargs["temperature"] = None
    return StepFlags(**kwargs)


def _check_same_tokens(key: str, value: torch.Tensor, batch: TensorDictBase, lengths: torch.Tensor,
                       trailing: int | None) -> None:
    """``batch[key]`` has the token layout of ``input_ids`` plus ``trailing`` extra dims (None: any)."""
    ids = batch["input_ids"]
    if is_jagged(ids):
        if not is_jagged(value):
            raise ValueError(f"{key} must be a jagged nested tensor like input_ids [B, j], got "
                             f"{'a nested' if value.is_nested else 'a dense'} tensor {tuple(value.shape)}")
        if not torch.equal(jagged_lengths(value), lengths):
            raise ValueError(f"{key} sequence lengths {jagged_lengths(value).tolist()} do not match "
                             f"input_ids lengths {lengths.tolist()}")
        extra = value.dim() - 2
    else:
        if value.is_nested or value.dim() < 2 or value.shape[:2] != ids.shape:
            raise ValueError(f"{key} must have shape {tuple(ids.shape)} (+ trailing dims) like input_ids, "
                             f"got {tuple(value.shape)}")
        extra = value.dim() - 2
    if trailing is not None and extra != trailing:
        raise ValueError(f"{key} must have {2 + trailing} dims ([B, j{', K' if trailing else ''}]), "
                         f"got {value.dim()}")


def _check_ids(key: str, ids: torch.Tensor, vocab_size: int) -> None:
    if ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{key} must be int64 (or int32), got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{key} must lie in [0, vocab_size={vocab_size}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")


def validate_batch(batch: TensorDictBase, *, vocab_size: int, max_sequence_length: int,
                   require_teacher: bool) -> None:
    """Raise ``ValueError`` naming the key when ``batch`` is not a valid engine batch.

    Checks: ``input_ids`` present, int64/int32, jagged ``[B, j]`` or padded ``[B, S]`` with a bool or
    0/1 ``attention_mask [B, S]``; every sequence has ``1 <= length <= max_sequence_length`` real
    tokens; real ids in ``[0, vocab_size)``; ``position_ids`` / ``loss_mask`` / every other per-token
    key shaped like ``input_ids``; ``teacher_ids`` (ids in the vocab) and ``teacher_logprobs``
    (floating) shaped ``[B, j, K]`` with the same ``K``, both required when ``require_teacher``;
    a tensor ``temperature`` is floating ``[B]``, finite and > 0. Reads only; costs O(N) host syncs.
    """
    if not isinstance(batch, TensorDictBase):
        raise ValueError(f"batch must be a tensordict.TensorDict, got {type(batch).__name__}")
    if "input_ids" not in batch.keys():
        raise ValueError("batch is missing the key input_ids")
    ids = batch["input_ids"]
    if batch.batch_dims != 1 or batch.batch_size[0] < 1:
        raise ValueError(f"batch must have a 1-d batch_size [B] with B >= 1, got {list(batch.batch_size)}")
    if is_jagged(ids):
        if ids.dim() != 2:
            raise ValueError(f"input_ids must be a jagged nested tensor [B, j], got {ids.dim()} dims")
    else:
        if ids.is_nested or ids.dim() != 2:
            raise ValueError(f"input_ids must be a jagged nested tensor [B, j] or a padded tensor [B, S], "
                             f"got shape {tuple(ids.shape)}")
        if "attention_mask" not in batch.keys():
            raise ValueError("batch is missing the key attention_mask (needed by padded input_ids [B, S])")
        mask = batch["attention_mask"]
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask must have shape {tuple(ids.shape)}, got {tuple(mask.shape)}")
        if mask.is_floating_point() or mask.is_complex() or (
                mask.dtype != torch.bool and not bool(((mask == 0) | (mask == 1)).all())):
            raise ValueError(f"attention_mask must be bool or 0/1 integers, got {mask.dtype}")
    lengths = sequence_lengths(batch)
    if int(lengths.min()) < 1:
        raise ValueError(f"input_ids: every sequence needs >= 1 token, got lengths {lengths.tolist()}")
    if int(lengths.max()) > max_sequence_length:
        raise ValueError(f"input_ids: sequence of {int(lengths.max())} tokens exceeds "
                         f"max_sequence_length={max_sequence_length}")
    _check_ids("input_ids", token_values(batch, "input_ids"), vocab_size)

    tokens = set(per_token_keys(batch))
    for key in ("position_ids", "loss_mask"):
        if key in batch.keys():
            _check_same_tokens(key, batch[key], batch, lengths, trailing=0)
    if "position_ids" in batch.keys() and batch["position_ids"].dtype not in (torch.int64, torch.int32):
        raise ValueError(f"position_ids must be int64 (or int32), got {batch['position_ids'].dtype}")
    if "loss_mask" in batch.keys() and batch["loss_mask"].is_complex():
        raise ValueError(f"loss_mask must be bool, integer or floating, got {batch['loss_mask'].dtype}")

    missing = [k for k in TEACHER_KEYS if k not in batch.keys()]
    if require_teacher and missing:
        raise ValueError(f"batch is missing the key {missing[0]} (required by distillation_use_topk)")
    if len(missing) == 1:
        raise ValueError(f"batch has {TEACHER_KEYS[1 - TEACHER_KEYS.index(missing[0])]} but is missing "
                         f"the key {missing[0]}")
    if not missing:
        for key in TEACHER_KEYS:
            _check_same_tokens(key, batch[key], batch, lengths, trailing=1)
        k_ids, k_lp = batch["teacher_ids"].shape[-1], batch["teacher_logprobs"].shape[-1]
        if k_ids != k_lp or k_ids < 1:
            raise ValueError(f"teacher_logprobs K={k_lp} must equal teacher_ids K={k_ids} (>= 1)")
        if not batch["teacher_logprobs"].is_floating_point():
            raise ValueError(f"teacher_logprobs must be floating, got {batch['teacher_logprobs'].dtype}")
        _check_ids("teacher_ids", token_values(batch, "teacher_ids"), vocab_size)

    if "temperature" in batch.keys() and not is_non_tensor(batch.get("temperature")):
        temp = batch["temperature"]
        if temp.is_nested or temp.shape != batch.batch_size or not temp.is_floating_point():
            raise ValueError(f"temperature must be a floating per-sample tensor [B]={list(batch.batch_size)} "
                             f"or a non-tensor number, got {temp.dtype} {tuple(temp.shape)}")
        if not bool((torch.isfinite(temp) & (temp > 0)).all()):
            raise ValueError(f"temperature must be finite and > 0, got {temp.tolist()}")

    for key in batch.keys():
        value = batch.get(key)
        if not is_jagged(ids) and key not in INPUT_KEYS and is_jagged(value):
            raise ValueError(f"{key} is a jagged nested tensor but input_ids is padded [B, S]")
    for key in tokens - {"input_ids", "position_ids", "loss_mask", *TEACHER_KEYS}:
        _check_same_tokens(key, batch[key], batch, lengths, trailing=None)
