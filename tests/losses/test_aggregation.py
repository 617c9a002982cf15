"""agg_loss: float64 reference (values and gradients), micro-batch split invariance, float weights,
bad input."""

from __future__ import annotations

import pytest
import torch

from mcore_engine.losses import AGG_MODES, LossContext, agg_loss, token_mean_metric, tokens_per_sequence
from tests.reference import micro_batches, random_packed_batch, random_split, ref_agg
from tests.utils import REL_TOL, assert_rel_close


def _global_ctx(seq_ids, mask):
    n_seqs = len({int(s) for s in seq_ids[mask].tolist()})           # sequences with a loss token
    return LossContext.from_counts(mask.sum(), n_seqs)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_agg_loss_matches_reference(mode, dtype):
    g = torch.Generator().manual_seed(AGG_MODES.index(mode) + 10 * (dtype == torch.float32))
    seq_ids, mask = random_packed_batch(13, g)
    values = torch.randn(seq_ids.numel(), generator=g, dtype=torch.float64)
    values_in = values.to(dtype).requires_grad_()
    ctx = _global_ctx(seq_ids, mask)
    values_c, mask_c, ids_c = values_in.detach().clone(), mask.clone(), seq_ids.clone()
    out = agg_loss(values_in, mask, seq_ids, mode, ctx)
    assert out.dtype == dtype and out.dim() == 0
    ref_in = values_in.detach().double().requires_grad_()
    ref = ref_agg(ref_in, mask, seq_ids, mode, ctx.global_num_tokens.double(), ctx.global_num_seqs.double())
    assert_rel_close(out, ref, REL_TOL[dtype] if dtype != torch.float64 else 1e-12, f"{mode} value")
    upstream = torch.randn((), generator=g, dtype=torch.float64) + 2
    (out * upstream.to(dtype)).backward()
    (ref * upstream).backward()
    assert_rel_close(values_in.grad, ref_in.grad, REL_TOL[torch.float32], f"{mode} grad")
    assert torch.equal(values_in.detach(), values_c) and torch.equal(mask, mask_c)
    assert torch.equal(seq_ids, ids_c)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_is_invariant_under_micro_batch_split(mode):
    g = torch.Generator().manual_seed(7)
    seq_ids, mask = random_packed_batch(17, g)
    values = torch.randn(seq_ids.numel(), generator=g).requires_grad_()
    ctx = _global_ctx(seq_ids, mask)
    whole = agg_loss(values, mask, seq_ids, mode, ctx)
    (whole_grad,) = torch.autograd.grad(whole, values)
    for parts in (1, 2, 5):
        total = values.new_zeros(())
        for seqs in random_split(17, parts, g):
            # tokens of the chosen sequences, in a shuffled order (ids need not be sorted or dense)
            idx = torch.nonzero(torch.isin(seq_ids, seqs)).flatten()
            idx = idx[torch.randperm(idx.numel(), generator=g)]
            total = total + agg_loss(values[idx], mask[idx], seq_ids[idx] * 3 + 100, mode, ctx)
        (grad,) = torch.autograd.grad(total, values)
        assert_rel_close(total, whole, REL_TOL[torch.float32], f"{mode} split into {parts}: value")
        assert_rel_close(grad, whole_grad, REL_TOL[torch.float32], f"{mode} split into {parts}: grad")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_any_split_matches_reference(mode, dtype):
    """Micro-batch contributions (an empty one included, sparse ids, bool or int masks) sum to the
    float64 whole-batch loss and gradient; NaN / inf at masked slots never leak."""
    g = torch.Generator().manual_seed(11 + AGG_MODES.index(mode))
    n_seqs = 9
    seq_ids, mask = random_packed_batch(n_seqs, g, max_len=13)
    mask = mask.double()
    sparse_ids = 7 * seq_ids + 1000
    values = torch.randn(seq_ids.numel(), generator=g, dtype=torch.float64).to(dtype)
    values[mask == 0] = float("nan")
    values[(mask == 0).nonzero()[0]] = float("inf")
    g_up = float(torch.randn((), generator=g)) + 2.0
    ctx = LossContext.from_counts(float(mask.sum()), float(n_seqs))
    v64 = values.double().requires_grad_()
    ref = ref_agg(v64, mask, seq_ids, mode, float(mask.sum()), n_seqs)
    (ref * g_up).backward()
    for trial, parts in enumerate((1, 2, 4, 9)):
        x = values.clone().requires_grad_()
        total = x.new_zeros((), dtype=torch.float32)
        for idx in micro_batches(seq_ids, parts, g, with_empty=True):
            m = mask[idx].to(torch.bool) if trial % 2 else mask[idx].to(torch.int64)
            part = agg_loss(x[idx], m, sparse_ids[idx], mode, ctx)
            assert part.dtype == dtype
            total = total + part.float()
        (total * g_up).backward()
        assert torch.isfinite(x.grad.float()).all()
        assert (x.grad[mask == 0] == 0).all()
        assert_rel_close(total, ref.detach(), REL_TOL[dtype], f"{mode} value")
        assert_rel_close(x.grad.float(), v64.grad, REL_TOL[dtype], f"{mode} grad")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_agg_loss_float_weights_token_modes(mode):
    """Float mask weights are used as given in the two modes without per-sequence counts."""
    g = torch.Generator().manual_seed(5)
    seq_ids, _ = random_packed_batch(6, g, max_len=13)
    w = torch.rand(seq_ids.numel(), generator=g, dtype=torch.float64)
    values = torch.randn(seq_ids.numel(), generator=g, dtype=torch.float64)
    ctx = LossContext.from_counts(float(w.sum()), 6.0)
    ref = ref_agg(values, w, seq_ids, mode, float(w.sum()), 6.0)
    got = sum(agg_loss(values[i].float(), w[i].float(), seq_ids[i], mode, ctx).double()
              for i in micro_batches(seq_ids, 3, g, with_empty=True))
    assert_rel_close(got, ref, 1e-6, mode)


