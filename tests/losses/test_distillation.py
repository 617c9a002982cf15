"""Top-k distillation processors and the overlap metric against a float64 full-vocab reference.

One process for the 1-shard checks; one gloo launch (2 ranks) for the vocab-parallel processor
(TP=2, padded vocab, with and without the clamp) and for data-parallel additivity of
``distillation_ppo_loss`` contributions (distillation + PPO, and PPO + k3 KL).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mcore_engine.losses import (
    LossContext,
    distillation_ppo_loss,
    forward_kl_topk,
    forward_kl_topk_tail,
    make_forward_kl_topk,
    topk_overlap,
)
from tests.reference import (
    make_teacher,
    ppo_inputs,
    random_packed_batch,
    ref_agg,
    ref_forward_kl_topk,
    ref_kl,
    ref_ppo_tokens,
)
from tests.utils import REL_TOL, assert_rel_close, run_distributed

KEYS = ("distillation_losses", "student_mass", "teacher_mass", "topk_overlap")


def _check_processor(fn, logits, data, ref, dtype, what, grad_shard=slice(None)):
    """Values of every output and the gradient of sum(g * distillation_losses) vs the reference."""
    tol = REL_TOL[dtype]
    out = fn(logits, data, "thd")
    assert set(out) == set(KEYS), f"{what}: keys {sorted(out)}"
    lead = logits.shape[:-1]
    for key in KEYS:
        if key == "topk_overlap" and dtype != torch.float32:
            continue                                     # bf16 ties make the student's top-k order ambiguous
        assert out[key].dtype == torch.float32 and out[key].shape == lead, f"{what}: {key} shape/dtype"
        assert_rel_close(out[key], ref[key].reshape(lead), tol, f"{what}: {key}")
    g = torch.randn(lead, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    (grad,) = torch.autograd.grad((out["distillation_losses"] * g.float()).sum(), logits)
    return grad, g


@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_kl_topk_single_shard(tail, dtype):
    g = torch.Generator().manual_seed(20 + tail + 2 * (dtype == torch.float32))
    t, v, k = 37, 203, 7
    logits = (torch.randn(1, t, v, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    ids, tlp = make_teacher(t, v, k, g)
    data = {"teacher_ids": ids, "teacher_logprobs": tlp}           # flat [T, K] for [1, T, V] logits
    before = (logits.detach().clone(), ids.clone(), tlp.clone())
    fn = forward_kl_topk_tail if tail else forward_kl_topk
    ref_logits = logits.detach().double().requires_grad_()
    ref = ref_forward_kl_topk(ref_logits, ids.view(1, t, k), tlp.view(1, t, k), tail=tail)
    grad, up = _check_processor(fn, logits, data, ref, dtype, f"tail={tail} {dtype}")
    (ref_grad,) = torch.autograd.grad((ref["distillation_losses"] * up).sum(), ref_logits)
    assert_rel_close(grad, ref_grad, REL_TOL[dtype], f"tail={tail} {dtype}: grad")
    for b, a in zip(before, (logits.detach(), ids, tlp), strict=True):
        assert torch.equal(a, b), "inputs must not be modified"


def test_clamped_factory_and_padded_vocab():
    g = torch.Generator().manual_seed(31)
    b, s, v, vocab, k = 2, 5, 64, 61, 5
    logits = (torch.randn(b, s, v, generator=g, dtype=torch.float64) * 4).float().requires_grad_()
    ids, tlp = make_teacher(b * s, vocab, k, g, sharpness=1.0)
    ids, tlp = ids.view(b, s, k), tlp.view(b, s, k)
    clamp = -3.0
    fn = make_forward_kl_topk(log_prob_min_clamp=clamp, vocab_size=vocab, chunk_size=3)
    ref_logits = logits.detach().double().requires_grad_()
    ref = ref_forward_kl_topk(ref_logits, ids, tlp, clamp=clamp, vocab_size=vocab)
    lq = torch.log_softmax(ref_logits.detach()[..., :vocab], -1).gather(-1, ids)
    assert (lq < clamp).any() and (tlp < clamp).any(), "inputs must exercise the clamp"
    grad, up = _check_processor(fn, logits, {"teacher_ids": ids, "teacher_logprobs": tlp}, ref,
                                torch.float32, "clamped bshd")
    (ref_grad,) = torch.autograd.grad((ref["distillation_losses"] * up).sum(), ref_logits)
    assert_rel_close(grad, ref_grad, REL_TOL[torch.float32], "clamped bshd: grad")
    assert (grad[..., vocab:] == 0).all(), "padded vocab entries get no gradient"
    no_overlap = make_forward_kl_topk(tail=True, compute_overlap=False)
    assert "topk_overlap" not in no_overlap(logits, {"teacher_ids": ids, "teacher_logprobs": tlp}, "bshd")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tail", [False, True])
@pytest.mark.parametrize("clamp", [None, -6.0])
def test_forward_kl_topk_clamp_chunks_and_extreme_rows(tail, clamp, dtype):
    """Rows far from the teacher and rows with most student mass on S; half the rows with ids that
    are not the teacher's top-k; chunked and unchunked; inputs unchanged."""
    seed = 1000 + 10 * tail + (clamp is not None) + 100 * (dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    t, v, k = 29, 97, 5
    logits = torch.randn(t, v, generator=g, dtype=torch.float64) * 2.0
    ids, t_lp = make_teacher(t, v, k, g, sharpness=2.5)
    logits[0].scatter_(0, ids[0], -12.0)                  # very low student log-probs on S
    logits[1].scatter_(0, ids[1], 8.0)                    # q_tail ~ 1e-3
    ids_r, t_lp_r = make_teacher(t, v, k, g, sharpness=2.5, random_ids=True)
    ids[2::2], t_lp[2::2] = ids_r[2::2], t_lp_r[2::2]
    logits = logits.to(dtype)
    g_up = torch.randn(t, generator=g, dtype=torch.float64)
    fn = forward_kl_topk_tail if tail else forward_kl_topk
    x64 = logits.double().requires_grad_()
    ref = ref_forward_kl_topk(x64, ids, t_lp, tail=tail, clamp=clamp)
    ref["distillation_losses"].backward(g_up)
    tol = REL_TOL[torch.float32] if dtype == torch.float32 else 1e-5   # values: fp32 math on exact inputs
    for chunk in (None, 4):
        x = logits.clone().requires_grad_()
        data = {"teacher_ids": ids.clone(), "teacher_logprobs": t_lp.clone()}
        out = fn(x, data, "thd", log_prob_min_clamp=clamp, chunk_size=chunk)
        for key in KEYS:
            assert out[key].dtype == torch.float32 and out[key].shape == (t,)
            assert_rel_close(out[key], ref[key].detach(), tol, f"{key} tail={tail} clamp={clamp} {dtype}")
        out["distillation_losses"].backward(g_up.float())
        assert x.grad.dtype == dtype
        assert_rel_close(x.grad, x64.grad, REL_TOL[dtype], f"grad tail={tail} clamp={clamp} {dtype}")
        assert torch.equal(data["teacher_ids"], ids) and torch.equal(data["teacher_logprobs"], t_lp)


@pytest.mark.parametrize("gap", [20.0, 40.0])
def test_tail_kl_of_a_concentrated_student(gap):
    """The student keeps q_tail ~ V e^-gap (1e-7 .. 1e-16) outside the teacher's set S, the teacher
    p_tail = 0.3: 1 - sum_S q would cancel in fp32; value (per token) and gradient stay exact."""
    g = torch.Generator().manual_seed(int(gap))
    t, v, k = 6, 97, 5
    logits = torch.randn(t, v, generator=g, dtype=torch.float64) * 2
    ids = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(t)])
    logits.scatter_(1, ids, gap + torch.randn(t, k, generator=g, dtype=torch.float64) * 0.5)
    t_lp = torch.log(torch.tensor([0.3, 0.2, 0.1, 0.05, 0.05], dtype=torch.float64)).expand(t, k).float()
    x64 = logits.float().double().requires_grad_()
    ref = ref_forward_kl_topk(x64, ids, t_lp, tail=True)
    g_up = torch.randn(t, generator=g, dtype=torch.float64)
    ref["distillation_losses"].backward(g_up)
    x = logits.float().requires_grad_()
    out = forward_kl_topk_tail(x, {"teacher_ids": ids, "teacher_logprobs": t_lp}, compute_overlap=False)
    out["distillation_losses"].backward(g_up.float())
    err = ((out["distillation_losses"].double() - ref["distillation_losses"]).abs()
           / ref["distillation_losses"].abs()).max()
    assert err < 1e-5, err
    assert_rel_close(x.grad, x64.grad, 1e-4, f"tail grad, q_tail ~ e^-{gap}")


