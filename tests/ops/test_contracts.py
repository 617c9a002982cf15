"""One-process contracts of the ops: validation, no mutation, what is saved, collectives, temperature."""

from __future__ import annotations

import math
from collections import Counter
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mcore_engine.ops import (
    _common,
    is_scalar_unit_temperature,
    scale_logits_by_temperature,
    vocab_parallel_entropy,
    vocab_parallel_forward_kl_topk,
    vocab_parallel_log_probs,
    vocab_parallel_logits_outputs,
    vocab_parallel_sum_pi_squared,
    vocab_parallel_topk,
)
from mcore_engine.processor import process_lm_head_logits
from tests.ops.cases import HARD_K, HARD_LEAD, HARD_V_LOCAL, Case, case_inputs
from tests.utils import run_distributed

N, V, K = 10, 23, 3


def _inputs(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, N // 2, V, generator=g).to(dtype)
    labels = torch.randint(0, V, (2, N // 2), generator=g)
    ids = torch.rand(2, N // 2, V, generator=g).argsort(-1)[..., :K]
    tlp = torch.randn(2, N // 2, K, generator=g).log_softmax(-1) - 0.3
    return x, labels, ids, tlp


OPS = {
    "log_probs": lambda x, lab, ids, tlp, t: vocab_parallel_log_probs(x, lab, temperature=t, chunk_size=3),
    "entropy": lambda x, lab, ids, tlp, t: vocab_parallel_entropy(x, temperature=t, chunk_size=3),
    "sum_pi_squared": lambda x, lab, ids, tlp, t: vocab_parallel_sum_pi_squared(x, temperature=t,
                                                                               chunk_size=3),
    "forward_kl_topk": lambda x, lab, ids, tlp, t: vocab_parallel_forward_kl_topk(
        x, ids, tlp, temperature=t, chunk_size=3, kl_tail=True,
        log_prob_min_clamp=-4.0)["distillation_losses"],
    "fused": lambda x, lab, ids, tlp, t: sum(vocab_parallel_logits_outputs(
        x, labels=lab, teacher_ids=ids, teacher_log_probs=tlp, entropy=True, sum_pi_squared=True,
        temperature=t, chunk_size=3).values()),
    "topk": lambda x, lab, ids, tlp, t: vocab_parallel_topk(x, 4, temperature=t)[0],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", sorted(OPS))
def test_op_does_not_mutate_inputs(op: str, dtype: torch.dtype) -> None:
    x, labels, ids, tlp = _inputs(dtype)
    x.requires_grad_(op != "topk")
    for t in (1.0, 0.7, torch.rand(2, N // 2) + 0.5):
        before = [a.detach().clone() for a in (x, labels, ids, tlp)]
        before.append(t.clone() if torch.is_tensor(t) else t)
        versions = [a._version for a in (x, labels, ids, tlp)]
        out = OPS[op](x, labels, ids, tlp, t)
        if out.requires_grad:
            (out * torch.randn_like(out)).sum().backward()
        for a, b in zip((x, labels, ids, tlp, t), before, strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), f"{op} modified an input"
        assert [a._version for a in (x, labels, ids, tlp)] == versions, f"{op} wrote into an input"


class _LargeAllocs(TorchDispatchMode):
    """Records every freshly allocated op output (not a view of an input) with >= ``limit`` elements."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit, self.seen = limit, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in tree_leaves((args, kwargs)) if torch.is_tensor(a)}
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.numel() >= self.limit \
                    and o.untyped_storage().data_ptr() not in inputs:
                self.seen.append((str(func), o.dtype, tuple(o.shape)))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7, "tok"])
def test_forward_saves_only_logits_and_allocates_no_full_size_tensor(dtype, temperature) -> None:
    x, labels, ids, tlp = _inputs(dtype)
    x.requires_grad_()
    t = torch.rand(2, N // 2) + 0.5 if temperature == "tok" else temperature
    saved = []
    large = _LargeAllocs(x.numel() // 2)  # chunk_size=3 of N=10 rows: any workspace is < half the logits
    with torch.autograd.graph.saved_tensors_hooks(lambda s: saved.append(s) or s, lambda s: s), large:
        out = vocab_parallel_logits_outputs(x, labels=labels, teacher_ids=ids, teacher_log_probs=tlp,
                                            entropy=True, sum_pi_squared=True, kl_tail=True, temperature=t,
                                            chunk_size=3)
    assert large.seen == [], f"forward allocated full-size tensors: {large.seen}"
    big = [s for s in saved if s.numel() > N * (K + 1)]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr() and big[0].dtype == dtype, \
        [(s.dtype, tuple(s.shape)) for s in saved]
    with large:
        sum(o.sum() for o in out.values() if o.requires_grad).backward()
    assert [s for s in large.seen if "fill" not in s[0]] == [("aten.empty.memory_format", dtype, x.shape)], \
        f"backward allocated more than one full-size gradient: {large.seen}"


def test_one_max_and_one_packed_sum_per_pass_none_in_backward() -> None:
    """Patched TP primitives: a fake 2-rank group records the collectives of one fused pass."""
    x, labels, ids, tlp = _inputs()
    x.requires_grad_()
    calls = []
    fake_group = object()
    with mock.patch.object(dist, "get_rank", return_value=0), \
            mock.patch.object(dist, "get_world_size", return_value=2), \
            mock.patch.object(dist, "all_reduce", side_effect=lambda buf, op, group: calls.append(
                (op, tuple(buf.shape), group))):
        out = vocab_parallel_logits_outputs(x, labels=labels, teacher_ids=ids, teacher_log_probs=tlp,
                                            entropy=True, sum_pi_squared=True, kl_tail=True, temperature=0.7,
                                            group=fake_group, chunk_size=4)
        n_fwd = len(calls)
        out["distillation_losses"].sum().backward()
    width = 1 + 1 + 1 + 1 + K + 1  # S, A, B, label, k teacher logits, tail
    expected = [(dist.ReduceOp.MAX, (N,), fake_group), (dist.ReduceOp.SUM, (N, width), fake_group)]
    assert calls[:n_fwd] == expected and len(calls) == n_fwd, calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_workspaces_are_allocated_once_per_pass(dtype) -> None:
    """Torch backend: the two fp32 [rows, V] workspaces are made once per pass, not once per chunk
    (per-chunk buffers of this size churn through the OS allocator on CPU)."""
    x, labels, ids, tlp = _inputs(dtype)
    x.requires_grad_()
    rows = 2  # 5 chunks of N = 10 rows
    large = _LargeAllocs(rows * V)
    with large:
        out = vocab_parallel_logits_outputs(x, labels=labels, teacher_ids=ids, teacher_log_probs=tlp,
                                            entropy=True, sum_pi_squared=True, kl_tail=True, temperature=0.7,
                                            chunk_size=rows)
    ws = ("aten.empty.memory_format", torch.float32, (rows, V))
    vocab_sized = lambda: [s for s in large.seen if s[2][-1] == V and "fill" not in s[0]]  # noqa: E731
    assert vocab_sized() == [ws, ws], large.seen
    large.seen.clear()
    with large:
        sum(o.sum() for o in out.values() if o.requires_grad).backward()
    grad = ("aten.empty.memory_format", dtype, tuple(x.shape))
    assert Counter(vocab_sized()) == Counter([grad, ws, ws]), large.seen


def test_group_none_is_single_shard_without_megatron() -> None:
    assert _common.resolve_group(None) is None
    sentinel = object()
    assert _common.resolve_group(sentinel) is sentinel


def test_unit_temperature_detection_and_scaling() -> None:
    assert is_scalar_unit_temperature(1) and is_scalar_unit_temperature(1.0)
    for t in (0.7, 2.0, torch.tensor(1.0), True, "1", None):
        assert not is_scalar_unit_temperature(t), t
    base = torch.randn(1, 4, 6, requires_grad=True)
    view = base.squeeze(0)
    assert scale_logits_by_temperature(view, 1) is view
    scale_logits_by_temperature(view, 1.0).sum().backward()
    assert torch.equal(base.grad, torch.ones_like(base))
    base.grad = None
    scaled = scale_logits_by_temperature(view, 0.5)
    assert scaled is not view and torch.equal(scaled, view * 2)
    scaled.sum().backward()
    assert torch.equal(base.grad, torch.full_like(base, 2.0))
    per_token = torch.rand(4) + 0.5
    assert torch.allclose(scale_logits_by_temperature(view, per_token), view / per_token[:, None])


def test_non_contiguous_logits() -> None:
    """A [S, B, V] tensor seen as [B, S, V] (not viewable as [N, V]) and a vocab slice of a wider tensor."""
    case = Case(5, (4, 3), 19, temperature="0.7")
    inp = case_inputs(case, 1)
    full = inp["full"]
    for x in (full.transpose(0, 1).contiguous().transpose(0, 1), torch.cat([full, full], -1)[..., :19]):
        ref = vocab_parallel_entropy(full.contiguous(), temperature=0.7)
        assert torch.allclose(vocab_parallel_entropy(x, temperature=0.7, chunk_size=2), ref, rtol=1e-6)


BAD = [
    ("labels", lambda x, lab, ids, tlp: vocab_parallel_log_probs(x, lab + V)),
    ("labels", lambda x, lab, ids, tlp: vocab_parallel_log_probs(x, lab - V)),
    ("labels", lambda x, lab, ids, tlp: vocab_parallel_log_probs(x, lab[:, :-1])),
    ("labels", lambda x, lab, ids, tlp: vocab_parallel_log_probs(x, lab.float())),
    ("labels", lambda x, lab, ids, tlp: vocab_parallel_log_probs(x, lab.clamp_min(V - 2), vocab_size=V - 2)),
    ("vocab_size", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, vocab_size=V + 1)),
    ("vocab_size", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, vocab_size=0)),
    ("logits", lambda x, lab, ids, tlp: vocab_parallel_entropy(lab)),
    ("logits", lambda x, lab, ids, tlp: vocab_parallel_entropy(x[..., :0])),
    ("k", lambda x, lab, ids, tlp: vocab_parallel_topk(x, V + 1)),
    ("k", lambda x, lab, ids, tlp: vocab_parallel_topk(x, 0)),
    ("k", lambda x, lab, ids, tlp: vocab_parallel_topk(x, V, vocab_size=V - 1)),
    ("teacher_topk_ids", lambda x, lab, ids, tlp: vocab_parallel_forward_kl_topk(x, ids + V, tlp)),
    ("teacher_topk_ids", lambda x, lab, ids, tlp: vocab_parallel_forward_kl_topk(x, ids[:, :1], tlp)),
    ("teacher_topk_log_probs", lambda x, lab, ids, tlp: vocab_parallel_forward_kl_topk(x, ids, tlp[..., :1])),
    ("teacher_topk_log_probs", lambda x, lab, ids, tlp: vocab_parallel_forward_kl_topk(x, ids, ids)),
    ("teacher_ids and teacher_log_probs", lambda x, lab, ids, tlp: vocab_parallel_logits_outputs(
        x, teacher_ids=ids)),
    ("kl_tail", lambda x, lab, ids, tlp: vocab_parallel_logits_outputs(x, entropy=True, kl_tail=True)),
    ("log_prob_min_clamp", lambda x, lab, ids, tlp: vocab_parallel_forward_kl_topk(
        x, ids, tlp, log_prob_min_clamp=math.nan)),
    ("chunk_size", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, chunk_size=0)),
    ("temperature", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, temperature=0.0)),
    ("temperature", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, temperature=-1.0)),
    ("temperature", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, temperature=math.inf)),
    ("temperature", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, temperature=torch.tensor(math.nan))),
    ("temperature", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, temperature=torch.zeros(2, N // 2))),
    ("temperature", lambda x, lab, ids, tlp: vocab_parallel_entropy(x, temperature=torch.ones(3))),
    ("temperature", lambda x, lab, ids, tlp: vocab_parallel_topk(x, 2, temperature="hot")),
    ("temperature", lambda x, lab, ids, tlp: scale_logits_by_temperature(x, -2.0)),
]


@pytest.mark.parametrize("i", range(len(BAD)))
def test_bad_input_raises_value_error_naming_the_argument(i: int) -> None:
    name, call = BAD[i]
    with pytest.raises(ValueError, match=name):
        call(*_inputs())


def check_bad_input(rank: int, world: int) -> None:
    """API.md's ValueErrors on 1 or more shards, each naming the offending argument."""
    group = dist.group.WORLD if world > 1 else None
    vg = HARD_V_LOCAL * world
    x = torch.randn(*HARD_LEAD, HARD_V_LOCAL)
    lab = torch.randint(0, vg, HARD_LEAD)
    tids = torch.randint(0, vg, HARD_LEAD + (HARD_K,))
    tlp = torch.randn(HARD_LEAD + (HARD_K,)).clamp_max(0) - 1
    cases = [
        ("labels", lambda: vocab_parallel_log_probs(x, torch.full(HARD_LEAD, vg), group=group)),
        ("labels", lambda: vocab_parallel_log_probs(x, torch.full(HARD_LEAD, -1), group=group)),
        ("labels", lambda: vocab_parallel_log_probs(x, torch.full(HARD_LEAD, vg - 1), group=group,
                                                    vocab_size=vg - 1)),  # a padded id is out of range
        ("labels", lambda: vocab_parallel_log_probs(x, lab[:, :4], group=group)),
        ("logits", lambda: vocab_parallel_log_probs(x.long(), lab, group=group)),
        ("logits", lambda: vocab_parallel_entropy(x.long(), group=group)),
        ("logits", lambda: vocab_parallel_entropy(torch.randn(*HARD_LEAD, 0), group=group)),
        ("k", lambda: vocab_parallel_topk(x, vg + 1, group=group)),
        ("k", lambda: vocab_parallel_topk(x, vg, group=group, vocab_size=vg - 3)),
        ("k", lambda: vocab_parallel_topk(x, 0, group=group)),
        ("teacher", lambda: vocab_parallel_forward_kl_topk(x, tids[..., :1, :], tlp, group=group)),
        ("teacher", lambda: vocab_parallel_forward_kl_topk(x, tids + vg, tlp, group=group)),
        ("teacher", lambda: vocab_parallel_forward_kl_topk(x, tids, tlp[..., :2], group=group)),
    ]
    for bad_t in (0.0, -1.0, float("nan"), float("inf"), torch.tensor(0.0),
                  torch.full(HARD_LEAD, 2.0).index_fill_(1, torch.tensor([2]), -0.5),
                  torch.full(HARD_LEAD, float("inf")), torch.ones(4), True):
        cases.append(("temperature", lambda bad_t=bad_t: vocab_parallel_entropy(x, temperature=bad_t,
                                                                                group=group)))
    flags = dict(calculate_sum_pi_squared=False, calculate_entropy=False, group=group)
    cases += [("distillation_only", lambda: process_lm_head_logits(
                  x, lab, 1.0, distillation_use_topk=False, distillation_only=True, **flags)),
              ("teacher_ids", lambda: process_lm_head_logits(
                  x, lab, 1.0, distillation_use_topk=True, distillation_only=False, batch={}, **flags))]
    for word, call in cases:
        with pytest.raises(ValueError) as info:
            call()
        assert word in str(info.value), f"ValueError message {str(info.value)!r} does not name {word!r}"


def test_bad_input_one_shard() -> None:
    check_bad_input(0, 1)


def test_bad_input_two_ranks() -> None:
    run_distributed(check_bad_input, 2)


@pytest.mark.parametrize("name, call", [
    ("teacher_topk_ids", lambda x, ids, tlp: vocab_parallel_forward_kl_topk(x, ids[:, :1], tlp)),
    ("teacher_topk_ids", lambda x, ids, tlp: vocab_parallel_forward_kl_topk(x, ids + HARD_V_LOCAL, tlp)),
    ("teacher_topk_log_probs", lambda x, ids, tlp: vocab_parallel_forward_kl_topk(x, ids, tlp[..., :2])),
])
def test_forward_kl_topk_errors_name_its_own_arguments(name, call) -> None:
    x = torch.randn(*HARD_LEAD, HARD_V_LOCAL)
    tids = torch.randint(0, HARD_V_LOCAL, HARD_LEAD + (HARD_K,))
    tlp = -torch.rand(HARD_LEAD + (HARD_K,)) - 1
    with pytest.raises(ValueError, match=name):
        call(x, tids, tlp)


def test_transposed_view_gives_the_same_values_and_gradient() -> None:
    """A transposed [S, B, V] -> [B, S, V] view gives the same values and gradient as a copy."""
    base = torch.randn(5, 3, HARD_V_LOCAL) * 3
    x = base.transpose(0, 1).detach().clone().requires_grad_(True)
    xt = base.clone().requires_grad_(True)
    up = torch.randn(3, 5)
    a = vocab_parallel_entropy(xt.transpose(0, 1), temperature=0.7, chunk_size=4)
    b = vocab_parallel_entropy(x, temperature=0.7, chunk_size=4)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
    (ga,) = torch.autograd.grad((a * up).sum(), xt)
    (gb,) = torch.autograd.grad((b * up).sum(), x)
    torch.testing.assert_close(ga.transpose(0, 1), gb, rtol=1e-6, atol=1e-9)
