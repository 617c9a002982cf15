"""3-D mRoPE positions of one vision-language sample: ``transformers`` 5.24's ``get_rope_index`` of
Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE and Qwen3.5 (dense and MoE) for one unpadded sample.

The rule. Tokens split into runs: text, image tokens (``image_token_id``) and video tokens
(``video_token_id``); each image / video run takes the next grid ``(t, h, w)`` of its kind in order.
A cursor ``p`` starts at 0::

    text run of n tokens:   t = h = w = p + arange(n);                       then p += n
    vision run of grid (t, h, w), H = h // m, W = w // m (m = spatial_merge_size), tokens in
    (frame, row, column) order:
                            t = p + long(i_t * dt),  h = p + i_h,  w = p + i_w; then p += max(H, W)

``dt`` is 1 for images; for Qwen2.5-VL videos ``tokens_per_second * second_per_grid_ts[video]``
(computed in the same dtypes as ``transformers``, so the truncation agrees). Qwen3-VL / Qwen3.5 split
every video into its frames (``t`` grids of ``(1, h, w)``, one run each: the processor writes a
timestamp and ``<|vision_start|>`` before every frame), so their videos carry time only through the
text timestamps (they ignore ``second_per_grid_ts``). After a vision run the text continues from
``p + max(H, W)``: the image's largest position + 1 when ``t = 1``; 5.24 keeps that step for a
Qwen2.5-VL video too, whose temporal positions can reach past it (older releases continued from the
run's max + 1). A text-only sample gets ``arange(L)`` on all three axes.

Memory: the ``[3, L]`` int64 result and O(L) temporaries; a Python loop over the vision runs only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcore_engine.config.vision import VisionConfig

__all__ = ["check_vision_inputs", "rope_index"]

PER_FRAME_VIDEO = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")
"""Model types whose videos are split into one run (and one grid) per frame."""
DEFAULT_TOKENS_PER_SECOND = 4
"""``transformers``' ``Qwen2_5_VLVisionConfig.tokens_per_second`` default, for a folder without it."""


@dataclass(frozen=True)
class _Run:
    """One image / video run of ``input_ids[start:end]`` and its grid."""

    start: int
    end: int
    video: bool
    grid: tuple[int, int, int]
    interval: Any = 1  # temporal step (Qwen2.5-VL videos: tokens_per_second * seconds per grid)


def _prefix(sample: int | None) -> str:
    return "" if sample is None else f"sample {sample}: "


def _grid(name: str, grid: Any, merge: int, where: str) -> list[tuple[int, int, int]]:
    """The rows of an ``[n, 3]`` integer grid with entries >= 1 and ``h``, ``w`` divisible by ``merge``."""
    if grid is None:
        return []
    if not isinstance(grid, torch.Tensor) or grid.dtype.is_floating_point or grid.dtype.is_complex \
            or grid.dtype == torch.bool or grid.dim() != 2 or grid.size(1) != 3:
        desc = (f"a {grid.dtype} tensor of shape {tuple(grid.shape)}" if isinstance(grid, torch.Tensor)
                else type(grid).__name__)
        raise ValueError(f"{where}{name} must be an integer tensor [n, 3] (t, h, w per item), got {desc}")
    rows = [tuple(int(x) for x in row) for row in grid.tolist()]
    for i, (t, h, w) in enumerate(rows):
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise ValueError(f"{where}{name} row {i} is {(t, h, w)}: entries must be >= 1 and h, w "
                             f"divisible by spatial_merge_size {merge}")
    return rows


def _seconds(second_per_grid_ts: Any, videos: int, where: str) -> list[Any]:
    """The per-video elements of ``second_per_grid_ts`` as ``transformers`` iterates them (0-d tensors
    of a tensor, numbers of a sequence), so that the temporal step is computed in the same dtype."""
    if second_per_grid_ts is None:
        return [1] * videos
    if isinstance(second_per_grid_ts, torch.Tensor):
        ok = second_per_grid_ts.dim() == 1 and not second_per_grid_ts.dtype.is_complex \
            and second_per_grid_ts.dtype != torch.bool
        items = list(second_per_grid_ts) if ok else []
        shape = f"a {second_per_grid_ts.dtype} tensor of shape {tuple(second_per_grid_ts.shape)}"
    elif isinstance(second_per_grid_ts, Sequence) and not isinstance(second_per_grid_ts, str):
        items = list(second_per_grid_ts)
        ok = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in items)
        shape = f"a sequence of {len(items)}"
    else:
        ok, items, shape = False, [], type(second_per_grid_ts).__name__
    if not ok or len(items) != videos:
        raise ValueError(f"{where}second_per_grid_ts must be one number per video [{videos}] (the rows of "
                         f"video_grid_thw), got {shape}")
    values = [float(x) for x in items]
    if not all(math.isfinite(x) and x >= 0 for x in values):
        raise ValueError(f"{where}second_per_grid_ts must be finite and >= 0, got {values}")
    return items


