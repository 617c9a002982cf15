"""How a TensorDict batch lays out its tokens: jagged nested ``[B, j, ...]`` or padded ``[B, S, ...]``.

Two layouts of ``input_ids`` are accepted (API.md "The engine"):

- jagged: ``torch.nested.nested_tensor(list_of_[L_i], layout=torch.jagged)``; every per-token key is a
  jagged nested tensor with the same lengths (trailing dims allowed, e.g. ``teacher_ids [B, j, K]``).
- padded: ``input_ids [B, S]`` plus ``attention_mask [B, S]`` (bool or 0/1); the real tokens of row
  ``b`` are ``input_ids[b][attention_mask[b]]`` in order (left, right or both-sided padding all work).
  Every per-token key has the shape ``[B, S, ...]``.

The user's loss mask is output-aligned (entry t masks the output at position t, which is about token
t + 1). It comes either per token (``loss_mask`` in the layout of ``input_ids``) or, beside jagged
``input_ids``, as verl's dense response mask ``[B, R]`` (:func:`loss_mask_values`).

The helpers here turn either layout into the same canonical form: ``lengths [B]`` (int64) and, per
key, ``values [N, ...]`` with ``N = lengths.sum()`` (sequence 0's tokens, then sequence 1's, ...):

    values = torch.cat([x[b][mask[b]] for b in range(B)])      # padded
    values = torch.cat(x.unbind())                             # jagged

Memory: one ``[N, ...]`` copy per extracted key (the jagged fast path returns a view).
"""

from __future__ import annotations

import torch
from tensordict import TensorDictBase, is_non_tensor

# Keys with a meaning of their own; everything else of token layout is a user per-token field.
INPUT_KEYS = ("input_ids", "position_ids", "attention_mask")
TEACHER_KEYS = ("teacher_ids", "teacher_logprobs")


def is_jagged(t: object) -> bool:
    """True for a ``torch.jagged`` nested tensor."""
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
    """Tensor keys laid out per token like ``input_ids`` (``attention_mask`` excluded).

    Jagged batches: every jagged nested tensor. Padded batches ``[B, S]``: every tensor with
    ``dim >= 2`` and ``shape[:2] == (B, S)``.
    """
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
    """The real tokens of ``batch[key]`` concatenated over sequences: ``[N, ...]``.

    Jagged: a view of the nested tensor's buffer when it is contiguous, else a concatenation.
    Padded: ``batch[key][attention_mask]`` (a copy).
    """
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
    """The key of the batch's dense ``[B, R]`` response mask, or None.

    Only beside jagged ``input_ids``: a dense (not nested) ``loss_mask`` (verl sets ``loss_mask =
    response_mask``), else a dense ``response_mask``. A per-token (jagged) ``loss_mask`` always
    wins: ``response_mask`` is then an ordinary per-sample field.
    """
    if not is_jagged(batch["input_ids"]):
        return None
    for key in ("loss_mask", "response_mask"):
        value = batch.get(key) if key in batch.keys() else None
        if isinstance(value, torch.Tensor):
            return None if value.is_nested else key
    return None


def response_lengths(batch: TensorDictBase, width: int) -> torch.Tensor:
    """Response tokens per sequence ``r_i``, int64 ``[B]`` on the CPU, for a ``[B, width]`` response
    mask: ``attention_mask[:, -width:].sum(1)`` of verl's left-right padded ``attention_mask
    [B, P + width]`` (prompts left-padded into the first P columns, responses right-padded into the
    last ``width``). ``ValueError`` naming the mask's key without one."""
    mask = batch["attention_mask"] if "attention_mask" in batch.keys() else None
    if isinstance(mask, torch.Tensor) and not mask.is_nested and mask.dim() == 2 and mask.shape[1] >= width:
        return mask[:, mask.shape[1] - width:].sum(1).to(device="cpu", dtype=torch.int64)
    key = response_mask_key(batch)
    raise ValueError(f"{key} [B, R] needs the response lengths from verl's left-right padded "
                     f"attention_mask [B, P + R] (R={width})")


def loss_mask_values(batch: TensorDictBase) -> torch.Tensor | None:
    """The user's output-aligned loss mask over the real tokens, float32 ``[N]``; None without one.

    Per-token ``loss_mask``: its :func:`token_values`. Dense response mask ``m [B, R]``
    (:func:`response_mask_key`): sequence i of ``L_i`` tokens ends with its ``r_i`` response tokens
    (:func:`response_lengths`), response token c sits at position ``L_i - r_i + c`` and is
    predicted by the output one earlier, so::

        loss_mask[i, L_i - r_i - 1 + c] = m[i, c]    (c < r_i), 0 elsewhere

    Needs ``1 <= L_i - r_i`` (a prompt token); ``validate_batch`` checks it. Memory: one ``[N]``.
    """
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
