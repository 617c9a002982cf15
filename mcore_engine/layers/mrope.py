"""TEMPORARY (lead's scratch; replaced by helper rope's module)."""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank


class MultimodalRotaryEmbedding(torch.nn.Module):
    def __init__(self, kv_channels, rotary_percent, rotary_base, mrope_section, interleaved):
        super().__init__()
        dim = int(kv_channels * rotary_percent)
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.section, self.interleaved, self.packed = mrope_section, interleaved, False

    def forward(self, position_ids, mrope_section=None, **kw):
        freqs = position_ids[..., None].float() * self.inv_freq  # [3, b, s, r]
        if self.interleaved:
            out = freqs[0].clone()
            for ax in (1, 2):
                idx = torch.arange(ax, 3 * self.section[ax], 3)
                out[..., idx] = freqs[ax][..., idx]
        else:
            out = torch.cat([m[i % 3] for i, m in enumerate(freqs.split(self.section, dim=-1))], dim=-1)
        emb = torch.cat((out, out), -1).transpose(0, 1)[:, :, None, :]  # [s, b, 1, d]
        cp = parallel_state.get_context_parallel_world_size()
        if cp > 1 and not self.packed:
            emb = get_pos_emb_on_this_cp_rank(emb, 0, parallel_state.get_context_parallel_group())
        return emb
