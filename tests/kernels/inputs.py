"""Shared pieces of the kernel tests: device, inputs in the ops' shard geometry, float64 references."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16


def temperature_rows(kind: str, rows: int, gen: torch.Generator) -> float | torch.Tensor | None:
    """The three temperature forms the ops hand to a chunk: None (unit), a float, a per-row fp32 [c]."""
    if kind == "none":
        return None
    if kind == "float":
        return 0.7
    return (torch.rand(rows, generator=gen) + 0.5).to(DEVICE)


def chunk_inputs(seed: int, rows: int, v_local: int, v_valid: int, dtype: torch.dtype, k: int,
                 offset: int, vocab: int) -> dict:
    """A logits chunk ``x = full[:, :v_valid]`` (a strided view, as the ops slice it), global labels and
    distinct teacher ids drawn over ``[0, vocab)`` (some in this shard ``[offset, offset + v_valid)``)."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(rows, v_local, generator=g, dtype=torch.float64) * 2.5).to(dtype).to(DEVICE)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    # Force about half of the labels and teacher ids into this shard.
    local = torch.randint(0, v_valid, (rows,), generator=g) + offset
    labels = torch.where(torch.rand(rows, generator=g) < 0.5, local, labels)
    ids = torch.rand(rows, vocab, generator=g).argsort(-1)[:, :k]
    ids[:, : k // 2] = torch.rand(rows, v_valid, generator=g).argsort(-1)[:, : k // 2] + offset
    return dict(full=full, x=full[:, :v_valid], labels=labels.to(DEVICE), ids=ids.to(DEVICE), gen=g)


def reference_stats64(x: torch.Tensor, t, m: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor,
                      offset: int) -> dict[str, torch.Tensor]:
    """Float64 statistics of a chunk from their definitions (ops/stats.py docstring), by name."""
    tt = 1.0 if t is None else (t.double()[:, None] if isinstance(t, torch.Tensor) else t)
    zm = x.double() / tt - m.double()[:, None]
    e = zm.exp()
    v_valid = x.shape[1]

    def point(gid: torch.Tensor) -> torch.Tensor:
        col = gid - offset
        inside = (col >= 0) & (col < v_valid)
        return torch.where(inside, zm.gather(1, col.clamp(0, v_valid - 1)), 0.0)

    in_teacher = torch.zeros_like(e, dtype=torch.bool)
    for i in range(ids.shape[1]):
        col = ids[:, i] - offset
        inside = (col >= 0) & (col < v_valid)
        in_teacher |= (torch.arange(v_valid, device=x.device)[None, :] == col[:, None]) & inside[:, None]
    return dict(S=e.sum(-1), A=(e * zm).sum(-1), B=(e * e).sum(-1), y=point(labels[:, None])[:, 0],
                teacher=point(ids), tail=(e * ~in_teacher).sum(-1))