def _runs_of(is_token: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of every maximal run of True in the 1-D bool ``is_token``."""
    if not bool(is_token.any()):
        return []
    padded = torch.nn.functional.pad(is_token.to(torch.int8), (1, 1))
    edges = padded.diff()
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    return list(zip(starts, ends, strict=True))


def _vision_runs(input_ids: torch.Tensor, vision: VisionConfig, image_grid_thw: Any, video_grid_thw: Any,
                 second_per_grid_ts: Any, sample: int | None) -> list[_Run]:
    """Validate one sample (see :func:`check_vision_inputs`) and return its vision runs in order."""
    where = _prefix(sample)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1 or input_ids.dtype.is_floating_point \
            or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        desc = (f"a {input_ids.dtype} tensor of shape {tuple(input_ids.shape)}"
                if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__)
        raise ValueError(f"{where}input_ids must be a 1-D integer tensor [L] (one unpadded sample), "
                         f"got {desc}")
    merge = vision.spatial_merge_size
    if merge < 1:
        raise ValueError(f"{where}vision_config.spatial_merge_size must be >= 1, got {merge}")
    images = _grid("image_grid_thw", image_grid_thw, merge, where)
    videos = _grid("video_grid_thw", video_grid_thw, merge, where)
    seconds = _seconds(second_per_grid_ts, len(videos), where)
    per_frame = vision.model_type in PER_FRAME_VIDEO
    tps = None
    if videos and not per_frame:
        tps = vision.tokens_per_second
        if tps is None:
            tps = vision.vision_config.get("tokens_per_second", DEFAULT_TOKENS_PER_SECOND)

    runs: list[_Run] = []
    kinds = (("image", "image_grid_thw", vision.image_token_id, images, False),
             ("video", "video_grid_thw", vision.video_token_id, videos, True))
    for name, field, token, grids, video in kinds:
        is_token = input_ids == token
        count = int(is_token.sum())
        expected = sum(t * h * w for t, h, w in grids) // (merge * merge)
        if count != expected:
            raise ValueError(f"{where}input_ids has {count} {name} tokens (id {token}) but {field} "
                             f"{[list(g) for g in grids]} needs {expected} (sum of t*h*w / "
                             f"spatial_merge_size**2 = {merge}**2)")
        items = []  # (grid of one run, its temporal step)
        for i, (t, h, w) in enumerate(grids):
            if video and per_frame:
                items += [((1, h, w), 1)] * t
            else:
                items.append(((t, h, w), tps * seconds[i] if video else 1))
        spans = _runs_of(is_token)
        unit = "frame" if video and per_frame else name
        if len(spans) != len(items):
            raise ValueError(f"{where}input_ids has {len(spans)} runs of {name} tokens but {field} gives "
                             f"{len(items)} {unit}s: each {unit}'s tokens must be contiguous, after a "
                             f"vision_start token ({vision.vision_start_token_id})")
        for k, ((start, end), (grid, interval)) in enumerate(zip(spans, items, strict=True)):
            need = grid[0] * grid[1] * grid[2] // (merge * merge)
            if end - start != need:
                raise ValueError(f"{where}input_ids: {unit} {k} has {end - start} contiguous {name} tokens "
                                 f"but its grid {list(grid)} in {field} needs {need}")
            if start == 0 or int(input_ids[start - 1]) != vision.vision_start_token_id:
                raise ValueError(f"{where}input_ids: {unit} {k} (tokens {start}..{end - 1}) must follow a "
                                 f"vision_start token ({vision.vision_start_token_id})")
            runs.append(_Run(start, end, video, grid, interval))
    return sorted(runs, key=lambda r: r.start)


def check_vision_inputs(input_ids: torch.Tensor, vision: VisionConfig,
                        image_grid_thw: torch.Tensor | None = None,
                        video_grid_thw: torch.Tensor | None = None,
                        second_per_grid_ts: Any = None, sample: int | None = None) -> None:
    """Check one sample's tokens against its grids; ``ValueError`` naming the field otherwise.

    ``image_grid_thw`` / ``video_grid_thw``: integer ``[n, 3]`` with entries >= 1 and ``h``, ``w``
    divisible by ``spatial_merge_size``; the number of image (video) tokens in ``input_ids`` equals
    ``sum(t * h * w) / spatial_merge_size**2`` over the grids; each image's (video's; Qwen3-VL /
    Qwen3.5: each frame's) tokens are one contiguous run right after a ``vision_start`` token;
    ``second_per_grid_ts``: one finite number >= 0 per video. ``sample`` only labels the message.
    """
    _vision_runs(input_ids, vision, image_grid_thw, video_grid_thw, second_per_grid_ts, sample)


def rope_index(input_ids: torch.Tensor, vision: VisionConfig, image_grid_thw: torch.Tensor | None = None,
               video_grid_thw: torch.Tensor | None = None, second_per_grid_ts: Any = None,
               sample: int | None = None) -> torch.Tensor:
    """The ``[3, L]`` int64 ``(t, h, w)`` positions of one unpadded sample ``input_ids`` ``[L]`` (the
    module docstring's rule), equal to ``transformers``' ``get_rope_index`` of ``vision.model_type``
    with an all-ones attention mask. Validates first (:func:`check_vision_inputs`)."""
    runs = _vision_runs(input_ids, vision, image_grid_thw, video_grid_thw, second_per_grid_ts, sample)
    merge = vision.spatial_merge_size
    device = input_ids.device
    out = torch.empty(3, input_ids.numel(), dtype=torch.long, device=device)
    cursor, done = 0, 0  # next position; tokens placed
    for run in [*runs, None]:
        stop = input_ids.numel() if run is None else run.start
        # --- text tokens before this run: three equal positions, consecutive ---
        out[:, done:stop] = torch.arange(cursor, cursor + stop - done, device=device)
        cursor += stop - done
        if run is None:
            break
        # --- the run: (frame, row, column) offsets from the cursor ---
        t, h, w = run.grid[0], run.grid[1] // merge, run.grid[2] // merge
        frames = (torch.arange(t, device=device) * run.interval).long() + cursor
        out[0, run.start:run.end] = frames.repeat_interleave(h * w)
        out[1, run.start:run.end] = (torch.arange(h, device=device) + cursor).repeat_interleave(w).repeat(t)
        out[2, run.start:run.end] = (torch.arange(w, device=device) + cursor).repeat(t * h)
        cursor += max(h, w)
        done = run.end
    return out
