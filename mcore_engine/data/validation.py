"""Batch validation at the engine boundary: a malformed batch raises ``ValueError`` naming the key
before any model work starts (the engine agrees on the outcome over data-parallel ranks)."""

from __future__ import annotations

import torch
from tensordict import TensorDictBase

from mcore_engine.data.layout import (
    INPUT_KEYS,
    TEACHER_KEYS,
    is_jagged,
    jagged_lengths,
    per_token_keys,
    response_lengths,
    response_mask_key,
    sequence_lengths,
    token_values,
)

__all__ = ["validate_batch"]


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
    elif value.is_nested or value.dim() < 2 or value.shape[:2] != ids.shape:
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


def _check_no_nan_or_pos_inf(key: str, values: torch.Tensor, *, allow_neg_inf: bool) -> None:
    """``ValueError`` on NaN or +inf in ``values`` (and on -inf unless ``allow_neg_inf``)."""
    bad = torch.isnan(values) | (values == float("inf"))
    if not allow_neg_inf:
        bad |= values == float("-inf")
    if bool(bad.any()):
        allowed = "NaN and +inf" if allow_neg_inf else "NaN and +-inf"
        raise ValueError(f"{key} must not contain {allowed}; it holds {int(bad.sum())} such value(s), "
                         f"e.g. {values[bad][0].item()}")


def _check_response_mask(batch: TensorDictBase, key: str, lengths: torch.Tensor) -> None:
    """A dense response mask ``batch[key]`` ``[B, R]`` (layout.loss_mask_values) and its lengths."""
    mask = batch[key]
    size = batch.batch_size[0]
    if mask.dim() != 2 or mask.shape[0] != size:
        raise ValueError(f"{key} must be a jagged nested tensor like input_ids [B, j] or a dense response "
                         f"mask [B={size}, R], got shape {tuple(mask.shape)}")
    if key == "loss_mask" and "response_mask" in batch.keys():
        other = batch["response_mask"]
        if isinstance(other, torch.Tensor) and (other.is_nested or other.shape != mask.shape):
            raise ValueError(f"loss_mask {tuple(mask.shape)} and response_mask "
                             f"{'nested' if other.is_nested else tuple(other.shape)} are both dense response "
                             "masks and must have one shape [B, R] (loss_mask is the one used)")
    if mask.is_complex():
        raise ValueError(f"{key} must be bool, integer or floating, got {mask.dtype}")
    width = mask.shape[1]
    resp = response_lengths(batch, width)
    real = batch["attention_mask"].sum(1).to(device="cpu", dtype=torch.int64)
    if not torch.equal(real, lengths):
        raise ValueError(f"attention_mask counts {real.tolist()} real tokens per row, input_ids has "
                         f"lengths {lengths.tolist()} (needed to place {key} [B, R])")
    bad = torch.nonzero(lengths - resp < 1).flatten().tolist()
    if bad:
        i = bad[0]
        raise ValueError(f"{key}: sequence {i} has {int(resp[i])} response tokens of {int(lengths[i])}; "
                         "a response must leave at least one prompt token")
    if mask.is_floating_point():
        cols = torch.arange(width)
        real_cols = (cols[None, :] < resp[:, None]).to(mask.device)
        _check_no_nan_or_pos_inf(key, mask[real_cols], allow_neg_inf=False)


def validate_batch(batch: TensorDictBase, *, vocab_size: int, max_sequence_length: int,
                   require_teacher: bool) -> None:
    """Raise ``ValueError`` naming the key when ``batch`` is not a valid engine batch:

    - ``input_ids``: int64/int32, jagged ``[B, j]`` or padded ``[B, S]`` with a bool or 0/1
      ``attention_mask``; ``1 <= length <= max_sequence_length``; ids in ``[0, vocab_size)``.
    - ``position_ids`` (int), ``loss_mask`` (finite) and other per-token keys shaped like ``input_ids``;
      beside jagged ``input_ids``, a dense ``[B, R]`` response mask instead (``layout``).
    - ``teacher_ids`` (in the vocab), ``teacher_logprobs`` (no NaN / +inf) ``[B, j, K]``, one ``K``;
      required when ``require_teacher``.
    (A tensor ``temperature`` is checked with the flags: ``data.flags.per_sample_temperature``.)

    Only real tokens are checked. Reads only; a few host syncs per key."""
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

    response_key = response_mask_key(batch)
    for key in ("position_ids", "loss_mask"):
        if key in batch.keys() and key != response_key:  # 3-D (t, h, w) positions: data.multimodal
            _check_same_tokens(key, batch[key], batch, lengths, trailing=None if key == "position_ids" else 0)
    if "position_ids" in batch.keys() and batch["position_ids"].dtype not in (torch.int64, torch.int32):
        raise ValueError(f"position_ids must be int64 (or int32), got {batch['position_ids'].dtype}")
    if not is_jagged(ids) and "response_mask" in batch.keys() and "loss_mask" not in batch.keys():
        raise ValueError("response_mask [B, R] sets the loss mask only beside jagged input_ids; padded "
                         "input_ids [B, S] need loss_mask [B, S]")
    if response_key is not None:
        _check_response_mask(batch, response_key, lengths)
    elif "loss_mask" in batch.keys():
        if batch["loss_mask"].is_complex():
            raise ValueError(f"loss_mask must be bool, integer or floating, got {batch['loss_mask'].dtype}")
        if batch["loss_mask"].is_floating_point():
            _check_no_nan_or_pos_inf("loss_mask", token_values(batch, "loss_mask"), allow_neg_inf=False)

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
        _check_no_nan_or_pos_inf("teacher_logprobs", token_values(batch, "teacher_logprobs"),
                                 allow_neg_inf=True)

    for key in batch.keys():
        if not is_jagged(ids) and key not in INPUT_KEYS and is_jagged(batch.get(key)):
            raise ValueError(f"{key} is a jagged nested tensor but input_ids is padded [B, S]")
    for key in set(per_token_keys(batch)) - {"input_ids", "position_ids", "loss_mask", *TEACHER_KEYS}:
        _check_same_tokens(key, batch[key], batch, lengths, trailing=None)
