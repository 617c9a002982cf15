"""``model.core_attention: local``: Megatron-Core's ``DotProductAttention`` for packed ``thd`` too, with
sliding windows per sequence."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

__all__ = ["PackedDotProductAttention"]


class PackedDotProductAttention(DotProductAttention):
    """Megatron-Core's local ``DotProductAttention`` that also takes packed ``thd`` sequences.

    With ``packed_seq_params`` (``qkv_format='thd'``; ``query [t, np, hn]``, ``key``/``value [t, ng, hn]``)::

        seq = searchsorted(cu_seqlens[1:], arange(t), right=True)           # [t]
        masked[i, j] = (seq[i] != seq[j]) | (j > i) | (j <= i - W)          # [t, t]; W: windowed layers
        out = softmax(q k^T / sqrt(hn) masked by -10000 [, sink]) v         # [t, 1, np * hn]

    ``attention_mask`` is ignored for ``thd``. Sliding window (``window_size = (W - 1, 0)`` on this
    layer): the band is OR-ed into the mask here, ``thd`` and ``bshd`` (Megatron's softmax would replace
    the mask by one ``[s, s]`` band, across the sequences of a pack). The learnable ``softmax_offset``
    (Megatron's) is marked TP-split on dim 0. Memory: the ``[np, t, t]`` scores of the whole pack.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        window = self.scale_mask_softmax.window_size
        self.scale_mask_softmax.window_size = None  # applied to the mask in forward instead
        self.window_left = window[0] if window is not None and window[0] >= 0 else None
        if self.window_left is not None:
            if window[1] != 0:
                raise ValueError(f"PackedDotProductAttention: window_size must be (left, 0), got {window}")
            self.scale_mask_softmax.scaled_masked_softmax_fusion = False  # the fused kernel: no band
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        if packed_seq_params is None:
            if self.window_left is not None:  # bshd: causal band | the given mask
                pos = torch.arange(query.size(0), device=query.device)
                band = (pos[None, :] > pos[:, None]) | (pos[None, :] < pos[:, None] - self.window_left)
                attention_mask = band if attention_mask is None else attention_mask | band
            return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                   attention_bias=attention_bias)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError("packed_seq_params.qkv_format must be 'thd', "
                             f"got {packed_seq_params.qkv_format!r}")
        cu = packed_seq_params.cu_seqlens_q_padded
        if cu is None:
            cu = packed_seq_params.cu_seqlens_q
        t = query.size(0)
        positions = torch.arange(t, device=query.device)
        seq = torch.searchsorted(cu[1:].to(device=query.device, dtype=torch.int64), positions, right=True)
        masked = (seq[:, None] != seq[None, :]) | (positions[None, :] > positions[:, None])
        if self.window_left is not None:
            masked |= positions[None, :] < positions[:, None] - self.window_left
        return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                               masked[None, None], attn_mask_type=AttnMaskType.arbitrary,
                               attention_bias=attention_bias)