def test_padded_vocab_ignores_huge_padding_logits():
    """``vocab_size`` < V: padding logits of 50 get no mass and no gradient; [1, T, V] with [T, K]."""
    g = torch.Generator().manual_seed(77)
    t, v, k, v_true = 23, 64, 4, 59
    logits = torch.randn(1, t, v, generator=g, dtype=torch.float64) * 2
    logits[..., v_true:] = 50.0
    ids, t_lp = make_teacher(t, v_true, k, g, sharpness=2.5)
    g_up = torch.randn(t, generator=g, dtype=torch.float64)
    x64 = logits[0, :, :v_true].clone().requires_grad_()
    ref = ref_forward_kl_topk(x64, ids, t_lp, tail=True)
    ref["distillation_losses"].backward(g_up)
    fn = make_forward_kl_topk(tail=True, vocab_size=v_true)
    x = logits.float().requires_grad_()
    out = fn(student_logits=x, data={"teacher_ids": ids, "teacher_logprobs": t_lp}, data_format="thd")
    assert out["distillation_losses"].shape == (1, t)
    for key in ("distillation_losses", "student_mass", "topk_overlap"):
        assert_rel_close(out[key][0], ref[key].detach(), 1e-5, key)
    out["distillation_losses"].backward(g_up.float()[None])
    assert (x.grad[..., v_true:] == 0).all()
    assert_rel_close(x.grad[0, :, :v_true], x64.grad, 1e-5, "padded grad")


