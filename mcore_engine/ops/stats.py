"""Per-row statistics of a chunk ``x [c, V_valid]``, forward and backward: the torch reference of
``mcore_engine_kernels.layout``'s definitions. ``z - m`` is floored at ``ZM_FLOOR`` (a ``-inf`` logit
adds 0 and gets log-prob ~ -1.8e19). Workspace: two fp32 ``[c, V_valid]`` buffers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from mcore_engine_kernels.layout import TAIL_EPS, ZM_FLOOR, Coefficients, StatLayout


def local_columns(ids: torch.Tensor, offset: int, v_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids ``[c, n]`` -> (column clamped into this shard ``[c, n]``, in-shard mask ``[c, n]``)."""
    local = ids - offset
    inside = (local >= 0) & (local < v_valid)
    return local.clamp(0, max(v_valid - 1, 0)), inside


def row_max(x: torch.Tensor, t: float | torch.Tensor | None) -> torch.Tensor:
    """``(x / t).amax(-1)`` in fp32 as ``x.amax(-1) / t`` (division by t > 0 is monotone): ``[c]``."""
    if x.shape[-1] == 0:
        return torch.full(x.shape[:-1], float("-inf"), dtype=torch.float32, device=x.device)
    m = x.amax(-1).float()
    return m if t is None else m / t


