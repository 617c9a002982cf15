"""distillation_ppo_loss: combined value and gradients, split invariance, the whole chain from the
student logits through the top-k processor, and the skip contract."""

from __future__ import annotations

import math

import pytest
import torch

import mcore_engine.losses.distillation_ppo as dppo
import mcore_engine.losses.policy as policy
from mcore_engine.losses import AGG_MODES, LossContext, distillation_ppo_loss, make_forward_kl_topk
from tests.reference import (
    make_teacher,
    micro_batches,
    ppo_inputs,
    random_packed_batch,
    random_split,
    ref_agg,
    ref_forward_kl_topk,
    ref_kl,
    ref_ppo_tokens,
)
from tests.utils import REL_TOL, assert_rel_close

TOL = REL_TOL[torch.float32]


def _batch(num_seqs, seed):
    g = torch.Generator().manual_seed(seed)
    seq_ids, mask = random_packed_batch(num_seqs, g)
    t = seq_ids.numel()
    r = torch.randn(6, t, generator=g)
    outputs = {"distillation_losses": r[0].abs().requires_grad_(),
               "log_probs": (-r[1].abs()).requires_grad_(),
               "student_mass": r[2].abs(), "teacher_mass": r[3].abs(),
               "topk_overlap": torch.rand(t, generator=g)}
    data = {"loss_mask": mask, "seq_ids": seq_ids, "advantages": r[4],
            "old_log_probs": outputs["log_probs"].detach() + 0.5 * r[5], "ref_log_probs": -r[5].abs()}
    ctx = LossContext.from_counts(mask.sum(), len(set(seq_ids[mask].tolist())))
    return outputs, data, ctx


def _reference(outputs, data, ctx, mode, coef, kl_coef, distillation_only=False):
    n, b = ctx.global_num_tokens.double(), ctx.global_num_seqs.double()
    mask, seq = data["loss_mask"], data["seq_ids"]
    dl = outputs["distillation_losses"].detach().double().requires_grad_()
    lp = outputs["log_probs"].detach().double().requires_grad_()
    total = coef * ref_agg(dl, mask, seq, mode, n, b)
    if not distillation_only:
        pg = ref_ppo_tokens(lp, data["old_log_probs"], data["advantages"], 0.2, 0.25, 2.5)[0]
        total = total + ref_agg(pg, mask, seq, mode, n, b)
        total = total + kl_coef * ref_agg(ref_kl(lp, data["ref_log_probs"], "k3"), mask, seq, mode, n, b)
    dl_grad, lp_grad = torch.autograd.grad(total, (dl, lp), allow_unused=True)
    return total, dl_grad, lp_grad


@pytest.mark.parametrize("mode", AGG_MODES)
def test_combined_loss_matches_reference_under_any_split(mode):
    outputs, data, ctx = _batch(21, 60 + AGG_MODES.index(mode))
    loss_fn = distillation_ppo_loss(loss_agg_mode=mode, distillation_loss_coef=0.7, clip_ratio_high=0.25,
                                    clip_ratio_c=2.5, kl_loss_coef=0.1, kl_loss_type="k3")
    ref, ref_dl, ref_lp = _reference(outputs, data, ctx, mode, 0.7, 0.1)
    leaves = (outputs["distillation_losses"], outputs["log_probs"])
    g = torch.Generator().manual_seed(1)
    for parts in (1, 4):
        total, metric_sum = 0.0, {}
        for seqs in random_split(21, parts, g):
            idx = torch.nonzero(torch.isin(data["seq_ids"], seqs)).flatten()
            mb_outputs = {k: v[idx] for k, v in outputs.items()}
            loss, metrics = loss_fn(mb_outputs, {k: v[idx] for k, v in data.items()}, ctx)
            total = total + loss
            metric_sum = {k: metric_sum.get(k, 0.0) + v for k, v in metrics.items()}
        grads = torch.autograd.grad(total, leaves)
        assert_rel_close(total, ref, TOL, f"{mode}/{parts}: loss")
        assert_rel_close(grads[0], ref_dl, TOL, f"{mode}/{parts}: grad distillation_losses")
        assert_rel_close(grads[1], ref_lp, TOL, f"{mode}/{parts}: grad log_probs")
        assert_rel_close(metric_sum["loss"], ref, TOL, f"{mode}/{parts}: loss metric")
        n, b = ctx.global_num_tokens.double(), ctx.global_num_seqs.double()
        for key in ("student_mass", "teacher_mass", "topk_overlap"):
            expected = ref_agg(outputs[key], data["loss_mask"], data["seq_ids"], "token-mean", n, b)
            assert_rel_close(metric_sum[key], expected, TOL, f"{mode}/{parts}: {key}")
        expected_keys = {"loss", "distillation_loss", "student_mass", "teacher_mass", "topk_overlap",
                         "pg_loss", "pg_clipfrac", "pg_clipfrac_lower", "ppo_kl", "kl_loss"}
        assert set(metric_sum) == expected_keys
        assert all(not v.requires_grad for v in metrics.values())


