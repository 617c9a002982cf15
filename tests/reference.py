"""Float64 references for the tests, written from the formulas in a different form than the code.

``reference_logits_outputs`` computes every per-token output of ``mcore_engine.ops`` on the full
(gathered) logits ``[..., V]``. The loss references: aggregation loops over sequences in Python; PPO
uses the closed form ``-A * min(r, 1 + hi)`` for ``A >= 0`` and ``|A| * min(max(r, 1 - lo), c)`` for
``A < 0``; distillation works on the full logits with ``log_softmax`` and takes the tail mass as the
sum of q outside the top-k set. All are differentiable in float64 (pass float64 leaves).
"""

from __future__ import annotations

from typing import Any

import torch


def reference_logits_outputs(
    logits: torch.Tensor, *, labels: torch.Tensor | None = None, teacher_ids: torch.Tensor | None = None,
    teacher_log_probs: torch.Tensor | None = None, entropy: bool = False, sum_pi_squared: bool = False,
    kl_tail: bool = False, log_prob_min_clamp: float | None = None, temperature: Any = 1.0,
    vocab_size: int | None = None, dtype: torch.dtype = torch.float64,
) -> dict[str, torch.Tensor]:
    """Float64 reference of ``mcore_engine.ops`` on the full (gathered) logits ``[..., V]``.

    Differentiable w.r.t. ``logits`` (pass a float64 leaf). Padded ids (>= vocab_size) are sliced off.
    ``dtype=torch.float32``: the same formulas in plain fp32 (a naive implementation's error budget).
    """
    v = logits.shape[-1] if vocab_size is None else vocab_size
    t = temperature
    if isinstance(t, torch.Tensor):
        t = t.to(dtype)
        t = t.unsqueeze(-1) if t.dim() else t
    z = logits.to(dtype)[..., :v] / t
    logp = z - z.logsumexp(-1, keepdim=True)
    p = logp.exp()
    out: dict[str, torch.Tensor] = {}
    if labels is not None:
        out["log_probs"] = logp.gather(-1, labels[..., None])[..., 0]
    if entropy:
        out["entropy"] = -(p * logp).sum(-1)  # = lse - sum p z, without the large-|z| cancellation
    if sum_pi_squared:
        out["sum_pi_squared"] = (p * p).sum(-1)
    if teacher_ids is not None:
        log_q = logp.gather(-1, teacher_ids)
        log_p = teacher_log_probs.to(dtype)
        big_p = log_p.exp()
        c = log_prob_min_clamp
        if c is None:
            terms = big_p * (log_p - log_q)
        else:
            terms = big_p * (log_p.clamp_min(c) - log_q.clamp_min(c))
        kl = torch.where(big_p > 0, terms, 0.0).sum(-1)  # 0 log 0 = 0
        if kl_tail:
            p_t = (1 - big_p.sum(-1)).clamp_min(1e-20)
            outside = torch.ones_like(p, dtype=torch.bool).scatter_(-1, teacher_ids, False)
            q_t = (p * outside).sum(-1).clamp_min(1e-20)  # a repeated id counts once
            kl = kl + p_t * (p_t.log() - q_t.log())
        out["distillation_losses"] = kl
        out["student_mass"] = log_q.exp().sum(-1).detach()
        out["teacher_mass"] = big_p.sum(-1)
    return out


def ref_agg(values, mask, seq_ids, mode, num_tokens, num_seqs):
    """verl's ``agg_loss`` with global normalisers, one Python loop over the sequences; values at
    ``mask == 0`` are ignored (may be NaN); float masks are weights."""
    values, mask = values.double(), mask.double()
    values = torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype))
    if mode == "token-mean":
        return values.sum() / num_tokens
    total = values.new_zeros(())
    for s in torch.unique(seq_ids).tolist():
        sel = seq_ids == s
        tok_sum = values[sel].sum()
        count = mask[sel].sum()
        if mode == "seq-mean-token-sum":
            total = total + tok_sum
        elif count > 0:
            total = total + tok_sum / count
    return total / num_seqs


def ref_ppo_tokens(lp, olp, adv, lo, hi, c):
    """Per-token dual-clip PPO loss and the clip indicators, float64."""
    lp, olp, adv = lp.double(), olp.double(), adv.double()
    r = torch.exp((lp - olp).clamp(-20, 20))
    pos = -adv * torch.minimum(r, torch.full_like(r, 1 + hi))
    neg = adv.abs() * torch.minimum(torch.maximum(r, torch.full_like(r, 1 - lo)), torch.full_like(r, c))
    loss = torch.where(adv >= 0, pos, neg)
    clipped = ((adv > 0) & (r > 1 + hi)) | ((adv < 0) & (r < 1 - lo))
    lower = (adv < 0) & (torch.maximum(r, torch.full_like(r, 1 - lo)) > c)
    return loss, clipped.double(), lower.double(), -(lp - olp).clamp(-20, 20)


