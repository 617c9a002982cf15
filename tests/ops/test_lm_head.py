"""Fused lm-head vs the logits path (``hidden @ weight.T`` + ops) and a float64 reference, 1 and 2 ranks."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from mcore_engine.ops import vocab_parallel_logits_outputs
from mcore_engine.ops.lm_head import fused_lm_head_outputs
from tests.reference import reference_logits_outputs
from tests.utils import REL_TOL, assert_rel_close, run_distributed

F32, BF16 = torch.float32, torch.bfloat16
KEYS = ("log_probs", "entropy", "sum_pi_squared", "distillation_losses")


@dataclass(frozen=True)
class LMCase:
    """One configuration; every rank rebuilds the same full hidden states and weight from ``seed``."""

    seed: int
    lead: tuple[int, ...]
    hidden: int
    v_local: int
    dtype: torch.dtype = F32
    pad: int = 0
    temperature: str = "1"  # "1", "0.7", "0d", "tok"
    chunk_size: int | None = None
    k: int = 4
    clamp: float | None = None
    kl_tail: bool = False


CASES = [
    LMCase(1, (13,), 24, 61, chunk_size=4, k=5, kl_tail=True),
    LMCase(2, (2, 7), 17, 53, pad=6, temperature="tok", chunk_size=3, clamp=-3.0, kl_tail=True),
    LMCase(3, (1, 9), 32, 47, temperature="0.7", chunk_size=None, k=3),
    LMCase(4, (3, 4), 20, 44, BF16, pad=5, temperature="0d", chunk_size=5, clamp=-2.5, kl_tail=True),
    LMCase(5, (11,), 16, 39, BF16, temperature="1", chunk_size=2, k=2),
]


def _inputs(case: LMCase, world: int) -> dict:
    g = torch.Generator().manual_seed(case.seed)
    v = case.v_local * world
    vocab = v - case.pad
    hidden = torch.randn(case.lead + (case.hidden,), generator=g, dtype=torch.float64).to(case.dtype)
    weight = (torch.randn(v, case.hidden, generator=g, dtype=torch.float64) * 2 / math.sqrt(case.hidden))
    ids = torch.rand(case.lead + (vocab,), generator=g).argsort(-1)[..., :case.k]
    temperature = {"1": 1.0, "0.7": 0.7, "0d": torch.tensor(1.3),
                   "tok": torch.rand(case.lead, generator=g) + 0.5}[case.temperature]
    return dict(
        hidden=hidden, weight=weight.to(case.dtype),
        upstream={k: torch.randn(case.lead, generator=g) for k in KEYS},
        kwargs=dict(labels=torch.randint(0, vocab, case.lead, generator=g), teacher_ids=ids,
                    teacher_log_probs=torch.randn(case.lead + (case.k,), generator=g).log_softmax(-1) - 0.15,
                    entropy=True, sum_pi_squared=True, kl_tail=case.kl_tail, log_prob_min_clamp=case.clamp,
                    temperature=temperature, vocab_size=vocab if case.pad else None))


def _loss(out: dict, upstream: dict) -> torch.Tensor:
    return sum((out[k].double() * upstream[k].double()).sum() for k in KEYS)


def _check(case: LMCase, rank: int, world: int) -> None:
    inp = _inputs(case, world)
    group = dist.group.WORLD if world > 1 else None
    rows = slice(rank * case.v_local, (rank + 1) * case.v_local)
    tol = REL_TOL[case.dtype]
    name = f"{case} rank {rank}/{world}"

    # Float64 reference on the full weight (same rounded inputs).
    h64 = inp["hidden"].double().requires_grad_()
    w64 = inp["weight"].double().requires_grad_()
    ref = reference_logits_outputs(h64 @ w64.T, **inp["kwargs"])
    _loss(ref, inp["upstream"]).backward()

    # The logits path on this rank's shard (hidden's grad all-reduced as the column-parallel layer does).
    h_l = inp["hidden"].clone().requires_grad_()
    w_l = inp["weight"][rows].clone().requires_grad_()
    out_l = vocab_parallel_logits_outputs(h_l @ w_l.T, group=group, chunk_size=case.chunk_size,
                                          **inp["kwargs"])
    _loss(out_l, inp["upstream"]).backward()
    if world > 1:
        dist.all_reduce(h_l.grad, group=group)

    # The fused path.
    h = inp["hidden"].clone().requires_grad_()
    w = inp["weight"][rows].clone().requires_grad_()
    h_before, w_before = h.detach().clone(), w.detach().clone()
    out = fused_lm_head_outputs(h, w, group=group, chunk_size=case.chunk_size, **inp["kwargs"])
    assert set(out) == set(ref), name
    _loss(out, inp["upstream"]).backward()
    assert torch.equal(h.detach(), h_before) and torch.equal(w.detach(), w_before), f"{name}: inputs modified"

    for key in ref:
        assert out[key].dtype == F32 and out[key].shape == case.lead, (name, key)
        assert_rel_close(out[key], ref[key], tol, f"{name} {key} vs float64")
        assert_rel_close(out[key], out_l[key], tol, f"{name} {key} vs logits path")
    assert h.grad.dtype == case.dtype and w.grad.dtype == case.dtype
    assert_rel_close(h.grad, h64.grad, tol, f"{name} grad hidden vs float64")
    assert_rel_close(w.grad, w64.grad[rows], tol, f"{name} grad weight vs float64")
    assert_rel_close(h.grad, h_l.grad, tol, f"{name} grad hidden vs logits path")
    assert_rel_close(w.grad, w_l.grad, tol, f"{name} grad weight vs logits path")
    v_valid = min(max(case.v_local * world - case.pad - rank * case.v_local, 0), case.v_local)
    assert not w.grad[v_valid:].any(), f"{name}: padded vocab rows got a gradient"


@pytest.mark.parametrize("case", CASES, ids=[f"case{c.seed}" for c in CASES])
def test_fused_lm_head_one_rank(case):
    _check(case, 0, 1)


def _two_rank_checks(rank: int, world: int) -> None:
    # The last case leaves rank 1 with padded ids only (V_valid = 0), as Megatron's padding can.
    for case in CASES + [LMCase(6, (5,), 12, 20, pad=23, temperature="0.7", chunk_size=2, kl_tail=True)]:
        _check(case, rank, world)


def test_fused_lm_head_two_ranks():
    run_distributed(_two_rank_checks, 2)


def test_saves_only_inputs_and_per_token_tensors():
    n, h_dim, v = 29, 12, 40
    hidden = torch.randn(n, h_dim, requires_grad=True)
    weight = torch.randn(v, h_dim, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = fused_lm_head_outputs(hidden, weight, labels=torch.randint(0, v, (n,)), entropy=True,
                                    temperature=0.7, chunk_size=4)
    big = [tuple(t.shape) for t in saved if t.numel() >= n * v // 2
           and t.untyped_storage().data_ptr() not in (hidden.untyped_storage().data_ptr(),
                                                        weight.untyped_storage().data_ptr())]
    assert not big, f"saved logits-sized tensors: {big}"
    (out["log_probs"].sum() + out["entropy"].sum()).backward()


def test_zero_tokens_and_no_outputs():
    hidden = torch.randn(0, 8, requires_grad=True)
    weight = torch.randn(10, 8, requires_grad=True)
    out = fused_lm_head_outputs(hidden, weight, labels=torch.zeros(0, dtype=torch.long), entropy=True)
    assert out["log_probs"].shape == (0,) and out["entropy"].shape == (0,)
    (out["log_probs"].sum() + out["entropy"].sum()).backward()
    assert hidden.grad.shape == (0, 8) and torch.equal(weight.grad, torch.zeros_like(weight))
    assert fused_lm_head_outputs(torch.randn(3, 8), weight) == {}


def test_bad_input_raises_value_error_naming_argument():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match="hidden"):
        fused_lm_head_outputs(torch.ones(4, 8, dtype=torch.long), weight, entropy=True)
    with pytest.raises(ValueError, match="weight"):
        fused_lm_head_outputs(hidden, torch.randn(10, 7), entropy=True)
    with pytest.raises(ValueError, match="weight"):
        fused_lm_head_outputs(hidden, weight.long(), entropy=True)
    with pytest.raises(ValueError, match="labels"):
        fused_lm_head_outputs(hidden, weight, labels=torch.full((4,), 10))
    with pytest.raises(ValueError, match="teacher_ids"):
        fused_lm_head_outputs(hidden, weight, teacher_ids=torch.zeros(4, dtype=torch.long),
                              teacher_log_probs=torch.zeros(4))
    with pytest.raises(ValueError, match="teacher_ids"):  # a list, as the logits path refuses it
        fused_lm_head_outputs(hidden, weight, teacher_ids=[[0, 1]] * 4, teacher_log_probs=torch.zeros(4, 2))
    with pytest.raises(ValueError, match="teacher_log_probs"):
        fused_lm_head_outputs(hidden, weight, teacher_ids=torch.zeros(4, 2, dtype=torch.long),
                              teacher_log_probs=[[0.0, 0.0]] * 4)
    with pytest.raises(ValueError, match="vocab_size"):
        fused_lm_head_outputs(hidden, weight, entropy=True, vocab_size=11)
    with pytest.raises(ValueError, match="temperature"):
        fused_lm_head_outputs(hidden, weight, entropy=True, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        fused_lm_head_outputs(hidden, weight, entropy=True, chunk_size=0)


def test_fp32_hidden_with_bf16_weight_computes_in_bf16():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(9, 8, generator=g, requires_grad=True)
    weight = torch.randn(21, 8, generator=g).bfloat16()
    label = torch.randint(0, 21, (9,), generator=g)
    out = fused_lm_head_outputs(hidden, weight, labels=label)
    ref = vocab_parallel_logits_outputs(hidden.bfloat16() @ weight.T, labels=label)
    assert_rel_close(out["log_probs"], ref["log_probs"], 1e-6, "log_probs")
    out["log_probs"].sum().backward()
    assert hidden.grad.dtype == torch.float32


def test_frozen_weight_or_hidden_gets_no_gradient_work():
    g = torch.Generator().manual_seed(4)
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(15, 8, generator=g)
    label = torch.randint(0, 15, (6,), generator=g)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    fused_lm_head_outputs(ref_h, ref_w, labels=label, entropy=True)["entropy"].sum().backward()
    h, w = hidden.clone().requires_grad_(), weight.clone()
    fused_lm_head_outputs(h, w, labels=label, entropy=True)["entropy"].sum().backward()
    assert w.grad is None and torch.equal(h.grad, ref_h.grad)
    h, w = hidden.clone(), weight.clone().requires_grad_()
    fused_lm_head_outputs(h, w, labels=label, entropy=True)["entropy"].sum().backward()
    assert h.grad is None and torch.equal(w.grad, ref_w.grad)


def test_inference_under_no_grad_matches():
    g = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(2, 5, 8, generator=g), torch.randn(17, 8, generator=g)
    label = torch.randint(0, 17, (2, 5), generator=g)
    with torch.no_grad():
        out = fused_lm_head_outputs(hidden.requires_grad_(), weight, labels=label, entropy=True)
    ref = vocab_parallel_logits_outputs(hidden.detach() @ weight.T, labels=label, entropy=True)
    for key in ref:
        assert not out[key].requires_grad and out[key].shape == (2, 5)
        assert_rel_close(out[key], ref[key], REL_TOL[F32], key)


def test_one_max_and_one_packed_sum_per_chunk_one_sum_in_backward():
    """Patched TP primitives (a fake 2-rank group): each chunk's logits are formed once, so each chunk
    is reduced on its own; backward all-reduces only the hidden gradient."""
    from unittest import mock

    n, h_dim, v, k = 10, 6, 23, 3
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(n, h_dim, generator=g, requires_grad=True)
    weight = torch.randn(v, h_dim, generator=g, requires_grad=True)
    ids = torch.rand(n, 2 * v, generator=g).argsort(-1)[:, :k]
    calls, fake_group = [], object()
    with mock.patch.object(dist, "get_rank", return_value=0), \
            mock.patch.object(dist, "get_world_size", return_value=2), \
            mock.patch.object(dist, "all_reduce", side_effect=lambda buf, op, group: calls.append(
                (op, tuple(buf.shape), group))):
        out = fused_lm_head_outputs(hidden, weight, labels=torch.randint(0, 2 * v, (n,), generator=g),
                                    teacher_ids=ids, teacher_log_probs=torch.full((n, k), -2.0), entropy=True,
                                    kl_tail=True, temperature=0.7, group=fake_group, chunk_size=4)
        n_fwd = len(calls)
        (out["entropy"].sum() + out["distillation_losses"].sum()).backward()
    width = 1 + 1 + 1 + k + 1  # S, A, label, k teacher logits, tail
    expected = [c for r in (4, 4, 2) for c in ((dist.ReduceOp.MAX, (r,), fake_group),
                                               (dist.ReduceOp.SUM, (r, width), fake_group))]
    assert calls[:n_fwd] == expected, calls
    assert calls[n_fwd:] == [(dist.ReduceOp.SUM, (n, h_dim), fake_group)], calls[n_fwd:]