def shifted(x: torch.Tensor, t: float | torch.Tensor | None, m: torch.Tensor,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """``(x / t - m[:, None]).clamp_min(ZM_FLOOR)`` in fp32 ``[c, V_valid]`` (into ``out`` if given)."""
    if out is None:
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if x.dtype != torch.float32:
        zm = out.copy_(x)
        if t is not None:
            zm.div_(t if not isinstance(t, torch.Tensor) else t[:, None])
        zm.sub_(m[:, None])
    elif t is None:
        zm = torch.sub(x, m[:, None], out=out)
    else:
        zm = torch.div(x, t if not isinstance(t, torch.Tensor) else t[:, None], out=out).sub_(m[:, None])
    return zm.clamp_min_(ZM_FLOOR)


def gather_shifted(zm: torch.Tensor, cols: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """``zm[row, cols]`` where ``inside`` else 0: ``[c, n]`` (``zm`` is finite: see ``shifted``)."""
    if zm.shape[-1] == 0:
        return torch.zeros(cols.shape, dtype=zm.dtype, device=zm.device)
    return zm.gather(1, cols).mul_(inside)


def label_shifted_logit(zm: torch.Tensor, cols: torch.Tensor, inside: torch.Tensor) -> torch.Tensor:
    """The log-prob path's only chunk work: ``z_y - m`` where the label is in this shard, else 0: ``[c]``."""
    return gather_shifted(zm, cols[:, None], inside[:, None])[:, 0]


def chunk_stats(zm: torch.Tensor, layout: StatLayout, out: torch.Tensor, *,
                label: tuple[torch.Tensor, torch.Tensor] | None = None,
                teacher: tuple[torch.Tensor, torch.Tensor] | None = None,
                e: torch.Tensor | None = None) -> torch.Tensor:
    """Fill ``out [c, layout.width]`` from ``zm`` (consumed); label, teacher from :func:`local_columns`."""
    if layout.label:
        out[:, layout.col_label] = label_shifted_logit(zm, *label)
    if layout.k:
        cols, inside = teacher
        out[:, layout.col_teacher:layout.col_tail] = gather_shifted(zm, cols, inside)
    e = torch.exp(zm, out=e) if e is not None else zm.exp()
    out[:, layout.col_sum_e] = e.sum(-1)
    if layout.entropy:
        out[:, layout.col_sum_ez] = zm.mul_(e).sum(-1)
    if layout.sum_pi_squared:
        out[:, layout.col_sum_e2] = torch.mul(e, e, out=zm).sum(-1)
    if layout.tail:
        if e.shape[-1]:
            e.scatter_reduce_(1, cols, (~inside).to(e.dtype), reduce="prod")
        out[:, layout.col_tail] = e.sum(-1)
    return out


def chunk_grad(zm: torch.Tensor, coef: Coefficients, p: torch.Tensor | None = None) -> torch.Tensor:
    """The ``Coefficients`` gradient w.r.t. ``z`` in ``zm``'s (consumed) or ``p``'s storage. ``a_tail``
    (up to ~1e20) is not cancelled: the teacher columns are overwritten with their value without it."""
    inv_s, a, b, mu, c2 = coef.inv_s, coef.a, coef.b, coef.mu, coef.c2
    tail = coef.a_tail is not None and zm.shape[-1] > 0
    a_full = a + coef.a_tail if coef.a_tail is not None else a
    if tail:
        hit = coef.tail_cols >= 0
        tcol = coef.tail_cols.clamp_min(0)
        zt = zm.gather(1, tcol)  # before zm is consumed
    p = (torch.exp(zm, out=p) if p is not None else zm.exp()).mul_(inv_s[:, None])
    if b is None and c2 is None:  # log-probs / KL only: g = p * a, in p's storage
        g = p.mul_(a_full[:, None])
    else:
        g = zm.sub_(mu[:, None]).mul_(b[:, None]).add_(a_full[:, None]) if b is not None \
            else torch.addcmul(a_full[:, None], p, c2[:, None], out=zm)
        if b is not None and c2 is not None:
            g.addcmul_(p, c2[:, None])
        g.mul_(p)
    if tail:
        pt = zt.exp().mul_(inv_s[:, None])
        inner = a[:, None] if b is None else zt.sub_(mu[:, None]).mul_(b[:, None]).add_(a[:, None])
        if c2 is not None:
            inner = inner + pt * c2[:, None]
        g.scatter_reduce_(1, tcol, (~hit).to(g.dtype), reduce="prod")  # 0 at the teacher columns
        g.scatter_add_(1, tcol, pt.mul_(inner).mul_(hit))
    if coef.cols is not None and g.shape[-1]:
        g.scatter_add_(1, coef.cols, coef.vals)
    return g


@dataclass(slots=True)
class Finalized:
    """Per-token outputs and the per-token quantities backward needs (all fp32, ``[N]`` or ``[N, k]``)."""

    outputs: dict[str, torch.Tensor]
    inv_s: torch.Tensor  # 1 / S
    mu: torch.Tensor | None  # A / S  (= sum p z - m)
    s2: torch.Tensor | None  # sum p^2
    kl_w: torch.Tensor | None  # W = sum_{i active} P_i
    kl_p: torch.Tensor | None  # [N, k] P_i * active_i
    tail_r: torch.Tensor | None  # p_tail / q_tail (0 where q_tail was floored)
    tail_p: torch.Tensor | None  # p_tail (0 where q_tail was floored) = tail_r * q_tail
    q: torch.Tensor | None  # [N, k] q_i (tail only)


def finalize(stats: torch.Tensor, layout: StatLayout, *, teacher_log_probs: torch.Tensor | None,
             clamp: float | None) -> Finalized:
    """Global statistics ``[N, width]`` -> outputs and backward's per-token terms::

        logS = log(S); log_probs = (z_y - m) - logS; entropy = logS - A / S; sum_pi2 = B / S**2
        log_q = (z_i - m) - logS;  P = exp(teacher_log_probs);  active_i = log q_i >= c
        KL = sum_i P_i (max(log P_i, c) - max(log q_i, c))   (a term with P_i = 0 counts 0)
        tail: p_t = max(1 - sum P, eps), q_t = max(T / S, eps), KL += p_t log(p_t / q_t)

    with ``eps = TAIL_EPS``: no tail gradient once ``T / S <= eps``.
    """
    s = stats[:, layout.col_sum_e]
    log_s = s.log()
    inv_s = s.reciprocal()
    out: dict[str, torch.Tensor] = {}
    mu = s2 = kl_w = kl_p = tail_r = tail_p = q = None
    if layout.label:
        out["log_probs"] = stats[:, layout.col_label] - log_s
    if layout.entropy:
        mu = stats[:, layout.col_sum_ez] * inv_s
        out["entropy"] = log_s - mu
    if layout.sum_pi_squared:
        s2 = stats[:, layout.col_sum_e2] * inv_s.square()
        out["sum_pi_squared"] = s2
    if layout.k:
        log_q = stats[:, layout.col_teacher:layout.col_tail] - log_s[:, None]
        log_p = teacher_log_probs.float()
        big_p = log_p.exp()
        if clamp is None:
            terms = big_p * (log_p - log_q)
            kl_p = big_p
        else:
            terms = big_p * (log_p.clamp_min(clamp) - log_q.clamp_min(clamp))
            kl_p = big_p * (log_q >= clamp)
        kl = terms.masked_fill_(big_p == 0, 0.0).sum(-1)  # 0 log 0 = 0: teacher ids with log-prob -inf
        kl_w = kl_p.sum(-1)
        q_all = log_q.exp()
        q_s = q_all.sum(-1)
        p_mass = big_p.sum(-1)
        if layout.tail:
            q = q_all
            p_t = (1 - p_mass).clamp_min(TAIL_EPS)
            q_raw = stats[:, layout.col_tail] * inv_s
            q_t = q_raw.clamp_min(TAIL_EPS)
            kl = kl + p_t * (p_t.log() - q_t.log())
            unfloored = q_raw > TAIL_EPS
            tail_r = (p_t / q_t) * unfloored
            tail_p = p_t * unfloored
        out["distillation_losses"] = kl
        out["student_mass"] = q_s
        out["teacher_mass"] = p_mass
    return Finalized(out, inv_s, mu, s2, kl_w, kl_p, tail_r, tail_p, q)


def chunk_coefficients(coef: Coefficients, r0: int, r1: int, offset: int, v_valid: int) -> Coefficients:
    """Rows ``[r0, r1)`` of all rows' coefficients (global ids) in this shard's local columns."""
    cols = vals = tail_cols = None
    if coef.cols is not None:
        cols, inside = local_columns(coef.cols[r0:r1], offset, v_valid)
        vals = coef.vals[r0:r1] * inside
    if coef.tail_cols is not None:
        tail_cols, inside = local_columns(coef.tail_cols[r0:r1], offset, v_valid)
        tail_cols = tail_cols.masked_fill(~inside, -1)
    inv_s, a, b, mu, c2, a_tail = (v[r0:r1] if v is not None else None
                                   for v in (coef.inv_s, coef.a, coef.b, coef.mu, coef.c2, coef.a_tail))
    return Coefficients(inv_s, a, b, mu, c2, cols, vals, a_tail, tail_cols)


def first_occurrence(ids: torch.Tensor) -> torch.Tensor:
    """``[N, k]`` bool: True at the first occurrence of each id in its row (repeats are False)."""
    srt, perm = ids.sort(dim=-1, stable=True)
    first = torch.ones_like(ids, dtype=torch.bool)
    first[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return torch.empty_like(first).scatter_(1, perm, first)


def grad_coefficients(fin: Finalized, grads: Mapping[str, torch.Tensor | None], labels: torch.Tensor | None,
                      ids: torch.Tensor | None) -> Coefficients | None:
    """Upstream ``grads`` by key + :func:`finalize`'s terms -> :class:`Coefficients` (global ids) or None.

    With ``p`` the softmax, ``S`` the teacher ids counted once, ``r = p_t / q_t``::

        d log_prob / dz = onehot(y) - p        -> a -= g_lp;       point (y, g_lp)
        d H / dz        = -p (z - mu)          -> b = -g_H
        d s2 / dz       = 2 p (p - s2)         -> c2 = 2 g_s2;     a -= c2 s2
        d KL / dz       = p W - P 1[active]    -> a += g_kl W;     points (ids, -g_kl P_active)
        tail, j not in S: -r Q_S p_j           -> a_tail = -g_kl r Q_S  (tail_cols: first occurrences)
        tail, j in S:      p_t q_j             -> points += g_kl p_t q
    """
    g_lp, g_h, g_s2, g_kl = (grads.get(k) for k in ("log_probs", "entropy", "sum_pi_squared",
                                                     "distillation_losses"))
    if g_lp is None and g_h is None and g_s2 is None and g_kl is None:
        return None
    n = fin.inv_s.shape[0]
    a = torch.zeros(n, dtype=torch.float32, device=fin.inv_s.device)
    b = -g_h.reshape(n).float() if g_h is not None else None
    c2 = a_tail = tail_ids = None
    cols, vals = [], []
    if g_lp is not None:
        g_lp = g_lp.reshape(n).float()
        a -= g_lp
        cols.append(labels.reshape(n, 1))
        vals.append(g_lp[:, None])
    if g_s2 is not None:
        c2 = 2 * g_s2.reshape(n).float()
        a -= c2 * fin.s2
    if g_kl is not None:
        g_kl = g_kl.reshape(n).float()
        a += g_kl * fin.kl_w
        tv = -fin.kl_p
        if fin.tail_r is not None:
            first = first_occurrence(ids)
            q_once = fin.q * first
            a_tail = -g_kl * fin.tail_r * q_once.sum(-1)
            tv = tv + fin.tail_p[:, None] * q_once
            tail_ids = ids.masked_fill(~first, -1)
        cols.append(ids)
        vals.append(g_kl[:, None] * tv)
    return Coefficients(fin.inv_s, a, b, fin.mu if b is not None else None, c2,
                        torch.cat(cols, 1) if cols else None, torch.cat(vals, 1) if vals else None,
                        a_tail, tail_ids)