def ref_kl(lp, ref, kind):
    lp, ref = lp.double(), ref.double()
    if kind == "k1":
        return lp - ref
    d = (ref - lp).clamp(-20, 20)
    return (torch.exp(d) - 1 - d).clamp(max=10)


def make_teacher(n: int, vocab: int, k: int, generator: torch.Generator, sharpness: float = 2.0,
                 random_ids: bool = False):
    """Teacher ids [n, k] and their log-probs [n, k] (float32) under a random teacher softmax: its
    top-k (sorted), or ``k`` random distinct ids per row with ``random_ids``."""
    t_logits = torch.randn(n, vocab, generator=generator, dtype=torch.float64) * sharpness
    logp = torch.log_softmax(t_logits, -1)
    if random_ids:
        ids = torch.stack([torch.randperm(vocab, generator=generator)[:k] for _ in range(n)])
        return ids, logp.gather(-1, ids).float()
    vals, ids = logp.topk(k, dim=-1)
    return ids, vals.float()


def ref_forward_kl_topk(logits, ids, tlp, *, clamp=None, tail=False, vocab_size=None):
    """Per-token outputs of the top-k forward KL on full logits [..., V] (float64, differentiable)."""
    z = logits.double()
    if vocab_size is not None:
        z = z[..., :vocab_size]
    logq = torch.log_softmax(z, -1)
    lq = logq.gather(-1, ids)
    p = tlp.double().exp()
    lp = tlp.double()
    if clamp is not None:
        lp, lq_c = lp.clamp(min=clamp), lq.clamp(min=clamp)
    else:
        lq_c = lq
    kl = (p * (lp - lq_c)).sum(-1)
    if tail:
        outside = torch.ones_like(z, dtype=torch.bool).scatter(-1, ids, False)
        q_tail = (logq.exp() * outside).sum(-1)
        p_tail = 1 - p.sum(-1)
        kl = kl + p_tail * torch.log(p_tail / q_tail)
    student_top = logq.detach().topk(ids.shape[-1], dim=-1).indices
    overlap = (ids[..., :, None] == student_top[..., None, :]).any(-1).double().mean(-1)
    return {"distillation_losses": kl, "student_mass": lq.detach().exp().sum(-1),
            "teacher_mass": p.sum(-1), "topk_overlap": overlap}


def random_packed_batch(num_seqs: int, generator: torch.Generator, max_len: int = 9):
    """seq_ids [T] of a packed batch with random lengths (>= 1) and a loss mask with some empty seqs."""
    lengths = torch.randint(1, max_len + 1, (num_seqs,), generator=generator)
    seq_ids = torch.repeat_interleave(torch.arange(num_seqs), lengths)
    mask = torch.rand(seq_ids.numel(), generator=generator) < 0.7
    mask[seq_ids == 0] = False                      # one sequence without any loss token
    return seq_ids, mask


def random_split(num_seqs: int, parts: int, generator: torch.Generator) -> list[torch.Tensor]:
    """A random partition of the sequence indices into ``parts`` groups (some may be empty)."""
    perm = torch.randperm(num_seqs, generator=generator)
    owner = torch.randint(0, parts, (num_seqs,), generator=generator)
    return [perm[owner[perm] == i] for i in range(parts)]


def micro_batches(seq_ids: torch.Tensor, parts: int, generator: torch.Generator,
                  with_empty: bool = False) -> list[torch.Tensor]:
    """Token indices of a random split of the sequences into ``parts`` micro-batches (whole
    sequences, tokens shuffled inside each), plus one empty micro-batch at a random place."""
    num_seqs = int(seq_ids.max()) + 1
    out = []
    for seqs in random_split(num_seqs, parts, generator):
        idx = torch.nonzero(torch.isin(seq_ids, seqs)).flatten()
        out.append(idx[torch.randperm(idx.numel(), generator=generator)])
    if with_empty:
        out.insert(int(torch.randint(0, len(out) + 1, (1,), generator=generator)),
                   torch.zeros(0, dtype=torch.int64))
    return out


def ppo_inputs(t: int, generator: torch.Generator):
    """(log_probs, old_log_probs, advantages) [t], float64, with log-ratios inside the clip, beyond
    ``1 +- eps``, beyond the dual clip ``c = 3`` (log 3 = 1.1) and beyond the +-20 clamp."""
    adv = torch.randn(t, generator=generator, dtype=torch.float64) * 1.5
    old = -torch.rand(t, generator=generator, dtype=torch.float64) * 4 - 0.05
    log_ratio = torch.randn(t, generator=generator, dtype=torch.float64) * 0.6
    log_ratio[::11] = 25.0 * torch.sign(torch.randn(len(log_ratio[::11]), generator=generator,
                                                    dtype=torch.float64))
    log_ratio[3::7] = 1.6
    return old + log_ratio, old, adv
