"""PPO dual-clip policy loss and the k1/k3 KL estimators against float64 references."""

from __future__ import annotations

import pytest
import torch

from mcore_engine.losses import AGG_MODES, LossContext, kl_estimator, ppo_policy_loss
from tests.reference import (
    micro_batches,
    ppo_inputs,
    random_packed_batch,
    random_split,
    ref_agg,
    ref_kl,
    ref_ppo_tokens,
)
from tests.utils import REL_TOL, assert_rel_close

CLIPS = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0)


def _ppo_inputs(num_seqs, g):
    seq_ids, mask = random_packed_batch(num_seqs, g)
    t = seq_ids.numel()
    old = -torch.rand(t, generator=g, dtype=torch.float64) * 4 - 0.1
    # log-ratios spread over every region: inside the clip, clipped above/below, beyond the dual clip
    log_ratio = torch.randn(t, generator=g, dtype=torch.float64) * 0.8
    adv = torch.randn(t, generator=g, dtype=torch.float64)
    return seq_ids, mask, old + log_ratio, old, adv


def _ctx(seq_ids, mask):
    return LossContext.from_counts(mask.sum(), len(set(seq_ids[mask].tolist())))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_loss_values_grads_and_metrics(mode):
    g = torch.Generator().manual_seed(100 + AGG_MODES.index(mode))
    seq_ids, mask, lp, old, adv = _ppo_inputs(23, g)
    ctx = _ctx(seq_ids, mask)
    lp32 = lp.float().requires_grad_()
    old32, adv32 = old.float(), adv.float()
    copies = (old32.clone(), adv32.clone(), mask.clone())
    loss, metrics = ppo_policy_loss(lp32, old32, adv32, mask, seq_ids, ctx, loss_agg_mode=mode, **CLIPS)

    lp_ref = lp32.detach().double().requires_grad_()
    tok, clipped, lower, kl = ref_ppo_tokens(lp_ref, old32, adv32, 0.2, 0.28, 3.0)
    n, b = ctx.global_num_tokens.double(), ctx.global_num_seqs.double()
    ref = ref_agg(tok, mask, seq_ids, mode, n, b)
    assert (clipped * mask).sum() > 0 and (lower * mask).sum() > 0, "inputs must exercise both clips"
    assert_rel_close(loss, ref, REL_TOL[torch.float32], "pg loss")
    up = torch.rand((), generator=g, dtype=torch.float64) + 0.5
    (loss * up.float()).backward()
    (ref * up).backward()
    assert_rel_close(lp32.grad, lp_ref.grad, REL_TOL[torch.float32], "pg loss grad")
    assert_rel_close(metrics["pg_loss"], ref, REL_TOL[torch.float32], "pg_loss metric")
    for key, val in (("pg_clipfrac", clipped), ("pg_clipfrac_lower", lower), ("ppo_kl", kl)):
        assert_rel_close(metrics[key], ref_agg(val, mask, seq_ids, "token-mean", n, b),
                         REL_TOL[torch.float32], key)
        assert not metrics[key].requires_grad and metrics[key].dtype == torch.float32
    for before, after in zip(copies, (old32, adv32, mask), strict=True):
        assert torch.equal(before, after)


