"""Independent float64 check of ``mcore_engine.losses`` (written without reading the other loss tests).

Every reference below is written from the formulas (verl's conventions) in float64 with plain torch
autograd, on inputs drawn here: values AND gradients (random upstream gradients), every aggregation
mode, random partitions of the sequences into micro-batches (the sum of the contributions must equal
the whole-batch loss and give the whole-batch gradient), odd lengths, masked tokens, fp32 and bf16.
"""

from __future__ import annotations

import math

import pytest
import torch

from mcore_engine.losses import (
    AGG_MODES,
    LossContext,
    agg_loss,
    distillation_ppo_loss,
    forward_kl_topk,
    forward_kl_topk_tail,
    kl_estimator,
    make_forward_kl_topk,
    ppo_policy_loss,
)
from tests.utils import REL_TOL, assert_rel_close

F64 = torch.float64


# ----------------------------------------------------------------------------- float64 references
def ref_agg(values: torch.Tensor, mask: torch.Tensor, seq_of_token: list[int], mode: str, n_tok: float,
            n_seq: float) -> torch.Tensor:
    """verl's agg_loss with global normalisers, one python loop over the sequences (float64)."""
    v = torch.where(mask != 0, values * mask, torch.zeros((), dtype=values.dtype))
    if mode == "token-mean":
        return v.sum() / n_tok
    seqs: dict[int, list[int]] = {}
    for t, s in enumerate(seq_of_token):
        seqs.setdefault(s, []).append(t)
    total = values.new_zeros(())
    for toks in seqs.values():
        idx = torch.tensor(toks)
        seq_sum = v[idx].sum()
        if mode == "seq-mean-token-sum":
            total = total + seq_sum
        else:
            cnt = mask[idx].sum()
            total = total + (seq_sum / cnt if cnt != 0 else seq_sum * 0)
    return total / n_seq


def ref_pg_losses(logp, old, adv, low, high, c):
    """verl compute_policy_loss (vanilla, dual-clip), per token."""
    neg_kl = torch.clamp(logp - old, -20.0, 20.0)
    ratio = torch.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    l3 = -adv * c
    clip2 = torch.min(l3, clip1)
    losses = torch.where(adv < 0, clip2, clip1)
    clipfrac = torch.gt(l2, l1).to(F64)
    clipfrac_lower = (torch.gt(clip1, l3) & (adv < 0)).to(F64)
    return losses, clipfrac, clipfrac_lower, -neg_kl


def ref_kl(logp, ref, kind):
    if kind == "k1":
        return logp - ref
    kl = torch.clamp(ref - logp, -20, 20)
    return torch.clamp(torch.exp(kl) - kl - 1, -10, 10)


def ref_forward_kl(logits: torch.Tensor, ids: torch.Tensor, t_logp: torch.Tensor, *, tail: bool,
                   clamp: float | None) -> dict[str, torch.Tensor]:
    """Top-k forward KL in float64; q_tail from the logsumexp over the complement of S (stable)."""
    lse = torch.logsumexp(logits, -1, keepdim=True)
    log_q = logits.gather(-1, ids) - lse
    p = t_logp.exp()
    if clamp is None:
        terms = p * (t_logp - log_q)
    else:
        terms = p * (torch.clamp(t_logp, min=clamp) - torch.clamp(log_q, min=clamp))
    kl = torch.where(p == 0, torch.zeros_like(terms), terms).sum(-1)
    if tail:
        p_tail = 1 - p.sum(-1)
        outside = logits.scatter(-1, ids, float("-inf"))
        log_q_tail = torch.logsumexp(outside, -1) - lse.squeeze(-1)
        kl = kl + p_tail * (torch.log(p_tail) - log_q_tail)
    s_top = logits.topk(ids.shape[-1], -1).indices
    overlap = (ids[..., :, None] == s_top[..., None, :]).any(-1).to(F64).mean(-1)
    return {"distillation_losses": kl, "student_mass": log_q.exp().sum(-1), "teacher_mass": p.sum(-1),
            "topk_overlap": overlap}


