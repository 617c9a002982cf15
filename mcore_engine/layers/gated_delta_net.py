"""Gated DeltaNet (Qwen3.5 / Qwen3-Next linear attention) as Megatron-Core's ``self_attention``:
tensor, sequence and context parallel, packed ``thd`` and ``bshd``; pure torch (no
flash-linear-attention needed; ``ops.gated_delta`` uses it on CUDA when it imports).

Math per token ``x [h]`` (``transformers`` 5.24 ``Qwen3_5GatedDeltaNet``; ``nk`` key heads of ``dk``,
``nv`` value heads of ``dv``, key head ``i`` serving value heads ``i r .. i r + r - 1``, ``r = nv / nk``)::

    q, k, v = silu(causal_depthwise_conv1d(W_qkv x))   # kernel K, zero history at each sequence start
    beta = sigmoid(W_b x);  g = -exp(A_log) * softplus(W_a x + dt_bias)          # [nv], fp32 g
    o = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True)            # state reset per sequence
    out = W_o (w * rmsnorm(o) * silu(W_z x))                                    # per value head, fp32 inside

(fp32 inside means "at least fp32": float64 runs stay float64.)

Layouts: ``hidden_states [s, b, h]`` (``[s / tp, b, h]`` with sequence parallelism: each of the four
column projections all-gathers it, ``out_proj`` reduce-scatters). ``thd`` (``packed_seq_params.
qkv_format == 'thd'``, ``b == 1``): sequences are the blocks of ``cu_seqlens_q_padded`` (else
``cu_seqlens_q``); ``bshd``: every row is one sequence; ``attention_mask`` is not used (right padding
never reaches a real token). TP rank ``r`` holds key heads ``r nk / tp ..`` and value heads
``r nv / tp ..``: ``in_proj_qkv`` / ``conv1d`` rows ``[q_r; k_r; v_r]`` (:func:`qkv_partition_rows`),
``in_proj_z`` / ``in_proj_b`` / ``in_proj_a`` / ``A_log`` / ``dt_bias`` their value-head rows,
``out_proj`` its columns; ``norm.weight [dv]`` is replicated (its gradient all-reduced over TP in
the backward: the TP ranks normalise different heads). Checkpoints store ``in_proj_qkv`` / ``conv1d``
as ``.q`` / ``.k`` / ``.v`` pieces, so they reshard to any TP size.

Context parallelism (CP rank ``c`` holds chunks ``c`` and ``2 cp - 1 - c`` of every sequence): after
the local projections one all-to-all (:mod:`mcore_engine.layers.gdn_cp`) turns ``[local tokens,
heads / tp]`` into ``[all tokens, heads / (tp cp)]``, reordered to global order; conv, decay and
rule run on whole sequences of the rank's head group (``conv1d`` / ``A_log`` / ``dt_bias`` sliced to
it); a second all-to-all brings ``o`` back to the local tokens before the gated norm and
``out_proj``. Each rank sends ``(cp - 1) / cp`` of ``(2 key_dim + value_dim + 2 nv) / tp`` values
per local token there and of ``value_dim / tp`` back (the same again in the backward). The per-head
parameters get gradients only on their slice; the sum over CP (Megatron's DDP reduces over DP x CP)
is the full gradient.

Memory saved for backward per layer and local token (``C = (2 key_dim + value_dim) / tp``, ``Hv =
nv / tp``): the projections' input (Megatron's linears), the conv input ``C`` and ``a``, ``b``
(``2 Hv``), ``o`` and ``z`` with the gated norm's fp32 intermediates (about ``4 Hv dv``), the
``out_proj`` input. The conv, decay and rule run again in the backward (``gdn.recompute``, default);
without it they also keep the conv's ``K - 1`` zero columns per sequence and pre-SiLU output
(``C``) and what ``ops.gated_delta`` keeps of ``q, k, v, g, beta`` (``[chunk, chunk]`` blocks per
head and chunk, no ``[s, s]`` tensor; about 19x ``o``). At CP > 1 the rule's share covers the global
sequence for ``Hv / cp`` heads: the same amount per rank.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    set_tensor_model_parallel_attributes,
)
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_tensors_for_checkpoint,
    sharded_state_dict_default,
)
from torch import Tensor

from mcore_engine.config.gdn import GDNConfig
from mcore_engine.layers.gdn_checkpoint import split_blocks
from mcore_engine.layers.gdn_cp import heads_to_tokens, tokens_to_heads
from mcore_engine.ops.gated_delta import chunk_gated_delta_rule

__all__ = ["GatedDeltaNet", "GatedRMSNorm", "qkv_partition_rows"]


def qkv_partition_rows(gdn: GDNConfig, tp: int, rank: int) -> Tensor:
    """Rows of the Hugging Face ``in_proj_qkv`` / ``conv1d`` (``[q; k; v]``, all heads) that TP rank
    ``rank`` of ``tp`` holds, in its order ``[q_r; k_r; v_r]`` (int64 ``[(2 key_dim + value_dim) / tp]``)."""
    if gdn.num_key_heads % tp or gdn.num_value_heads % tp or not 0 <= rank < tp:
        raise ValueError(f"qkv_partition_rows: tp={tp} must divide num_key_heads={gdn.num_key_heads} and "
                         f"num_value_heads={gdn.num_value_heads}, rank={rank} in [0, tp)")
    kd, vd = gdn.key_dim // tp, gdn.value_dim // tp
    return torch.cat([torch.arange(rank * kd, (rank + 1) * kd),
                      gdn.key_dim + torch.arange(rank * kd, (rank + 1) * kd),
                      2 * gdn.key_dim + torch.arange(rank * vd, (rank + 1) * vd)])


class GatedRMSNorm(torch.nn.Module):
    """``transformers``' ``Qwen3NextRMSNormGated``: ``(w * rmsnorm(o).to(dtype)) * silu(z.float())``
    over the last dim (fp32 statistics; float64 stays float64), returned in ``o``'s dtype.
    ``tp_group`` (size > 1): the weight's gradient is all-reduced over it (the TP ranks normalise
    different heads)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: Any,
                 tp_group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size, dtype=dtype, device=device))
        self.eps = eps
        self.tp_group = tp_group

    def forward(self, o: Tensor, z: Tensor) -> Tensor:
        weight = self.weight
        if self.tp_group is not None and dist.get_world_size(self.tp_group) > 1:
            weight = copy_to_tensor_model_parallel_region(weight, group=self.tp_group)
        dtype = o.dtype
        x = _wide(o)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return ((weight * x.to(dtype)) * F.silu(_wide(z))).to(dtype)


