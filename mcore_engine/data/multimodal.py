"""Images and videos in the batch, as verl sends them, and where their tokens sit in a pack.

``batch["multi_modal_inputs"]`` holds one entry per sample (a tensordict ``NonTensorStack``): ``None``
(text only) or a dict with ``pixel_values`` ``[n_patches, C * temporal_patch * patch^2]`` and
``image_grid_thw`` int ``[n_images, 3]`` (and / or the video pair ``pixel_values_videos`` /
``video_grid_thw``, with ``second_per_grid_ts`` ``[n_videos]`` for Qwen2.5-VL). An image of grid
``(t, h, w)`` is ``t h w`` patch rows and ``t h w / m^2`` tokens of ``image_token_id`` in
``input_ids`` (``m``: ``spatial_merge_size``)::

    vision = vision_batch(mb, inputs, cfg)      # per micro-batch, after packing
    feats  = tower(cat(pixel_values, pixel_values_videos), cat(grids))     # [n_visual_tokens, H]
    embeds.view(-1, H)[vision.token_slots] = feats                         # the image tokens' rows

The 3-D mRoPE positions (:func:`~mcore_engine.data.rope_index.rope_index`, or the batch's
``position_ids [.., 3]``) are laid out like the pack, ``[3, rows, cols]``, padding slots at their 1-D
position. At CP > 1 :meth:`VisionBatch.local` keeps this rank's image tokens (the positions stay the
whole pack's: the rotary embedding cuts them). Memory: the micro-batch's pixels (one copy) and
``O(T)`` integers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDictBase

from mcore_engine.config.vision import VisionConfig
from mcore_engine.data.layout import is_jagged, token_values
from mcore_engine.data.packing import ModelInputs
from mcore_engine.data.rope_index import check_vision_inputs, rope_index

__all__ = ["MM_KEY", "VisionBatch", "check_multi_modal_inputs", "sample_entries", "vision_batch"]

MM_KEY = "multi_modal_inputs"
_IMAGE = ("pixel_values", "image_grid_thw")
_VIDEO = ("pixel_values_videos", "video_grid_thw")
_KNOWN = {*_IMAGE, *_VIDEO, "second_per_grid_ts"}


@dataclass(frozen=True)
class VisionBatch:
    """One micro-batch's pixels for the tower and where the tower's outputs go."""

    pixel_values: torch.Tensor | None
    """Patch rows of every image then every video of the micro-batch, in pack order (None: none)."""
    grid_thw: torch.Tensor | None
    """int64 ``[n_images + n_videos, 3]``, the same order."""
    token_slots: torch.Tensor
    """int64 ``[n]``: flat slot (``input_ids.reshape(-1)`` of the model inputs) of each visual token
    this rank holds, in the order of the tower's output rows ``feature_index``."""
    feature_index: torch.Tensor
    """int64 ``[n]``: the tower output row of each of ``token_slots``."""
    positions: torch.Tensor
    """int64 ``[3, rows, cols]``: the whole pack's (t, h, w) positions."""

    @property
    def num_visual_tokens(self) -> int:
        return 0 if self.grid_thw is None else int(self.feature_index.numel())

    def local(self, slots: torch.Tensor) -> VisionBatch:
        """This context-parallel rank's share: ``slots`` (int64 ``[n_local]``, the global flat slot of
        each local token, ``ContextParallelSplit.slots[rank]``) -> local token slots."""
        total = int(self.positions[0].numel())
        where = torch.full((total,), -1, dtype=torch.int64, device=slots.device)
        where[slots] = torch.arange(slots.numel(), device=slots.device)
        local = where[self.token_slots.to(slots.device)]
        keep = local >= 0
        return dataclasses.replace(self, token_slots=local[keep], feature_index=self.feature_index[keep])


def sample_entries(batch: TensorDictBase) -> list[Mapping[str, Any] | None] | None:
    """The per-sample ``multi_modal_inputs`` entries of ``batch`` (None without the key)."""
    if MM_KEY not in batch.keys():
        return None
    value = batch.get(MM_KEY)
    entries = value.tolist() if hasattr(value, "tolist") else getattr(value, "data", value)
    if not isinstance(entries, list):
        entries = [entries] * batch.batch_size[0]
    return [getattr(e, "data", e) for e in entries]


