"""How a TensorDict batch lays out its tokens: jagged nested ``[B, j, ...]`` or padded ``[B, S, ...]``.

Jagged: every per-token key is a jagged nested tensor with the lengths of ``input_ids`` (trailing
dims allowed). Padded: ``input_ids [B, S]`` plus a bool or 0/1 ``attention_mask [B, S]`` (any padding
side), every per-token key ``[B, S, ...]``. Both map to ``lengths [B]`` (int64) and, per key,
``values [N, ...]`` (one copy per key; a view for contiguous jagged)::

    values = torch.cat([x[b][mask[b]] for b in range(B)])      # padded
    values = torch.cat(x.unbind())                             # jagged
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase, is_non_tensor

# Keys with a meaning of their own; everything else of token layout is a user per-token field.
INPUT_KEYS = ("input_ids", "position_ids", "attention_mask")
TEACHER_KEYS = ("teacher_ids", "teacher_logprobs")


def is_jagged(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.is_nested and t.layout == torch.jagged


def tensor_keys(batch: TensorDictBase) -> list[str]:
    """Top-level keys holding tensors (non-tensor entries such as flags are left out)."""
    return [k for k, v in batch.items() if not is_non_tensor(v)]


def padding_mask(batch: TensorDictBase) -> torch.Tensor:
    """``attention_mask`` of a padded batch as bool ``[B, S]`` (True = real token)."""
    return batch["attention_mask"].to(torch.bool)


def sequence_lengths(batch: TensorDictBase) -> torch.Tensor:
    """Real tokens per sequence, int64 ``[B]`` on the CPU."""
    ids = batch["input_ids"]
    if is_jagged(ids):
        return jagged_lengths(ids)
    return padding_mask(batch).sum(dim=1).to(device="cpu", dtype=torch.int64)


def jagged_lengths(t: torch.Tensor) -> torch.Tensor:
    """Lengths of a jagged nested tensor, int64 ``[B]`` on the CPU."""
    lengths = t.lengths()
    if lengths is None:
        lengths = t.offsets().diff()
    return lengths.to(device="cpu", dtype=torch.int64)


def per_token_keys(batch: TensorDictBase) -> list[str]:
    """Tensor keys laid out per token like ``input_ids`` (``attention_mask`` excluded): jagged nested
    tensors, or (padded) tensors with ``shape[:2] == (B, S)``."""
    ids = batch["input_ids"]
    keys = []
    for key in tensor_keys(batch):
        if key == "attention_mask":
            continue
        value = batch[key]
        if is_jagged(ids):
            if is_jagged(value):
                keys.append(key)
        elif not value.is_nested and value.dim() >= 2 and value.shape[:2] == ids.shape[:2]:
            keys.append(key)
    return keys


def token_values(batch: TensorDictBase, key: str) -> torch.Tensor:
    """``[N, ...]``: the real tokens of ``batch[key]`` over sequences (jagged: a view when contiguous;
    padded: ``batch[key][attention_mask]``, a copy)."""
    value = batch[key]
    if is_jagged(value):
        offsets = value.offsets()
        if value.lengths() is None and int(offsets[0]) == 0:
            return value.values()[: int(offsets[-1])]
        return torch.cat(value.unbind())
    return value[padding_mask(batch)]


def padded_source_index(batch: TensorDictBase) -> torch.Tensor:
    """Flat positions ``[N]`` (int64) of the real tokens in a padded batch's ``[B * S]`` view."""
    return padding_mask(batch).reshape(-1).nonzero().squeeze(1).cpu()


def response_mask_key(batch: TensorDictBase) -> str | None:
    """Key of the dense ``[B, R]`` response mask beside jagged ``input_ids``, or None: a dense
    ``loss_mask`` (verl's ``loss_mask = response_mask``), else a dense ``response_mask``; a jagged
    ``loss_mask`` wins (``response_mask`` is then an ordinary field)."""
    if not is_jagged(batch["input_ids"]):
        return None
    for key in ("loss_mask", "response_mask"):
        value = batch.get(key) if key in batch.keys() else None
        if isinstance(value, torch.Tensor):
            return None if value.is_nested else key
    return None


def response_lengths(batch: TensorDictBase, width: int) -> torch.Tensor:
    """Response tokens per sequence, int64 ``[B]`` (CPU): ``attention_mask[:, -width:].sum(1)`` of
    verl's ``attention_mask [B, P + width]`` (left-padded prompts, right-padded responses).
    ``ValueError`` naming the mask's key without one."""
    mask = batch["attention_mask"] if "attention_mask" in batch.keys() else None
    if isinstance(mask, torch.Tensor) and not mask.is_nested and mask.dim() == 2 and mask.shape[1] >= width:
        return mask[:, mask.shape[1] - width:].sum(1).to(device="cpu", dtype=torch.int64)
    key = response_mask_key(batch)
    raise ValueError(f"{key} [B, R] needs the response lengths from verl's left-right padded "
                     f"attention_mask [B, P + R] (R={width})")


def loss_mask_values(batch: TensorDictBase) -> torch.Tensor | None:
    """The output-aligned loss mask (entry t masks the output predicting token t + 1) over the real
    tokens, float32 ``[N]`` (None without one): a per-token ``loss_mask``'s :func:`token_values`, or
    from a dense response mask ``m [B, R]`` with ``r_i`` response tokens ending sequence i of ``L_i``::

        loss_mask[i, L_i - r_i - 1 + c] = m[i, c]    (c < r_i), 0 elsewhere

    Needs ``L_i - r_i >= 1`` (checked by ``validate_batch``)."""
    key = response_mask_key(batch)
    if key is None:
        if "loss_mask" not in batch.keys():
            return None
        return token_values(batch, "loss_mask").to(torch.float32)
    mask = batch[key]
    width = mask.shape[1]
    lengths = sequence_lengths(batch).to(mask.device)
    resp = response_lengths(batch, width).to(mask.device)
    ends = lengths.cumsum(0)
    cols = torch.arange(width, device=mask.device)
    valid = cols[None, :] < resp[:, None]
    positions = (ends - resp - 1)[:, None] + cols[None, :]
    out = torch.zeros(int(ends[-1]), dtype=torch.float32, device=mask.device)
    out[positions[valid]] = mask[valid].to(torch.float32)
    return out