def _wide(x: Tensor) -> Tensor:
    """``x`` in fp32, or as it is when wider (float64 runs stay float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _causal_conv_silu(x: Tensor, weight: Tensor, lengths: list[int] | None) -> Tensor:
    """``silu(depthwise causal conv)`` of ``x [T, b, C]`` with ``weight [C, K]``; ``lengths`` (thd, b = 1):
    every sequence starts from zero history (``K - 1`` zero rows before it, one valid convolution)."""
    t, b, c = x.shape
    k = weight.size(-1)
    w = weight.unsqueeze(1)
    if lengths is None:  # bshd: every row its own sequence (a contiguous [b, C, T] input: faster on CPU)
        y = F.conv1d(x.permute(1, 2, 0).contiguous(), w, padding=k - 1, groups=c)[..., :t]  # [b, C, T]
        return F.silu(y).permute(2, 0, 1)
    n = len(lengths)
    seq = torch.repeat_interleave(torch.arange(n, device=x.device),
                                  torch.tensor(lengths, device=x.device), output_size=t)
    dest = torch.arange(t, device=x.device) + (seq + 1) * (k - 1)  # column of token i in the buffer
    buf = x.new_zeros(c, t + n * (k - 1)).index_copy(1, dest, x[:, 0].t())
    y = F.conv1d(buf.unsqueeze(0), w, groups=c)[0]  # [C, T + (n - 1)(K - 1)]: window [o, o + K)
    return F.silu(y.index_select(1, dest - (k - 1))).t().unsqueeze(1)


def _group(pg_collection: ProcessGroupCollection | None, name: str) -> dist.ProcessGroup | None:
    group = getattr(pg_collection, name, None) if pg_collection is not None else None
    if group is None:
        getter = {"tp": parallel_state.get_tensor_model_parallel_group,
                  "cp": parallel_state.get_context_parallel_group}[name]
        group = getter(check_initialized=False)
    return group


class GatedDeltaNet(MegatronModule):
    """Gated DeltaNet layer (module docstring): ``forward(hidden_states [s, b, h], ...) -> (out, None)``."""

    def __init__(self, config: TransformerConfig, submodules: Any = None, layer_number: int = 1,
                 gdn: GDNConfig | None = None, pg_collection: ProcessGroupCollection | None = None,
                 **kwargs: Any) -> None:
        super().__init__(config=config)
        if not isinstance(gdn, GDNConfig):
            raise ValueError("GatedDeltaNet: gdn must be a GDNConfig (ModelConfig.linear_attention), "
                             f"got {gdn!r}")
        self.gdn, self.layer_number = gdn, layer_number
        # --- process groups: pg_collection's, else parallel_state's ---
        self.tp_group, self.cp_group = _group(pg_collection, "tp"), _group(pg_collection, "cp")
        self.tp_size = dist.get_world_size(self.tp_group) if self.tp_group is not None else 1
        self.cp_size = dist.get_world_size(self.cp_group) if self.cp_group is not None else 1
        self.tp_rank = dist.get_rank(self.tp_group) if self.tp_size > 1 else 0
        self.cp_rank = dist.get_rank(self.cp_group) if self.cp_size > 1 else 0
        if self.cp_size != config.context_parallel_size:
            raise ValueError(f"GatedDeltaNet: config.context_parallel_size={config.context_parallel_size} "
                             f"but the CP process group has {self.cp_size} rank(s)")
        split = self.tp_size * self.cp_size
        for name in ("num_key_heads", "num_value_heads"):
            if getattr(gdn, name) % split:
                raise ValueError(f"GatedDeltaNet: GDNConfig.{name} ({getattr(gdn, name)}) must be divisible "
                                 f"by tensor_model_parallel_size x context_parallel_size ({self.tp_size} x "
                                 f"{self.cp_size}): each rank holds whole GDN heads")
        tp = self.tp_size
        self.nk, self.nv = gdn.num_key_heads // tp, gdn.num_value_heads // tp  # per TP rank
        self.dk, self.dv = gdn.key_head_dim, gdn.value_head_dim
        self.conv_dim = 2 * gdn.key_dim + gdn.value_dim
        h = config.hidden_size

        # --- projections (Megatron's TP linears; SP gather / reduce-scatter inside) ---
        def column(out: int) -> ColumnParallelLinear:
            return ColumnParallelLinear(h, out, config=config, init_method=config.init_method, bias=False,
                                        gather_output=False, skip_bias_add=False, tp_group=self.tp_group)

        self.in_proj_qkv = column(self.conv_dim)
        self.in_proj_z = column(gdn.value_dim)
        self.in_proj_b = column(gdn.num_value_heads)
        self.in_proj_a = column(gdn.num_value_heads)
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() \
            else torch.cuda.current_device()
        dtype = config.params_dtype
        k = gdn.conv_kernel_dim
        self.conv1d = torch.nn.Conv1d(self.conv_dim // tp, self.conv_dim // tp, k, groups=self.conv_dim // tp,
                                      bias=False, padding=k - 1, device=device, dtype=dtype)
        self.A_log = torch.nn.Parameter(torch.zeros(self.nv, dtype=dtype, device=device))
        self.dt_bias = torch.nn.Parameter(torch.ones(self.nv, dtype=dtype, device=device))
        for p in (self.conv1d.weight, self.A_log, self.dt_bias):
            set_tensor_model_parallel_attributes(p, True, 0, 1)
        self.norm = GatedRMSNorm(self.dv, config.layernorm_epsilon, dtype, device, self.tp_group)
        self.out_proj = RowParallelLinear(gdn.value_dim, h, config=config,
                                          init_method=config.output_layer_init_method, bias=False,
                                          input_is_parallel=True, skip_bias_add=True, tp_group=self.tp_group)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """conv1d ``U(-1/sqrt(K), 1/sqrt(K))`` (``nn.Conv1d``'s), ``A_log = log(U(1, 16))``, ``dt_bias = 1``:
        drawn for all heads from the default generator and sliced, so every TP layout gets the same
        weights."""
        if not self.config.perform_initialization:
            return
        k = self.gdn.conv_kernel_dim
        with torch.no_grad():
            conv = torch.empty(self.conv_dim, 1, k).uniform_(-1 / math.sqrt(k), 1 / math.sqrt(k))
            rows = qkv_partition_rows(self.gdn, self.tp_size, self.tp_rank)
            self.conv1d.weight.copy_(conv[rows])
            a_log = torch.empty(self.gdn.num_value_heads).uniform_(1, 16).log()
            self.A_log.copy_(a_log[self.tp_rank * self.nv: (self.tp_rank + 1) * self.nv])
            self.dt_bias.fill_(1.0)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None,
                inference_context: Any = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None,
                **kwargs: Any) -> tuple[Tensor, Tensor | None]:
        """``[s, b, h]`` -> ``([s, b, h], None)`` (SP: ``[s / tp, b, h]`` both); steps as in the module
        docstring."""
        # --- 1. checks; the global (padded) sequence lengths, None for bshd ---
        if inference_context is not None or kwargs.get("inference_params") is not None:
            raise ValueError("GatedDeltaNet: inference_context (KV / recurrent cache) is not supported")
        if attention_bias is not None:
            raise ValueError("GatedDeltaNet: attention_bias is not supported (got a tensor)")
        lengths = self._lengths(hidden_states, packed_seq_params)

        # --- 2. projections: [s, b, *] with the whole (CP-local) sequence, this TP rank's heads ---
        qkv, _ = self.in_proj_qkv(hidden_states)
        z, _ = self.in_proj_z(hidden_states)
        b_in, _ = self.in_proj_b(hidden_states)
        a_in, _ = self.in_proj_a(hidden_states)
        s, b = qkv.shape[:2]
        conv_w, a_log, dt_bias = self.conv1d.weight[:, 0], self.A_log, self.dt_bias
        nk, nv, kd = self.nk, self.nv, self.nk * self.dk

        # --- 3. CP: local tokens of all heads -> all tokens of this rank's head group ---
        cp = self.cp_size
        if cp > 1:
            cp_lengths = lengths if lengths is not None else [s * cp]
            nk, nv = nk // cp, nv // cp
            q, k, v = qkv.split([kd, kd, self.nv * self.dv], dim=-1)
            kd_c, vd_c = nk * self.dk, nv * self.dv
            x = torch.cat([q.unflatten(-1, (cp, kd_c)), k.unflatten(-1, (cp, kd_c)),
                           v.unflatten(-1, (cp, vd_c)), a_in.unflatten(-1, (cp, nv)),
                           b_in.unflatten(-1, (cp, nv))], dim=-1)  # [s, b, cp (head group), W]
            x = tokens_to_heads(x, cp_lengths, self.cp_group)  # [T, b, W]
            qkv, a_in, b_in = x.split([2 * kd_c + vd_c, nv, nv], dim=-1)
            c = self.cp_rank
            rows = torch.cat([torch.arange(c * kd_c, (c + 1) * kd_c),
                              kd + torch.arange(c * kd_c, (c + 1) * kd_c),
                              2 * kd + torch.arange(c * vd_c, (c + 1) * vd_c)]).to(conv_w.device)
            conv_w = conv_w.index_select(0, rows)
            a_log, dt_bias = a_log[c * nv: (c + 1) * nv], dt_bias[c * nv: (c + 1) * nv]

        # --- 4-5. conv, decay and the chunked rule; recomputed in backward unless gdn.recompute is off ---
        args = (qkv, conv_w, a_in, b_in, a_log, dt_bias)
        if self.gdn.recompute and torch.is_grad_enabled():
            o = torch.utils.checkpoint.checkpoint(self._mix, *args, lengths=lengths, heads=(nk, nv),
                                                  use_reentrant=False)
        else:
            o = self._mix(*args, lengths=lengths, heads=(nk, nv))

        # --- 6. CP: back to the local tokens of all heads ---
        if cp > 1:
            o = heads_to_tokens(o.flatten(-2), cp_lengths, self.cp_group, cp).reshape(s, b, self.nv, self.dv)

        # --- 7. gated RMSNorm per value head, out_proj (SP: reduce-scatter) ---
        o = self.norm(o, z.unflatten(-1, (self.nv, self.dv)))
        return self.out_proj(o.flatten(-2))

    def _mix(self, qkv: Tensor, conv_w: Tensor, a_in: Tensor, b_in: Tensor, a_log: Tensor, dt_bias: Tensor,
             *, lengths: list[int] | None, heads: tuple[int, int]) -> Tensor:
        """Causal conv + SiLU per sequence, ``q, k, v``, decay ``g`` (fp32) and ``beta``, then the
        chunked gated delta rule (state reset at each sequence start): ``o [T, b, nv, dv]`` of this
        rank's ``heads = (nk, nv)``."""
        nk, nv = heads
        kd = nk * self.dk
        qkv = _causal_conv_silu(qkv, conv_w, lengths)
        q, k, v = qkv.split([kd, kd, nv * self.dv], dim=-1)
        g = -_wide(a_log).exp() * F.softplus(_wide(a_in) + dt_bias)  # [T, b, nv]
        beta = b_in.sigmoid()
        cu = None
        if lengths is not None:
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                              device=qkv.device)
        o, _ = chunk_gated_delta_rule(
            q.unflatten(-1, (nk, self.dk)).transpose(0, 1), k.unflatten(-1, (nk, self.dk)).transpose(0, 1),
            v.unflatten(-1, (nv, self.dv)).transpose(0, 1), g.transpose(0, 1), beta.transpose(0, 1),
            use_qk_l2norm=True, cu_seqlens=cu, chunk_size=self.gdn.chunk_size)
        return o.transpose(0, 1)  # [T, b, nv, dv]

    def _lengths(self, hidden: Tensor, params: PackedSeqParams | None) -> list[int] | None:
        """Global padded sequence lengths of a ``thd`` pack (checked), ``None`` for ``bshd``."""
        if hidden.dim() != 3:
            raise ValueError(f"GatedDeltaNet: hidden_states must be [s, b, h], got {tuple(hidden.shape)}")
        sp = self.tp_size if self.config.sequence_parallel else 1
        s, b = hidden.size(0) * sp, hidden.size(1)
        cp = self.cp_size
        if params is None:
            if cp > 1 and s % 2:
                raise ValueError(f"GatedDeltaNet: with context_parallel_size={cp} the local sequence length "
                                 f"must be even (2 chunks), got {s}")
            return None
        if params.qkv_format != "thd":
            raise ValueError("GatedDeltaNet: packed_seq_params.qkv_format must be 'thd', "
                             f"got {params.qkv_format!r}")
        if b != 1:
            raise ValueError(f"GatedDeltaNet: a thd pack must be hidden_states [t, 1, h], got b={b}")
        name = "cu_seqlens_q_padded" if params.cu_seqlens_q_padded is not None else "cu_seqlens_q"
        cu = getattr(params, name)
        if cu is None or cu.dim() != 1 or cu.numel() < 2:
            raise ValueError(f"GatedDeltaNet: packed_seq_params.{name} must be a 1-D tensor [n + 1]")
        cu = [int(x) for x in cu.tolist()]
        lengths = [hi - lo for lo, hi in zip(cu[:-1], cu[1:], strict=True)]
        multiple = 2 * cp if cp > 1 else 1
        if cu[0] != 0 or cu[-1] != s * cp or any(n < 0 or n % multiple for n in lengths):
            raise ValueError(f"GatedDeltaNet: packed_seq_params.{name} must run from 0 to the global pack "
                             f"size {s} * context_parallel_size {cp} in steps that are non-negative "
                             f"multiples of {multiple}, got {cu}")
        return lengths

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """TP-sharded along dim 0: ``A_log``, ``dt_bias``, ``conv1d.weight`` and the projections; the
        ``in_proj_qkv`` / ``conv1d`` shards split into ``.q`` / ``.k`` / ``.v`` pieces
        (:func:`~mcore_engine.layers.gdn_checkpoint.split_blocks`), so a checkpoint reshards to any TP
        size (each piece is head-contiguous over the ranks)."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        state: dict = {}
        self._save_to_state_dict(state, "", keep_vars=True)
        state = make_sharded_tensors_for_checkpoint(state, prefix, {"A_log": 0, "dt_bias": 0},
                                                    sharded_offsets, tp_group=self.tp_group,
                                                    dp_cp_group=metadata["dp_cp_group"])
        for name, module in self.named_children():
            if name == "conv1d":
                state.update(make_sharded_tensors_for_checkpoint(
                    module.state_dict(prefix="", keep_vars=True), f"{prefix}{name}.", {"weight": 0},
                    sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"]))
            else:
                state.update(sharded_state_dict_default(module, f"{prefix}{name}.", sharded_offsets, metadata,
                                                        tp_group=self.tp_group))
        sections = [self.nk * self.dk, self.nk * self.dk, self.nv * self.dv]
        for key in ("in_proj_qkv.weight", "conv1d.weight"):
            state[f"{prefix}{key}"] = split_blocks(state[f"{prefix}{key}"], sections, ("q", "k", "v"))
        return state