def _patch_width(cfg: VisionConfig) -> int | None:
    v = cfg.vision_config
    keys = ("in_channels", "temporal_patch_size", "patch_size")
    if not all(k in v for k in keys[1:]):
        return None
    channels = int(v.get("in_channels", v.get("in_chans", 3)))
    return channels * int(v["temporal_patch_size"]) * int(v["patch_size"]) ** 2


def _grid(entry: Mapping[str, Any], key: str, where: str, merge: int) -> torch.Tensor | None:
    grid = entry.get(key)
    if grid is None:
        return None
    if not isinstance(grid, torch.Tensor) or grid.is_floating_point() or grid.dim() != 2 \
            or grid.shape[1] != 3:
        raise ValueError(f"{where}.{key} must be an int tensor [n, 3] (t, h, w per image), got "
                         f"{getattr(grid, 'dtype', type(grid).__name__)} {tuple(getattr(grid, 'shape', ()))}")
    if grid.numel() and (int(grid.min()) < 1 or bool(((grid[:, 1:] % merge) != 0).any())):
        raise ValueError(f"{where}.{key} entries must be >= 1 with h and w multiples of spatial_merge_size="
                         f"{merge}, got {grid.tolist()}")
    return grid.to(torch.int64)


def check_multi_modal_inputs(batch: TensorDictBase, vision: VisionConfig | None) -> None:
    """``ValueError`` naming the sample and the field unless every entry fits its sample: images for
    a vision model only; pixel rows = ``sum(t h w)`` of the grids and as wide as the tower's patch;
    ``input_ids`` holding ``sum(t h w) / m^2`` image (video) tokens; a ``position_ids`` trailing dim of
    3 only for a vision model. Reads only; a few host syncs per sample with images."""
    entries = sample_entries(batch)
    pos = batch.get("position_ids", None) if "position_ids" in batch.keys() else None
    pos_3d = pos is not None and pos.dim() == 3
    if pos_3d and (vision is None or pos.shape[-1] != 3):
        raise ValueError(f"position_ids: a trailing dimension ({pos.shape[-1]}) needs a vision-language "
                         "model (ModelConfig.vision) and is 3 (t, h, w)" if vision is None else
                         f"position_ids: the trailing dimension must be 3 (t, h, w), got {pos.shape[-1]}")
    if entries is None:
        if vision is None:
            return
        entries = [None] * batch.batch_size[0]
    if len(entries) != batch.batch_size[0]:
        raise ValueError(f"{MM_KEY} must have one entry per sample ({batch.batch_size[0]}), got "
                         f"{len(entries)}")
    ids = batch["input_ids"]
    for i, entry in enumerate(entries):
        where = f"{MM_KEY}[{i}]"
        if entry is not None and not isinstance(entry, Mapping):
            raise ValueError(f"{where} must be None or a dict of tensors, got {type(entry).__name__}")
        entry = entry or {}
        if not any(entry.get(k) is not None for k in (*_IMAGE, *_VIDEO)) and vision is None:
            continue
        if vision is None:
            raise ValueError(f"{where}: images for a text-only model (ModelConfig.vision is None; load a "
                             "vision-language model.hf_path)")
        unknown = sorted(set(entry) - _KNOWN)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; expected some of {sorted(_KNOWN)}")
        sample = ids[i] if is_jagged(ids) else ids[i][batch["attention_mask"][i].bool()]
        merge, width = vision.spatial_merge_size, _patch_width(vision)
        for (pix_key, grid_key), token in ((_IMAGE, vision.image_token_id), (_VIDEO, vision.video_token_id)):
            pixels, grid = entry.get(pix_key), _grid(entry, grid_key, where, merge)
            if (pixels is None) != (grid is None):
                raise ValueError(f"{where}: {pix_key} and {grid_key} come together, got only "
                                 f"{grid_key if pixels is None else pix_key}")
            tokens = int((sample == token).sum())
            if pixels is None:
                if tokens:
                    kind = "image" if pix_key == _IMAGE[0] else "video"
                    raise ValueError(f"{where}.input_ids has {tokens} {kind} tokens (id {token}) but no "
                                     f"{grid_key}")
                continue
            if not isinstance(pixels, torch.Tensor) or not pixels.is_floating_point() or pixels.dim() != 2:
                raise ValueError(f"{where}.{pix_key} must be a floating tensor [n_patches, width], got "
                                 f"{getattr(pixels, 'dtype', type(pixels).__name__)} "
                                 f"{tuple(getattr(pixels, 'shape', ()))}")
            rows = int(grid.prod(-1).sum())
            if pixels.shape[0] != rows:
                raise ValueError(f"{where}.{grid_key} {grid.tolist()} gives {rows} patch rows but {pix_key} "
                                 f"has {pixels.shape[0]}")
            if width is not None and pixels.shape[1] != width:
                raise ValueError(f"{where}.{pix_key} rows must be {width} wide (channels x "
                                 f"temporal_patch_size x patch_size^2 of the tower), got {pixels.shape[1]}")
            if not bool(torch.isfinite(pixels).all()):
                raise ValueError(f"{where}.{pix_key} has NaN or infinite values")
            if tokens * merge * merge != rows:
                raise ValueError(f"{where}.input_ids has {tokens} tokens of id {token} but {grid_key} "
                                 f"{grid.tolist()} needs {rows // (merge * merge)} (t h w / {merge}^2 each)")
        # each image's (video frame's) tokens one run after a vision-start token, video timing
        check_vision_inputs(sample, vision, entry.get("image_grid_thw"), entry.get("video_grid_thw"),
                            entry.get("second_per_grid_ts"), sample=i)


