"""``model.core_attention: local``: Megatron-Core's ``DotProductAttention`` for packed ``thd`` too."""

from __future__ import annotations

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from torch import Tensor

__all__ = ["PackedDotProductAttention"]


class PackedDotProductAttention(DotProductAttention):
    """Megatron-Core's local ``DotProductAttention`` that also takes packed ``thd`` sequences.

    With ``packed_seq_params`` (``qkv_format='thd'``; ``query [t, np, hn]``, ``key``/``value [t, ng, hn]``)::

        seq = searchsorted(cu_seqlens[1:], arange(t), right=True)           # [t]
        masked[i, j] = (seq[i] != seq[j]) | (j > i)                         # [t, t]
        out = softmax(q k^T / sqrt(hn) masked by -10000) v                  # [t, 1, np * hn]

    ``attention_mask`` is ignored for ``thd``. Memory: the ``[np, t, t]`` scores of the whole pack.
    """

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        if packed_seq_params is None:
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
        return super().forward(query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1),
                               masked[None, None], attn_mask_type=AttnMaskType.arbitrary,
                               attention_bias=attention_bias)
