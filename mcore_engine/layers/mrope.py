"""Multimodal RoPE (mRoPE) frequencies in Megatron-Core's layout: ``MultimodalRotaryEmbedding`` replaces
``GPTModel.rotary_pos_emb`` when ``position_embedding_type == "mrope"``.

With ``r = rot_dim / 2`` channel pairs, ``inv_freq[i] = rotary_base ** (-2 i / rot_dim)`` (fp32, as
Megatron's ``RotaryEmbedding`` and ``transformers``' default rope) and positions ``p [3, b, s]``
(t, h, w)::

    m[s, b, i] = float(p[axis[i], b, s]) * inv_freq[i]          # fp32, [s, b, r]: one axis per pair
    freqs      = cat(m, m, -1)[:, :, None]                       # [s, b, 1, rot_dim]

``axis`` (``mrope_section = [s_t, s_h, s_w]``, ``s_t + s_h + s_w = r``): sectioned (Qwen2.5-VL) pairs
``[0, s_t)`` -> t, ``[s_t, s_t + s_h)`` -> h, the rest -> w; interleaved (Qwen3-VL, Qwen3.5) pair ``i``
-> h if ``i % 3 == 1 and i < 3 s_h``, w if ``i % 3 == 2 and i < 3 s_w``, else t. Megatron's
``apply_rotary_pos_emb`` (rotate-half, ``rotary_interleaved=False``) then computes
``x[..., :rot_dim] * cos(freqs) + rotate_half(x[..., :rot_dim]) * sin(freqs)`` and passes the rest of
the head through: exactly ``transformers``' ``apply_rotary_pos_emb`` with the cos / sin its mRoPE
rotary module builds (partial rotary: Qwen3.5's ``partial_rotary_factor`` is ``rotary_percent``).

Context parallelism: ``position_ids`` are global. A bshd result (``packed = False``) is cut to this
CP rank's load-balanced chunks ``r`` and ``2 cp - 1 - r`` (``get_pos_emb_on_this_cp_rank``); a packed
thd result is returned whole ``[T, 1, 1, rot_dim]``: Megatron-Core's ``_apply_rotary_pos_emb_thd``
(0.16 and 0.19) takes the whole pack's freqs when ``freqs.size(0) == cu_seqlens[-1]`` and cuts them
per sequence and rank itself, so ``T`` must be the padded pack length (``cu_seqlens_q_padded[-1]``).

Memory: ``[s, b, r]`` fp32 angles and the ``[s, b, 1, rot_dim]`` fp32 result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rope_utils import get_pos_emb_on_this_cp_rank
from torch import Tensor, nn

__all__ = ["MultimodalRotaryEmbedding", "mrope_axis"]


def mrope_axis(mrope_section: Sequence[int], interleaved: bool) -> Tensor:
    """``[r]`` int64: the position axis (0 = t, 1 = h, 2 = w) of each rotary channel pair."""
    s_t, s_h, s_w = (int(s) for s in mrope_section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor([s_t, s_h, s_w]))
    i = torch.arange(s_t + s_h + s_w)
    axis = torch.zeros_like(i)
    axis[(i % 3 == 1) & (i < 3 * s_h)] = 1
    axis[(i % 3 == 2) & (i < 3 * s_w)] = 2
    return axis


class MultimodalRotaryEmbedding(nn.Module):
    """mRoPE frequencies ``[s, b, 1, rot_dim]`` (fp32) from 3-D positions (module docstring).

    ``rot_dim = int(kv_channels * rotary_percent)``; ``mrope_section`` must sum to ``rot_dim / 2``.
    The model sets ``packed`` before each call (True: thd pack ``[3, 1, T]``, left whole at CP > 1).
    """

    def __init__(self, kv_channels: int, rotary_percent: float, rotary_base: float,
                 mrope_section: Sequence[int], interleaved: bool,
                 cp_group: torch.distributed.ProcessGroup | None = None) -> None:
        super().__init__()
        dim = int(kv_channels * rotary_percent) if rotary_percent < 1.0 else int(kv_channels)
        if dim < 2 or dim % 2:
            raise ValueError(f"MultimodalRotaryEmbedding: rot_dim = int(kv_channels {kv_channels} * "
                             f"rotary_percent {rotary_percent}) = {dim} must be even and >= 2")
        self.rot_dim = dim
        self.interleaved = bool(interleaved)
        self.mrope_section = self._checked_section(mrope_section)
        self.packed = False
        self.cp_group = cp_group
        # A plain attribute, not a buffer: a bf16 cast of the model must leave it fp32 (as Megatron's).
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self._axis = mrope_axis(self.mrope_section, self.interleaved)

    def _checked_section(self, mrope_section: Any) -> list[int]:
        ok = isinstance(mrope_section, Sequence) and len(mrope_section) == 3 and all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in mrope_section)
        if not ok or 2 * sum(mrope_section) != self.rot_dim:
            raise ValueError(f"mrope_section must be three ints >= 0 (t, h, w channel pairs) summing to "
                             f"rot_dim / 2 = {self.rot_dim // 2}, got {mrope_section!r}")
        return [int(s) for s in mrope_section]

    def forward(self, position_ids: Tensor, mrope_section: Sequence[int] | None = None,
                cp_group: torch.distributed.ProcessGroup | None = None, **_: Any) -> Tensor:
        """``position_ids`` ``[3, b, s]`` (integer, global) -> ``freqs`` ``[s, b, 1, rot_dim]`` fp32 (this
        CP rank's chunks for bshd at CP > 1). ``mrope_section``: GPTModel passes its config's (the same
        pairs; validated); ``cp_group``: else this module's, else Megatron's CP group; other keyword
        arguments of newer GPTModel calls are ignored."""
        if position_ids.dim() != 3 or position_ids.size(0) != 3 or position_ids.dtype.is_floating_point \
                or position_ids.dtype.is_complex or position_ids.dtype == torch.bool:
            raise ValueError(f"position_ids must be an integer tensor [3, b, s] (t, h, w), got "
                             f"{position_ids.dtype} {tuple(position_ids.shape)}")
        section = self.mrope_section if mrope_section is None else self._checked_section(mrope_section)
        device = position_ids.device
        if self.inv_freq.device != device:  # once, at the first call on the model's device
            self.inv_freq, self._axis = self.inv_freq.to(device), self._axis.to(device)
        axis = self._axis
        if section != self.mrope_section:
            axis = mrope_axis(section, self.interleaved).to(device)
        # --- 1. each pair's position: that of its axis  [s, b, r] ---
        pair_pos = position_ids.float().index_select(0, axis).permute(2, 1, 0)
        # --- 2. angles, fp32 as transformers: float(p) * inv_freq ---
        angles = pair_pos * self.inv_freq
        # --- 3. Megatron's rotate-half layout  [s, b, 1, rot_dim] ---
        emb = torch.cat((angles, angles), dim=-1)[:, :, None, :]
        # --- 4. bshd at CP > 1: this rank's chunks r and 2 cp - 1 - r; a thd pack stays whole ---
        if not self.packed:
            group = next((g for g in (cp_group, self.cp_group) if g is not None), None)
            if group is None:
                group = parallel_state.get_context_parallel_group(check_initialized=False)
            if group is not None and group.size() > 1:
                emb = get_pos_emb_on_this_cp_rank(emb, 0, group)
        return emb
