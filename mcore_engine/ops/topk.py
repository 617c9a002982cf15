"""Vocab-parallel top-k of the log-softmax over the global vocab (not differentiable).

Per chunk: MAX and SUM all-reduces give the lse; each rank takes its top-min(k, V_valid), padded to
k with (-inf, id 0), and one all-gather of (values, global ids) in float64 lets every rank re-take
the top-k (a pad never wins: real entries are >= ``ZM_FLOOR``). Workspace: fp32 ``[chunk, V_local]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_engine.ops import _common
from mcore_engine.ops import stats as _stats
from mcore_engine.ops.temperature import Temperature, temperature_rows


def vocab_parallel_topk(logits: torch.Tensor, k: int, *, temperature: Temperature = 1.0,
                        group: dist.ProcessGroup | None = None, chunk_size: int | None = None,
                        vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``z.log_softmax(-1).topk(k)`` over the global vocab -> (fp32, global ids int64) ``[..., k]``,
    detached, the same on every rank."""
    group = _common.resolve_group(group)
    shard = _common.make_shard(logits, group, vocab_size)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= shard.vocab_size:
        raise ValueError(f"k must be an int in [1, V_global = {shard.vocab_size}], got {k!r}")
    rows = _common.check_chunk_size(chunk_size, shard.v_local)
    lead = tuple(logits.shape[:-1])
    t_rows = temperature_rows(temperature, lead, logits.device)
    x = _common.flat_rows(logits.detach())
    n = x.shape[0]
    out_lp = torch.empty(n, k, dtype=torch.float32, device=logits.device)
    out_ids = torch.empty(n, k, dtype=torch.int64, device=logits.device)
    kk = min(k, shard.v_valid)
    with torch.no_grad():
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            xc = x[r0:r1, :shard.v_valid]
            tc = t_rows[r0:r1] if isinstance(t_rows, torch.Tensor) else t_rows
            m = _common.all_reduce_(_stats.row_max(xc, tc), dist.ReduceOp.MAX, shard)
            zm = _stats.shifted(xc, tc, m)
            log_s = _common.all_reduce_(zm.exp().sum(-1), dist.ReduceOp.SUM, shard).log_()
            cand = torch.zeros(r1 - r0, 2 * k, dtype=torch.float64, device=x.device)  # pad: (-inf, id 0)
            cand[:, kk:k] = float("-inf")
            if kk:
                vals, idx = zm.topk(kk, dim=-1)
                cand[:, :kk] = vals
                cand[:, k:k + kk] = idx + shard.offset
            if shard.world > 1:
                gathered = [torch.empty_like(cand) for _ in range(shard.world)]
                dist.all_gather(gathered, cand, group=shard.group)
                cand = torch.stack(gathered, 1)  # [c, world, 2k]
            else:
                cand = cand[:, None]
            vals, pos = cand[..., :k].reshape(r1 - r0, -1).topk(k, dim=-1)
            out_lp[r0:r1] = vals.float() - log_s[:, None]
            out_ids[r0:r1] = cand[..., k:].reshape(r1 - r0, -1).gather(1, pos).long()
    return out_lp.view(lead + (k,)), out_ids.view(lead + (k,))
