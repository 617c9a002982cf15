"""Images in verl's batches, as the core takes them (``verl.py`` calls :func:`prepare_multimodal`).

verl 0.9.1's agent loop gives every sample a ``multi_modal_inputs`` dict (its processor's output
without ``input_ids`` / ``attention_mask``: ``pixel_values`` ``[n_patches, C * t * p * p]``,
``image_grid_thw`` ``[n_images, 3]``, the video pair, plus its own ``images_seqlens`` bookkeeping;
``{}`` when the sample has no media) and, for a processor with ``get_rope_index`` (Qwen2-VL family),
``position_ids`` ``[4, L]`` per sample: row 0 the text position ``0 .. L-1``, rows 1-3 the mRoPE
``(t, h, w)`` positions. ``left_right_2_no_padding`` makes them a nested ``[B, 4, j]`` (ragged
dimension 2); the ``TrainingWorker`` hands both to the engine unchanged.

The core's batch (interface 5): ``multi_modal_inputs`` one entry per sample, a dict of the media
keys or None; ``position_ids`` per token with a trailing 3, ``[B, j, 3]`` jagged like ``input_ids``
(or ``[B, S, 3]`` padded). So, per sample: the dict keeps the media keys, drops ``images_seqlens``
(``image_grid_thw``'s per-image ``t * h * w``, recomputed where needed) and becomes None without media;
the position rows ``[-3:]`` are transposed to ``[j, 3]``. verl's positions are honoured, not
recomputed: they are ``transformers``' ``get_rope_index`` of the checkpoint, what the rollout used.
A batch whose samples all lack media loses the key (a text batch, also for text-only models: verl
sends ``{}`` entries there too). Memory: one copy of the position rows (``3 * tokens`` int64).
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict

__all__ = ["MEDIA_KEYS", "VERL_DERIVED_KEYS", "media_entries", "positions_3d", "prepare_multimodal"]

MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
"""The per-sample keys the core's vision path reads (interface 5)."""
VERL_DERIVED_KEYS = ("images_seqlens",)
"""verl's bookkeeping beside them (its FLOPs counter): derived from ``image_grid_thw``, dropped."""


def _entries(value: Any, batch_size: int) -> list[Any]:
    items = list(value.tolist() if isinstance(value, NonTensorStack) else value)
    items = [item.data if isinstance(item, NonTensorData) else item for item in items]
    if len(items) != batch_size:
        raise ValueError(f"multi_modal_inputs must have one entry per sample ({batch_size}), "
                         f"got {len(items)}")
    return items


def media_entries(value: Any, batch_size: int) -> list[dict[str, torch.Tensor] | None]:
    """verl's per-sample ``multi_modal_inputs`` -> the core's: a dict of the :data:`MEDIA_KEYS` it
    has (``images_seqlens`` dropped), None for a sample without media (None or ``{}``). A key outside
    both lists, or a media value that is not a tensor, raises ``ValueError`` naming the sample."""
    out: list[dict[str, torch.Tensor] | None] = []
    for i, item in enumerate(_entries(value, batch_size)):
        if item is None:
            out.append(None)
            continue
        if not hasattr(item, "items"):
            raise ValueError(f"multi_modal_inputs[{i}] must be a dict of tensors or None, "
                             f"got {type(item).__name__}")
        unknown = sorted(set(item.keys()) - set(MEDIA_KEYS) - set(VERL_DERIVED_KEYS))
        if unknown:
            raise ValueError(f"multi_modal_inputs[{i}] has keys {unknown} the mcore_engine backend does not "
                             f"take (expected some of {list(MEDIA_KEYS)})")
        media = {k: item[k] for k in MEDIA_KEYS if k in item and item[k] is not None}
        for key, tensor in media.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"multi_modal_inputs[{i}][{key!r}] must be a tensor, "
                                 f"got {type(tensor).__name__}")
        out.append(media or None)
    return out