def test_distillation_only_never_starts_the_policy_loss(monkeypatch):
    calls = []

    def spy(name, real):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return real(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(policy, "ppo_policy_loss", spy("ppo", policy.ppo_policy_loss))
    monkeypatch.setattr(dppo, "kl_estimator", spy("kl", dppo.kl_estimator))
    outputs, data, ctx = _batch(9, 70)
    loss_fn = distillation_ppo_loss(kl_loss_coef=0.1, clip_ratio_high=0.25, clip_ratio_c=2.5)

    # the spies can fire: with the policy gradient on, both terms run
    loss_fn(outputs, data, ctx)
    assert calls == ["ppo", "kl"]
    calls.clear()

    only = LossContext(global_num_tokens=ctx.global_num_tokens, global_num_seqs=ctx.global_num_seqs,
                       distillation_only=True)
    no_lp = {k: v for k, v in outputs.items() if k != "log_probs"}     # the processor skipped log-probs
    data_no_adv = {k: v for k, v in data.items() if k not in ("advantages", "old_log_probs", "ref_log_probs")}
    loss, metrics = loss_fn(no_lp, data_no_adv, only)
    assert calls == [], f"policy terms were started under distillation_only: {calls}"
    assert not {"pg_loss", "pg_clipfrac", "ppo_kl", "kl_loss"} & set(metrics)
    ref, ref_dl, _ = _reference(outputs, data, ctx, "token-mean", 1.0, 0.0, distillation_only=True)
    assert_rel_close(loss, ref, TOL, "distillation_only loss")
    (grad,) = torch.autograd.grad(loss, outputs["distillation_losses"])
    assert_rel_close(grad, ref_dl, TOL, "distillation_only grad")


def _chain_batch(n_seqs, seed, v=53, k=4):
    """A packed batch for the whole chain: student logits [T, V], teacher top-k, PPO inputs."""
    g = torch.Generator().manual_seed(seed)
    seq_ids, mask = random_packed_batch(n_seqs, g)
    mask = mask.double()
    t = seq_ids.numel()
    logits = torch.randn(t, v, generator=g, dtype=torch.float64) * 2
    ids, t_lp = make_teacher(t, v, k, g, sharpness=2.5)
    lp, old, adv = ppo_inputs(t, g)
    ref_lp = old + torch.randn(t, generator=g, dtype=torch.float64) * 0.3
    return g, seq_ids, mask, logits, ids, t_lp, lp.float(), old.float(), adv.float(), ref_lp.float()


@pytest.mark.parametrize("mode", AGG_MODES)
def test_whole_chain_from_logits_matches_reference_under_any_split(mode):
    """coef * agg(tail KL) + agg(pg) + kl_coef * agg(kl) from micro-batches of logits through
    ``make_forward_kl_topk``: value, gradients w.r.t. the logits and log_probs, and metrics."""
    n_seqs = 8
    seed = 500 + AGG_MODES.index(mode)
    g, seq_ids, mask, logits, ids, t_lp, lp, old, adv, ref_lp = _chain_batch(n_seqs, seed)
    coef, kl_coef, kl_type, low, high, c = 0.7, 0.05, ("k1", "k3")[AGG_MODES.index(mode) % 2], 0.2, 0.25, 2.5
    g_up = float(torch.randn((), generator=g)) + 2.0
    n_tok = float(mask.sum())
    lg64 = logits.float().double().requires_grad_()
    lp64 = lp.double().requires_grad_()
    dist = ref_forward_kl_topk(lg64, ids, t_lp, tail=True)
    pg = ref_ppo_tokens(lp64, old, adv, low, high, c)[0]
    kl = ref_kl(lp64, ref_lp, kl_type)
    agg = [ref_agg(v, mask, seq_ids, mode, n_tok, n_seqs) for v in (dist["distillation_losses"], pg, kl)]
    ref = coef * agg[0] + agg[1] + kl_coef * agg[2]
    (ref * g_up).backward()

    loss_fn = distillation_ppo_loss(distillation_loss_coef=coef, loss_agg_mode=mode, clip_ratio_low=low,
                                    clip_ratio_high=high, clip_ratio_c=c, kl_loss_coef=kl_coef,
                                    kl_loss_type=kl_type)
    processor = make_forward_kl_topk(tail=True)
    ctx = LossContext.from_counts(n_tok, float(n_seqs))
    for parts in (1, 3, 8):
        lg = logits.float().requires_grad_()
        lp_in = lp.clone().requires_grad_()
        total = torch.zeros(())
        met_sum: dict[str, float] = {}
        for idx in micro_batches(seq_ids, parts, g):
            if idx.numel() == 0:
                continue
            teacher = {"teacher_ids": ids[idx], "teacher_logprobs": t_lp[idx]}
            outputs = processor(student_logits=lg[idx], data=teacher, data_format="thd")
            outputs["log_probs"] = lp_in[idx]
            data = {"loss_mask": mask[idx], "seq_ids": 7 * seq_ids[idx] + 1000, "advantages": adv[idx],
                    "old_log_probs": old[idx], "ref_log_probs": ref_lp[idx]}
            loss, met = loss_fn(outputs, data, ctx)
            total = total + loss
            for key, val in met.items():
                assert not val.requires_grad
                met_sum[key] = met_sum.get(key, 0.0) + float(val)
        (total * g_up).backward()
        assert_rel_close(total, ref.detach(), 1e-5, f"dppo {mode} value")
        assert_rel_close(lg.grad, lg64.grad, 1e-5, f"dppo {mode} logits grad")
        assert_rel_close(lp_in.grad, lp64.grad, 1e-5, f"dppo {mode} log_probs grad")
        expect = {"loss": float(ref), "distillation_loss": float(agg[0]), "pg_loss": float(agg[1]),
                  "kl_loss": float(agg[2]),
                  "student_mass": float((dist["student_mass"] * mask).sum() / n_tok),
                  "teacher_mass": float((dist["teacher_mass"] * mask).sum() / n_tok),
                  "topk_overlap": float((dist["topk_overlap"] * mask).sum() / n_tok)}
        for key, val in expect.items():
            assert math.isclose(met_sum[key], val, rel_tol=1e-5, abs_tol=1e-6), (key, met_sum[key], val)


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
def test_distillation_only_never_reads_poisoned_policy_inputs(mode, monkeypatch):
    """Under ``distillation_only`` NaN policy inputs that are present are never read; the loss and
    the logits gradient equal 1.3 * agg(clamped KL)."""
    n_seqs = 7
    g, seq_ids, mask, logits, ids, t_lp, lp, *_ = _chain_batch(n_seqs, 900 + AGG_MODES.index(mode))
    n_tok = float(mask.sum())
    g_up = float(torch.randn((), generator=g)) + 2.0
    lg64 = logits.float().double().requires_grad_()
    ref_dist = ref_forward_kl_topk(lg64, ids, t_lp, clamp=-7.0)
    ref = 1.3 * ref_agg(ref_dist["distillation_losses"], mask, seq_ids, mode, n_tok, n_seqs)
    (ref * g_up).backward()

    def _boom(*a, **kw):
        raise AssertionError("policy loss computed under distillation_only")
    monkeypatch.setattr(policy, "ppo_policy_loss", _boom)

    loss_fn = distillation_ppo_loss(distillation_loss_coef=1.3, loss_agg_mode=mode, kl_loss_coef=0.1)
    processor = make_forward_kl_topk(tail=False, log_prob_min_clamp=-7.0)
    ctx = LossContext.from_counts(n_tok, float(n_seqs), distillation_only=True)
    lg = logits.float().requires_grad_()
    poison = torch.full((seq_ids.numel(),), float("nan"))
    total = torch.zeros(())
    for idx in micro_batches(seq_ids, 3, g):
        if idx.numel() == 0:
            continue
        outputs = _Recording(processor(student_logits=lg[idx], data={"teacher_ids": ids[idx],
                                                                     "teacher_logprobs": t_lp[idx]}))
        outputs["log_probs"] = poison[idx].clone().requires_grad_()
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
        loss_fn({"log_probs": lp[:5]}, {"loss_mask": mask[:5], "seq_ids": seq_ids[:5]}, ctx)


def test_combined_loss_rejects_bad_input():
    outputs, data, ctx = _batch(5, 80)
    only = LossContext(global_num_tokens=ctx.global_num_tokens, global_num_seqs=ctx.global_num_seqs,
                       distillation_only=True)
    loss_fn = distillation_ppo_loss()
    with pytest.raises(ValueError, match="distillation_losses"):
        loss_fn({"log_probs": outputs["log_probs"]}, data, only)
    with pytest.raises(ValueError, match="log_probs"):
        loss_fn({"distillation_losses": outputs["distillation_losses"]}, data, ctx)
    with pytest.raises(ValueError, match="advantages"):
        loss_fn(outputs, {k: v for k, v in data.items() if k != "advantages"}, ctx)
    with pytest.raises(ValueError, match="loss_mask"):
        loss_fn(outputs, {k: v for k, v in data.items() if k != "loss_mask"}, ctx)
    with pytest.raises(ValueError, match="ref_log_probs"):
        no_ref = {k: v for k, v in data.items() if k != "ref_log_probs"}
        distillation_ppo_loss(kl_loss_coef=0.1)(outputs, no_ref, ctx)
    bad = ((dict(loss_agg_mode="mean"), "loss_agg_mode"), (dict(kl_loss_type="k2"), "kl_loss_type"),
           (dict(kl_loss_coef=-1.0), "kl_loss_coef"), (dict(clip_ratio_c=0.9), "clip_ratio_c"))
    for kwargs, name in bad:
        with pytest.raises(ValueError, match=name):
            distillation_ppo_loss(**kwargs)
