"""Seeded inputs shared by the ops and processor tests: full logits, their shard, labels, teacher top-k."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.reference import reference_logits_outputs
from tests.utils import rel_err


@dataclass(frozen=True)
class Case:
    """One input configuration; every rank rebuilds the same FULL tensors from ``seed``."""

    seed: int
    lead: tuple[int, ...]  # logits.shape[:-1]: (N,), (1, T) or (B, S)
    v_local: int
    dtype: torch.dtype = torch.float32
    pad: int = 0  # vocab_size = v_local * world - pad
    temperature: str = "1"  # "1", "0.7", "0d", "tok"
    chunk_size: int | None = None
    k: int = 4
    clamp: float | None = None
    kl_tail: bool = False


def case_inputs(case: Case, world: int) -> dict:
    """Full float logits (in ``case.dtype``), labels, teacher ids/log-probs, temperature, upstream grads."""
    g = torch.Generator().manual_seed(case.seed)
    v = case.v_local * world
    vocab_size = v - case.pad
    full = (torch.randn(case.lead + (v,), generator=g, dtype=torch.float64) * 2.5).to(case.dtype)
    labels = torch.randint(0, vocab_size, case.lead, generator=g)
    ids = torch.rand(case.lead + (vocab_size,), generator=g).argsort(-1)[..., :case.k]
    # Teacher mass < 1 so the tail bucket is non-trivial.
    tlp = torch.randn(case.lead + (case.k,), generator=g).log_softmax(-1) + math.log(0.85)
    if case.seed % 2:  # a teacher slot with probability 0 (log-prob -inf) in the first token
        tlp.view(-1, case.k)[0, -1] = float("-inf")
    temperature = {"1": 1.0, "0.7": 0.7, "0d": torch.tensor(1.3),
                   "tok": torch.rand(case.lead, generator=g) + 0.5}[case.temperature]
    weights = {key: torch.randn(case.lead, generator=g, dtype=torch.float64)
               for key in ("log_probs", "entropy", "sum_pi_squared", "distillation_losses")}
    return dict(full=full, labels=labels, teacher_ids=ids, teacher_log_probs=tlp, temperature=temperature,
                weights=weights, vocab_size=vocab_size if case.pad else None)


def shard_of(full: torch.Tensor, rank: int, v_local: int) -> torch.Tensor:
    """This rank's vocab shard as a fresh leaf that requires grad."""
    return full[..., rank * v_local:(rank + 1) * v_local].clone().requires_grad_()