# ----------------------------------------------------------------------------- batch helpers
def make_batch(gen: torch.Generator, n_seqs: int, max_len: int = 13):
    """Odd/ragged sequence lengths, sparse non-dense global seq ids, a mask with holes and one
    fully-masked sequence. Returns (seq_of_token, tokens_of_seq, mask, seq_ids)."""
    lengths = torch.randint(1, max_len + 1, (n_seqs,), generator=gen).tolist()
    seq_of_token = [s for s, n in enumerate(lengths) for _ in range(n)]
    tokens_of_seq, start = [], 0
    for n in lengths:
        tokens_of_seq.append(list(range(start, start + n)))
        start += n
    mask = (torch.rand(len(seq_of_token), generator=gen) > 0.3).to(F64)
    mask[torch.tensor(tokens_of_seq[n_seqs // 2])] = 0          # a sequence without loss tokens
    seq_ids = torch.tensor([7 * s + 1000 for s in seq_of_token], dtype=torch.int64)
    return seq_of_token, tokens_of_seq, mask, seq_ids


def random_partition(gen: torch.Generator, tokens_of_seq: list[list[int]], with_empty: bool = True):
    """Random micro-batches of whole sequences (shuffled order, tokens shuffled inside each micro-batch),
    plus possibly an empty micro-batch. Returns a list of index tensors."""
    n = len(tokens_of_seq)
    perm = torch.randperm(n, generator=gen).tolist()
    n_mb = int(torch.randint(1, n + 1, (1,), generator=gen))
    cuts = sorted(torch.randperm(n - 1, generator=gen)[: n_mb - 1].add(1).tolist()) if n_mb > 1 else []
    bounds = [0, *cuts, n]
    parts = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        toks = [t for s in perm[a:b] for t in tokens_of_seq[s]]
        toks = torch.tensor(toks, dtype=torch.int64)
        parts.append(toks[torch.randperm(len(toks), generator=gen)])
    if with_empty:
        where = int(torch.randint(0, len(parts) + 1, (1,), generator=gen))
        parts.insert(where, torch.zeros(0, dtype=torch.int64))
    return parts


def ctx_for(mask: torch.Tensor, n_seqs: int, distillation_only: bool = False) -> LossContext:
    return LossContext.from_counts(float(mask.sum()), float(n_seqs), distillation_only=distillation_only)


# ----------------------------------------------------------------------------- aggregation
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_any_split(mode, dtype):
    gen = torch.Generator().manual_seed(11 + AGG_MODES.index(mode))
    n_seqs = 9
    seq_of_token, tokens_of_seq, mask, seq_ids = make_batch(gen, n_seqs)
    T = len(seq_of_token)
    values = torch.randn(T, generator=gen, dtype=F64).to(dtype)
    values[mask == 0] = float("nan")                      # padding garbage must not leak
    values[(mask == 0).nonzero()[0]] = float("inf")
    g_up = float(torch.randn((), generator=gen)) + 2.0
    ctx = ctx_for(mask, n_seqs)

    v64 = values.to(F64).requires_grad_()
    ref = ref_agg(v64, mask, seq_of_token, mode, float(mask.sum()), n_seqs)
    (ref * g_up).backward()
    for trial in range(4):
        x = values.clone().requires_grad_()
        total = x.new_zeros((), dtype=torch.float32)
        for idx in random_partition(gen, tokens_of_seq):
            m = mask[idx].to(torch.bool) if trial % 2 else mask[idx].to(torch.int64)
            part = agg_loss(x[idx], m, seq_ids[idx], mode, ctx)
            assert part.dtype == dtype
            total = total + part.float()
        (total * g_up).backward()
        assert torch.isfinite(x.grad.float()).all()
        assert (x.grad[mask == 0] == 0).all()
        assert_rel_close(total, ref.detach(), REL_TOL[dtype], f"{mode} value")
        assert_rel_close(x.grad.float(), v64.grad, REL_TOL[dtype], f"{mode} grad")


def test_agg_loss_fractional_weights_token_modes():
    """Float mask weights are 'used as given' (docstring): checked for the two modes without counts."""
    gen = torch.Generator().manual_seed(5)
    seq_of_token, tokens_of_seq, _, seq_ids = make_batch(gen, 6)
    T = len(seq_of_token)
    w = torch.rand(T, generator=gen, dtype=F64)
    values = torch.randn(T, generator=gen, dtype=F64)
    for mode in ("token-mean", "seq-mean-token-sum"):
        ctx = LossContext.from_counts(float(w.sum()), 6.0)
        ref = ref_agg(values, w, seq_of_token, mode, float(w.sum()), 6.0)
        got = sum(agg_loss(values[i].float(), w[i].float(), seq_ids[i], mode, ctx).double()
                  for i in random_partition(gen, tokens_of_seq))
        assert_rel_close(got, ref, 1e-6, mode)


def test_agg_loss_fractional_weights_seq_mean_token_mean():
    values = torch.tensor([1.0, 3.0, -2.0, 5.0], dtype=F64)
    w = torch.tensor([0.25, 0.25, 0.5, 0.5], dtype=F64)           # sequence sums 0.5 and 1.0
    seq = [0, 0, 1, 1]
    ctx = LossContext.from_counts(float(w.sum()), 2.0)
    ref = ref_agg(values, w, seq, "seq-mean-token-mean", float(w.sum()), 2.0)   # (2 + 1.5) / 2 = 1.75
    got = agg_loss(values, w, torch.tensor(seq), "seq-mean-token-mean", ctx)
    assert_rel_close(got, ref, 1e-12, "seq-mean-token-mean fractional weights")


# ----------------------------------------------------------------------------- PPO policy loss
def _pg_inputs(gen, T):
    adv = torch.randn(T, generator=gen, dtype=F64) * 1.5
    old = -torch.rand(T, generator=gen, dtype=F64) * 4 - 0.05
    # log ratios spread over: inside the clip, beyond 1 +- eps, beyond the dual clip c = 3 (log 3 = 1.1),
    # and beyond the +-20 log-ratio clamp.
    log_ratio = torch.randn(T, generator=gen, dtype=F64) * 0.6
    log_ratio[::11] = 25.0 * torch.sign(torch.randn(len(log_ratio[::11]), generator=gen, dtype=F64))
    log_ratio[3::7] = 1.6
    return old + log_ratio, old, adv


@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_policy_loss_any_split(mode):
    gen = torch.Generator().manual_seed(101 + AGG_MODES.index(mode))
    n_seqs = 11
    seq_of_token, tokens_of_seq, mask, seq_ids = make_batch(gen, n_seqs)
    T = len(seq_of_token)
    logp, old, adv = _pg_inputs(gen, T)
    logp32, old32, adv32 = logp.float(), old.float(), adv.float()
    low, high, c = 0.2, 0.28, 3.0
    g_up = float(torch.randn((), generator=gen)) + 2.0
    ctx = ctx_for(mask, n_seqs)

    x64 = logp32.double().requires_grad_()
    losses, cf, cfl, kl = ref_pg_losses(x64, old32.double(), adv32.double(), low, high, c)
    assert (cfl[mask != 0] > 0).any() and (cf[mask != 0] > 0).any()      # both clips are exercised
    ref = ref_agg(losses, mask, seq_of_token, mode, float(mask.sum()), n_seqs)
    (ref * g_up).backward()
    n_tok = float(mask.sum())
    ref_metrics = {"pg_loss": ref.detach(), "pg_clipfrac": (cf * mask).sum() / n_tok,
                   "pg_clipfrac_lower": (cfl * mask).sum() / n_tok,
                   "ppo_kl": (kl.detach() * mask).sum() / n_tok}

    for _ in range(3):
        x = logp32.clone().requires_grad_()
        total = torch.zeros(())
        metrics = dict.fromkeys(ref_metrics, 0.0)
        for idx in random_partition(gen, tokens_of_seq):
            loss, met = ppo_policy_loss(x[idx], old32[idx], adv32[idx], mask[idx], seq_ids[idx], ctx,
                                        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
                                        loss_agg_mode=mode)
            total = total + loss
            for k in metrics:
                assert not met[k].requires_grad
                metrics[k] = metrics[k] + met[k].double()
        (total * g_up).backward()
        assert_rel_close(total, ref.detach(), REL_TOL[torch.float32], f"pg {mode} value")
        assert_rel_close(x.grad, x64.grad, REL_TOL[torch.float32], f"pg {mode} grad")
        for k, v in ref_metrics.items():
            assert abs(float(metrics[k]) - float(v)) <= 1e-5 * max(1.0, abs(float(v))), (k, metrics[k], v)


def test_ppo_policy_loss_inputs_not_modified_and_constants():
    gen = torch.Generator().manual_seed(3)
    T = 17
    logp, old, adv = (t.float() for t in _pg_inputs(gen, T))
    old.requires_grad_()
    adv.requires_grad_()
    x = logp.clone().requires_grad_()
    mask = torch.ones(T)
    copies = [t.detach().clone() for t in (x, old, adv, mask)]
    loss, _ = ppo_policy_loss(x, old, adv, mask, None, LossContext.from_counts(T, 1))
    loss.backward()
    assert old.grad is None and adv.grad is None            # old log-probs and advantages are constants
    for a, b in zip((x, old, adv, mask), copies, strict=True):
        assert torch.equal(a.detach(), b)


# ----------------------------------------------------------------------------- KL estimators
@pytest.mark.parametrize("kind", ["k1", "k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_estimators(kind, dtype):
    gen = torch.Generator().manual_seed(7)
    T = 301
    ref_lp = -torch.rand(T, generator=gen, dtype=F64) * 5
    d = torch.randn(T, generator=gen, dtype=F64) * 1.2
    d[::13] = 22.0                      # beyond the +-20 clamp
    d[5::17] = -23.0
    d[2::19] = 3.0                      # k3 = e^3 - 4 > 10: value clamp
    logp = (ref_lp - d).to(dtype)
    ref_lp = ref_lp.to(dtype)
    g_up = torch.randn(T, generator=gen, dtype=F64)
    x64 = logp.double().requires_grad_()
    ref = ref_kl(x64, ref_lp.double(), kind)
    ref.backward(g_up)
    x = logp.clone().requires_grad_()
    got = kl_estimator(x, ref_lp, kind)
    got.backward(g_up.to(dtype))
    tol = REL_TOL[dtype]
    assert got.dtype == dtype
    assert_rel_close(got, ref.detach(), tol, f"{kind} value")
    assert_rel_close(x.grad, x64.grad, tol, f"{kind} grad")
    if kind == "k3":   # tiny log ratios: expm1 accuracy (relative error on each element)
        small = torch.tensor([1e-4, -3e-4, 2e-3], dtype=F64)
        got_s = kl_estimator(small.float(), torch.zeros(3), "k3").double()
        ref_s = small**2 / 2 - small**3 / 6 + small**4 / 24
        assert ((got_s - ref_s).abs() / ref_s).max() < 1e-3


# ----------------------------------------------------------------------------- top-k distillation
def _teacher(gen, T, V, K, *, random_ids: bool = False, vocab_size: int | None = None):
    """Teacher top-k ids and log-probs of a random full-vocab teacher (so p_tail > 0)."""
    v_valid = vocab_size or V
    t_logits = torch.randn(T, v_valid, generator=gen, dtype=F64) * 2.5
    t_logp_full = t_logits.log_softmax(-1)
    if random_ids:
        ids = torch.stack([torch.randperm(v_valid, generator=gen)[:K] for _ in range(T)])
        lp = t_logp_full.gather(-1, ids)
    else:
        lp, ids = t_logp_full.topk(K, -1)
    return ids, lp.float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("clamp", [None, -6.0])
def test_forward_kl_topk_values_and_grads(tail, clamp, dtype):
    seed = 1000 + 10 * tail + (clamp is not None) + 100 * (dtype == torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    T, V, K = 29, 97, 5
    logits = (torch.randn(T, V, generator=gen, dtype=F64) * 2.0)
    # a row far from the teacher (very low student log-probs on S) and a row with most of the student
    # mass on S (q_tail ~ 1e-3; the extreme q_tail -> 0 is checked separately below)
    ids, t_lp = _teacher(gen, T, V, K, random_ids=False)
    logits[0].scatter_(0, ids[0], -12.0)
    logits[1].scatter_(0, ids[1], 8.0)
    ids_r, t_lp_r = _teacher(gen, T, V, K, random_ids=True)
    ids[2::2], t_lp[2::2] = ids_r[2::2], t_lp_r[2::2]       # half the rows: ids are not the teacher's top-k
    logits = logits.to(dtype)
    g_up = torch.randn(T, generator=gen, dtype=F64)
    fn = forward_kl_topk_tail if tail else forward_kl_topk

    x64 = logits.double().requires_grad_()
    ref = ref_forward_kl(x64, ids, t_lp.double(), tail=tail, clamp=clamp)
    ref["distillation_losses"].backward(g_up)
    tol = REL_TOL[torch.float32] if dtype == torch.float32 else 1e-5   # values: fp32 math on exact inputs
    for chunk in (None, 4):
        x = logits.clone().requires_grad_()
        data = {"teacher_ids": ids.clone(), "teacher_logprobs": t_lp.clone()}
        out = fn(x, data, "thd", log_prob_min_clamp=clamp, chunk_size=chunk)
        for key in ("distillation_losses", "student_mass", "teacher_mass", "topk_overlap"):
            assert out[key].dtype == torch.float32 and out[key].shape == (T,)
            assert_rel_close(out[key], ref[key].detach(), tol, f"{key} tail={tail} clamp={clamp} {dtype}")
        out["distillation_losses"].backward(g_up.float())
        assert x.grad.dtype == dtype
        assert_rel_close(x.grad, x64.grad, REL_TOL[dtype], f"grad tail={tail} clamp={clamp} {dtype}")
        assert torch.equal(data["teacher_ids"], ids) and torch.equal(data["teacher_logprobs"], t_lp)


def _concentrated_student(gap: float):
    """One row per teacher: the student puts all but q_tail ~ V e^-gap of its mass on the teacher's
    top-k set S, the teacher keeps p_tail = 0.3 outside it (an over-confident student: exactly when
    the tail term matters)."""
    gen = torch.Generator().manual_seed(int(gap))
    T, V, K = 6, 97, 5
    logits = torch.randn(T, V, generator=gen, dtype=F64) * 2
    ids = torch.stack([torch.randperm(V, generator=gen)[:K] for _ in range(T)])
    logits.scatter_(1, ids, gap + torch.randn(T, K, generator=gen, dtype=F64) * 0.5)
    t_lp = torch.log(torch.tensor([0.3, 0.2, 0.1, 0.05, 0.05], dtype=F64)).expand(T, K).float()
    x64 = logits.float().double().requires_grad_()
    ref = ref_forward_kl(x64, ids, t_lp.double(), tail=True, clamp=None)
    g_up = torch.randn(T, generator=gen, dtype=F64)
    ref["distillation_losses"].backward(g_up)
    x = logits.float().requires_grad_()
    out = forward_kl_topk_tail(x, {"teacher_ids": ids, "teacher_logprobs": t_lp}, compute_overlap=False)
    out["distillation_losses"].backward(g_up.float())
    return ref, x64.grad, out, x.grad


@pytest.mark.parametrize("gap", [20.0, 40.0])
def test_forward_kl_topk_tail_concentrated_student_value(gap):
    """q_tail ~ 1e-7 .. 1e-16: 1 - sum_S q would cancel in fp32; the value must stay exact per token."""
    ref, _, out, _ = _concentrated_student(gap)
    err = ((out["distillation_losses"].double() - ref["distillation_losses"]).abs()
           / ref["distillation_losses"].abs()).max()
    assert err < 1e-5, err


@pytest.mark.parametrize("gap", [20.0, 40.0])
def test_forward_kl_topk_tail_concentrated_student_grad(gap):
    _, ref_grad, _, grad = _concentrated_student(gap)
    assert_rel_close(grad, ref_grad, 1e-4, f"tail grad, q_tail ~ e^-{gap}")


def test_forward_kl_topk_padded_vocab_and_3d():
    """``vocab_size`` < V_local: padded columns get no mass and no gradient; [1, T, V] with [T, K] data."""
    gen = torch.Generator().manual_seed(77)
    T, V, K, v_true = 23, 64, 4, 59
    logits = torch.randn(1, T, V, generator=gen, dtype=F64) * 2
    logits[..., v_true:] = 50.0                                   # huge padding logits must be ignored
    ids, t_lp = _teacher(gen, T, V, K, vocab_size=v_true)
    g_up = torch.randn(T, generator=gen, dtype=F64)
    x64 = logits[0, :, :v_true].clone().requires_grad_()
    ref = ref_forward_kl(x64, ids, t_lp.double(), tail=True, clamp=None)
    ref["distillation_losses"].backward(g_up)
    fn = make_forward_kl_topk(tail=True, vocab_size=v_true)
    x = logits.float().requires_grad_()
    out = fn(student_logits=x, data={"teacher_ids": ids, "teacher_logprobs": t_lp}, data_format="thd")
    assert out["distillation_losses"].shape == (1, T)
    for key in ("distillation_losses", "student_mass", "topk_overlap"):
        assert_rel_close(out[key][0], ref[key].detach(), 1e-5, key)
    out["distillation_losses"].backward(g_up.float()[None])
    assert (x.grad[..., v_true:] == 0).all()
    assert_rel_close(x.grad[0, :, :v_true], x64.grad, 1e-5, "padded grad")


# ----------------------------------------------------------------------------- distillation_ppo_loss
def _dppo_setup(gen, n_seqs, V=53, K=4):
    seq_of_token, tokens_of_seq, mask, seq_ids = make_batch(gen, n_seqs, max_len=9)
    T = len(seq_of_token)
    logits = torch.randn(T, V, generator=gen, dtype=F64) * 2
    ids, t_lp = _teacher(gen, T, V, K)
    logp, old, adv = _pg_inputs(gen, T)
    ref_lp = old + torch.randn(T, generator=gen, dtype=F64) * 0.3
    return seq_of_token, tokens_of_seq, mask, seq_ids, logits, ids, t_lp, logp.float(), old.float(), \
        adv.float(), ref_lp.float()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_distillation_ppo_loss_any_split(mode):
    gen = torch.Generator().manual_seed(500 + AGG_MODES.index(mode))
    n_seqs = 8
    (seq_of_token, tokens_of_seq, mask, seq_ids, logits, ids, t_lp, logp, old, adv,
     ref_lp) = _dppo_setup(gen, n_seqs)
    coef, kl_coef, kl_type, low, high, c = 0.7, 0.05, ("k1", "k3")[AGG_MODES.index(mode) % 2], 0.2, 0.25, 2.5
    g_up = float(torch.randn((), generator=gen)) + 2.0
    n_tok = float(mask.sum())

    # reference: coef * agg(fkl_tail) + agg(pg) + kl_coef * agg(kl), float64, whole batch
    lg64 = logits.float().double().requires_grad_()
    lp64 = logp.double().requires_grad_()
    dist = ref_forward_kl(lg64, ids, t_lp.double(), tail=True, clamp=None)
    pg, *_ = ref_pg_losses(lp64, old.double(), adv.double(), low, high, c)
    kl = ref_kl(lp64, ref_lp.double(), kl_type)
    agg = [ref_agg(v, mask, seq_of_token, mode, n_tok, n_seqs) for v in (dist["distillation_losses"], pg, kl)]
    ref = coef * agg[0] + agg[1] + kl_coef * agg[2]
    (ref * g_up).backward()

    loss_fn = distillation_ppo_loss(distillation_loss_coef=coef, loss_agg_mode=mode, clip_ratio_low=low,
                                    clip_ratio_high=high, clip_ratio_c=c, kl_loss_coef=kl_coef,
                                    kl_loss_type=kl_type)
    processor = make_forward_kl_topk(tail=True)
    ctx = ctx_for(mask, n_seqs)
    for _ in range(3):
        lg = logits.float().requires_grad_()
        lp = logp.clone().requires_grad_()
        total = torch.zeros(())
        met_sum: dict[str, float] = {}
        for idx in random_partition(gen, tokens_of_seq, with_empty=False):
            teacher = {"teacher_ids": ids[idx], "teacher_logprobs": t_lp[idx]}
            outputs = processor(student_logits=lg[idx], data=teacher, data_format="thd")
            outputs["log_probs"] = lp[idx]
            data = {"loss_mask": mask[idx], "seq_ids": seq_ids[idx], "advantages": adv[idx],
                    "old_log_probs": old[idx], "ref_log_probs": ref_lp[idx]}
            loss, met = loss_fn(outputs, data, ctx)
            total = total + loss
            for k, v in met.items():
                assert not v.requires_grad
                met_sum[k] = met_sum.get(k, 0.0) + float(v)
        (total * g_up).backward()
        assert_rel_close(total, ref.detach(), 1e-5, f"dppo {mode} value")
        assert_rel_close(lg.grad, lg64.grad, 1e-5, f"dppo {mode} logits grad")
        assert_rel_close(lp.grad, lp64.grad, 1e-5, f"dppo {mode} log_probs grad")
        expect = {"loss": float(ref), "distillation_loss": float(agg[0]), "pg_loss": float(agg[1]),
                  "kl_loss": float(agg[2]),
                  "student_mass": float((dist["student_mass"] * mask).sum() / n_tok),
                  "teacher_mass": float((dist["teacher_mass"] * mask).sum() / n_tok),
                  "topk_overlap": float((dist["topk_overlap"] * mask).sum() / n_tok)}
        for k, v in expect.items():
            assert math.isclose(met_sum[k], v, rel_tol=1e-5, abs_tol=1e-6), (k, met_sum[k], v)


class _Recording(dict):
    """A dict that records which keys were read."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_distillation_only_skips_policy_loss(mode, monkeypatch):
    gen = torch.Generator().manual_seed(900 + AGG_MODES.index(mode))
    n_seqs = 7
    (seq_of_token, tokens_of_seq, mask, seq_ids, logits, ids, t_lp, logp, old, adv,
     ref_lp) = _dppo_setup(gen, n_seqs)
    n_tok = float(mask.sum())
    g_up = float(torch.randn((), generator=gen)) + 2.0
    lg64 = logits.float().double().requires_grad_()
    dist = ref_forward_kl(lg64, ids, t_lp.double(), tail=False, clamp=-7.0)
    ref = 1.3 * ref_agg(dist["distillation_losses"], mask, seq_of_token, mode, n_tok, n_seqs)
    (ref * g_up).backward()

    import mcore_engine.losses.policy as policy_mod

    def _boom(*a, **kw):
        raise AssertionError("policy loss computed under distillation_only")
    monkeypatch.setattr(policy_mod, "ppo_policy_loss", _boom)

    loss_fn = distillation_ppo_loss(distillation_loss_coef=1.3, loss_agg_mode=mode, kl_loss_coef=0.1)
    processor = make_forward_kl_topk(tail=False, log_prob_min_clamp=-7.0)
    ctx = ctx_for(mask, n_seqs, distillation_only=True)
    lg = logits.float().requires_grad_()
    poison = torch.full((len(seq_of_token),), float("nan"))
    total = torch.zeros(())
    for idx in random_partition(gen, tokens_of_seq, with_empty=False):
        outputs = _Recording(processor(student_logits=lg[idx], data={"teacher_ids": ids[idx],
                                                                     "teacher_logprobs": t_lp[idx]}))
        # present-but-poisoned policy inputs must never be touched
        outputs_lp = poison[idx].clone().requires_grad_()
        outputs["log_probs"] = outputs_lp
        data = _Recording(loss_mask=mask[idx], seq_ids=seq_ids[idx], advantages=poison[idx],
                          old_log_probs=poison[idx], ref_log_probs=poison[idx])
        loss, met = loss_fn(outputs, data, ctx)
        assert not ({"log_probs"} & outputs.read), outputs.read
        assert not ({"advantages", "old_log_probs", "ref_log_probs"} & data.read), data.read
        assert not {"pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss"} & set(met)
        total = total + loss
    (total * g_up).backward()
    assert torch.isfinite(total)
    assert_rel_close(total, ref.detach(), 1e-5, f"distillation_only {mode} value")
    assert_rel_close(lg.grad, lg64.grad, 1e-5, f"distillation_only {mode} grad")

    # log_probs absent altogether (the processor skipped it) works too; missing distillation is an error
    teacher = {"teacher_ids": ids[:5], "teacher_logprobs": t_lp[:5]}
    outputs = processor(student_logits=lg[:5].detach(), data=teacher)
    loss_fn(outputs, {"loss_mask": mask[:5], "seq_ids": seq_ids[:5]}, ctx)
    with pytest.raises(ValueError):
        loss_fn({"log_probs": logp[:5]}, {"loss_mask": mask[:5], "seq_ids": seq_ids[:5]}, ctx)


# ----------------------------------------------------------------------------- 2 gloo ranks
def _two_rank_checks(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    group = dist.group.WORLD
    # (1) vocab-parallel tail KL: the vocab sharded over the 2 ranks, padded (61 real ids of 64)
    gen = torch.Generator().manual_seed(2024)
    T, V, K, v_true = 19, 64, 6, 61
    v_loc = V // world_size
    logits = torch.randn(T, V, generator=gen, dtype=F64) * 2
    ids, t_lp = _teacher(gen, T, V, K, vocab_size=v_true)
    g_up = torch.randn(T, generator=gen, dtype=F64)
    x64 = logits[:, :v_true].float().double().requires_grad_()
    ref = ref_forward_kl(x64, ids, t_lp.double(), tail=True, clamp=-9.0)
    ref["distillation_losses"].backward(g_up)
    shard = logits[:, rank * v_loc:(rank + 1) * v_loc].float().requires_grad_()
    out = forward_kl_topk_tail(shard, {"teacher_ids": ids, "teacher_logprobs": t_lp}, log_prob_min_clamp=-9.0,
                               vocab_size=v_true, group=group)
    for key in ("distillation_losses", "student_mass", "teacher_mass", "topk_overlap"):
        assert_rel_close(out[key], ref[key].detach(), 1e-5, f"TP=2 {key}")
    out["distillation_losses"].backward(g_up.float())
    full_grad = torch.cat([x64.grad, torch.zeros(T, V - v_true, dtype=F64)], 1)
    assert_rel_close(shard.grad, full_grad[:, rank * v_loc:(rank + 1) * v_loc], 1e-5, "TP=2 grad")

    # (2) data parallel: each rank its own sequences, global ctx; all-reduced sum == whole-batch loss
    n_seqs = 10
    (seq_of_token, tokens_of_seq, mask, seq_ids, _, _, _, logp, old, adv,
     ref_lp) = _dppo_setup(gen, n_seqs)
    mode = "seq-mean-token-mean"
    lp64 = logp.double().requires_grad_()
    pg, *_ = ref_pg_losses(lp64, old.double(), adv.double(), 0.2, 0.2, 3.0)
    kl = ref_kl(lp64, ref_lp.double(), "k3")
    ref_loss = (ref_agg(pg, mask, seq_of_token, mode, float(mask.sum()), n_seqs)
                + 0.1 * ref_agg(kl, mask, seq_of_token, mode, float(mask.sum()), n_seqs))
    ref_loss.backward()
    loss_fn = distillation_ppo_loss(loss_agg_mode=mode, kl_loss_coef=0.1, kl_loss_type="k3")
    ctx = LossContext.from_counts(float(mask.sum()), float(n_seqs), dp_size=world_size)
    lp = logp.clone().requires_grad_()
    mine = [t for s in range(rank, n_seqs, world_size) for t in tokens_of_seq[s]]
    idx = torch.tensor(mine)
    loss, _ = loss_fn({"log_probs": lp[idx]}, {"loss_mask": mask[idx], "seq_ids": seq_ids[idx],
                                              "advantages": adv[idx], "old_log_probs": old[idx],
                                              "ref_log_probs": ref_lp[idx]}, ctx)
    loss.backward()
    total, grad = loss.detach().clone(), lp.grad.clone()
    dist.all_reduce(total, group=group)
    dist.all_reduce(grad, group=group)
    assert_rel_close(total, ref_loss.detach(), 1e-5, "DP=2 loss")
    assert_rel_close(grad, lp64.grad, 1e-5, "DP=2 grad")


def test_two_ranks_vocab_parallel_and_data_parallel():
    from tests.utils import run_distributed

    run_distributed(_two_rank_checks, 2)
