"""Independent verification of ``mcore_engine.ops`` and ``process_lm_head_logits`` against API.md.

Written without reading the other op tests or ``tests/utils.py``'s reference: the float64 reference
below is built straight from API.md's formulas on the GATHERED logits (padded ids dropped) and
differentiated by autograd in float64. Inputs are deliberately unlike the other tests: leading shape
``[3, 5]`` with ``V_local = 77``, logits scale 30, near-one-hot rows, temperatures 0.3 / 3.0 /
per-token tensors, padded vocab whose padding spans the rank boundary, k = 1 and k = V_global,
teacher ids and labels all on the other rank, an active ``log_prob_min_clamp`` and ``kl_tail``.
Values AND gradients (random upstream) on 1 rank in-process and on 2 gloo ranks in ONE launch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from mcore_engine.ops import (
    is_scalar_unit_temperature,
    scale_logits_by_temperature,
    vocab_parallel_entropy,
    vocab_parallel_forward_kl_topk,
    vocab_parallel_log_probs,
    vocab_parallel_sum_pi_squared,
    vocab_parallel_topk,
)
from mcore_engine.processor import process_lm_head_logits
from tests.utils import run_distributed

V_LOCAL = 77
LEAD = (3, 5)
K = 6
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(a: torch.Tensor, e: torch.Tensor) -> float:
    a, e = a.detach().double(), e.detach().double()
    assert a.shape == e.shape, f"shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert torch.isfinite(a).all(), "non-finite values"
    return float((a - e).norm() / e.norm().clamp_min(1e-300))


# ----------------------------------------------------------------------------------------------
# float64 reference from API.md
# ----------------------------------------------------------------------------------------------
def _reference(full: torch.Tensor, vocab_size: int, temperature, labels, tids, tlp, clamp, tail,
               dtype: torch.dtype = torch.float64):
    """API.md math on the gathered logits ``full [..., V_global]`` in ``dtype`` -> (outputs, leaf).

    float64 is THE reference; the same formulas in plain float32 autograd give the error budget of a
    naive fp32 implementation (CCE-style ``|ref - op| <= |ref - naive_fp32| + tol``), which only
    matters where fp32 itself cannot reach 1e-5 (near-one-hot rows: ``1 - p_max`` cancels).
    """
    leaf = full.detach().to(dtype).requires_grad_(True)
    x = leaf[..., :vocab_size]
    if isinstance(temperature, torch.Tensor):
        t = temperature.to(dtype).broadcast_to(full.shape[:-1])[..., None]
    else:
        t = float(temperature)
    z = x / t
    lse = z.logsumexp(-1)
    logp = z - lse[..., None]
    p = logp.exp()
    out = {
        "log_probs": logp.gather(-1, labels[..., None])[..., 0],
        "entropy": -(p * logp).sum(-1),  # = lse - sum p z, without the large-|z| cancellation
        "sum_pi_squared": (p * p).sum(-1),
    }
    big_p = tlp.to(dtype).exp()
    log_q = logp.gather(-1, tids)
    lp = tlp.to(dtype)
    if clamp is None:
        terms = big_p * (lp - log_q)
    else:
        terms = big_p * (lp.clamp_min(clamp) - log_q.clamp_min(clamp))
    kl = torch.where(big_p > 0, terms, torch.zeros_like(terms)).sum(-1)
    if tail:
        in_s = torch.zeros(x.shape, dtype=torch.bool).scatter_(-1, tids, True)
        q_t = (p * ~in_s).sum(-1)
        p_t = 1 - big_p.sum(-1)
        kl = kl + p_t * (p_t.log() - q_t.log())
    out["distillation_losses"] = kl
    out["student_mass"] = log_q.exp().sum(-1)
    out["teacher_mass"] = big_p.sum(-1)
    return out, leaf


def _ref_grad(out, leaf, ups: dict[str, torch.Tensor]) -> torch.Tensor:
    loss = sum((out[k] * u.to(leaf.dtype)).sum() for k, u in ups.items())
    (g,) = torch.autograd.grad(loss, leaf, retain_graph=True)
    return g


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    name: str
    scale: float = 3.0
    temp: object = 1.0  # number, "tok" ([3, 5] tensor) or "tok_b" ([3, 1] tensor)
    pad: int = 0  # vocab_size = V_global - pad
    one_hot: bool = False
    other_rank: bool = False  # labels and teacher ids all in the LAST rank's shard
    clamp: bool = False
    tail: bool = False
    chunk: int | None = None
    neg_inf_teacher: bool = False


CASES = [
    Case("plain"),
    Case("scale30_t0.3", scale=30.0, temp=0.3, chunk=4),
    Case("t3.0_tail", temp=3.0, tail=True),
    Case("per_token_t", temp="tok", chunk=7),
    Case("per_token_t_bcast_clamp", temp="tok_b", clamp=True),
    Case("pad_across_boundary", pad=90, temp=0.3),  # V_global 154 -> vocab 64: rank 1 all padding
    Case("pad_partial", pad=20, tail=True, chunk=2),
    Case("near_one_hot", one_hot=True),
    Case("other_rank_clamp_tail", other_rank=True, clamp=True, tail=True, temp=3.0),
    Case("teacher_neg_inf", neg_inf_teacher=True, scale=30.0),
]


def _make(case: Case, world: int, dtype: torch.dtype, seed: int):
    """Full (gathered) inputs, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    v_global = V_LOCAL * world
    vocab = v_global - (case.pad if world > 1 else case.pad % V_LOCAL)
    full = torch.randn(*LEAD, v_global, generator=g, dtype=torch.float64) * case.scale
    if case.one_hot:
        hot = torch.randint(0, vocab, LEAD, generator=g)
        full.scatter_(-1, hot[..., None], 14.0)
    full = full.to(dtype)
    lo = vocab - V_LOCAL + K if case.other_rank else 0  # all in the last shard (and > 0)
    lo = max(lo, 0)
    labels = torch.randint(lo, vocab, LEAD, generator=g)
    # teacher: top-k of some other distribution over [lo, vocab)
    teacher = torch.randn(*LEAD, vocab - lo, generator=g, dtype=torch.float64) * 2.0
    vals, idx = teacher.log_softmax(-1).topk(K, dim=-1)
    tids = idx + lo
    tlp = vals.float()
    if case.neg_inf_teacher:
        tlp[0, 1, -1] = float("-inf")
        tlp[2, 3, -2:] = float("-inf")
    if case.temp == "tok":
        temp = torch.rand(*LEAD, generator=g) * 3.5 + 0.25
    elif case.temp == "tok_b":
        temp = torch.rand(LEAD[0], 1, generator=g) * 3.5 + 0.25
    else:
        temp = case.temp
    clamp = None
    if case.clamp:
        t = temp.double()[..., None] if isinstance(temp, torch.Tensor) else temp
        z = full.double()[..., :vocab] / t
        lq = z.log_softmax(-1).gather(-1, tids).flatten().sort().values
        i = lq.numel() // 2
        clamp = float((lq[i - 1] + lq[i]) / 2)
    return full, vocab, labels, tids, tlp, temp, clamp


