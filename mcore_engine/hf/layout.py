"""Layout transforms between Hugging Face tensors and Megatron tensor-parallel shards (no process groups).

``shard_from_hf`` builds TP rank ``r``'s shard reading only the rows / columns it needs;
``hf_from_gathered`` splits the TP-gathered tensor back. For ``qkv``, with ``G`` groups, ``Q`` query
heads per group and head dim ``d``, rank ``r`` holds ``full[r*n:(r+1)*n]``, ``n = len(full) / tp``::

    full = torch.cat([torch.cat([q[g*Q*d:(g+1)*Q*d], k[g*d:(g+1)*d], v[g*d:(g+1)*d]]) for g in range(G)])

With ``cfg.attention_output_gate`` (Qwen3.5 / Qwen3-Next) a group is ``[q (Q*d); gate (Q*d); k; v]``
(Megatron-Core's order) while Hugging Face's ``q_proj`` holds per head ``[q_h (d); gate_h (d)]``.
The Gated DeltaNet kinds (``hybrid.GDN_KINDS``) are row maps: rank ``r`` reads Hugging Face rows
``perm[r*n:(r+1)*n]`` (one read of their span), the gathered tensor goes back as ``hf[perm] = full``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mcore_engine.config import ModelConfig
from mcore_engine.hf.hybrid import GDN_KINDS, PART_KINDS, row_map
from mcore_engine.hf.mapping import TensorRule, head_dim

# read(name, dim, start, stop) -> rows (dim 0) or columns (dim 1) [start, stop) of an HF tensor,
# or the whole tensor when start and stop are None.
Reader = Callable[..., torch.Tensor]


def _qkv_segments(cfg: ModelConfig, start: int, stop: int) -> list[tuple[int, int, int]]:
    """Rows ``[start, stop)`` of the fused qkv layout as ``(source 0/1/2 = q/k/v, hf_start, hf_stop)``."""
    d, ng = head_dim(cfg), cfg.query_groups
    per_group = cfg.num_attention_heads // ng
    q_rows = per_group * d
    gated = cfg.attention_output_gate
    group_rows = q_rows * (2 if gated else 1) + 2 * d
    segments = []
    for g in range(start // group_rows, min(ng, -(-stop // group_rows))):
        base = g * group_rows
        if gated:  # per head: Megatron rows of q_h at h*d, of gate_h at q_rows + h*d; HF q_proj at 2d*h (+d)
            pieces = [(0, j * d, d, (g * per_group + j) * 2 * d) for j in range(per_group)]
            pieces += [(0, q_rows + j * d, d, (g * per_group + j) * 2 * d + d) for j in range(per_group)]
            pieces += [(1, 2 * q_rows, d, g * d), (2, 2 * q_rows + d, d, g * d)]
        else:
            pieces = [(0, 0, q_rows, g * q_rows), (1, q_rows, d, g * d), (2, q_rows + d, d, g * d)]
        for src, offset, size, hf_base in pieces:
            a, b = max(start, base + offset), min(stop, base + offset + size)
            if a < b:
                segments.append((src, hf_base + a - base - offset, hf_base + b - base - offset))
    return segments


def shard_from_hf(rule: TensorRule, read: Reader, cfg: ModelConfig, tp_rank: int, tp_size: int,
                  local_shape: torch.Size) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard (``local_shape``, stored dtype, zero vocab padding) of ``rule``'s
    parameter: one read per source tensor. Memory: the shard, plus one copy for qkv.
    """
    names = rule.hf_names
    if rule.kind == "replicated":
        return read(names[0])
    if rule.kind == "row":
        n = local_shape[1]
        return read(names[0], 1, tp_rank * n, (tp_rank + 1) * n)
    if rule.kind in ("column", "heads"):
        n = local_shape[0]
        return read(names[0], 0, tp_rank * n, (tp_rank + 1) * n)
    if rule.kind == "gate_up":
        n = local_shape[0] // 2
        return torch.cat([read(name, 0, tp_rank * n, (tp_rank + 1) * n) for name in names])
    if rule.kind == "vocab":
        n = local_shape[0]
        start, stop = tp_rank * n, min((tp_rank + 1) * n, cfg.vocab_size)
        rows = read(names[0], 0, start, max(start, stop))
        pad = rows.new_zeros((n - rows.shape[0], *rows.shape[1:]))
        return torch.cat([rows, pad]) if pad.numel() else rows
    if rule.kind == "qkv":
        n = local_shape[0]
        segments = _qkv_segments(cfg, tp_rank * n, (tp_rank + 1) * n)
        parts = {}
        for src in {s for s, _, _ in segments}:  # one contiguous read per source tensor
            lo = min(a for s, a, _ in segments if s == src)
            hi = max(b for s, _, b in segments if s == src)
            parts[src] = (lo, read(names[src], 0, lo, hi))
        return torch.cat([parts[s][1][a - parts[s][0]:b - parts[s][0]] for s, a, b in segments])
    if rule.kind in GDN_KINDS:
        n = local_shape[0]
        rows = row_map(rule.kind, cfg, tp_size)[tp_rank * n:(tp_rank + 1) * n]
        lo, hi = int(rows.min()), int(rows.max()) + 1
        return read(names[0], 0, lo, hi)[rows - lo]
    raise ValueError(f"rule.kind: unknown kind {rule.kind!r}")


