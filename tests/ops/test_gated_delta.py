"""The gated delta rule (mcore_engine/ops/gated_delta.py): chunked and recurrent forms against a float64
token-by-token loop (values and gradients), against transformers 5.24's torch implementations, packed
sequences against each sequence alone, gradcheck, input checks."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

from mcore_engine.ops import gated_delta
from mcore_engine.ops.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from tests.utils import assert_rel_close

FORMS = {"chunk": chunk_gated_delta_rule, "recurrent": recurrent_gated_delta_rule}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
# Relative-norm budgets. bf16: the math runs in fp32, so the error is the bf16 rounding of o and of the
# returned gradients (unit roundoff 2^-9, ~4e-3 per element); 1e-2 leaves room for sums of those.
TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def reference(q, k, v, g, beta, *, scale=None, initial_state=None, use_qk_l2norm=True, cu_seqlens=None,
              output_final_state=True):
    """Float64, one sequence and one token at a time: S = e^g S; S += k (beta (v - S^T k))^T; o = S^T q."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    q, k, v, g, beta = (x.double() for x in (q, k, v, g, beta))
    q, k = q.repeat_interleave(hv // hk, dim=2), k.repeat_interleave(hv // hk, dim=2)
    if use_qk_l2norm:
        q = q / ((q * q).sum(-1, keepdim=True) + 1e-6).sqrt()
        k = k / ((k * k).sum(-1, keepdim=True) + 1e-6).sqrt()
    q = q * (dk ** -0.5 if scale is None else scale)
    if cu_seqlens is None:
        seqs = [(i, 0, t) for i in range(b)]
    else:
        cu = cu_seqlens.tolist()
        seqs = [(0, s, e) for s, e in zip(cu[:-1], cu[1:], strict=True)]
    out: dict[tuple[int, int], torch.Tensor] = {}
    finals = []
    for n, (i, s, e) in enumerate(seqs):
        state = torch.zeros(hv, dk, dv, dtype=torch.float64) if initial_state is None \
            else initial_state[n].double()
        for j in range(s, e):
            state = state * g[i, j].exp()[:, None, None]
            delta = beta[i, j, :, None] * (v[i, j] - torch.einsum("hkv,hk->hv", state, k[i, j]))
            state = state + k[i, j, :, :, None] * delta[:, None, :]
            out[i, j] = torch.einsum("hkv,hk->hv", state, q[i, j])
        finals.append(state)
    o = torch.stack([torch.stack([out[i, j] for j in range(t)]) if t else torch.zeros(0, hv, dv)
                     for i in range(b)])
    return o, torch.stack(finals)


def make_inputs(seed, b, t, hk, hv, dk, dv, n_states, dtype=torch.float32):
    """Fresh random leaves: g = -softplus(randn) (decays e^g in (0, 1)), beta = sigmoid(randn)."""
    gen = torch.Generator().manual_seed(seed)
    x = dict(q=torch.randn(b, t, hk, dk, generator=gen), k=torch.randn(b, t, hk, dk, generator=gen),
             v=torch.randn(b, t, hv, dv, generator=gen), g=-F.softplus(torch.randn(b, t, hv, generator=gen)),
             beta=torch.randn(b, t, hv, generator=gen).sigmoid(),
             initial_state=torch.randn(n_states, hv, dk, dv, generator=gen) * 0.5)
    return {key: val.to(dtype).requires_grad_() for key, val in x.items()}


def grads(fn, x, seed, **kw):
    """(o, final, grads of sum(o*w) + sum(final*w2) wrt every input in x)."""
    o, final = fn(**x, output_final_state=True, **kw)
    gen = torch.Generator().manual_seed(seed + 1000)
    loss = (o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() \
        + (final.double() * torch.randn(final.shape, generator=gen, dtype=torch.float64)).sum()
    return o, final, dict(zip(x, torch.autograd.grad(loss, list(x.values())), strict=True))


def check_against_reference(fn, x, seed, tol, **kw):
    o, final, gr = grads(fn, x, seed, **kw)
    ref = {key: val.detach().double().requires_grad_() for key, val in x.items()}
    kw.pop("chunk_size", None)
    o_ref, final_ref, gr_ref = grads(reference, ref, seed, **kw)
    assert o.dtype == x["v"].dtype
    assert_rel_close(o, o_ref, tol, "o")
    assert_rel_close(final, final_ref, tol, "final_state")
    for key in x:
        assert gr[key].dtype == x[key].dtype
        assert_rel_close(gr[key], gr_ref[key], tol, f"grad {key}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", FORMS)
def test_matches_the_token_loop_values_and_gradients(form, dtype):
    """B = 2, grouped heads (Hv = 2 Hk), T = 21 with chunk 8 (two full chunks and a partial one)."""
    x = make_inputs(1, 2, 21, 2, 4, 5, 6, 2, dtype)
    kw = {"chunk_size": 8} if form == "chunk" else {}
    check_against_reference(FORMS[form], x, 1, TOL[dtype], **kw)


@pytest.mark.parametrize("form", FORMS)
def test_packed_lengths_around_the_chunk_size(form):
    """Packed lengths 1, C-1, C, C+1, several chunks, and empty sequences (which keep their state)."""
    cu = torch.tensor([0, 1, 8, 8, 16, 25, 51, 52, 52], dtype=torch.int32)  # C = 8
    x = make_inputs(2, 1, 52, 1, 2, 4, 3, 8, torch.float64)
    kw = {"chunk_size": 8} if form == "chunk" else {}
    check_against_reference(FORMS[form], x, 2, TOL[torch.float64], cu_seqlens=cu, **kw)


@pytest.mark.parametrize("form", FORMS)
def test_scale_and_no_l2norm(form):
    x = make_inputs(3, 1, 11, 2, 2, 4, 4, 1, torch.float64)
    kw = {"chunk_size": 4} if form == "chunk" else {}
    check_against_reference(FORMS[form], x, 3, TOL[torch.float64], scale=0.3, use_qk_l2norm=False, **kw)


@pytest.mark.parametrize("form", FORMS)
def test_strong_and_zero_decays(form):
    """Decays e^g down to ~e^-100 per token (products underflow within a chunk) and g = 0 (no decay)."""
    x = make_inputs(12, 1, 40, 1, 2, 4, 3, 1, torch.float64)
    with torch.no_grad():
        x["g"].mul_(30.0)
        x["g"][:, 5:12] = 0.0
    kw = {"chunk_size": 16} if form == "chunk" else {}
    check_against_reference(FORMS[form], x, 12, TOL[torch.float64], **kw)


def test_chunk_size_does_not_change_the_result():
    x = make_inputs(4, 1, 37, 1, 3, 4, 5, 1, torch.float64)
    o1, s1 = chunk_gated_delta_rule(**x, output_final_state=True, chunk_size=1)
    for c in (3, 16, 64):
        o, s = chunk_gated_delta_rule(**x, output_final_state=True, chunk_size=c)
        assert_rel_close(o, o1, 1e-12, f"o, chunk {c}")
        assert_rel_close(s, s1, 1e-12, f"final_state, chunk {c}")


@pytest.mark.parametrize("form", FORMS)
def test_packed_equals_each_sequence_alone_fp32(form):
    """Values, final states and gradients of a pack equal each sequence run alone (B = 1), fp32 1e-6."""
    cu = torch.tensor([0, 3, 70, 71, 135, 200])
    x = make_inputs(5, 1, 200, 2, 4, 8, 8, 5)
    kw = {"chunk_size": 16} if form == "chunk" else {}
    o, final, gr = grads(FORMS[form], x, 5, cu_seqlens=cu, **kw)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)):
        alone = {key: (val[n:n + 1] if key == "initial_state" else val[:, s:e]).detach().requires_grad_()
                 for key, val in x.items()}
        o_a, f_a = FORMS[form](**alone, output_final_state=True, **kw)
        assert_rel_close(o[:, s:e], o_a, 1e-6, f"o of sequence {n}")
        assert_rel_close(final[n:n + 1], f_a, 1e-6, f"final_state of sequence {n}")
        gen = torch.Generator().manual_seed(5 + 1000)  # the same upstream weights, sliced
        w_o = torch.randn(o.shape, generator=gen, dtype=torch.float64)[:, s:e]
        w_f = torch.randn(final.shape, generator=gen, dtype=torch.float64)[n:n + 1]
        loss = (o_a.double() * w_o).sum() + (f_a.double() * w_f).sum()
        for key, grad in zip(alone, torch.autograd.grad(loss, list(alone.values())), strict=True):
            part = gr[key][n:n + 1] if key == "initial_state" else gr[key][:, s:e]
            assert_rel_close(part, grad, 1e-6, f"grad {key} of sequence {n}")


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_matches_transformers(use_qk_l2norm):
    """transformers 5.24's torch_chunk_gated_delta_rule / torch_recurrent_gated_delta_rule, fp32 1e-5:
    B = 2, T = 150 (chunk 64: two full chunks and a partial one), Hv = 2 Hk, an initial state."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    x = make_inputs(6, 2, 150, 2, 4, 16, 12, 2)
    hf_kw = dict(initial_state=x["initial_state"], output_final_state=True,
                 use_qk_l2norm_in_kernel=use_qk_l2norm)
    args = [x[key] for key in ("q", "k", "v", "g", "beta")]
    for theirs in (hf.torch_chunk_gated_delta_rule, hf.torch_recurrent_gated_delta_rule):
        o_ref, s_ref = theirs(*args, **hf_kw)
        for fn in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
            o, s = fn(*args, initial_state=x["initial_state"], output_final_state=True,
                      use_qk_l2norm=use_qk_l2norm)
            assert_rel_close(o, o_ref, 1e-5, f"o: {fn.__name__} vs {theirs.__name__}")
            assert_rel_close(s, s_ref, 1e-5, f"final_state: {fn.__name__} vs {theirs.__name__}")


def test_gradcheck():
    x = make_inputs(7, 1, 7, 1, 2, 3, 2, 2, torch.float64)
    cu = torch.tensor([0, 2, 7])
    names = list(x)

    def fn(*args):
        return chunk_gated_delta_rule(**dict(zip(names, args, strict=True)), output_final_state=True,
                                      cu_seqlens=cu, chunk_size=3)

    assert torch.autograd.gradcheck(fn, tuple(x.values()))


def test_defaults_and_does_not_mutate_inputs():
    x = make_inputs(8, 1, 9, 1, 1, 4, 4, 1)
    before = {key: val.detach().clone() for key, val in x.items()}
    for fn in FORMS.values():
        o, s = fn(*[x[key] for key in NAMES[:5]])
        assert s is None and o.shape == x["v"].shape
        o, s = fn(**x, output_final_state=True)
        assert s.dtype == torch.float32 and s.shape == x["initial_state"].shape
    for key, val in x.items():
        assert torch.equal(val, before[key]), key


def test_fla_is_never_used_on_cpu(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the fla kernel was called on CPU")

    monkeypatch.setattr(gated_delta, "_fla_chunk", lambda: boom)
    x = make_inputs(9, 1, 5, 1, 1, 2, 2, 1)
    o, _ = chunk_gated_delta_rule(**x)
    assert torch.isfinite(o).all()


def _bad_cases():
    x = {key: val.detach() for key, val in make_inputs(10, 1, 6, 2, 4, 3, 5, 1).items()}
    x2 = {key: val.detach() for key, val in make_inputs(10, 2, 6, 2, 4, 3, 5, 2).items()}
    return [
        (dict(x, q=x["q"][0]), "q: expected [B, T, Hk, dk]"),
        (dict(x, k=x["k"][..., :2]), "k: expected [B, T, Hk, dk] = [1, 6, 2, 3]"),
        (dict(x, v=x["v"][:, :5]), "v: expected [B, T, Hv, dv] = [1, 6, Hv, dv]"),
        (dict(x, v=x["v"][:, :, :3], g=x["g"][..., :3], beta=x["beta"][..., :3]), "multiple of Hk = 2"),
        (dict(x, g=x["g"][..., :2]), "g: expected [B, T, Hv] = [1, 6, 4]"),
        (dict(x, beta=x["beta"][0]), "beta: expected [B, T, Hv] = [1, 6, 4]"),
        (dict(x, q=x["q"].long()), "q: expected a floating-point tensor"),
        (dict(x, initial_state=x["initial_state"][:, :2]), "initial_state: expected [B, Hv, dk, dv]"),
        (dict(x2, cu_seqlens=torch.tensor([0, 6])), "cu_seqlens: packed sequences need B == 1"),
        (dict(x, cu_seqlens=torch.tensor([1, 6])), "cu_seqlens: expected non-decreasing offsets from 0"),
        (dict(x, cu_seqlens=torch.tensor([0, 5])), "from 0 to T = 6"),
        (dict(x, cu_seqlens=torch.tensor([0, 4, 3, 6])), "cu_seqlens: expected non-decreasing"),
        (dict(x, cu_seqlens=torch.tensor([0.0, 6.0])), "cu_seqlens: expected a 1-D integer tensor"),
        (dict(x, cu_seqlens=torch.tensor([0, 2, 6])), "initial_state: expected [N, Hv, dk, dv] = [2,"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
@pytest.mark.parametrize("form", FORMS)
def test_bad_input_raises_value_error_naming_the_argument(form, case):
    kwargs, match = _bad_cases()[case]
    with pytest.raises(ValueError, match=re.escape(match)):
        FORMS[form](**kwargs)


def test_bad_chunk_size():
    x = make_inputs(11, 1, 4, 1, 1, 2, 2, 1)
    with pytest.raises(ValueError, match="chunk_size: expected a positive int"):
        chunk_gated_delta_rule(**x, chunk_size=0)