def _shard(full: torch.Tensor, rank: int) -> torch.Tensor:
    return full[..., rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_(True)


def run_cases(rank: int, world: int, group, dtype: torch.dtype, seed0: int = 0) -> dict[str, float]:
    """Every public op and the processor on every case; returns {what: rel err}; asserts tolerances."""
    errs: dict[str, float] = {}
    for ci, case in enumerate(CASES):
        _check_case(rank, world, group, dtype, case, seed0 + 100 * ci, errs)
    return errs


def _check_case(rank: int, world: int, group, dtype: torch.dtype, case: Case, seed: int,
                errs: dict[str, float]) -> None:
    tol = TOL[dtype]
    full, vocab, labels, tids, tlp, temp, clamp = _make(case, world, dtype, seed)
    ref, leaf = _reference(full, vocab, temp, labels, tids, tlp, clamp, case.tail)
    if dtype == torch.float32:
        naive, leaf32 = _reference(full, vocab, temp, labels, tids, tlp, clamp, case.tail, torch.float32)
    g = torch.Generator().manual_seed(seed + 1)
    ups = {k: torch.randn(*LEAD, generator=g) for k in ("log_probs", "entropy", "sum_pi_squared",
                                                       "distillation_losses")}
    x = _shard(full, rank)
    sl = slice(rank * V_LOCAL, (rank + 1) * V_LOCAL)
    kw = dict(temperature=temp, group=group, chunk_size=case.chunk, vocab_size=vocab)
    saved = (x.detach().clone(), labels.clone(), tids.clone(), tlp.clone(),
             temp.clone() if isinstance(temp, torch.Tensor) else temp)

    def budget(key: str | None, key_ups: dict[str, torch.Tensor] | None = None) -> float:
        """tol + 2 x the naive fp32 error of the same quantity, capped at 5 x tol (fp32 logits only).

        Needed where fp32 itself cannot reach 1e-5: near-one-hot rows (``1 - p_max`` cancels) and
        |z| ~ 300 (scale 30 / t 0.3: rounding z alone moves probabilities by ~2e-5 relative).
        """
        if dtype != torch.float32:
            return tol
        if key_ups is None:
            naive_err = _rel(naive[key], ref[key])
        else:
            naive_err = _rel(_ref_grad(naive, leaf32, key_ups), _ref_grad(ref, leaf, key_ups))
        return min(tol + 2 * naive_err, 5 * tol)

    def check(what: str, out: torch.Tensor, ref_out: torch.Tensor, key: str) -> None:
        assert out.dtype == torch.float32 and out.shape == LEAD, (what, out.dtype, out.shape)
        e = _rel(out, ref_out)
        errs[f"{case.name}/{what}"] = e
        b = budget(key)
        assert e <= b, f"{case.name}/{what}: value rel err {e:.3e} > {b:.3e}"

    def check_grad(what: str, gx: torch.Tensor, key_ups: dict[str, torch.Tensor]) -> None:
        assert gx.dtype == dtype and gx.shape == x.shape
        e = _rel(gx, _ref_grad(ref, leaf, key_ups)[..., sl])
        errs[f"{case.name}/{what}"] = e
        b = budget(None, key_ups)
        assert e <= b, f"{case.name}/{what}: grad rel err {e:.3e} > {b:.3e}"

    # --- single ops: value + gradient ---
    singles = {
        "log_probs": lambda: vocab_parallel_log_probs(x, labels, **kw),
        "entropy": lambda: vocab_parallel_entropy(x, **kw),
        "sum_pi_squared": lambda: vocab_parallel_sum_pi_squared(x, **kw),
    }
    for key, fn in singles.items():
        out = fn()
        check(key, out, ref[key], key)
        (gx,) = torch.autograd.grad((out * ups[key]).sum(), x)
        check_grad(f"{key}.grad", gx, {key: ups[key]})
    kl = vocab_parallel_forward_kl_topk(x, tids, tlp, temperature=temp, group=group,
                                        chunk_size=case.chunk, log_prob_min_clamp=clamp,
                                        vocab_size=vocab, kl_tail=case.tail)
    for key in ("distillation_losses", "student_mass", "teacher_mass"):
        check(key, kl[key], ref[key], key)
    assert not kl["student_mass"].requires_grad and not kl["teacher_mass"].requires_grad
    (gx,) = torch.autograd.grad((kl["distillation_losses"] * ups["distillation_losses"]).sum(), x)
    check_grad("kl.grad", gx, {"distillation_losses": ups["distillation_losses"]})
    if vocab < (rank + 1) * V_LOCAL:  # padded columns of this shard get exactly 0 gradient
        assert (gx[..., max(vocab - rank * V_LOCAL, 0):] == 0).all()

    # --- processor: everything in one call (no kl_tail there) ---
    if not case.tail:
        out = process_lm_head_logits(
            x, labels, temp, calculate_sum_pi_squared=True, calculate_entropy=True,
            distillation_use_topk=True, distillation_only=False,
            batch={"teacher_ids": tids, "teacher_logprobs": tlp}, vocab_size=vocab, group=group,
            chunk_size=case.chunk, log_prob_min_clamp=clamp)
        assert set(out) == {"log_probs", "entropy", "sum_pi_squared", "distillation_losses",
                            "student_mass", "teacher_mass"}, set(out)
        for key in out:
            check(f"proc.{key}", out[key], ref[key], key)
        (gx,) = torch.autograd.grad(sum((out[k] * u).sum() for k, u in ups.items()), x)
        check_grad("proc.grad", gx, ups)
        # distillation_only: no log_probs, label not even needed
        out = process_lm_head_logits(
            x, None, temp, calculate_sum_pi_squared=False, calculate_entropy=False,
            distillation_use_topk=True, distillation_only=True,
            batch={"teacher_ids": tids, "teacher_logprobs": tlp}, vocab_size=vocab, group=group,
            chunk_size=case.chunk, log_prob_min_clamp=clamp)
        assert set(out) == {"distillation_losses", "student_mass", "teacher_mass"}
        check("proc_donly.kl", out["distillation_losses"], ref["distillation_losses"],
              "distillation_losses")

    # --- top-k: k = 1, 5, V_global (the true vocab) ---
    zref = (full.double()[..., :vocab]
            / (temp.double().broadcast_to(LEAD)[..., None] if isinstance(temp, torch.Tensor) else temp))
    lref = zref.log_softmax(-1)
    for k in (1, 5, vocab):
        lp, ids = vocab_parallel_topk(x, k, temperature=temp, group=group, chunk_size=case.chunk,
                                      vocab_size=vocab)
        assert lp.shape == LEAD + (k,) and ids.shape == LEAD + (k,)
        assert lp.dtype == torch.float32 and ids.dtype == torch.int64
        assert not lp.requires_grad
        assert ((ids >= 0) & (ids < vocab)).all()
        assert (lp[..., 1:] <= lp[..., :-1]).all(), "top-k not sorted descending"
        assert (ids.sort(-1).values.diff(dim=-1) > 0).all(), "duplicate ids in top-k"
        e1 = _rel(lp, lref.topk(k, dim=-1).values)
        e2 = _rel(lp, lref.gather(-1, ids))
        errs[f"{case.name}/topk{k}"] = max(e1, e2)
        b = tol if dtype != torch.float32 else min(5 * tol, tol + 2 * _rel(  # as in budget() above
            zref.float().log_softmax(-1).topk(k, dim=-1).values, lref.topk(k, dim=-1).values))
        assert max(e1, e2) <= b, f"{case.name}/topk k={k}: {e1:.3e} {e2:.3e} > {b:.3e}"
        if k == vocab:
            assert (ids.sort(-1).values == torch.arange(vocab)).all()

    # --- inputs never modified ---
    assert torch.equal(x.detach(), saved[0]) and torch.equal(labels, saved[1])
    assert torch.equal(tids, saved[2]) and torch.equal(tlp, saved[3])
    if isinstance(temp, torch.Tensor):
        assert torch.equal(temp, saved[4])


# ----------------------------------------------------------------------------------------------
# zero tokens, bad input, -inf logits (shared by 1 and 2 ranks)
# ----------------------------------------------------------------------------------------------
def check_zero_tokens(rank: int, group) -> None:
    """Zero tokens is valid: empty fp32 outputs of the right shape, and backward works."""
    for lead in ((0,), (2, 0)):
        x = torch.randn(*lead, V_LOCAL, requires_grad=True)
        labels = torch.zeros(lead, dtype=torch.int64)
        tids = torch.zeros(lead + (K,), dtype=torch.int64)
        tlp = torch.zeros(lead + (K,))
        outs = [vocab_parallel_log_probs(x, labels, group=group, temperature=0.3),
                vocab_parallel_entropy(x, group=group, temperature=torch.ones(lead)),
                vocab_parallel_sum_pi_squared(x, group=group)]
        kl = vocab_parallel_forward_kl_topk(x, tids, tlp, group=group, kl_tail=True)
        outs += [kl["distillation_losses"], kl["student_mass"], kl["teacher_mass"]]
        proc = process_lm_head_logits(x, labels, 1.0, calculate_sum_pi_squared=True, calculate_entropy=True,
                                      distillation_use_topk=True, distillation_only=False,
                                      batch={"teacher_ids": tids, "teacher_logprobs": tlp}, group=group)
        outs += list(proc.values())
        for o in outs:
            assert o.shape == lead and o.dtype == torch.float32, (o.shape, o.dtype)
        (gx,) = torch.autograd.grad(sum(o.sum() for o in outs if o.requires_grad), x)
        assert gx.shape == x.shape
        lp, ids = vocab_parallel_topk(x, 3, group=group)
        assert lp.shape == lead + (3,) and ids.shape == lead + (3,) and ids.dtype == torch.int64


def _raises(fn, *words: str) -> None:
    with pytest.raises(ValueError) as info:
        fn()
    msg = str(info.value)
    for w in words:
        assert w in msg, f"ValueError message {msg!r} does not name {w!r}"


def check_bad_input(rank: int, world: int, group) -> None:
    """API.md's ValueErrors, each naming the offending argument."""
    vg = V_LOCAL * world
    x = torch.randn(*LEAD, V_LOCAL)
    lab = torch.randint(0, vg, LEAD)
    tids = torch.randint(0, vg, LEAD + (K,))
    tlp = torch.randn(LEAD + (K,)).clamp_max(0) - 1
    _raises(lambda: vocab_parallel_log_probs(x, torch.full(LEAD, vg), group=group), "labels")
    _raises(lambda: vocab_parallel_log_probs(x, torch.full(LEAD, -1), group=group), "labels")
    _raises(lambda: vocab_parallel_log_probs(x, torch.full(LEAD, vg - 1), group=group, vocab_size=vg - 1),
            "labels")  # a padded id is out of range
    _raises(lambda: vocab_parallel_log_probs(x, lab[:, :4], group=group), "labels")
    _raises(lambda: vocab_parallel_log_probs(x.long(), lab, group=group), "logits")
    _raises(lambda: vocab_parallel_entropy(x.long(), group=group), "logits")
    _raises(lambda: vocab_parallel_entropy(torch.randn(*LEAD, 0), group=group), "logits")
    for bad_t in (0.0, -1.0, float("nan"), float("inf"), torch.tensor(0.0),
                  torch.full(LEAD, 2.0).index_fill_(1, torch.tensor([2]), -0.5),
                  torch.full(LEAD, float("inf")), torch.ones(4), True):
        _raises(lambda bad_t=bad_t: vocab_parallel_entropy(x, temperature=bad_t, group=group), "temperature")
    _raises(lambda: vocab_parallel_topk(x, vg + 1, group=group), "k")
    _raises(lambda: vocab_parallel_topk(x, vg, group=group, vocab_size=vg - 3), "k")
    _raises(lambda: vocab_parallel_topk(x, 0, group=group), "k")
    _raises(lambda: vocab_parallel_forward_kl_topk(x, tids[..., :1, :], tlp, group=group), "teacher")
    _raises(lambda: vocab_parallel_forward_kl_topk(x, tids + vg, tlp, group=group), "teacher")
    _raises(lambda: vocab_parallel_forward_kl_topk(x, tids, tlp[..., :2], group=group), "teacher")
    flags = dict(calculate_sum_pi_squared=False, calculate_entropy=False, group=group)
    _raises(lambda: process_lm_head_logits(x, lab, 1.0, distillation_use_topk=False, distillation_only=True,
                                           **flags), "distillation_only")
    _raises(lambda: process_lm_head_logits(x, lab, 1.0, distillation_use_topk=True, distillation_only=False,
                                           batch={}, **flags), "teacher_ids")


def neg_inf_logits_outputs(rank: int, group) -> dict[str, bool]:
    """Logits with -inf entries (masked tokens) on the column where ANOTHER rank's label/teacher id is
    clamped to in this shard (the last valid column). Softmax, log-probs of finite entries and the KL
    are well defined (TP=1 gives them); returns which outputs came out finite and correct."""
    g = torch.Generator().manual_seed(11)
    world = 1 if group is None else dist.get_world_size(group)
    full = torch.randn(4, world * V_LOCAL, generator=g, dtype=torch.float64).float()
    full[:, V_LOCAL - 1] = float("-inf")  # rank 0's last column
    labels = torch.full((4,), world * V_LOCAL - 3)  # on the last rank
    tids = torch.stack([labels, labels - 1], -1)
    tlp = torch.tensor([[-1.0, -2.0]]).expand(4, 2).contiguous()
    x = full[:, rank * V_LOCAL:(rank + 1) * V_LOCAL].clone().requires_grad_(True)
    logp = full.double().log_softmax(-1)
    lp = vocab_parallel_log_probs(x, labels, group=group)
    kl = vocab_parallel_forward_kl_topk(x, tids, tlp, group=group)["distillation_losses"]
    kl_ref = (tlp.double().exp() * (tlp.double() - logp.gather(-1, tids))).sum(-1)
    _, ids = vocab_parallel_topk(x, world * V_LOCAL, group=group)
    lp_ref = logp.gather(-1, labels[:, None])[:, 0]
    return {"log_probs": bool(torch.isfinite(lp).all()) and _rel(lp, lp_ref) < 1e-5,
            "kl": bool(torch.isfinite(kl).all()) and _rel(kl, kl_ref) < 1e-5,
            "topk_ids": bool(((ids >= 0) & (ids < world * V_LOCAL)).all())}


# ----------------------------------------------------------------------------------------------
# 1 rank (in process)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_rank_values_and_grads(dtype: torch.dtype) -> None:
    run_cases(0, 1, None, dtype)


def test_one_rank_zero_tokens_and_bad_input() -> None:
    check_zero_tokens(0, None)
    check_bad_input(0, 1, None)


def test_one_rank_neg_inf_logits() -> None:
    assert neg_inf_logits_outputs(0, None) == {"log_probs": True, "kl": True, "topk_ids": True}


def test_forward_kl_topk_errors_name_its_own_arguments() -> None:
    x = torch.randn(*LEAD, V_LOCAL)
    tids = torch.randint(0, V_LOCAL, LEAD + (K,))
    tlp = -torch.rand(LEAD + (K,)) - 1
    _raises(lambda: vocab_parallel_forward_kl_topk(x, tids[:, :1], tlp), "teacher_topk_ids")
    _raises(lambda: vocab_parallel_forward_kl_topk(x, tids + V_LOCAL, tlp), "teacher_topk_ids")
    _raises(lambda: vocab_parallel_forward_kl_topk(x, tids, tlp[..., :2]), "teacher_topk_log_probs")


def test_near_one_hot_gradients_within_4x_of_naive_fp32() -> None:
    """Known fp32 limit (documented in ``ops/stats.py``): at a logit gap of 16 the hot label's gradient
    needs ``1 - p_y`` (~3e-5) from ``1 / S`` with ``S = 1 + 3e-5`` summed in fp32, so ``S``'s rounding
    (~6e-8) shows up ~3x more than in plain fp32 autograd (measured 7.0e-3 vs 2.5e-3 for sum-pi^2, 7.7e-3
    vs 2.3e-3 for the log-prob). Summing ``S`` in fp64 would fix it (7.9e-4 / 1.3e-3) but costs 80x the
    fp32 sum on CPU. This bounds the gap so that it cannot silently grow."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(15, 154, generator=g)
    hot = torch.randint(0, 154, (15,), generator=g)
    x.scatter_(-1, hot[:, None], 16.0)
    up = torch.randn(15, generator=g)
    pairs = [(lambda v: vocab_parallel_sum_pi_squared(v), lambda z: (z.softmax(-1) ** 2).sum(-1)),
             (lambda v: vocab_parallel_log_probs(v, hot),
              lambda z: z.log_softmax(-1).gather(-1, hot[:, None])[:, 0])]
    for op, math_fn in pairs:
        grads = []
        for dt, fn in ((torch.float64, math_fn), (torch.float32, math_fn), (torch.float32, op)):
            xl = x.to(dt).requires_grad_(True)
            grads.append(torch.autograd.grad((fn(xl) * up.to(dt)).sum(), xl)[0])
        err_naive, err_op = _rel(grads[1], grads[0]), _rel(grads[2], grads[0])
        assert err_op <= 4 * err_naive + 1e-5, f"op {err_op:.2e} vs naive fp32 {err_naive:.2e}"


def test_entropy_with_neg_inf_logits() -> None:
    x = torch.randn(4, V_LOCAL, dtype=torch.float64).float()
    x[:, 3] = float("-inf")
    x.requires_grad_(True)
    h = vocab_parallel_entropy(x, temperature=0.7)
    z = x.detach().double()[:, torch.arange(V_LOCAL) != 3] / 0.7
    ref = -(z.softmax(-1) * z.log_softmax(-1)).sum(-1)
    assert torch.isfinite(h).all() and _rel(h, ref) < 1e-5, h
    (g,) = torch.autograd.grad(h.sum(), x)
    assert torch.isfinite(g).all() and (g[:, 3] == 0).all()


def test_unit_temperature_detection() -> None:
    assert is_scalar_unit_temperature(1) and is_scalar_unit_temperature(1.0)
    # bool is rejected as a temperature (ValueError above), so it is consistently not "unit" either
    assert not is_scalar_unit_temperature(True)
    for t in (torch.tensor(1.0), torch.ones(3), 1.0000001, 0.9999999, 2, 0.3, "1", None):
        assert not is_scalar_unit_temperature(t), t


def test_scale_logits_by_temperature() -> None:
    x = torch.randn(*LEAD, V_LOCAL, dtype=torch.float64) * 5
    for unit in (1, 1.0):
        assert scale_logits_by_temperature(x, unit) is x
    x0 = x.clone()
    up = torch.randn(*LEAD, V_LOCAL, dtype=torch.float64)
    for t in (0.3, 3.0, torch.tensor(1.0), torch.tensor(0.7), torch.rand(LEAD) + 0.2, torch.rand(3, 1) + 0.2):
        xl = x.clone().requires_grad_(True)
        y = scale_logits_by_temperature(xl, t)
        assert y is not xl and y.data_ptr() != xl.data_ptr()
        tt = t.double()[..., None] if isinstance(t, torch.Tensor) and t.dim() else t
        torch.testing.assert_close(y, x / tt, rtol=1e-12, atol=0)
        (gx,) = torch.autograd.grad((y * up).sum(), xl)
        torch.testing.assert_close(gx, up / tt, rtol=1e-12, atol=0)
        assert torch.equal(xl.detach(), x0)
    _raises(lambda: scale_logits_by_temperature(x, 0.0), "temperature")
    _raises(lambda: scale_logits_by_temperature(x, torch.ones(4)), "temperature")


def test_scale_logits_by_temperature_keeps_the_logits_dtype() -> None:
    x = torch.randn(*LEAD, V_LOCAL, dtype=torch.bfloat16)
    for t in (0.7, torch.tensor(0.7), torch.rand(LEAD) + 0.5, torch.rand(LEAD, dtype=torch.float64) + 0.5):
        assert scale_logits_by_temperature(x, t).dtype == torch.bfloat16, t


@pytest.mark.parametrize("t_dtype", [torch.float32, torch.float64])
def test_scale_logits_by_temperature_per_token_rounds_once(t_dtype: torch.dtype) -> None:
    """bf16 logits / a wider per-token t: the promoted quotient rounded once to bf16, value and gradient,
    in chunks (rows > one chunk), for a non-contiguous view too."""
    from mcore_engine.ops import temperature as temp_mod

    base = (torch.randn(9, 2, 300, dtype=torch.float64) * 4).to(torch.bfloat16)
    t = torch.rand(2, 9, dtype=t_dtype) + 0.3
    up = torch.randn(2, 9, 300).to(torch.bfloat16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(temp_mod, "DEFAULT_CHUNK_ELEMENTS", 4 * 300)  # 5 chunks of 4 rows
        for x in (base.transpose(0, 1).contiguous(), base.transpose(0, 1)):
            xl = x.detach().requires_grad_(True)
            y = scale_logits_by_temperature(xl, t)
            assert y.dtype == torch.bfloat16 and y.shape == x.shape
            assert torch.equal(y, (x.to(t_dtype) / t[..., None]).to(torch.bfloat16))
            (gx,) = torch.autograd.grad(y, xl, up)
            assert gx.dtype == torch.bfloat16
            assert torch.equal(gx, (up.to(t_dtype) / t[..., None]).to(torch.bfloat16))


def test_processor_custom_func_and_flags() -> None:
    """Custom func: unit temperature hands the very same tensor; others the scaled logits; flags pick keys."""
    x = torch.randn(*LEAD, V_LOCAL) * 4
    lab = torch.randint(0, V_LOCAL, LEAD)
    seen = {}

    def func(*, student_logits, data, data_format):
        seen.update(logits=student_logits, data=data, fmt=data_format)
        return {"custom": student_logits.float().logsumexp(-1)}

    batch = {"anything": 1}
    out = process_lm_head_logits(x, lab, 1.0, calculate_sum_pi_squared=False, calculate_entropy=True,
                                 distillation_use_topk=True, distillation_only=False,
                                 logits_processor_func=func, batch=batch, data_format="bshd")
    assert seen["logits"] is x and seen["data"] is batch and seen["fmt"] == "bshd"
    assert set(out) == {"log_probs", "entropy", "custom"}
    temp = torch.rand(LEAD) + 0.5
    t0 = temp.clone()
    out = process_lm_head_logits(x, lab, temp, calculate_sum_pi_squared=True, calculate_entropy=False,
                                 distillation_use_topk=True, distillation_only=True,
                                 logits_processor_func=func, batch=batch)
    assert set(out) == {"sum_pi_squared", "custom"}
    torch.testing.assert_close(seen["logits"], x / temp[..., None])
    assert torch.equal(temp, t0)
    out = process_lm_head_logits(x, lab, 0.3, calculate_sum_pi_squared=False, calculate_entropy=False,
                                 distillation_use_topk=False, distillation_only=False)
    assert set(out) == {"log_probs"}
    ref = (x.double() / 0.3).log_softmax(-1).gather(-1, lab[..., None])[..., 0]
    assert _rel(out["log_probs"], ref) < 1e-5


def test_processor_checks_the_temperature_once() -> None:
    """With a custom func the scaled logits reuse the fused pass's temperature check (one device sync)."""
    from mcore_engine.ops import temperature as temp_mod

    x = torch.randn(*LEAD, V_LOCAL)
    lab = torch.randint(0, V_LOCAL, LEAD)
    temp = torch.rand(LEAD) + 0.5
    with pytest.MonkeyPatch.context() as mp:
        calls = []
        real = temp_mod._check_temperature
        mp.setattr(temp_mod, "_check_temperature", lambda *a: (calls.append(1), real(*a)))
        out = process_lm_head_logits(x, lab, temp, calculate_sum_pi_squared=False, calculate_entropy=True,
                                     distillation_use_topk=True, distillation_only=False,
                                     logits_processor_func=lambda **kw: {"s": kw["student_logits"].sum(-1)})
    assert set(out) == {"log_probs", "entropy", "s"} and len(calls) == 1
    torch.testing.assert_close(out["s"], (x / temp[..., None]).sum(-1))


def test_non_contiguous_logits() -> None:
    """A transposed [S, B, V] -> [B, S, V] view gives the same values and gradient."""
    base = torch.randn(5, 3, V_LOCAL) * 3
    xt = base.transpose(0, 1).requires_grad_(False)
    x = xt.detach().clone().requires_grad_(True)
    xt = base.clone().requires_grad_(True)
    xv = xt.transpose(0, 1)
    up = torch.randn(3, 5)
    a = vocab_parallel_entropy(xv, temperature=0.7, chunk_size=4)
    b = vocab_parallel_entropy(x, temperature=0.7, chunk_size=4)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    (ga,) = torch.autograd.grad((a * up).sum(), xt)
    (gb,) = torch.autograd.grad((b * up).sum(), x)
    torch.testing.assert_close(ga.transpose(0, 1), gb, rtol=1e-6, atol=1e-9)


# ----------------------------------------------------------------------------------------------
# 2 gloo ranks: ONE launch; rank 0 writes each part's outcome, the tests below read them
# ----------------------------------------------------------------------------------------------
def _two_rank_body(rank: int, world: int, path: str) -> None:
    """Asserting parts fail the whole launch (a crashed rank unblocks its peer); the -inf probe only
    reports, and the tests below assert on its report."""
    group = dist.group.WORLD
    errs = {"fp32": run_cases(rank, world, group, torch.float32, seed0=7),
            "bf16": run_cases(rank, world, group, torch.bfloat16, seed0=7)}
    check_zero_tokens(rank, group)
    check_bad_input(rank, world, group)
    result = {"errs": errs, "neg_inf": neg_inf_logits_outputs(rank, group)}
    if rank == 0:
        with open(path, "w") as f:
            json.dump(result, f)
    dist.barrier(group)  # leave together: a peer torn down mid-exit can abort the other rank in gloo


@pytest.fixture(scope="module")
def two_rank(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("two_rank") / "result.json"
    run_distributed(_two_rank_body, 2, str(path))
    with open(path) as f:
        return json.load(f)


def test_two_gloo_ranks_values_grads_zero_tokens_bad_input(two_rank: dict) -> None:
    assert len(two_rank["errs"]["fp32"]) > 150 and len(two_rank["errs"]["bf16"]) > 150


def test_two_gloo_ranks_neg_inf_logits_log_probs_and_kl(two_rank: dict) -> None:
    got = two_rank["neg_inf"]
    assert got["log_probs"] and got["kl"], got


def test_two_gloo_ranks_neg_inf_logits_topk_ids(two_rank: dict) -> None:
    assert two_rank["neg_inf"]["topk_ids"], two_rank["neg_inf"]
