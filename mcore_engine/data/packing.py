"""Pack a micro-batch into Megatron-Core GPTModel inputs ('thd' or 'bshd') and unpack outputs.

``b`` sequences of ``L_i`` real tokens (``N = sum L_i``), each padded to ``P_i = ceil(L_i / m) * m``:

- ``thd``: ``input_ids [1, T]``, ``T = sum P_i``, sequence i at ``[cu_seqlens_padded[i], +L_i)``;
  ``packed_seq_params.cu_seqlens_* = cu_seqlens_padded`` (padding attends only inside its block).
- ``bshd``: ``input_ids [b, S]``, ``S = max P_i``, right-padded; bool ``attention_mask [b, 1, S, S]
  = causal | key_is_padding`` (True = masked).

Per token (position t predicts token t+1)::

    labels[t]    = input_ids[t + 1]                    (0 at each sequence's last token and padding)
    loss_mask[t] = user_loss_mask[t] * (t is not the last token of its sequence)   # float32

Dense per-sample fields are not packed. Memory: O(T) per field (``[T, K]`` teacher), bshd O(b S^2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase, is_non_tensor

from mcore_engine.data.layout import (
    INPUT_KEYS,
    TEACHER_KEYS,
    is_jagged,
    loss_mask_values,
    padded_source_index,
    per_token_keys,
    sequence_lengths,
    token_values,
)

DATA_FORMATS = ("thd", "bshd")


@dataclass(kw_only=True)
class ModelInputs:
    """One micro-batch's model inputs plus what :func:`unpack_per_token` needs. Token-layout tensors
    are shaped like ``input_ids``: ``[1, T]`` (thd) or ``[b, S]`` (bshd)."""

    data_format: str
    """"thd" or "bshd"."""
    input_ids: torch.Tensor
    """int64 token ids, 0 on padding slots."""
    position_ids: torch.Tensor
    """int64 positions restarting at 0 per sequence (the batch's ``position_ids`` when given)."""
    labels: torch.Tensor
    """int64 next-token ids; 0 on each sequence's last token and on padding."""
    loss_mask: torch.Tensor
    """float32; user loss_mask times "not the last token"; 0 on padding."""
    attention_mask: torch.Tensor | None
    """bshd: bool ``[b, 1, S, S]``, True = masked. thd: None, or the block-diagonal causal
    ``[1, 1, T, T]`` when packed with ``thd_attention_mask=True`` (for attention without thd support)."""
    packed_seq_params: Any
    """thd: ``megatron.core.packed_seq_params.PackedSeqParams``; bshd: None."""
    temperature: float | torch.Tensor
    """The host number as given, or float32 per-token tensor (1.0 on padding) from a ``[b]`` tensor."""
    teacher_ids: torch.Tensor | None
    """int64 ``[..., K]`` (0 on padding) or None."""
    teacher_logprobs: torch.Tensor | None
    """``[..., K]`` in the batch's dtype (0 on padding) or None."""
    lengths: torch.Tensor
    """int64 ``[b]`` (CPU): real tokens per sequence."""
    cu_seqlens: torch.Tensor
    """int32 ``[b + 1]``: cumulative real lengths (offsets into the unpacked ``[N]`` token list)."""
    cu_seqlens_padded: torch.Tensor
    """int32 ``[b + 1]``: thd slot offsets of each sequence's block (bshd: multiples of S)."""
    token_index: torch.Tensor
    """int64 ``[N]``: flat slot (in ``input_ids.reshape(-1)``) of every real token, in order."""
    slot_sequence: torch.Tensor
    """int64 ``[T]`` / ``[b * S]``: the micro-batch sequence each slot belongs to (padding included)."""
    source_jagged: bool
    """Whether the micro-batch's input_ids were jagged (unpack returns jagged) or padded."""
    source_index: torch.Tensor | None
    """Padded input only: int64 ``[N]`` flat positions of the real tokens in the input's ``[b * S_in]``."""
    source_seq_len: int | None
    """Padded input only: ``S_in``."""

    def scatter_tokens(self, values: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        """Place ``values [N, ...]`` (real tokens in order) into the model layout, ``fill`` elsewhere."""
        return _scatter(values, self.token_index, tuple(self.input_ids.shape), fill)


def _scatter(values: torch.Tensor, token_index: torch.Tensor, shape: tuple[int, int],
             fill: float | int = 0) -> torch.Tensor:
    """``out = full(shape + tail, fill); out.view(-1, *tail)[token_index] = values`` (out of place)."""
    flat = values.new_full((shape[0] * shape[1], *values.shape[1:]), fill)
    flat = flat.index_copy(0, token_index.to(values.device), values)
    return flat.reshape(*shape, *values.shape[1:])


def _slot_layout(lengths: torch.Tensor, data_format: str, pad_multiple: int):
    """Return (padded_lengths, slot offsets [b+1], token_index [N], slot_sequence, shape)."""
    b = lengths.numel()
    padded = (lengths + pad_multiple - 1) // pad_multiple * pad_multiple
    seq_of_token = torch.repeat_interleave(torch.arange(b), lengths)
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    pos_in_seq = torch.arange(int(cu[-1])) - cu[seq_of_token]
    if data_format == "thd":
        starts = torch.nn.functional.pad(padded.cumsum(0), (1, 0))
        shape = (1, int(starts[-1]))
        slot_sequence = torch.repeat_interleave(torch.arange(b), padded)
    else:
        seq_len = int(padded.max())
        starts = torch.arange(b + 1) * seq_len
        shape = (b, seq_len)
        slot_sequence = torch.arange(b).repeat_interleave(seq_len)
    token_index = starts[seq_of_token] + pos_in_seq
    return starts, token_index, slot_sequence, shape, seq_of_token, pos_in_seq


def pack_micro_batch(mb: TensorDictBase, *, data_format: str, temperature: float | None,
                     pad_multiple: int = 1, thd_attention_mask: bool = False,
                     device: torch.device | str | None = None) -> ModelInputs:
    """Pack a validated micro-batch (only read) into :class:`ModelInputs`. ``temperature``: a number
    is passed through, ``None`` expands ``mb["temperature"] [b]`` (or ``[b, 1]``) per token.
    ``device`` defaults to ``input_ids``' device."""
    if data_format not in DATA_FORMATS:
        raise ValueError(f"data_format must be one of {DATA_FORMATS}, got {data_format!r}")
    if not isinstance(pad_multiple, int) or pad_multiple < 1:
        raise ValueError(f"pad_multiple must be a positive int, got {pad_multiple!r}")
    ids = mb["input_ids"]
    device = torch.device(device) if device is not None else ids.device
    lengths = sequence_lengths(mb)
    starts, token_index, slot_sequence, shape, seq_of_token, pos_in_seq = _slot_layout(
        lengths, data_format, pad_multiple)
    token_index = token_index.to(device)
    num_slots = shape[0] * shape[1]

    def scatter(values: torch.Tensor, fill: float | int = 0) -> torch.Tensor:
        return _scatter(values.to(device), token_index, shape, fill)

    # --- 1. ids, positions, next-token labels, loss mask ---
    id_values = token_values(mb, "input_ids").to(device=device, dtype=torch.int64)
    is_last = (pos_in_seq == lengths[seq_of_token] - 1).to(device)
    label_values = torch.where(is_last, 0, id_values.roll(-1))
    mask_values = (~is_last).to(torch.float32)
    user_mask = loss_mask_values(mb)  # per-token loss_mask, or derived from a dense [b, R] response mask
    if user_mask is not None:
        mask_values = mask_values * user_mask.to(device)
    slot_positions = torch.arange(num_slots) - starts[slot_sequence]
    position_ids = slot_positions.reshape(shape).to(device)
    if "position_ids" in mb.keys():  # 3-D (t, h, w) positions [N, 3] go to data.multimodal instead
        user_positions = token_values(mb, "position_ids").to(device=device, dtype=torch.int64)
    if "position_ids" in mb.keys() and user_positions.dim() == 1:
        position_ids = position_ids.reshape(-1).index_copy(0, token_index, user_positions).reshape(shape)

    # --- 2. attention: PackedSeqParams (thd) or a bool mask, True = masked (bshd) ---
    attention_mask, packed_seq_params = None, None
    if data_format == "thd":
        # here, not at the top: importing megatron.core costs ~5 s, and bshd / flag tests never need it
        from megatron.core.packed_seq_params import PackedSeqParams

        cu_padded = starts.to(device=device, dtype=torch.int32)
        max_len = int((starts[1:] - starts[:-1]).max())
        packed_seq_params = PackedSeqParams(
            qkv_format="thd", cu_seqlens_q=cu_padded, cu_seqlens_kv=cu_padded,
            cu_seqlens_q_padded=cu_padded, cu_seqlens_kv_padded=cu_padded,
            max_seqlen_q=max_len, max_seqlen_kv=max_len)
        if thd_attention_mask:
            seq, pos = slot_sequence.to(device), torch.arange(num_slots, device=device)
            blocked = (seq[:, None] != seq[None, :]) | (pos[None, :] > pos[:, None])
            attention_mask = blocked[None, None]
    else:
        seq_len = shape[1]
        pos = torch.arange(seq_len, device=device)
        causal = pos[None, :] > pos[:, None]
        key_padding = pos[None, :] >= lengths.to(device)[:, None]
        attention_mask = causal[None, None] | key_padding[:, None, None, :]

    # --- 3. temperature per token (from a per-sample tensor) and teacher top-k ---
    if temperature is None:
        if "temperature" not in mb.keys() or is_non_tensor(mb.get("temperature")):
            raise ValueError("temperature=None needs a per-sample tensor temperature [b] in the batch")
        per_sample = mb["temperature"].reshape(-1).to(device=device, dtype=torch.float32)  # [b] or [b, 1]
        temperature = scatter(per_sample[seq_of_token.to(device)], fill=1.0)
    teacher_ids = teacher_logprobs = None
    if all(k in mb.keys() for k in TEACHER_KEYS):
        teacher_ids = scatter(token_values(mb, "teacher_ids").to(torch.int64))
        teacher_logprobs = scatter(token_values(mb, "teacher_logprobs"))

    source_jagged = is_jagged(ids)
    return ModelInputs(
        data_format=data_format,
        input_ids=scatter(id_values), position_ids=position_ids, labels=scatter(label_values),
        loss_mask=scatter(mask_values), attention_mask=attention_mask,
        packed_seq_params=packed_seq_params, temperature=temperature,
        teacher_ids=teacher_ids, teacher_logprobs=teacher_logprobs, lengths=lengths,
        cu_seqlens=torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32),
        cu_seqlens_padded=starts.to(torch.int32), token_index=token_index,
        slot_sequence=slot_sequence.to(device), source_jagged=source_jagged,
        source_index=None if source_jagged else padded_source_index(mb),
        source_seq_len=None if source_jagged else ids.shape[1],
    )


def _token_rows(t: torch.Tensor, inputs: ModelInputs, what: str) -> torch.Tensor:
    """``t`` in the model layout (``input_ids.shape + tail`` or flat ``[T, *tail]``) -> ``[N, *tail]``."""
    model_shape = tuple(inputs.input_ids.shape)
    if t.dim() >= 2 and tuple(t.shape[:2]) == model_shape:
        flat = t.reshape(-1, *t.shape[2:])
    elif t.dim() >= 1 and t.shape[0] == inputs.input_ids.numel():
        flat = t
    else:
        raise ValueError(f"{what} must have shape {model_shape} (+ trailing dims) or "
                         f"[{inputs.input_ids.numel()}, ...], got {tuple(t.shape)}")
    return flat.index_select(0, inputs.token_index.to(flat.device))


def unpack_per_token(t: torch.Tensor, inputs: ModelInputs) -> torch.Tensor:
    """Per-token output ``[1, T, ...]`` / ``[b, S, ...]`` / ``[T, ...]`` -> the layout of the
    micro-batch's ``input_ids``: jagged ``[b, j, ...]`` or padded ``[b, S_in, ...]`` (zeros where
    ``attention_mask`` is 0). Differentiable; one ``[N, ...]`` copy."""
    rows = _token_rows(t, inputs, "t")
    if inputs.source_jagged:
        offsets = inputs.cu_seqlens.to(device=rows.device, dtype=torch.int64)
        return torch.nested.nested_tensor_from_jagged(rows, offsets=offsets)
    b = inputs.lengths.numel()
    out = rows.new_zeros((b * inputs.source_seq_len, *rows.shape[1:]))
    out = out.index_copy(0, inputs.source_index.to(rows.device), rows)
    return out.reshape(b, inputs.source_seq_len, *rows.shape[1:])


def flatten_per_token(mb: TensorDictBase, inputs: ModelInputs, *,
                      sample_ids: torch.Tensor | None = None) -> TensorDict:
    """The micro-batch's per-token fields as a flat ``[T]`` TensorDict in packed slot order
    (``T = inputs.input_ids.numel()``, padding included and 0): ``loss_mask``, ``seq_ids``
    (``sample_ids[i]`` on sequence i's slots, default ``arange(b)``), ``teacher_*`` ``[T, K]`` (views)
    and every other per-token key of ``mb`` but the inputs. Memory: one ``[T, ...]`` per user key."""
    device = inputs.input_ids.device
    b, num_slots = inputs.lengths.numel(), inputs.input_ids.numel()
    if sample_ids is None:
        sample_ids = torch.arange(b)
    sample_ids = torch.as_tensor(sample_ids, dtype=torch.int64)
    if sample_ids.shape != (b,):
        raise ValueError(f"sample_ids must have shape [{b}], got {tuple(sample_ids.shape)}")
    fields = {
        "loss_mask": inputs.loss_mask.reshape(-1),
        "seq_ids": sample_ids.to(device)[inputs.slot_sequence],
    }
    if inputs.teacher_ids is not None:  # views of the packed tensors: no copy
        fields["teacher_ids"] = inputs.teacher_ids.reshape(num_slots, -1)
        fields["teacher_logprobs"] = inputs.teacher_logprobs.reshape(num_slots, -1)
    for key in per_token_keys(mb):
        if key in INPUT_KEYS or key in TEACHER_KEYS or key == "loss_mask":
            continue
        values = token_values(mb, key).to(device)
        fields[key] = inputs.scatter_tokens(values).reshape(-1, *values.shape[1:])
    return TensorDict(fields, batch_size=[num_slots], device=None)