def test_topk_overlap_and_bad_input():
    g = torch.Generator().manual_seed(41)
    teacher = torch.stack([torch.randperm(30, generator=g)[:6] for _ in range(50)]).view(5, 10, 6)
    student = torch.stack([torch.randperm(30, generator=g)[:4] for _ in range(50)]).view(5, 10, 4)
    brute = (teacher[..., :, None] == student[..., None, :]).any(-1).float().mean(-1)
    assert torch.equal(topk_overlap(teacher, student), brute)
    assert 0 < brute.mean() < 1
    assert torch.equal(topk_overlap(teacher, teacher.flip(-1)), torch.ones(5, 10))
    with pytest.raises(ValueError, match="student_ids"):
        topk_overlap(teacher, student[:2])
    logits = torch.randn(4, 10)
    data = {"teacher_ids": torch.zeros(4, 2, dtype=torch.long), "teacher_logprobs": torch.full((4, 2), -1.0)}
    with pytest.raises(ValueError, match="data_format"):
        forward_kl_topk(logits, data, "sbhd")
    with pytest.raises(ValueError, match="teacher_logprobs"):
        forward_kl_topk(logits, {"teacher_ids": data["teacher_ids"]}, "thd")
    with pytest.raises(ValueError, match="log_prob_min_clamp"):
        make_forward_kl_topk(log_prob_min_clamp=1.0)


