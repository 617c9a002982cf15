"""Triton chunk gradient (``chunk_grad``) vs its float64 formula and the ops' torch path."""

from __future__ import annotations

import pytest
import torch
from mcore_engine_kernels.backward import chunk_grad
from mcore_engine_kernels.launch import LaunchConfig
from mcore_engine_kernels.layout import Coefficients

from mcore_engine.ops import stats as torch_stats
from tests.kernels.inputs import BF16, DEVICE, F16, F32, chunk_inputs, temperature_rows
from tests.utils import assert_rel_close, rel_err

SMALL = LaunchConfig(block_v=128, num_warps=4)

# (seed, dtype, temperature, rows, v_local, v_valid, offset, terms, splits, config); tail: the scale of
# a_tail (the KL tail's coefficient, excluded at the teacher ids), 0 for none.
CASES = [
    (1, F32, "none", 37, 1000, 1000, 0, dict(b=True, c2=True, points=6, tail=1e9), None, None),
    (2, F32, "rows", 17, 1000, 953, 1000, dict(b=True, c2=False, points=4, tail=0), 5, SMALL),
    (3, BF16, "float", 29, 517, 517, 517, dict(b=False, c2=True, points=1, tail=0), 3, SMALL),
    (4, BF16, "rows", 23, 700, 650, 0, dict(b=True, c2=True, points=5, tail=1.0), None, None),
    (5, F16, "float", 19, 333, 333, 333, dict(b=False, c2=False, points=0, tail=0), 2, SMALL),
    (6, F32, "float", 21, 800, 777, 0, dict(b=False, c2=False, points=7, tail=1e12), 4, SMALL),
]


def _stats_of(x, t, m):
    """Exact-ish global statistics of the chunk (single shard) in fp32: inv_s and mu = A / S."""
    zm = torch_stats.shifted(x, t, m).double()
    e = zm.exp()
    return (1 / e.sum(-1)).float(), ((e * zm).sum(-1) / e.sum(-1)).float()


def _reference_grad64(x, t, m, coef: Coefficients):
    """The module docstring's formula in float64: ``(p (a + a_tail [not tail] + b (zm - mu) + c2 p)
    + scatter) / t``."""
    inv_s, a, b, mu, c2 = coef.inv_s, coef.a, coef.b, coef.mu, coef.c2
    cols, vals, a_tail, tail_cols = coef.cols, coef.vals, coef.a_tail, coef.tail_cols
    tt = 1.0 if t is None else (t.double()[:, None] if isinstance(t, torch.Tensor) else t)
    zm = x.double() / tt - m.double()[:, None]
    p = zm.exp() * inv_s.double()[:, None]
    inner = a.double()[:, None] + torch.zeros_like(p)
    if a_tail is not None:
        at_ids = torch.zeros_like(p, dtype=torch.bool)
        at_ids.scatter_(1, tail_cols.clamp_min(0), tail_cols >= 0)
        inner = inner + a_tail.double()[:, None] * ~at_ids
    if b is not None:
        inner = inner + b.double()[:, None] * (zm - mu.double()[:, None])
    if c2 is not None:
        inner = inner + c2.double()[:, None] * p
    g = p * inner
    if cols is not None:
        g = g.scatter_add(1, cols, vals.double())
    return g / tt


