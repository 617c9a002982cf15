"""How a TensorDict batch lays out its tokens: jagged nested ``[B, j, ...]`` or padded ``[B, S, ...]``.

Two layouts of ``input_ids`` are accepted (API.md "The engine"):

- jagged: ``torch.nested.nested_tensor(list_of_[L_i], layout=torch.jagged)``; every per-token key is a
  jagged nested tensor with the same lengths (trailing dims allowed, e.g. ``teacher_ids [B, j, K]``).
- padded: ``input_ids [B, S]`` plus ``attention_mask [B, S]`` (bool or 0/1); the real tokens of row
  ``b`` are ``input_ids[b][attention_mask[b]]`` in order (left, right or both-sided padding all work).
  Every per-token key has the shape ``[B, S, ...]``.

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
