"""TEMPORARY (lead's scratch; replaced by helper rope's module)."""
from __future__ import annotations

import torch


def rope_index(input_ids, vision, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None):
    m = vision.spatial_merge_size
    ids = input_ids.tolist()
    grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    out, pos, i = [], 0, 0
    while i < len(ids):
        if ids[i] == vision.image_token_id:
            t, h, w = next(grids)
            h, w = h // m, w // m
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            out.append(torch.stack([tt.reshape(-1) + pos, hh.reshape(-1) + pos, ww.reshape(-1) + pos]))
            i += t * h * w
            pos += max(h, w)
        else:
            out.append(torch.full((3, 1), pos))
            pos += 1
            i += 1
    return torch.cat(out, 1).to(torch.int64)