def positions_3d(position_ids: torch.Tensor, lengths: list[int] | None = None) -> torch.Tensor:
    """verl's per-sample ``[R, L]`` positions (R = 4: text row + mRoPE ``t, h, w``; R = 3: ``t, h, w``)
    as the core's per-token ``(t, h, w)``: nested ``[B, R, j]`` -> jagged ``[B, j, 3]`` (ragged dim 1,
    like ``input_ids``, same offsets); dense ``[B, R, S]`` -> ``[B, S, 3]``. ``lengths``: the samples'
    token counts (``input_ids``'), checked. Any other shape raises ``ValueError``.

    Nested input is read from its jagged storage (:func:`_nested_positions`), not unbound: ``unbind``
    of a 3-D jagged tensor depends on its ``_ragged_idx``, which Ray's pickling loses (verl's
    ``maybe_fix_3d_position_ids``), and verl's ``chunk_tensordict`` re-packs it per sample padded."""
    if position_ids.dim() != 3:
        raise ValueError("position_ids must be [B, 3 or 4, L] per sample for 3-D positions, "
                         f"got {position_ids.dim()} dims")
    if position_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"position_ids must be int64 (or int32), got {position_ids.dtype}")
    if position_ids.is_nested:
        return _nested_positions(position_ids, lengths)
    if position_ids.shape[1] not in (3, 4):
        raise ValueError("position_ids must be [B, 4 (text row + t, h, w) or 3, L], "
                         f"got {list(position_ids.shape)}")
    if lengths is not None and any(position_ids.shape[2] != n for n in lengths):
        raise ValueError(f"position_ids has {position_ids.shape[2]} positions a sample but input_ids has "
                         f"{lengths}")
    return position_ids[:, -3:].transpose(1, 2).to(torch.int64).contiguous()


def _nested_positions(position_ids: torch.Tensor, lengths: list[int] | None) -> torch.Tensor:
    """The two jagged layouts verl 0.9.1 hands over, as jagged ``[B, j, 3]`` with ``input_ids``' offsets:

    - ``values() [R, T]``, ``offsets()`` the samples' token counts (``left_right_2_no_padding``:
      ragged dimension 2);
    - ``values() [B * R, S]``, every offset step ``R``: each sample ``[R, S]`` padded to the longest
      ``S`` (``verl.utils.tensordict_utils.chunk_tensordict``'s fallback for 3-D jagged tensors, used
      when ``unbind`` fails, which it does once Ray has pickled the batch); the first ``lengths[i]``
      columns are the sample's (``lengths`` needed).
    """
    values, offsets = position_ids.values(), position_ids.offsets()
    counts = offsets.diff().tolist()
    rows = values.shape[0] if values.dim() == 2 else 0
    if rows in (3, 4) and values.shape[1] == int(offsets[-1]):
        if lengths is not None:
            for i, (n, want) in enumerate(zip(counts, lengths, strict=True)):
                if n != want:
                    raise ValueError(f"position_ids[{i}] has {n} positions but input_ids[{i}] has "
                                     f"{want} tokens")
        per_token = values[-3:].transpose(0, 1)
    elif counts and len(set(counts)) == 1 and counts[0] in (3, 4) and rows == len(counts) * counts[0]:
        if lengths is None or len(lengths) != len(counts) or max(lengths) > values.shape[1]:
            raise ValueError(f"position_ids: per-sample padded [R={counts[0]}, {values.shape[1]}] rows "
                             f"need the samples' lengths <= {values.shape[1]}, got {lengths}")
        r = counts[0]
        per_token = torch.cat([values[i * r + r - 3:(i + 1) * r, :n].transpose(0, 1)
                               for i, n in enumerate(lengths)])
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=values.device)
        offsets[1:] = torch.tensor(lengths, device=values.device).cumsum(0)
    else:
        raise ValueError(f"position_ids must be [B, 4 (text row + t, h, w) or 3, L] per sample, got a "
                         f"jagged tensor with values {list(values.shape)} and offsets {offsets.tolist()}")
    per_token = per_token.to(torch.int64).contiguous()
    return torch.nested.nested_tensor_from_jagged(per_token, offsets=offsets.clone())


def _lengths(input_ids: torch.Tensor) -> list[int]:
    if input_ids.is_nested:
        return input_ids.offsets().diff().tolist()
    return [input_ids.shape[-1]] * input_ids.shape[0]


def prepare_multimodal(data: TensorDict) -> TensorDict:
    """In place: ``multi_modal_inputs`` as :func:`media_entries` (removed when no sample has media) and
    3-D ``position_ids`` as :func:`positions_3d`; a text batch (``position_ids`` ``[B, j]``, no media)
    is left as it is. Returns ``data``."""
    entries = positions = None
    if "multi_modal_inputs" in data.keys():
        entries = media_entries(data.get("multi_modal_inputs"), data.batch_size[0])
    if "position_ids" in data.keys() and data["position_ids"].dim() == 3:
        ids = data["input_ids"]
        positions = positions_3d(data["position_ids"], _lengths(ids))
        if positions.is_nested and ids.is_nested:  # input_ids' own offsets: the same ragged size j
            positions = torch.nested.nested_tensor_from_jagged(positions.values(), offsets=ids.offsets())
    if entries is not None:  # checked everything above: now change the batch
        del data["multi_modal_inputs"]
        if any(e is not None for e in entries):
            data["multi_modal_inputs"] = NonTensorStack(*[NonTensorData(e) for e in entries],
                                                        batch_size=data.batch_size[:1])
    if positions is not None:
        data["position_ids"] = positions
    return data
