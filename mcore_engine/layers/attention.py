"""Causal core attention for Megatron-Core's local layer spec: SDPA kernels, packed ``thd``, context
parallelism (CP) on CPU and on GPUs without Transformer Engine.

Math, per sequence of (padded) length ``L``, query head ``h`` and its KV group ``g = h // (np / ng)``::

    out[i, h] = softmax_j<=i(scale * q[i, h] . k[j, g]) @ v[:i+1, g]     # causal at GLOBAL positions

Sliding window ``W`` (windowed layers): only keys ``i - W < j <= i`` of the sequence. Sinks (softmax
type ``learnable`` / ``off-by-one``): a logit ``s_h`` per head in every row's denominator,
``p[i, j] = exp(z[i, j]) / (sum_j' exp(z[i, j']) + exp(s_h))`` (transformers' gpt-oss ``sinks``).

``attention_mask`` is ignored: masking is always causal inside each sequence (``thd``: the blocks of
``cu_seqlens_q_padded``, else ``cu_seqlens_q``; ``bshd``: each row). For right-padded sequences this
is exact on the real tokens (padding keys come after every real query); padding queries attend
causally too, so no row is ever fully masked (never NaN).

CP layout (Megatron / Transformer Engine load balancing): a sequence of padded length ``L`` (a
multiple of ``2 * cp``) is cut into ``2 * cp`` chunks of ``c = L / (2 cp)`` tokens; CP rank ``r`` holds
chunk ``r`` then chunk ``2 cp - 1 - r``. A local ``thd`` pack is each sequence's ``2 c`` local tokens in
order (local ``cu_seqlens = cu_seqlens_q_padded // cp``); a local ``bshd`` row is the two chunks of the
global row (``sq = S / cp``). :func:`cp_local_index` maps local tokens to global pack positions.

Algorithm: one autograd all-gather of ``[K | V]`` over CP (backward: reduce-scatter-sum of dK/dV),
reordered to global order; then per sequence and local query chunk ``j`` (global rows
``[j c, (j + 1) c)``) attention to the key prefix ``[0, (j + 1) c)``, causal aligned bottom-right:

- ``j = 0`` (always at CP = 1): one ``F.scaled_dot_product_attention(is_causal=True)`` call.
- ``j > 0`` on CPU: two flash calls, the full prefix ``[0, j c)`` and the causal diagonal block,
  merged by their log-sum-exp; backward runs the flash backward of both parts against the merged
  output and log-sum-exp (exact, the ring-attention identity).
- ``j > 0`` elsewhere: ``F.scaled_dot_product_attention`` with ``causal_lower_right`` (native in the
  CUDA flash / memory-efficient kernels; K/V heads repeated for GQA there).
- with a window that bites or sinks: :func:`~mcore_engine.layers.attention_blocks.block_attention`
  on the key range ``[max(0, j c - W + 1), (j + 1) c)`` (a window crosses the CP split by reading the
  gathered keys of the chunk before), query blocks against their band (CPU flash kernels; elsewhere
  fp32 matmuls per block: correct, not fast, untested on GPUs); the sink enters each row's merged
  log-sum-exp once. Its gradient is the local queries' share (the engine sums it over DP x CP).

Memory saved for backward, per layer: the local queries, the gathered K/V (``cp x`` the local K/V;
a copy padded to one head dim when ``k_channels != v_channels``), the output and an fp32 log-sum-exp
per query and head; windows and sinks add nothing but the ``[np]`` sinks. No ``[s, s]`` tensor
(Megatron's ``DotProductAttention`` keeps fp32 ``[b, np, s, s]`` probabilities). Cost: a Python loop
over sequences (``thd``; about 120-170 us per sequence and layer for forward + backward on one CPU
core), one or two SDPA calls per sequence and local chunk (with a window: one per block of queries,
``O(s (W + B))`` work), one host read of ``cu_seqlens`` per layer; the gather order is cached for 16
packs.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    is_layer_window_attention,
    make_sharded_tensors_for_checkpoint,
)
from megatron.core.utils import divide
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right

from mcore_engine.layers.attention_blocks import block_attention

__all__ = ["SDPACoreAttention", "cp_local_index"]

_CAUSAL_TYPES = (AttnMaskType.causal, AttnMaskType.padding_causal)
# torch >= 2.13 names them *_single; older releases *_tensor
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# ----------------------------------------------------------------------------------------------------
# CP layout
# ----------------------------------------------------------------------------------------------------
def _checked_lengths(padded_lengths: list[int] | tuple[int, ...] | Tensor, cp_size: int,
                     what: str = "padded_lengths") -> list[int]:
    lengths = [int(n) for n in (padded_lengths.tolist() if isinstance(padded_lengths, Tensor)
                                else padded_lengths)]
    if not isinstance(cp_size, int) or cp_size < 1:
        raise ValueError(f"cp_size must be an int >= 1, got {cp_size!r}")
    multiple = 2 * cp_size if cp_size > 1 else 1
    bad = [n for n in lengths if n < 0 or n % multiple]
    if bad:
        raise ValueError(f"{what}: every padded sequence length must be a non-negative multiple of "
                         f"2 * context_parallel_size = {multiple}, got {bad[:4]}")
    return lengths


def cp_local_index(padded_lengths: list[int] | tuple[int, ...] | Tensor, cp_size: int,
                   cp_rank: int) -> Tensor:
    """Global pack positions of CP rank ``cp_rank``'s local tokens, int64 ``[sum(padded_lengths) / cp]``
    (CPU), in local order.

    Sequences of ``padded_lengths`` (each a multiple of ``2 * cp_size``) lie back to back in the
    global pack; rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of each (``c = L / (2 cp)``)::

        for start, L in zip(starts, padded_lengths):
            c = L // (2 * cp)
            index += [*range(start + r * c, start + (r + 1) * c),
                      *range(start + (2 * cp - 1 - r) * c, start + (2 * cp - r) * c)]

    ``global[cp_local_index(...)]`` is the local split of a per-token tensor; the concatenation over
    ranks is a permutation of ``range(sum(padded_lengths))``. ``cp_size = 1``: the identity.
    """
    lengths = torch.tensor(_checked_lengths(padded_lengths, cp_size), dtype=torch.int64)
    if not isinstance(cp_rank, int) or not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank must be an int in [0, {cp_size}), got {cp_rank!r}")
    if cp_size == 1:
        return torch.arange(int(lengths.sum()))
    c = lengths // (2 * cp_size)
    starts = lengths.cumsum(0) - lengths
    piece_starts = torch.stack([starts + cp_rank * c, starts + (2 * cp_size - 1 - cp_rank) * c], 1).flatten()
    sizes = torch.stack([c, c], 1).flatten()
    local_starts = sizes.cumsum(0) - sizes
    return torch.repeat_interleave(piece_starts - local_starts, sizes) + torch.arange(int(sizes.sum()))


@functools.lru_cache(maxsize=16)
def _global_order(lengths: tuple[int, ...], cp_size: int, device: torch.device) -> Tensor:
    """``order`` with ``gathered[order]`` in global order, for ``gathered`` = the ranks' local packs
    concatenated rank by rank (what the all-gather returns)."""
    gathered = torch.cat([cp_local_index(lengths, cp_size, r) for r in range(cp_size)])
    order = torch.empty_like(gathered)
    order[gathered] = torch.arange(gathered.numel())
    return order.to(device)


# ----------------------------------------------------------------------------------------------------
# Autograd pieces
# ----------------------------------------------------------------------------------------------------
class _GatherFromContextParallel(torch.autograd.Function):
    """forward: all-gather along dim 0 over the CP group (rank-major); backward: reduce-scatter (sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        _ALL_GATHER(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        out = grad.new_empty((grad.size(0) // ctx.size, *grad.shape[1:]))
        _REDUCE_SCATTER(out, grad.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None, None


def _attend(q: Tensor, k: Tensor, v: Tensor, prefix: int, scale: float, cpu_kernels: bool,
            k_start: int = 0, window: int | None = None, sinks: Tensor | None = None) -> Tensor:
    """``q [c, b, h, d]`` at positions ``prefix ..``, ``k, v [prefix + c - k_start, b, hk, d]`` at positions
    ``k_start ..`` -> ``[b, h, c, d]``: query ``i`` attends to keys ``0 .. prefix + i`` (with ``window``:
    the last ``window`` of them), ``sinks [h]`` in the denominators. No window / sink: ``is_causal`` SDPA,
    the CPU prefix merge or ``causal_lower_right`` (``hk = h``); else :func:`block_attention`."""
    q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
    if window is not None and window >= prefix + q.size(2):
        window = None  # every query sees its whole prefix
    if window is not None or sinks is not None:
        return block_attention(q, k, v, sinks, prefix, k_start, window, scale, cpu_flash=cpu_kernels)
    gqa = q.size(1) != k.size(1)
    if prefix == 0:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if cpu_kernels:  # the full prefix and the causal diagonal, merged by log-sum-exp
        return block_attention(q, k, v, None, prefix, 0, None, scale, cpu_flash=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.size(2), k.size(2)),
                                          scale=scale)


# ----------------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------------
class SDPACoreAttention(MegatronModule):
    """Megatron-Core core attention (``DotProductAttention``'s constructor plus MLA's ``k_channels`` /
    ``v_channels``): causal per sequence, ``bshd`` or packed ``thd``, any CP size (module docstring).

    ``forward(query, key, value, attention_mask, ...)``: ``bshd`` ``query [sq, b, np, hk]``, ``key
    [sq, b, ng, hk]``, ``value [sq, b, ng, hv]`` -> ``[sq, b, np * hv]``; ``thd`` (``packed_seq_params``)
    ``[t, np|ng, h*]`` -> ``[t, np * hv]`` (Transformer Engine's layout: Megatron's attention reshapes it,
    and Megatron-Core 0.19's MLA cuts a padded value dim from it). Under CP the inputs are this rank's
    local tokens.
    ``scale``: ``softmax_scale`` else ``1 / sqrt(k_channels or kv_channels)``; Megatron's
    ``apply_query_key_layer_scaling`` cancels out of the scores (the kernels scale in fp32).
    ``cp_comm_type`` is ignored (K/V are always all-gathered).
    Sliding window (this layer windowed by ``is_layer_window_attention(config.window_size,
    config.window_attn_skip_freq, layer_number)``, ``window_size = (W - 1, 0)``): query ``i`` sees keys
    ``i - W < j <= i`` of its own sequence. ``softmax_type``: ``"learnable"`` owns ``softmax_offset``
    ``[np / tp]`` (a sink logit per head in every softmax denominator, gpt-oss' ``sinks``; TP-split on
    dim 0, gradient exact, in ``sharded_state_dict``), ``"off-by-one"`` a fixed 0 logit. ``ValueError``
    for dropout > 0, non-causal masks or windows, cross attention and qk-clip.
    """

    def __init__(self, config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, cp_comm_type: str | None = None,
                 pg_collection: ProcessGroupCollection | None = None, k_channels: int | None = None,
                 v_channels: int | None = None) -> None:
        super().__init__(config=config)
        self.config: TransformerConfig = config
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        _check_supported(config, self.layer_number, attn_mask_type, attention_type, attention_dropout)

        # --- process groups: pg_collection's, else parallel_state's ---
        tp_group = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp_group is None:
            tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.tp_group, self.cp_group = tp_group, cp_group
        tp = _group_size(tp_group, config.tensor_model_parallel_size, "tensor_model_parallel_size")
        self.cp_size = _group_size(cp_group, config.context_parallel_size, "context_parallel_size")
        self.cp_rank = dist.get_rank(cp_group) if self.cp_size > 1 else 0

        # --- heads and head dims per partition (as DotProductAttention) ---
        self.k_channels = k_channels if k_channels is not None else config.kv_channels
        self.v_channels = v_channels if v_channels is not None else config.kv_channels
        self.num_attention_heads_per_partition = divide(config.num_attention_heads, tp)
        self.num_query_groups_per_partition = divide(config.num_query_groups, tp)
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * self.v_channels
        self.softmax_scale = (1.0 / math.sqrt(self.k_channels) if softmax_scale is None
                              else float(softmax_scale))

        # --- sliding window (keys per query, itself included) and the sink logits ---
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq,
                                             self.layer_number)
        self.window = config.window_size[0] + 1 if windowed and config.window_size[0] >= 0 else None
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.cuda.current_device()
        n = self.num_attention_heads_per_partition
        if config.softmax_type == "off-by-one":  # a fixed 0 logit
            self.register_buffer("softmax_offset", torch.zeros(n, dtype=config.params_dtype, device=device),
                                 persistent=False)
        elif config.softmax_type == "learnable":
            tp_rank = dist.get_rank(tp_group) if tp > 1 else 0
            self.softmax_offset = torch.nn.Parameter(torch.zeros(n, dtype=config.params_dtype, device=device))
            set_tensor_model_parallel_attributes(self.softmax_offset, True, 0, 1)
            if config.perform_initialization:  # all heads from the default generator, then this rank's
                with torch.no_grad():
                    full = config.init_method(torch.empty(config.num_attention_heads, dtype=torch.float32))
                    self.softmax_offset.copy_(full[tp_rank * n: (tp_rank + 1) * n])
        else:
            self.softmax_offset = None

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        """Causal attention of the local queries to the (gathered) keys; see the class docstring."""
        # --- 1. checks; the sequences' global padded lengths; everything as [s, b, heads, dim] ---
        if attention_bias is not None:
            raise ValueError("SDPACoreAttention: attention_bias is not supported (got a tensor)")
        if attn_mask_type is not None and attn_mask_type not in _CAUSAL_TYPES:
            raise ValueError(f"SDPACoreAttention: attn_mask_type must be causal, got {attn_mask_type}")
        cp = self.cp_size
        if packed_seq_params is not None:
            lengths = self._thd_lengths(packed_seq_params, query)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        else:
            lengths = self._bshd_lengths(query)
        heads, groups = query.size(2), key.size(2)
        np_local = self.num_attention_heads_per_partition
        if heads != np_local or heads % groups or key.shape[:3] != value.shape[:3] \
                or key.shape[:2] != query.shape[:2]:
            raise ValueError(f"SDPACoreAttention: expected query [s, b, {np_local}, hk] and key / value "
                             f"[s, b, ng, h*], got {tuple(query.shape)}, {tuple(key.shape)}, "
                             f"{tuple(value.shape)}")
        hv = value.size(-1)

        # --- 2. whole-sequence K/V: all-gather [K | V] over CP, then global order ---
        if cp > 1:
            s_local, b = key.shape[:2]
            kv = torch.cat([key.reshape(s_local, b, -1), value.reshape(s_local, b, -1)], dim=-1)
            kv = _GatherFromContextParallel.apply(kv, self.cp_group, cp)
            kv = kv.index_select(0, _global_order(tuple(lengths), cp, kv.device))
            k_len = groups * key.size(-1)
            key = kv[..., :k_len].unflatten(-1, (groups, -1))
            value = kv[..., k_len:].unflatten(-1, (groups, -1))
        query, key, value = _same_head_dim(query, key, value)
        cpu_kernels = query.device.type == "cpu"
        if groups != heads and not cpu_kernels:  # the lower-right GPU kernels lack GQA
            key, value = (x.repeat_interleave(heads // groups, dim=2) for x in (key, value))

        # --- 3. per sequence and local query chunk: causal attention to the key prefix ---
        chunks = [0] if cp == 1 else [self.cp_rank, 2 * cp - 1 - self.cp_rank]
        sizes = [n // (2 * cp if cp > 1 else 1) for n in lengths]
        q_pieces = iter(query.split([c for c in sizes for _ in chunks], dim=0))
        outs = []
        for k_seq, v_seq, c in zip(key.split(lengths), value.split(lengths), sizes, strict=True):
            for j in chunks:
                q = next(q_pieces)
                if c:
                    lo = 0 if self.window is None else max(0, j * c - self.window + 1)
                    outs.append(_attend(q, k_seq[lo: (j + 1) * c], v_seq[lo: (j + 1) * c], j * c,
                                        self.softmax_scale, cpu_kernels, lo, self.window,
                                        self.softmax_offset))

        # --- 4. [b, np, c, h] pieces -> [sq, b, np * hv] (thd: [t, np * hv], as Transformer Engine's) ---
        if not outs:  # an empty pack
            out = query.new_zeros(query.size(0), query.size(1), heads * hv)
        else:
            out = torch.cat([o.permute(2, 0, 1, 3) for o in outs], dim=0)[..., :hv]
        if packed_seq_params is not None:
            return out.reshape(out.size(0), -1)
        return out.reshape(out.size(0), out.size(1), -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """``softmax_offset`` (learnable softmax) TP-sharded along dim 0; nothing else is stored."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"softmax_offset": 0}, sharded_offsets,
            tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def _bshd_lengths(self, query: Tensor) -> list[int]:
        """``[S]``: every row is one sequence of global length ``S = sq * cp``."""
        if query.dim() != 4:
            raise ValueError("SDPACoreAttention: bshd query must be [sq, b, np, hn], got "
                             f"{tuple(query.shape)}")
        if self.cp_size > 1 and query.size(0) % 2:
            raise ValueError(f"SDPACoreAttention: with context_parallel_size={self.cp_size} the local "
                             f"sequence length must be even (2 chunks), got sq={query.size(0)}")
        return [query.size(0) * self.cp_size]

    def _thd_lengths(self, params: PackedSeqParams, query: Tensor) -> list[int]:
        """Global padded sequence lengths of a ``thd`` pack, checked against the local ``query``."""
        if params.qkv_format != "thd":
            raise ValueError(f"SDPACoreAttention: packed_seq_params.qkv_format must be 'thd', "
                             f"got {params.qkv_format!r}")
        if query.dim() != 3:
            raise ValueError(f"SDPACoreAttention: thd query must be [t, np, hn], got {tuple(query.shape)}")
        name = "cu_seqlens_q_padded" if params.cu_seqlens_q_padded is not None else "cu_seqlens_q"
        cu = getattr(params, name)
        if cu is None or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"SDPACoreAttention: packed_seq_params.{name} must be a 1-D tensor [n + 1]")
        cu = [int(x) for x in cu.tolist()]
        lengths = _checked_lengths([b - a for a, b in zip(cu[:-1], cu[1:], strict=True)], self.cp_size,
                                   what=f"packed_seq_params.{name}")
        if cu[0] != 0 or cu[-1] != query.size(0) * self.cp_size:
            raise ValueError(f"SDPACoreAttention: packed_seq_params.{name} must run from 0 to the global "
                             f"pack size {query.size(0)} * context_parallel_size {self.cp_size}, got "
                             f"{cu[0]} .. {cu[-1]}")
        return lengths


def _same_head_dim(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Zero-pad q/k or v to one head dim (the SDPA kernels need it; scores and output unchanged)."""
    dk, dv = key.size(-1), value.size(-1)
    if dv < dk:
        value = F.pad(value, (0, dk - dv))
    elif dk < dv:
        query, key = F.pad(query, (0, dv - dk)), F.pad(key, (0, dv - dk))
    return query, key, value


def _group_size(group: dist.ProcessGroup | None, configured: int, name: str) -> int:
    size = dist.get_world_size(group) if group is not None else 1
    if size != configured:
        raise ValueError(f"SDPACoreAttention: config.{name}={configured} but the process group has "
                         f"{size} rank(s)" + (" (parallel_state not initialised?)" if group is None else ""))
    return size


def _check_supported(config: TransformerConfig, layer_number: int, attn_mask_type: AttnMaskType,
                     attention_type: str, attention_dropout: float | None) -> None:
    """``ValueError`` for what this attention does not do (it is causal self-attention only)."""
    dropout = config.attention_dropout if attention_dropout is None else attention_dropout
    window = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number)
    problems = {
        f"attention dropout {dropout} (only 0.0)": dropout != 0.0,
        f"attention_type {attention_type!r} (only 'self')": attention_type != "self",
        f"attn_mask_type {attn_mask_type} (only causal)": attn_mask_type not in _CAUSAL_TYPES,
        f"softmax_type {config.softmax_type!r} (only 'vanilla', 'off-by-one', 'learnable')":
            config.softmax_type not in ("vanilla", "off-by-one", "learnable"),
        f"window_size {config.window_size} (only (left, 0): causal)":
            window and (len(config.window_size) != 2 or config.window_size[1] != 0),
        "qk_clip / log_max_attention_logit (no max-logit tracking)":
            bool(config.qk_clip or config.log_max_attention_logit),
    }
    bad = [what for what, hit in problems.items() if hit]
    if bad:
        raise ValueError(f"SDPACoreAttention does not support {', '.join(bad)}")
