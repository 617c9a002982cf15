"""distillation_ppo_loss: combined value and gradients, split invariance, and the skip contract."""

from __future__ import annotations

import pytest
import torch

import mcore_engine.losses.distillation_ppo as dppo
import mcore_engine.losses.policy as policy
from mcore_engine.losses import AGG_MODES, LossContext, distillation_ppo_loss
from tests.reference import random_packed_batch, random_split, ref_agg, ref_kl, ref_ppo_tokens
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
