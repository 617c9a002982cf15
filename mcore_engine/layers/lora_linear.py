"""PEFT's LoRA on Megatron-Core's tensor-parallel linears (local spec), sharded like the weights.

Per adapted projection ``p`` (PEFT's separate ``q`` / ``k`` / ``v``, ``o``, ``gate`` / ``up``, ``down``)::

    y_p = x @ W_p.T + b_p + scaling * ((dropout(x) @ A_p.T) @ B_p.T)     # scaling = alpha / rank
    A_p [r, in]: kaiming_uniform_(a=sqrt(5)) over the FULL fan-in;  B_p [out_p, r]: zeros

- column-parallel (``linear_qkv``, ``linear_fc1``, the Gated DeltaNet's ``in_proj_*``): ``A_p``
  replicated, ``B_p`` split on dim 0 like ``W_p`` (:class:`ColumnLayout`: per local query group
  ``[q | k | v]``, with an output gate ``q_proj``'s per-head ``[q_h; g_h]`` into ``[q | gate | k | v]``;
  ``[gate; up]``; GDN ``in_proj_qkv``: rank ``t`` holds ``B``'s rows ``[q_t; k_t; v_t]``).
- row-parallel (``linear_proj``, ``linear_fc2``, GDN ``out_proj``): ``A`` split on dim 1 like ``W``,
  ``B`` replicated; the partial delta joins the base's partial output before its all-reduce / reduce-scatter.

No communication is added: the deltas are computed on the input the base matmul sees, so the base's
backward collective carries both terms. Replicated adapters (column ``A``, row ``B``) get partial
gradients per TP rank and carry :data:`LORA_TP_PARTIAL_GRAD` (the engine SUMs them over TP). Dropout:
column side on the default generator (the same mask on every TP rank), row side in Megatron's TP RNG
tracker (per-rank masks).

Memory: ``r * (in + out_p)`` parameters per projection; saved for backward beyond a frozen base: the
linear's input (all-gathered ``[s, b, H]`` under sequence parallelism), the ``[s, b, r]``
intermediates, with dropout one dropped copy of the input per projection.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import get_pg_rank, get_pg_size
from torch import Tensor

from mcore_engine.config.lora import LoRAConfig
from mcore_engine.layers.gdn_checkpoint import split_blocks

__all__ = ["LORA_TP_PARTIAL_GRAD", "ColumnLayout", "LoRAColumnParallelLinear", "LoRARowParallelLinear",
           "LoRAShard"]

LORA_TP_PARTIAL_GRAD = "lora_tp_partial_grad"
"""Parameter attribute: its gradient is a partial sum on each TP rank; SUM it over the TP group."""


@dataclass(frozen=True)
class ColumnLayout:
    """The FULL output rows of a column-parallel linear as projections, and how TP splits them.

    ``interleaved=False``: ``[p_0 (widths[0] rows); p_1; ...]``, TP splits every projection, rank ``t``
    holding ``[p_0[t]; p_1[t]; ...]`` (SwiGLU ``[gate; up]``, a plain linear: one projection).
    ``interleaved=True``: ``groups`` repetitions of ``[p_0 | p_1 | ...]`` (``widths`` rows each), TP
    splits whole groups (fused qkv: per query group ``[q (np / ng heads) | k | v]``, ``d`` rows a head).
    Either way a projection's rows on rank ``t`` are rows ``[t n, (t + 1) n)`` of its own tensor, except:
    ``blocks`` (one projection, ``groups == 1``): its rows are blocks ``[b_0; b_1; ...]`` of these
    sizes, each TP-split, rank ``t`` holding ``[b_0[t]; b_1[t]; ...]`` (Gated DeltaNet ``in_proj_qkv``:
    ``[q; k; v]``); ``output_gate = (Q, d)`` (interleaved, gated attention): projection 0's ``B`` holds
    per head ``[q_h; gate_h]`` (PEFT's ``q_proj``, ``2 d`` rows a head) and lands in the group's
    ``[q (Q d); gate (Q d)]`` rows (Megatron's order).
    """

    projections: tuple[str, ...]
    widths: tuple[int, ...]
    groups: int = 1
    interleaved: bool = False
    blocks: tuple[int, ...] = ()
    output_gate: tuple[int, int] | None = None

    def b_rows(self, projection: str, tp: int, rank: int) -> Tensor | None:
        """Rows of the projection's FULL ``B`` that TP rank ``rank`` holds, in its order; None: the
        contiguous slice ``chunk(tp)[rank]``."""
        if not self.blocks or projection != self.projections[0]:
            return None
        starts = [sum(self.blocks[:i]) for i in range(len(self.blocks))]
        return torch.cat([torch.arange(s + rank * (b // tp), s + (rank + 1) * (b // tp))
                          for s, b in zip(starts, self.blocks, strict=True)])

    def local_perm(self, projection: str, local_groups: int) -> Tensor | None:
        """Local output row ``j`` of the projection's slice is row ``perm[j]`` of its local ``B @ A``
        (None: the same order): the output gate's per-head ``[q_h; g_h]`` -> ``[q heads; gate heads]``."""
        if self.output_gate is None or projection != self.projections[0]:
            return None
        heads, d = self.output_gate
        rows = torch.arange(local_groups * heads * 2 * d).view(local_groups, heads, 2, d)
        return rows.transpose(1, 2).reshape(-1)

    def out_features(self, projection: str) -> int:
        """Full rows of one projection."""
        return self.groups * self.widths[self.projections.index(projection)]

    def local(self, tp: int) -> tuple[int, tuple[int, ...]]:
        """``(groups, widths)`` of the TP-local layout; ``ValueError`` when TP does not divide it."""
        if len(self.projections) != len(self.widths) or not self.projections:
            raise ValueError(f"layout: projections {self.projections} and widths {self.widths} differ in "
                             "length")
        if self.blocks:
            if len(self.projections) != 1 or self.groups != 1 or sum(self.blocks) != self.widths[0] \
                    or any(b % tp for b in self.blocks):
                raise ValueError(f"layout: blocks {self.blocks} must be of one projection, add up to its "
                                 f"width {self.widths} and each be divisible by the tensor-parallel size "
                                 f"{tp}")
            return 1, (self.widths[0] // tp,)
        gate = self.output_gate
        if gate is not None and (not self.interleaved or 2 * gate[0] * gate[1] != self.widths[0]):
            raise ValueError(f"layout: output_gate {gate} needs an interleaved layout whose first width is "
                             f"2 * heads * head_dim, got widths {self.widths}")
        if self.interleaved:
            if self.groups % tp:
                raise ValueError(f"layout.groups={self.groups} (num_query_groups) is not divisible by the "
                                 f"tensor-parallel size {tp}: per-projection adapters need whole groups "
                                 "per rank")
            return self.groups // tp, self.widths
        if self.groups != 1 or any(w % tp for w in self.widths):
            raise ValueError(f"layout: widths {self.widths} (groups {self.groups}) not divisible by the "
                             f"tensor-parallel size {tp}")
        return 1, tuple(w // tp for w in self.widths)


@dataclass(frozen=True)
class LoRAShard:
    """One projection's adapter on this TP rank: detached views of the parameters (no copies)."""

    a: Tensor
    """This rank's ``A`` (full ``[r, in]``)."""
    b: Tensor
    """This rank's ``B`` (full ``[out, r]``)."""
    a_tp_dim: int | None
    """Dim of the full ``A`` split evenly over TP (rank order), None: replicated."""
    b_tp_dim: int | None
    """Same for ``B``."""
    b_rows: Tensor | None = None
    """Row ``j`` of the TP-gathered ``B`` is row ``b_rows[j]`` of the full ``B`` (None: the same row)."""

    def full_b(self, gathered: Tensor) -> Tensor:
        """The full ``B`` (PEFT's row order) from the TP-gathered one."""
        if self.b_rows is None:
            return gathered
        out = torch.empty_like(gathered)
        out[self.b_rows.to(gathered.device)] = gathered
        return out


def _generator(seed: int, name: str, projection: str) -> torch.Generator:
    """A CPU generator seeded from ``(seed, name, projection)`` (stable across processes)."""
    digest = hashlib.sha256(f"{seed}/{name}/{projection}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def _draw_full(a_shape: tuple[int, int], b_shape: tuple[int, int], init: bool | str, rank: int,
               g: torch.Generator) -> tuple[Tensor, Tensor]:
    """PEFT's init of the FULL fp32 ``A`` / ``B``: True: A kaiming-uniform(a=sqrt 5), B zero; "gaussian":
    A ~ N(0, 1/r), B zero; False: both kaiming-uniform (``nn.Linear``'s default; for tests)."""
    a = torch.empty(a_shape)
    if init == "gaussian":
        a.normal_(0.0, 1.0 / rank, generator=g)
    else:
        torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=g)
    b = torch.zeros(b_shape)
    if init is False:
        torch.nn.init.kaiming_uniform_(b, a=math.sqrt(5), generator=g)
    return a, b


def _hyper(rank: int, alpha: float, dropout: float, init_lora_weights: bool | str) -> LoRAConfig:
    """The config's rules for rank / alpha / dropout (and its ``scaling``); ``ValueError`` naming them."""
    if init_lora_weights not in (True, False, "gaussian"):
        raise ValueError(f"init_lora_weights must be True, False or 'gaussian', got {init_lora_weights!r}")
    return LoRAConfig(rank=rank, alpha=alpha, dropout=dropout, target_modules="all-linear")


class _LoRA:
    """What both wrappers share; ``lora_A`` / ``lora_B``: ``ParameterDict`` keyed by projection."""

    lora_A: torch.nn.ParameterDict
    lora_B: torch.nn.ParameterDict
    _A_TP_DIM: int | None
    _B_TP_DIM: int | None

    def _init_lora(self, targets: tuple[str, ...], shapes: dict[str, tuple[int, int]], *, hyper: LoRAConfig,
                   seed: int, name: str, init_lora_weights: bool | str) -> None:
        """Draw each projection's full ``A [r, in]`` / ``B [out, r]`` (``shapes[p] = (out, in)``) and keep
        this rank's slices as parameters in the base weight's dtype and device."""
        rank = hyper.rank
        self.lora_rank, self.lora_alpha, self.lora_scaling = rank, hyper.alpha, hyper.scaling
        self.lora_dropout, self.lora_name, self.lora_targets = float(hyper.dropout), name, targets
        self.lora_enabled = True
        self.lora_layer: int | None = None  # global layer index, set by apply_lora
        self._lora_shapes = shapes
        ref = self.weight
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        tp, tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        for p in targets:
            out_f, in_f = shapes[p]
            a, b = _draw_full((rank, in_f), (out_f, rank), init_lora_weights, rank, _generator(seed, name, p))
            for which, full, dim in (("A", a, self._A_TP_DIM), ("B", b, self._B_TP_DIM)):
                local = self._local(p, which, full, dim, tp, tp_rank)
                param = torch.nn.Parameter(local.to(device=ref.device, dtype=ref.dtype).contiguous())
                set_tensor_model_parallel_attributes(param, dim is not None, -1 if dim is None else dim, 1)
                param.allreduce = True
                if dim is None:  # replicated: each TP rank's gradient is a partial sum
                    setattr(param, LORA_TP_PARTIAL_GRAD, True)
                (self.lora_A if which == "A" else self.lora_B)[p] = param

    def _local(self, p: str, which: str, full: Tensor, dim: int | None, tp: int, tp_rank: int) -> Tensor:
        """This rank's slice of a FULL ``A`` / ``B`` (``B`` of a block layout: its rows)."""
        rows = getattr(self, "_lora_layout", None)
        rows = rows.b_rows(p, tp, tp_rank) if rows is not None and which == "B" else None
        if rows is not None:
            return full[rows.to(full.device)]
        return full if dim is None else full.chunk(tp, dim)[tp_rank]

    # --- accessors -----------------------------------------------------------------------------------
    def adapter_shards(self) -> dict[str, LoRAShard]:
        """Projection -> this rank's ``A`` / ``B`` (detached views), their TP-split dims and, for a block
        layout, the full rows of the TP-gathered ``B``."""
        layout, tp = getattr(self, "_lora_layout", None), get_pg_size(self.tp_group)
        out = {}
        for p in self.lora_targets:
            rows = None if layout is None or layout.b_rows(p, tp, 0) is None else \
                torch.cat([layout.b_rows(p, tp, t) for t in range(tp)])
            out[p] = LoRAShard(self.lora_A[p].detach(), self.lora_B[p].detach(), self._A_TP_DIM,
                               self._B_TP_DIM, rows)
        return out

    def full_shapes(self, projection: str) -> tuple[tuple[int, int], tuple[int, int]]:
        """Full (unsharded) shapes ``([r, in], [out, r])`` of one projection's ``A`` and ``B``."""
        out_f, in_f = self._lora_shapes[projection]
        return (self.lora_rank, in_f), (out_f, self.lora_rank)

    @torch.no_grad()
    def load_full(self, projection: str, a: Tensor, b: Tensor) -> None:
        """Copy this rank's slices of a projection's FULL ``A [r, in]`` and ``B [out, r]`` (PEFT's
        orientation) into the adapter; ``ValueError`` on an unknown projection or a wrong shape."""
        if projection not in self.lora_targets:
            raise ValueError(f"projection {projection!r} has no adapter here (adapted: {self.lora_targets})")
        tp, tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        for which, full, shape, dim in (("A", a, self.full_shapes(projection)[0], self._A_TP_DIM),
                                        ("B", b, self.full_shapes(projection)[1], self._B_TP_DIM)):
            if tuple(full.shape) != shape:
                raise ValueError(f"{self.lora_name}.{projection}: full {which} has shape "
                                 f"{tuple(full.shape)}, expected {shape}")
            local = self._local(projection, which, full, dim, tp, tp_rank)
            (self.lora_A if which == "A" else self.lora_B)[projection].copy_(local)

    def _lora_repr(self) -> str:
        return (f"LoRA(r={self.lora_rank}, alpha={self.lora_alpha}, dropout={self.lora_dropout}, "
                f"targets={self.lora_targets}, enabled={self.lora_enabled})")

    def _sharded_lora_state_dict(self, axes: dict[str, int], prefix: str, sharded_offsets, metadata):
        for p in self.lora_targets:
            for which, dim in (("A", self._A_TP_DIM), ("B", self._B_TP_DIM)):
                if dim is not None:
                    axes[f"lora_{which}.{p}"] = dim
        state = self.state_dict(prefix="", keep_vars=True)
        for p in getattr(self, "_lora_shared_a", ()):  # another linear's A (layers.lora.apply_lora's
            del state[f"lora_A.{p}"]                   # shared_a): checkpointed once, by its owner
        groups = {"tp_group": self.tp_group, "dp_cp_group": metadata["dp_cp_group"]}
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, **groups)


def _check_base(base: torch.nn.Module, cls: type) -> None:
    if type(base) is not cls:
        raise ValueError(f"LoRA wraps Megatron's {cls.__name__} of the local spec exactly; got "
                         f"{type(base).__name__} (Transformer Engine / other linears are not supported)")
    if base.is_expert:
        raise ValueError("LoRA on MoE expert linears (is_expert=True) is not supported")
    if getattr(base, "gtp_remat_size", 1) != 1:
        raise ValueError("LoRA on linears with GTP weight rematerialisation is not supported")


class LoRAColumnParallelLinear(_LoRA, ColumnParallelLinear):
    """A ``ColumnParallelLinear`` with per-projection LoRA adapters (``A_p`` replicated, ``B_p`` split
    on dim 0); same forward signature and ``(output, bias)``. Made by :meth:`from_base`, which converts
    the base module in place: its parameters, names and hooks are unchanged, the adapters are
    ``lora_A.<p>`` / ``lora_B.<p>``."""

    _A_TP_DIM, _B_TP_DIM = None, 0

    @classmethod
    def from_base(cls, base: ColumnParallelLinear, *, layout: ColumnLayout, targets: Iterable[str], rank: int,
                  alpha: float, seed: int, name: str, dropout: float = 0.0,
                  init_lora_weights: bool | str = True) -> LoRAColumnParallelLinear:
        """Convert ``base`` in place (and return it); ``name`` (with ``seed``) seeds the adapters, e.g.
        ``decoder.layers.<global layer>.self_attention.linear_qkv``. ``ValueError`` before any change
        for a base that is not a plain local-spec ``ColumnParallelLinear`` or a layout / target mismatch."""
        _check_base(base, ColumnParallelLinear)
        hyper = _hyper(rank, alpha, dropout, init_lora_weights)
        targets = set(targets)
        if not targets or not targets <= set(layout.projections):
            raise ValueError(f"targets {sorted(targets)} must be a non-empty subset of {layout.projections}")
        groups, widths = layout.local(get_pg_size(base.tp_group))
        if groups * sum(widths) != base.output_size_per_partition:
            raise ValueError(f"layout {layout} gives {groups * sum(widths)} local rows, the linear has "
                             f"{base.output_size_per_partition}")
        if base.weight is None:
            raise ValueError("LoRA needs the linear's own weight (skip_weight_param_allocation is not "
                             "supported)")
        base.__class__ = cls
        base._lora_groups, base._lora_widths = groups, widths
        base._lora_offsets = {p: sum(widths[:i]) for i, p in enumerate(layout.projections)}
        base._lora_local_width = dict(zip(layout.projections, widths, strict=True))
        base._lora_layout = layout
        perms = {p: layout.local_perm(p, groups) for p in layout.projections}
        base._lora_perm = {p: None if t is None else t.to(base.weight.device) for p, t in perms.items()}
        ordered = tuple(p for p in layout.projections if p in targets)
        shapes = {p: (layout.out_features(p), base.input_size) for p in ordered}
        base._init_lora(ordered, shapes, hyper=hyper, seed=seed, name=name,
                        init_lora_weights=init_lora_weights)
        return base

    def _hidden(self, x: Tensor) -> dict[str, Tensor]:
        """``u_p = dropout_p(x) @ A_p.T`` per adapted projection (one matmul when nothing is dropped)."""
        names = self.lora_targets
        x = x.to(self.lora_A[names[0]].dtype)
        if self.training and self.lora_dropout > 0:  # default generator: the same mask on every TP rank
            return {p: F.linear(F.dropout(x, self.lora_dropout, True), self.lora_A[p]) for p in names}
        if len(names) == 1:
            return {names[0]: F.linear(x, self.lora_A[names[0]])}
        u = F.linear(x, torch.cat([self.lora_A[p] for p in names]))
        return dict(zip(names, u.split(self.lora_rank, dim=-1), strict=True))

    def forward(self, input_: Tensor, weight: Tensor | None = None,
                runtime_gather_output: bool | None = None) -> tuple[Tensor, Tensor | None]:
        """Base output plus ``scaling * B_p (A_p x)`` in each adapted projection's local rows; disabled:
        exactly ``ColumnParallelLinear.forward``."""
        if not self.lora_enabled:
            return super().forward(input_, weight, runtime_gather_output)
        if weight is None:
            weight = self.weight
        elif weight.shape != self.weight.shape:
            raise RuntimeError(f"supplied weight's shape is {tuple(weight.shape)}, not "
                               f"{tuple(self.weight.shape)}")
        # --- 1. the input the base matmul sees (the base's own collective: backward all-reduce / RS) ---
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(input_, tensor_parallel_output_grad=True,
                                                     group=self.tp_group)
        elif self.disable_grad_reduce:
            x = input_
        else:
            x = copy_to_tensor_model_parallel_region(input_, group=self.tp_group)
        # --- 2. base, as Megatron's linear functions compute it ---
        out = torch.matmul(x, weight.t())
        if self.bias is not None and not self.skip_bias_add:
            out = out + self.bias
        # --- 3. deltas into their slices of the local layout [.., groups, sum(widths)] ---
        view = out.view(*out.shape[:-1], self._lora_groups, sum(self._lora_widths))
        for p, u in self._hidden(x).items():
            delta = F.linear(u, self.lora_B[p]).mul_(self.lora_scaling).to(out.dtype)
            if self._lora_perm.get(p) is not None:  # PEFT's per-head [q_h; g_h] -> [q heads; gate heads]
                delta = delta.index_select(-1, self._lora_perm[p])
            off, w = self._lora_offsets[p], self._lora_local_width[p]
            view[..., off:off + w].add_(delta.view(*delta.shape[:-1], self._lora_groups, w))
        # --- 4. the base's output handling ---
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            out = gather_from_tensor_model_parallel_region(out, group=self.tp_group)
        return out, (self.bias if self.skip_bias_add else None)

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """This rank's ``W + scaling * B_p A_p`` (every adapted projection) in the base's local layout and
        dtype, computed in fp32 (fp64 for an fp64 base); a new tensor."""
        w = self.weight.detach()
        acc = torch.float64 if w.dtype == torch.float64 else torch.float32
        merged = w.to(acc, copy=True)
        view = merged.view(self._lora_groups, sum(self._lora_widths), w.shape[1])
        for p in self.lora_targets:
            delta = (self.lora_B[p].to(acc) @ self.lora_A[p].to(acc)) * self.lora_scaling
            if self._lora_perm.get(p) is not None:
                delta = delta.index_select(0, self._lora_perm[p])
            off, width = self._lora_offsets[p], self._lora_local_width[p]
            view[:, off:off + width].add_(delta.view(self._lora_groups, width, -1))
        return merged.to(w.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's (weight / bias split on dim 0) plus ``lora_B.<p>`` split on dim 0 (``lora_A``
        replicated; a block layout's ``B`` saved block by block, so it reshards like the weight)."""
        state = self._sharded_lora_state_dict({"weight": 0, "bias": 0}, prefix, sharded_offsets, metadata)
        layout, tp = self._lora_layout, get_pg_size(self.tp_group)
        for p in self.lora_targets:  # a block layout's B: one TP-split tensor per block (reshardable)
            if layout.b_rows(p, tp, 0) is not None:
                key = f"{prefix}lora_B.{p}"
                state[key] = split_blocks(state[key], [b // tp for b in layout.blocks],
                                          [f"block{i}" for i in range(len(layout.blocks))])
        return state

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, {self._lora_repr()})")


class LoRARowParallelLinear(_LoRA, RowParallelLinear):
    """A ``RowParallelLinear`` with one LoRA adapter (``A`` split on dim 1, ``B`` replicated); same forward
    and ``(output, bias)``. Made by :meth:`from_base` (converts the base in place, as the column one)."""

    _A_TP_DIM, _B_TP_DIM = 1, None

    @classmethod
    def from_base(cls, base: RowParallelLinear, *, projection: str, rank: int, alpha: float, seed: int,
                  name: str, dropout: float = 0.0,
                  init_lora_weights: bool | str = True) -> LoRARowParallelLinear:
        """Convert ``base`` in place (and return it); see :meth:`LoRAColumnParallelLinear.from_base`."""
        _check_base(base, RowParallelLinear)
        hyper = _hyper(rank, alpha, dropout, init_lora_weights)
        base.__class__ = cls
        base._init_lora((projection,), {projection: (base.output_size, base.input_size)}, hyper=hyper,
                        seed=seed, name=name, init_lora_weights=init_lora_weights)
        return base

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:
        """Partial ``x_t W_t.T + scaling * (x_t A_t.T) B.T``, then the base's all-reduce / reduce-scatter
        and bias; disabled: exactly ``RowParallelLinear.forward``."""
        if not self.lora_enabled:
            return super().forward(input_)
        (p,) = self.lora_targets
        # --- 1. this rank's input features ---
        x = input_
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        # --- 2. base partial + LoRA partial ---
        out = torch.matmul(x, self.weight.t())
        xa = x.to(self.lora_A[p].dtype)
        if self.training and self.lora_dropout > 0:  # split features: this TP rank's own stream
            with get_cuda_rng_tracker().fork():
                xa = F.dropout(xa, self.lora_dropout, True)
        delta = F.linear(F.linear(xa, self.lora_A[p]), self.lora_B[p]).mul_(self.lora_scaling)
        out.add_(delta.to(out.dtype))
        # --- 3. the base's reduction and bias ---
        if self.sequence_parallel:
            out = reduce_scatter_to_sequence_parallel_region(out, group=self.tp_group)
        else:
            out = reduce_from_tensor_model_parallel_region(out, group=self.tp_group)
        if self.skip_bias_add:
            return out, self.bias
        return (out + self.bias if self.bias is not None else out), None

    @torch.no_grad()
    def merged_weight(self) -> Tensor:
        """This rank's ``W_t + scaling * B A_t`` (local ``[out, in / tp]``, base dtype; fp32 math)."""
        (p,) = self.lora_targets
        w = self.weight.detach()
        acc = torch.float64 if w.dtype == torch.float64 else torch.float32
        delta = (self.lora_B[p].to(acc) @ self.lora_A[p].to(acc)) * self.lora_scaling
        return (w.to(acc) + delta).to(w.dtype)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Megatron's (weight split on dim 1) plus ``lora_A.<p>`` split on dim 1, ``lora_B`` replicated."""
        return self._sharded_lora_state_dict({"weight": 1}, prefix, sharded_offsets, metadata)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, {self._lora_repr()})")