def gathered_names(rule: TensorRule) -> list[str]:
    """The names :func:`hf_from_gathered` gives ``rule``'s tensors (Qwen3-Next part: ``"{name}#{kind}"``)."""
    return [f"{rule.hf_names[0]}#{rule.kind}"] if rule.kind in PART_KINDS else list(rule.hf_names)


def hf_from_gathered(rule: TensorRule, full: torch.Tensor, cfg: ModelConfig,
                     tp_size: int) -> list[tuple[str, torch.Tensor]]:
    """Hugging Face ``(name, tensor)`` pairs from the gathered ``full``: replicated, row and column
    tensors as ``full``, vocab as the view ``full[:vocab_size]``, qkv and gate/up as one new copy.
    """
    names, rest = rule.hf_names, full.shape[1:]
    if rule.kind in ("replicated", "row", "column", "heads"):
        return [(names[0], full)]
    if rule.kind == "vocab":
        return [(names[0], full[:cfg.vocab_size])]
    if rule.kind == "gate_up":
        halves = full.view(tp_size, 2, -1, *rest)
        return [(names[i], halves[:, i].reshape(-1, *rest)) for i in range(2)]
    if rule.kind == "qkv":
        d, ng = head_dim(cfg), cfg.query_groups
        q_rows = cfg.num_attention_heads // ng * d
        if cfg.attention_output_gate:
            q, gate, k, v = full.view(ng, 2 * q_rows + 2 * d, *rest).split([q_rows, q_rows, d, d], dim=1)
            heads = (ng, q_rows // d, 1, d, *rest)
            q = torch.cat([q.reshape(heads), gate.reshape(heads)], dim=2)  # per head [q_h; gate_h]
        else:
            q, k, v = full.view(ng, q_rows + 2 * d, *rest).split([q_rows, d, d], dim=1)
        return [(name, t.reshape(-1, *rest)) for name, t in zip(names, (q, k, v), strict=True)]
    if rule.kind in PART_KINDS:  # one part of a Qwen3-Next tensor: hybrid.assemble_parts writes it back
        return [(f"{names[0]}#{rule.kind}", full)]
    if rule.kind in GDN_KINDS:
        out = torch.empty_like(full)
        out[row_map(rule.kind, cfg, tp_size).to(full.device)] = full
        return [(names[0], out)]
    raise ValueError(f"rule.kind: unknown kind {rule.kind!r}")