def test_ppo_loss_split_invariance():
    g = torch.Generator().manual_seed(3)
    seq_ids, mask, lp, old, adv = _ppo_inputs(19, g)
    ctx = _ctx(seq_ids, mask)
    lp = lp.float().requires_grad_()
    old, adv = old.float(), adv.float()
    for mode in AGG_MODES:
        whole, wm = ppo_policy_loss(lp, old, adv, mask, seq_ids, ctx, loss_agg_mode=mode, **CLIPS)
        (whole_grad,) = torch.autograd.grad(whole, lp)
        total, sums = lp.new_zeros(()), dict.fromkeys(wm, 0.0)
        for seqs in random_split(19, 3, g):
            idx = torch.nonzero(torch.isin(seq_ids, seqs)).flatten()
            part, pm = ppo_policy_loss(lp[idx], old[idx], adv[idx], mask[idx], seq_ids[idx], ctx,
                                       loss_agg_mode=mode, **CLIPS)
            total = total + part
            sums = {k: sums[k] + pm[k] for k in sums}
        (grad,) = torch.autograd.grad(total, lp)
        assert_rel_close(total, whole, REL_TOL[torch.float32], f"{mode}: value")
        assert_rel_close(grad, whole_grad, REL_TOL[torch.float32], f"{mode}: grad")
        for k in wm:
            assert_rel_close(torch.as_tensor(sums[k]), wm[k], REL_TOL[torch.float32], f"{mode}: metric {k}")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_ppo_loss_any_split_matches_reference(mode):
    """Micro-batch contributions (an empty one included), log-ratios beyond the +-20 clamp: the sum
    of losses and metrics equals the float64 whole-batch reference, and so does the gradient."""
    g = torch.Generator().manual_seed(101 + AGG_MODES.index(mode))
    n_seqs = 11
    seq_ids, mask = random_packed_batch(n_seqs, g, max_len=13)
    mask = mask.double()
    lp, old, adv = (t.float() for t in ppo_inputs(seq_ids.numel(), g))
    low, high, c = 0.2, 0.28, 3.0
    g_up = float(torch.randn((), generator=g)) + 2.0
    n_tok = float(mask.sum())
    ctx = LossContext.from_counts(n_tok, float(n_seqs))
    x64 = lp.double().requires_grad_()
    losses, cf, cfl, kl = ref_ppo_tokens(x64, old, adv, low, high, c)
    assert (cfl[mask != 0] > 0).any() and (cf[mask != 0] > 0).any()      # both clips are exercised
    ref = ref_agg(losses, mask, seq_ids, mode, n_tok, n_seqs)
    (ref * g_up).backward()
    ref_metrics = {"pg_loss": ref.detach(), "pg_clipfrac": (cf * mask).sum() / n_tok,
                   "pg_clipfrac_lower": (cfl * mask).sum() / n_tok,
                   "ppo_kl": (kl.detach() * mask).sum() / n_tok}
    for parts in (1, 4, 11):
        x = lp.clone().requires_grad_()
        total = torch.zeros(())
        metrics = dict.fromkeys(ref_metrics, 0.0)
        for idx in micro_batches(seq_ids, parts, g, with_empty=True):
            loss, met = ppo_policy_loss(x[idx], old[idx], adv[idx], mask[idx], 7 * seq_ids[idx] + 1000, ctx,
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


def test_ppo_loss_old_log_probs_and_advantages_are_constants():
    g = torch.Generator().manual_seed(3)
    t = 17
    lp, old, adv = (v.float() for v in ppo_inputs(t, g))
    old.requires_grad_()
    adv.requires_grad_()
    x = lp.clone().requires_grad_()
    mask = torch.ones(t)
    copies = [v.detach().clone() for v in (x, old, adv, mask)]
    loss, _ = ppo_policy_loss(x, old, adv, mask, None, LossContext.from_counts(t, 1))
    loss.backward()
    assert old.grad is None and adv.grad is None
    for a, b in zip((x, old, adv, mask), copies, strict=True):
        assert torch.equal(a.detach(), b)


def test_ppo_loss_rejects_bad_input():
    ctx = LossContext.from_counts(3, 1)
    x, m = torch.randn(3), torch.ones(3)
    bad = ((dict(clip_ratio_low=1.0), "clip_ratio_low"), (dict(clip_ratio_high=-0.1), "clip_ratio_high"),
           (dict(clip_ratio_c=1.0), "clip_ratio_c"))
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            ppo_policy_loss(x, x, x, m, None, ctx, **kw)
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(x, x, x[:2], m, None, ctx)


def _kl_inputs(layout, t, dtype, g):
    """(log_probs, ref_log_probs, indices whose k3 is clamped). ``few``: three tokens beyond the
    clamps (|ref - lp| > 20, k3 > 10); ``many``: every 13th / 17th / 19th token beyond one."""
    if layout == "few":
        lp = (-torch.rand(t, generator=g, dtype=torch.float64) * 5).to(dtype)
        ref_lp = (lp.double() + torch.randn(t, generator=g, dtype=torch.float64) * 1.5).to(dtype)
        ref_lp[:3] = torch.tensor([-30.0, 25.0, 12.0], dtype=dtype) + lp[:3]
        return lp, ref_lp, torch.arange(3)
    ref_lp = -torch.rand(t, generator=g, dtype=torch.float64) * 5
    d = torch.randn(t, generator=g, dtype=torch.float64) * 1.2
    d[::13] = 22.0
    d[5::17] = -23.0
    d[2::19] = 3.0                      # k3 = e^3 - 4 > 10: value clamp
    clamped = torch.cat([torch.arange(0, t, 13), torch.arange(5, t, 17), torch.arange(2, t, 19)])
    return (ref_lp - d).to(dtype), ref_lp.to(dtype), clamped


@pytest.mark.parametrize("layout", ["few", "many"])
@pytest.mark.parametrize("kind", ["k1", "k3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kl_estimators(kind, dtype, layout):
    g = torch.Generator().manual_seed(5 + (kind == "k3") + 2 * (layout == "many"))
    t = 301
    lp, ref_lp, clamped = _kl_inputs(layout, t, dtype, g)
    lp_in = lp.clone().requires_grad_()
    ref_copy = ref_lp.clone()
    out = kl_estimator(lp_in, ref_lp, kind)
    assert out.dtype == dtype and torch.equal(ref_lp, ref_copy)
    lp_ref = lp.double().requires_grad_()
    expected = ref_kl(lp_ref, ref_lp, kind)
    assert_rel_close(out, expected, REL_TOL[dtype], f"{kind} value")
    up = torch.randn(t, generator=g, dtype=torch.float64)
    (out * up.to(dtype)).sum().backward()
    (expected * up).sum().backward()
    assert_rel_close(lp_in.grad, lp_ref.grad, REL_TOL[dtype], f"{kind} grad")
    if kind == "k3":
        assert (out.double() >= 0).all() and out.max() <= 10
        assert (lp_in.grad[clamped] == 0).all(), "clamped tokens get no gradient"


def test_k3_is_accurate_for_tiny_log_ratios():
    lp = torch.full((4,), -2.0)
    ref = lp + torch.tensor([1e-4, -3e-4, 2e-3, -1e-3])
    expected = ref_kl(lp, ref, "k3")
    assert_rel_close(kl_estimator(lp, ref, "k3"), expected, 1e-4, "k3 small d")
    small = torch.tensor([1e-4, -3e-4, 2e-3], dtype=torch.float64)
    got = kl_estimator(small.float(), torch.zeros(3), "k3").double()
    series = small**2 / 2 - small**3 / 6 + small**4 / 24                # e^-d - 1 + d, d = -small
    assert ((got - series).abs() / series).max() < 1e-3, "k3 per-token accuracy for tiny log-ratios"
    with pytest.raises(ValueError, match="kind"):
        kl_estimator(lp, ref, "k2")
    with pytest.raises(ValueError, match="ref_log_probs"):
        kl_estimator(lp, ref[:2], "k1")