def test_agg_loss_float_weights_seq_mean_token_mean():
    values = torch.tensor([1.0, 3.0, -2.0, 5.0], dtype=torch.float64)
    w = torch.tensor([0.25, 0.25, 0.5, 0.5], dtype=torch.float64)      # sequence sums 0.5 and 1.0
    seq = torch.tensor([0, 0, 1, 1])
    ctx = LossContext.from_counts(float(w.sum()), 2.0)
    ref = ref_agg(values, w, seq, "seq-mean-token-mean", float(w.sum()), 2.0)   # (2 + 1.5) / 2 = 1.75
    got = agg_loss(values, w, seq, "seq-mean-token-mean", ctx)
    assert_rel_close(got, ref, 1e-12, "seq-mean-token-mean float weights")


def test_tokens_per_sequence_and_empty_input():
    seq_ids = torch.tensor([5, 2, 5, 9, 2, 5])
    mask = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.bool)
    assert torch.equal(tokens_per_sequence(mask, seq_ids), torch.tensor([2.0, 2.0, 2.0, 1.0, 2.0, 2.0]))
    ctx = LossContext.from_counts(4, 3)
    empty = torch.empty(0, requires_grad=True)
    for mode in AGG_MODES:
        out = agg_loss(empty, torch.empty(0, dtype=torch.bool), torch.empty(0, dtype=torch.long), mode, ctx)
        assert out.item() == 0.0
        out.backward()


def test_masked_slots_never_leak_non_finite_values():
    seq_ids = torch.tensor([0, 0, 1, 1, 1])
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0])
    values = torch.tensor([0.5, float("nan"), -1.0, 2.0, float("inf")], requires_grad=True)
    ctx = LossContext.from_counts(3, 2)
    for mode in AGG_MODES:
        out = agg_loss(values, mask, seq_ids, mode, ctx)
        (grad,) = torch.autograd.grad(out, values)
        assert torch.isfinite(out) and torch.isfinite(grad).all(), mode
        assert grad[1] == 0 and grad[4] == 0
    assert torch.isfinite(token_mean_metric(values, mask, ctx))


def test_agg_loss_rejects_bad_input():
    ctx = LossContext.from_counts(4, 2)
    v, m, s = torch.randn(4), torch.ones(4), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        agg_loss(v, m, s, "seq-sum", ctx)
    with pytest.raises(ValueError, match="loss_mask"):
        agg_loss(v, m[:3], s, "token-mean", ctx)
    with pytest.raises(ValueError, match="seq_ids"):
        agg_loss(v, m, None, "seq-mean-token-mean", ctx)
    with pytest.raises(ValueError, match="seq_ids"):
        agg_loss(v, m, s.float(), "seq-mean-token-mean", ctx)
    with pytest.raises(ValueError, match="values"):
        agg_loss(s, m, s, "token-mean", ctx)
    with pytest.raises(ValueError, match="global_num_tokens"):
        LossContext(global_num_tokens=torch.ones(2), global_num_seqs=torch.tensor(1.0))
    with pytest.raises(ValueError, match="dp_size"):
        LossContext.from_counts(1, 1, dp_size=0)