def _two_rank_checks(rank, world, full_logits, ids, tlp, vocab, seq_ids, mask, adv):
    # --- TP=2: each rank holds its vocab shard of the same logits; padded vocab ---
    v_local = full_logits.shape[-1] // world
    shard = full_logits[..., rank * v_local:(rank + 1) * v_local].float().clone().requires_grad_()
    fn = make_forward_kl_topk(tail=True, vocab_size=vocab, group=dist.group.WORLD, chunk_size=4)
    ref_logits = full_logits.clone().requires_grad_()
    ref = ref_forward_kl_topk(ref_logits, ids, tlp, tail=True, vocab_size=vocab)
    grad, up = _check_processor(fn, shard, {"teacher_ids": ids, "teacher_logprobs": tlp}, ref,
                                torch.float32, f"TP rank {rank}")
    (ref_grad,) = torch.autograd.grad((ref["distillation_losses"] * up).sum(), ref_logits)
    assert_rel_close(grad, ref_grad[..., rank * v_local:(rank + 1) * v_local], REL_TOL[torch.float32],
                     f"TP rank {rank}: grad")

    # --- TP=2 with the clamp: tail KL, 61 real ids of 64, log_prob_min_clamp=-9 ---
    g = torch.Generator().manual_seed(2024)
    t2, v2, k2, vocab2 = 19, 64, 6, 61
    v2_local = v2 // world
    logits2 = torch.randn(t2, v2, generator=g, dtype=torch.float64) * 2
    ids2, tlp2 = make_teacher(t2, vocab2, k2, g, sharpness=2.5)
    g_up = torch.randn(t2, generator=g, dtype=torch.float64)
    x64 = logits2[:, :vocab2].float().double().requires_grad_()
    ref2 = ref_forward_kl_topk(x64, ids2, tlp2, tail=True, clamp=-9.0)
    ref2["distillation_losses"].backward(g_up)
    shard2 = logits2[:, rank * v2_local:(rank + 1) * v2_local].float().requires_grad_()
    out2 = forward_kl_topk_tail(shard2, {"teacher_ids": ids2, "teacher_logprobs": tlp2},
                                log_prob_min_clamp=-9.0, vocab_size=vocab2, group=dist.group.WORLD)
    for key in KEYS:
        assert_rel_close(out2[key], ref2[key].detach(), 1e-5, f"TP=2 clamped {key}")
    out2["distillation_losses"].backward(g_up.float())
    full_grad = torch.cat([x64.grad, torch.zeros(t2, v2 - vocab2, dtype=torch.float64)], 1)
    own = slice(rank * v2_local, (rank + 1) * v2_local)
    assert_rel_close(shard2.grad, full_grad[:, own], 1e-5, "TP=2 clamped grad")

    # --- DP=2: each rank holds half of the sequences; contributions all-reduce to the global loss ---
    ctx = LossContext.from_counts(mask.sum(), len(set(seq_ids[mask].tolist())), dp_size=world)
    t = seq_ids.numel()
    per_token = torch.randn(2, t, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    mine = torch.nonzero(seq_ids % world == rank).flatten()
    dl = per_token[0].float().requires_grad_()
    lp = (-per_token[1].abs()).float().requires_grad_()
    loss_fn = distillation_ppo_loss(loss_agg_mode="seq-mean-token-mean", distillation_loss_coef=0.5)
    outputs = {"distillation_losses": dl[mine], "log_probs": lp[mine]}
    data = {"loss_mask": mask[mine], "seq_ids": seq_ids[mine], "advantages": adv[mine]}
    loss, _ = loss_fn(outputs, data, ctx)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    grads = torch.stack([dl.grad, lp.grad])
    dist.all_reduce(grads)
    dl_ref, lp_ref = per_token[0].clone().requires_grad_(), (-per_token[1].abs()).requires_grad_()
    n, b = ctx.global_num_tokens.double(), ctx.global_num_seqs.double()
    pg = ref_ppo_tokens(lp_ref, lp_ref.detach(), adv, 0.2, 0.2, 3.0)[0]
    ref_loss = (0.5 * ref_agg(dl_ref, mask, seq_ids, "seq-mean-token-mean", n, b)
                + ref_agg(pg, mask, seq_ids, "seq-mean-token-mean", n, b))
    ref_loss.backward()
    assert_rel_close(total, ref_loss, REL_TOL[torch.float32], "DP=2 loss")
    assert_rel_close(grads, torch.stack([dl_ref.grad, lp_ref.grad]), REL_TOL[torch.float32], "DP=2 grads")

    # --- DP=2, PPO + k3 KL without a distillation output: all-reduced sum == whole-batch loss ---
    g = torch.Generator().manual_seed(2025)
    seq2, mask2 = random_packed_batch(10, g)
    mask2 = mask2.double()
    t2 = seq2.numel()
    lp2, old2, adv2 = (x.float() for x in ppo_inputs(t2, g))
    ref_lp2 = (old2.double() + torch.randn(t2, generator=g, dtype=torch.float64) * 0.3).float()
    mode, n2 = "seq-mean-token-mean", float(mask2.sum())
    lp64 = lp2.double().requires_grad_()
    pg2 = ref_ppo_tokens(lp64, old2, adv2, 0.2, 0.2, 3.0)[0]
    ref_loss2 = (ref_agg(pg2, mask2, seq2, mode, n2, 10) + 0.1 * ref_agg(ref_kl(lp64, ref_lp2, "k3"), mask2,
                                                                          seq2, mode, n2, 10))
    ref_loss2.backward()
    loss_fn2 = distillation_ppo_loss(loss_agg_mode=mode, kl_loss_coef=0.1, kl_loss_type="k3")
    ctx2 = LossContext.from_counts(n2, 10.0, dp_size=world)
    lp_in = lp2.clone().requires_grad_()
    idx = torch.nonzero(seq2 % world == rank).flatten()
    loss2, _ = loss_fn2({"log_probs": lp_in[idx]}, {"loss_mask": mask2[idx], "seq_ids": seq2[idx],
                                                    "advantages": adv2[idx], "old_log_probs": old2[idx],
                                                    "ref_log_probs": ref_lp2[idx]}, ctx2)
    loss2.backward()
    total2, grad2 = loss2.detach().clone(), lp_in.grad.clone()
    dist.all_reduce(total2)
    dist.all_reduce(grad2)
    assert_rel_close(total2, ref_loss2.detach(), 1e-5, "DP=2 PPO + KL loss")
    assert_rel_close(grad2, lp64.grad, 1e-5, "DP=2 PPO + KL grad")


def test_two_ranks_tensor_and_data_parallel():
    g = torch.Generator().manual_seed(51)
    t, v, vocab, k = 13, 2 * 45, 87, 6
    full = torch.randn(1, t, v, generator=g, dtype=torch.float64) * 3
    ids, tlp = make_teacher(t, vocab, k, g)
    assert ((ids < v // 2).any(-1) & (ids >= v // 2).any(-1)).sum() > t // 2, "ids on both shards"
    seq_ids, mask = random_packed_batch(11, g)
    adv = torch.randn(seq_ids.numel(), generator=g)
    run_distributed(_two_rank_checks, 2, full, ids.view(1, t, k), tlp.view(1, t, k), vocab,
                    seq_ids, mask, adv)


def test_processor_runs_the_configured_distillation_and_loss_end_to_end():
    from mcore_engine.processor import process_lm_head_logits

    g = torch.Generator().manual_seed(61)
    t, v, k = 19, 71, 4
    logits = (torch.randn(1, t, v, generator=g, dtype=torch.float64) * 2).float().requires_grad_()
    ids, tlp = make_teacher(t, v, k, g)
    batch = {"teacher_ids": ids.view(1, t, k), "teacher_logprobs": tlp.view(1, t, k)}
    labels = torch.zeros(1, t, dtype=torch.long)
    out = process_lm_head_logits(logits, labels, 0.5, calculate_sum_pi_squared=False, calculate_entropy=False,
                                 distillation_use_topk=True, distillation_only=True,
                                 logits_processor_func=make_forward_kl_topk(tail=True), batch=batch)
    assert set(out) == set(KEYS), "distillation_only: no log_probs, the processor's keys merged in"
    ref_logits = logits.detach().double().requires_grad_()
    ref = ref_forward_kl_topk(ref_logits / 0.5, batch["teacher_ids"], batch["teacher_logprobs"], tail=True)
    mask = torch.rand(t, generator=g) < 0.8
    ctx = LossContext.from_counts(mask.sum(), 1, distillation_only=True)
    data = {"loss_mask": mask, "seq_ids": torch.zeros(t, dtype=torch.long)}
    loss, metrics = distillation_ppo_loss()({kk: vv.reshape(-1) for kk, vv in out.items()}, data, ctx)
    ref_loss = (ref["distillation_losses"].reshape(-1) * mask).sum() / mask.sum()
    assert_rel_close(loss, ref_loss, REL_TOL[torch.float32], "end-to-end loss")
    (grad,) = torch.autograd.grad(loss, logits)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_logits)
    assert_rel_close(grad, ref_grad, REL_TOL[torch.float32], "end-to-end grad")
    assert_rel_close(metrics["topk_overlap"], (ref["topk_overlap"].reshape(-1) * mask).sum() / mask.sum(),
                     REL_TOL[torch.float32], "end-to-end overlap")