@pytest.mark.parametrize("case", CASES, ids=[f"case{c[0]}" for c in CASES])
def test_chunk_grad_matches_float64_and_torch_path(case):
    seed, dtype, tkind, rows, v_local, v_valid, offset, terms, splits, cfg = case
    vocab = offset + v_valid + 211
    n = terms["points"]
    inp = chunk_inputs(seed, rows, v_local, v_valid, dtype, max(n, 1), offset, vocab)
    x, g = inp["x"], inp["gen"]
    t = temperature_rows(tkind, rows, g)
    m = torch_stats.row_max(x, t)
    inv_s, mu = _stats_of(x, t, m)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    a = rnd(rows)
    b = rnd(rows) if terms["b"] else None
    mu = mu if terms["b"] else None
    c2 = rnd(rows) if terms["c2"] else None
    cols = vals = None
    if n:
        # Label + teacher ids as the ops pass them: clamped local columns, values zeroed off-shard.
        gids = torch.cat([inp["labels"][:, None], inp["ids"][:, :n - 1]], 1)
        cols, inside = torch_stats.local_columns(gids, offset, v_valid)
        vals = rnd(rows, n) * inside
    a_tail = tail_cols = None
    if terms["tail"]:
        # The teacher ids (with one repeat per row), local; -1 off-shard and for the repeats.
        tids = torch.cat([inp["ids"][:, :n - 1], inp["ids"][:, :1]], 1)
        first = torch_stats.first_occurrence(tids)
        tail_cols, inside = torch_stats.local_columns(tids, offset, v_valid)
        tail_cols = tail_cols.masked_fill(~(inside & first), -1)
        a_tail = rnd(rows) * terms["tail"]
    x_before = inp["full"].clone()

    # The chunk's columns of a full-width gradient (padded columns must stay untouched).
    grad = torch.full((rows, v_local), float("nan"), dtype=dtype, device=DEVICE)
    out = grad[:, :v_valid]
    coef = Coefficients(inv_s, a, b, mu, c2, cols, vals, a_tail, tail_cols)
    res = chunk_grad(x, t, m, coef, out, splits=splits, config=cfg)
    assert res is out and out.dtype == dtype
    assert torch.isfinite(out).all(), "some gradient element was not written"
    assert torch.isnan(grad[:, v_valid:]).all(), "chunk_grad wrote past the valid columns"
    assert torch.equal(inp["full"], x_before), "chunk_grad modified its input"

    ref = _reference_grad64(x, t, m, coef)
    # Error budget: the rounding of the exact result to the output dtype, plus fp32 arithmetic.
    budget = rel_err(ref.to(dtype), ref) + 1e-5
    assert rel_err(out, ref) <= budget, f"grad vs float64: {rel_err(out, ref):.3e} > {budget:.3e}"
    if a_tail is not None:  # the teacher columns alone: the huge a_tail must not leak into them
        at = tail_cols.clamp_min(0)
        sub, sub_ref = out.gather(1, at)[tail_cols >= 0], ref.gather(1, at)[tail_cols >= 0]
        budget = rel_err(sub_ref.to(dtype), sub_ref) + 1e-5
        assert rel_err(sub, sub_ref) <= budget, f"teacher columns: {rel_err(sub, sub_ref):.3e} > {budget:.3e}"

    # The ops' torch path: recompute zm, chunk_grad (w.r.t. z), divide by t, cast to the logits' dtype.
    gz = torch_stats.chunk_grad(torch_stats.shifted(x, t, m), coef)
    if t is not None:
        gz = gz / (t[:, None] if isinstance(t, torch.Tensor) else t)
    assert_rel_close(out, gz.to(dtype), 1e-5 if dtype == F32 else 1e-2, "grad vs torch path")


def test_bad_input_raises_value_error_naming_argument():
    x = torch.randn(5, 40, device=DEVICE)
    r = torch.ones(5, device=DEVICE)
    out = torch.empty(5, 40, device=DEVICE)
    col = torch.zeros(5, 1, dtype=torch.long, device=DEVICE)
    bad = [("inv_s must be", Coefficients(r[:3], r), out), ("mu must be", Coefficients(r, r, b=r), out),
           ("cols and vals", Coefficients(r, r, cols=col), out),
           ("a_tail and tail_cols", Coefficients(r, r, a_tail=r), out),
           ("tail_cols must be", Coefficients(r, r, a_tail=r, tail_cols=col[:4].repeat(1, 2)), out),
           ("out must be", Coefficients(r, r), out[:, :39])]
    for message, coef, o in bad:
        with pytest.raises(ValueError, match=message):
            chunk_grad(x, None, r, coef, o)