def vision_batch(mb: TensorDictBase, inputs: ModelInputs, vision: VisionConfig) -> VisionBatch:
    """The micro-batch ``mb`` (checked by :func:`check_multi_modal_inputs`), packed as ``inputs``:
    its pixels and grids in pack order, the visual tokens' slots and the pack's 3-D positions."""
    entries = sample_entries(mb) or [None] * mb.batch_size[0]
    device = inputs.input_ids.device
    ids = token_values(mb, "input_ids").to(torch.int64)
    cu = inputs.cu_seqlens.tolist()
    user = None
    if "position_ids" in mb.keys() and mb.get("position_ids").dim() == 3:
        user = token_values(mb, "position_ids").to(torch.int64)                 # [N, 3]
    pixels: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    grids: dict[str, list[torch.Tensor]] = {"image": [], "video": []}
    rows = []
    for i, entry in enumerate(entries):
        entry = entry or {}
        sample = ids[cu[i]:cu[i + 1]]
        image_grid, video_grid = entry.get("image_grid_thw"), entry.get("video_grid_thw")
        if user is None:
            rows.append(rope_index(sample, vision, image_grid_thw=image_grid, video_grid_thw=video_grid,
                                   second_per_grid_ts=entry.get("second_per_grid_ts")).T)
        for kind, (pix_key, grid_key) in (("image", _IMAGE), ("video", _VIDEO)):
            if entry.get(pix_key) is not None:
                pixels[kind].append(entry[pix_key])
                grids[kind].append(entry[grid_key].to(torch.int64).reshape(-1, 3))
    token_positions = user if user is not None else torch.cat(rows)                  # [N, 3]
    flat_pos = inputs.position_ids.reshape(-1, 1).expand(-1, 3).clone()
    flat_pos = flat_pos.index_copy(0, inputs.token_index, token_positions.to(device))
    positions = flat_pos.T.reshape(3, *inputs.input_ids.shape).contiguous()

    pack_ids = inputs.input_ids.reshape(-1)
    slots = [torch.nonzero(pack_ids == token).reshape(-1) for token in (vision.image_token_id,
                                                                         vision.video_token_id)]
    token_slots = torch.cat(slots)
    all_pixels = pixels["image"] + pixels["video"]
    all_grids = grids["image"] + grids["video"]
    return VisionBatch(
        pixel_values=torch.cat(all_pixels).to(device) if all_pixels else None,
        grid_thw=torch.cat(all_grids).to(device) if all_grids else None,
        token_slots=token_slots, feature_index=torch.arange(token_slots.numel(), device=device),
        positions=positions)
