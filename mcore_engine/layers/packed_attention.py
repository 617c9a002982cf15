"""``model.core_attention: local``: Megatron-Core's ``DotProductAttention`` for packed ``thd`` too."""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

__all__ = ["PackedDotProductAttention"]


class PackedDotProductAttention(DotProductAttention):
    """Megatron-Core's local ``DotProductAttention`` that also takes packed ``thd`` sequences.

    With ``packed_seq_params`` (``qkv_format='thd'``; ``query [t, np, hn]``, ``key``/``value [t, ng, hn]``)::

        seq = searchsorted(cu_seqlens[1:], arange(t), right=True)           # [t]
        masked[i, j] = (seq[i] != seq[j]) | (j > i) | (i - j > w)           # [t, t]; w: window - 1
        out = softmax(q k^T / sqrt(hn) masked by -10000) v                  # [t, 1, np * hn]

    ``attention_mask`` is ignored for ``thd``. On a windowed layer Megatron's softmax replaces any
    mask by one causal window over the whole ``[sq, sk]`` (across the pack's sequences): the window
    is taken out of it and applied here, inside each sequence (``bshd``: each row). Attention sinks
    (``softmax_offset``, one logit per local head) are marked TP-sharded on dim 0, so the gradient
    norm, checkpoints and weight loading count and cut them per head. Memory: the ``[np, t, t]``
    scores of the whole pack.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        window = self.scale_mask_softmax.window_size
        self.scale_mask_softmax.window_size = None
        self.window_left = None if window is None else int(window[0])
        if isinstance(self.softmax_offset, torch.nn.Parameter):
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        if packed_seq_params is None:
            if self.window_left is not None:  # [b, 1, sq, sk]: causal and windowed per row
                i = torch.arange(query.size(0), device=query.device)
                distance = i[:, None] - i[None, :]
                attention_mask = ((distance < 0) | (distance > self.window_left))[None, None]
                attn_mask_type = AttnMaskType.arbitrary
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
            masked |= positions[:, None] - positions[None, :] > self.window_left
        return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                               masked[None, None], attn_mask_type=AttnMaskType.arbitrary,
                               attention_bias=attention_bias)