def weighted_sum(outputs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over differentiable outputs of (out * w): a scalar whose grad uses a random upstream grad."""
    total = torch.zeros((), dtype=torch.float64)
    for key, w in weights.items():
        if key in outputs:
            total = total + (outputs[key].double() * w).sum()
    return total


@dataclass(frozen=True)
class HardCase:
    """Inputs unlike ``Case``: leading shape ``[3, 5]``, ``V_local = 77``, ``k = 6``, large logits,
    near-one-hot rows, temperatures 0.3 / 3.0 / per token / per row ``[3, 1]``, padding across the
    rank boundary, ids all on the last rank, a clamp at the median student log-prob, -inf teacher
    log-probs. Checked against the float64 reference within an error budget (``budget``)."""

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


HARD_V_LOCAL, HARD_LEAD, HARD_K = 77, (3, 5), 6
HARD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
HARD_CASES = [
    HardCase("plain"),
    HardCase("scale30_t0.3", scale=30.0, temp=0.3, chunk=4),
    HardCase("t3.0_tail", temp=3.0, tail=True),
    HardCase("per_token_t", temp="tok", chunk=7),
    HardCase("per_token_t_bcast_clamp", temp="tok_b", clamp=True),
    HardCase("pad_across_boundary", pad=90, temp=0.3),  # V_global 154 -> vocab 64: rank 1 all padding
    HardCase("pad_partial", pad=20, tail=True, chunk=2),
    HardCase("near_one_hot", one_hot=True),
    HardCase("other_rank_clamp_tail", other_rank=True, clamp=True, tail=True, temp=3.0),
    HardCase("teacher_neg_inf", neg_inf_teacher=True, scale=30.0),
]


def hard_case_inputs(case: HardCase, world: int, dtype: torch.dtype, seed: int) -> dict:
    """Full (gathered) inputs, identical on every rank: full, vocab, labels, tids, tlp, temp, clamp."""
    g = torch.Generator().manual_seed(seed)
    v_global = HARD_V_LOCAL * world
    vocab = v_global - (case.pad if world > 1 else case.pad % HARD_V_LOCAL)
    full = torch.randn(*HARD_LEAD, v_global, generator=g, dtype=torch.float64) * case.scale
    if case.one_hot:
        hot = torch.randint(0, vocab, HARD_LEAD, generator=g)
        full.scatter_(-1, hot[..., None], 14.0)
    full = full.to(dtype)
    lo = max(vocab - HARD_V_LOCAL + HARD_K, 0) if case.other_rank else 0  # all in the last shard
    labels = torch.randint(lo, vocab, HARD_LEAD, generator=g)
    # teacher: top-k of some other distribution over [lo, vocab)
    teacher = torch.randn(*HARD_LEAD, vocab - lo, generator=g, dtype=torch.float64) * 2.0
    vals, idx = teacher.log_softmax(-1).topk(HARD_K, dim=-1)
    tids, tlp = idx + lo, vals.float()
    if case.neg_inf_teacher:
        tlp[0, 1, -1] = float("-inf")
        tlp[2, 3, -2:] = float("-inf")
    if case.temp == "tok":
        temp = torch.rand(*HARD_LEAD, generator=g) * 3.5 + 0.25
    elif case.temp == "tok_b":
        temp = torch.rand(HARD_LEAD[0], 1, generator=g) * 3.5 + 0.25
    else:
        temp = case.temp
    clamp = None
    if case.clamp:
        t = temp.double()[..., None] if isinstance(temp, torch.Tensor) else temp
        lq = (full.double()[..., :vocab] / t).log_softmax(-1).gather(-1, tids).flatten().sort().values
        i = lq.numel() // 2
        clamp = float((lq[i - 1] + lq[i]) / 2)
    return dict(full=full, vocab=vocab, labels=labels, tids=tids, tlp=tlp, temp=temp, clamp=clamp)


class HardReference:
    """The float64 reference of a ``HardCase`` and its error budget: ``tol + 2 x`` the error of the same
    formulas in plain fp32 (CCE-style ``|ref - op| <= |ref - naive_fp32| + tol``), capped at ``5 x tol``
    (fp32 logits only). Needed where fp32 itself cannot reach 1e-5: near-one-hot rows (``1 - p_max``
    cancels) and ``|z| ~ 300`` (scale 30 / t 0.3)."""

    def __init__(self, case: HardCase, inp: dict, dtype: torch.dtype) -> None:
        self.name, self.dtype, self.tol = case.name, dtype, HARD_TOL[dtype]
        kw = dict(labels=inp["labels"], teacher_ids=inp["tids"], teacher_log_probs=inp["tlp"], entropy=True,
                  sum_pi_squared=True, kl_tail=case.tail, log_prob_min_clamp=inp["clamp"],
                  temperature=inp["temp"], vocab_size=inp["vocab"])
        self.leaf = inp["full"].detach().double().requires_grad_()
        self.ref = reference_logits_outputs(self.leaf, **kw)
        if dtype == torch.float32:
            self.leaf32 = inp["full"].detach().float().requires_grad_()
            self.naive = reference_logits_outputs(self.leaf32, **kw, dtype=torch.float32)

    @staticmethod
    def _grad(out: dict, leaf: torch.Tensor, ups: dict[str, torch.Tensor]) -> torch.Tensor:
        loss = sum((out[k] * u.to(leaf.dtype)).sum() for k, u in ups.items())
        (g,) = torch.autograd.grad(loss, leaf, retain_graph=True)
        return g

    def budget(self, key: str | None = None, ups: dict[str, torch.Tensor] | None = None) -> float:
        if self.dtype != torch.float32:
            return self.tol
        if ups is None:
            naive_err = rel_err(self.naive[key], self.ref[key])
        else:
            naive = self._grad(self.naive, self.leaf32, ups)
            naive_err = rel_err(naive, self._grad(self.ref, self.leaf, ups))
        return min(self.tol + 2 * naive_err, 5 * self.tol)

    def check(self, what: str, out: torch.Tensor, key: str) -> None:
        assert out.dtype == torch.float32 and out.shape == HARD_LEAD, (what, out.dtype, out.shape)
        e, b = rel_err(out, self.ref[key]), self.budget(key)
        assert e <= b, f"{self.name}/{what}: value rel err {e:.3e} > {b:.3e}"

    def check_grad(self, what: str, gx: torch.Tensor, ups: dict[str, torch.Tensor], cols: slice) -> None:
        assert gx.dtype == self.dtype
        e, b = rel_err(gx, self._grad(self.ref, self.leaf, ups)[..., cols]), self.budget(None, ups)
        assert e <= b, f"{self.name}/{what}: grad rel err {e:.3e} > {b:.3e}"
