"""The gated delta rule (Gated DeltaNet's linear attention), chunked and recurrent, in pure torch.

Per sequence and value head, with a state ``S`` of shape ``[dk, dv]`` (zeros or ``initial_state``),
``q_t = scale * l2norm(q_t)``, ``k_t = l2norm(k_t)`` (when ``use_qk_l2norm``) and ``a_t = exp(g_t)``::

    S_t = a_t * S_{t-1} + k_t (beta_t * (v_t - a_t * S_{t-1}^T k_t))^T     # decay, then delta-rule write
    o_t = S_t^T q_t

``recurrent_gated_delta_rule`` runs this token by token. ``chunk_gated_delta_rule`` computes the same
thing chunk by chunk: in a chunk of ``C`` tokens starting from ``S_0``, with ``G_i = g_1 + ... + g_i``
and ``D_ij = exp(G_i - G_j)`` (``j <= i``, else 0), the written values ``u_i`` (``S_i = e^{G_i} S_0 +
sum_{j<=i} D_ij k_j u_j^T``) satisfy the unit lower-triangular system (the WY / UT representation)::

    (I + tril(diag(beta) K K^T * D, -1)) U = diag(beta) V - diag(beta e^G) K S_0

so ``U = W_v - W_k S_0`` with ``[W_v, W_k]`` from one ``solve_triangular`` per chunk (parallel over
chunks), and the sequential scan over chunks is::

    O   = (Q * e^G) S_0 + ((Q K^T) * D) U
    S_C = e^{G_C} S_0 + (K * e^{G_C - G})^T U

Packed sequences (``cu_seqlens``, ``B == 1``) never share a chunk: every sequence is cut into its own
chunks (the last one padded with ``q = k = v = beta = g = 0``, which changes nothing), the chunks of
all sequences are solved together, and the scan steps all sequences at once (longest first, so the
sequences still running are a prefix of the state batch). ``B > 1`` is ``B`` sequences of length ``T``.

Math in fp32 (float64 when an input is float64), ``o`` in ``v``'s dtype, final state fp32/float64.
Semantics are those of transformers 5.24's ``torch_chunk_gated_delta_rule`` /
``torch_recurrent_gated_delta_rule`` (qwen3_next). Exact gradients come from autograd. Memory saved
for backward by the chunked form, per value head: O(T * (C + dk + dv)) (``[C, C]`` blocks per chunk,
never ``[T, T]``) plus one ``[dk, dv]`` state per chunk; the recurrent form saves one state per token.
On CUDA, when flash-linear-attention imports, the chunked form calls its kernel instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

_L2NORM_EPS = 1e-6
_Step = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # (step j, state) -> (out, state)


# --- input checks -------------------------------------------------------------------------------------


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor | None) -> int:
    """Raise ``ValueError`` naming the bad argument; return the number of sequences N."""
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, T, Hk, dk], got {list(q.shape)}")
    b, t, hk, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k: expected [B, T, Hk, dk] = {list(q.shape)} (as q), got {list(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (b, t):
        raise ValueError(f"v: expected [B, T, Hv, dv] = [{b}, {t}, Hv, dv], got {list(v.shape)}")
    hv, dv = v.shape[2:]
    if hk == 0 or hv % hk:
        raise ValueError(f"v: expected Hv a multiple of Hk = {hk} (value heads grouped per key head), "
                         f"got Hv = {hv} in v of shape {list(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (b, t, hv):
            raise ValueError(f"{name}: expected [B, T, Hv] = {[b, t, hv]}, got {list(x.shape)}")
    n = b
    if cu_seqlens is not None:
        integer = isinstance(cu_seqlens, torch.Tensor) and not (
            cu_seqlens.is_floating_point() or cu_seqlens.is_complex() or cu_seqlens.dtype == torch.bool)
        if not integer or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens: expected a 1-D integer tensor [N+1], N >= 1, got "
                             f"{cu_seqlens.dtype if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens!r} "
                             f"of shape {list(getattr(cu_seqlens, 'shape', []))}")
        if b != 1:
            raise ValueError(f"cu_seqlens: packed sequences need B == 1 (q of shape [1, T, Hk, dk]), "
                             f"got B = {b}")
        cu = cu_seqlens.tolist()
        if cu[0] != 0 or cu[-1] != t or any(x > y for x, y in zip(cu[:-1], cu[1:], strict=True)):
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to T = {t}, got {cu}")
        n = len(cu) - 1
    if initial_state is not None and (not isinstance(initial_state, torch.Tensor)
                                      or initial_state.shape != (n, hv, dk, dv)):
        what = "N" if cu_seqlens is not None else "B"
        raise ValueError(f"initial_state: expected [{what}, Hv, dk, dv] = {[n, hv, dk, dv]}, got "
                         f"{list(getattr(initial_state, 'shape', [])) or type(initial_state).__name__}")
    return n


# --- the sequence layout shared by both forms ---------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """Tokens cut into chunks of ``size``, chunks ordered step-major over sequences sorted longest first.

    Chunk ``m`` holds tokens ``index[m]`` (``T`` = a zero pad row); step ``j`` of the scan owns chunks
    ``sum(counts[:j]) ..`` of the first ``counts[j]`` sorted sequences. ``inverse[t]`` is the flat
    (chunk, position) slot of token ``t``; ``order[s]`` the original sequence of sorted slot ``s``.
    """

    size: int
    index: torch.Tensor  # [M, size] long
    inverse: torch.Tensor  # [T] long
    order: torch.Tensor  # [N] long
    counts: list[int]

    @classmethod
    def build(cls, cu: torch.Tensor, size: int, device: torch.device) -> _Layout:
        cu = cu.to("cpu", torch.long)
        total = int(cu[-1])
        lengths = cu[1:] - cu[:-1]
        n_chunks = (lengths + size - 1) // size
        order = torch.argsort(n_chunks, descending=True, stable=True)
        n_sorted = n_chunks[order]
        steps = int(n_sorted.max()) if n_sorted.numel() else 0
        active = n_sorted[None, :] > torch.arange(steps)[:, None]  # [steps, N]
        step, seq = active.nonzero(as_tuple=True)  # row-major: step-major
        pos = step[:, None] * size + torch.arange(size)  # [M, size], position in its sequence
        valid = pos < lengths[order][seq][:, None]
        index = torch.where(valid, cu[order][seq][:, None] + pos, total)
        inverse = torch.empty(total, dtype=torch.long)
        inverse[index[valid]] = torch.arange(index.numel()).view_as(index)[valid]
        return cls(size, index.to(device), inverse.to(device), order.to(device), active.sum(1).tolist())

    def to_chunks(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, H, ...]`` -> ``[M, H, size, ...]`` (padding zeros)."""
        x = torch.cat([x, x.new_zeros((1,) + x.shape[1:])])[self.index]  # [M, size, H, ...]
        return x.transpose(1, 2)

    def to_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, H, size, ...]`` -> ``[T, H, ...]``."""
        x = x.transpose(1, 2)
        return x.reshape((-1,) + x.shape[2:])[self.inverse]

    def steps(self, *xs: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per scan step, the rows of each ``[M, ...]`` tensor that step owns: split once, so the backward
        concatenates the steps' gradients once (slicing per step would build a zero-filled ``[M, ...]``
        gradient per step: quadratic in the chunks)."""
        return list(zip(*(x.split(self.counts) for x in xs), strict=True))

    def scan(self, state: torch.Tensor, step: _Step) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run ``step(j, state) -> (out, state)`` over the steps ``j``; return (outputs ``[M, ...]``, final
        states ``[N, ...]`` in the original order). ``state`` is ``[N, ...]`` in the original order."""
        state = state[self.order]
        counts = self.counts + [0]
        finished = [state[counts[0]:]]  # empty sequences keep their initial state
        state, outs = state[:counts[0]], []
        for j in range(len(self.counts)):
            out, state = step(j, state)
            outs.append(out)
            finished.append(state[counts[j + 1]:])  # sequences that end here, at the end of the batch
            state = state[:counts[j + 1]]
        final = torch.cat(finished[::-1])[torch.argsort(self.order)]
        return (torch.cat(outs) if outs else None), final


# --- shared preprocessing -----------------------------------------------------------------------------


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, cu_seqlens):
    """fp32 (or float64) token-major ``[B*T, H, ...]`` tensors, the sequence offsets and the state."""
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2:]
    dtype = functools.reduce(torch.promote_types, [x.dtype for x in (q, k, v, g, beta)], torch.float32)
    q, k, v, g, beta = (x.to(dtype).reshape((b * t,) + x.shape[2:]) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + _L2NORM_EPS)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + _L2NORM_EPS)
    q = q * (dk ** -0.5 if scale is None else scale)
    if hv != hk:  # key head i serves value heads i*r .. i*r+r-1
        q, k = (x.repeat_interleave(hv // hk, dim=1) for x in (q, k))
    if cu_seqlens is None:
        cu_seqlens = torch.arange(b + 1) * t
    n = cu_seqlens.numel() - 1
    state = (torch.zeros(n, hv, dk, dv, dtype=dtype, device=v.device) if initial_state is None
             else initial_state.to(device=v.device, dtype=dtype))
    return q, k, v, g, beta, cu_seqlens, state


# --- the two forms ------------------------------------------------------------------------------------


def _chunk_torch(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                 use_qk_l2norm=True, cu_seqlens=None, chunk_size=64):
    """The pure-torch chunked form (``chunk_gated_delta_rule`` without the input checks or fla)."""
    shape, out_dtype, dv = v.shape, v.dtype, v.shape[-1]
    q, k, v, g, beta, cu, state = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, cu_seqlens)
    lengths = cu[1:] - cu[:-1]
    size = max(1, min(chunk_size, int(lengths.max()) if lengths.numel() else 1))
    lay = _Layout.build(cu, size, v.device)
    # --- 1. chunks: [M, H, C, d], cumulative log decay G and pairwise decays D (lower incl. diagonal) ---
    q, k, v = lay.to_chunks(q), lay.to_chunks(k), lay.to_chunks(v)
    g, beta = lay.to_chunks(g), lay.to_chunks(beta)  # [M, H, C]
    cum = g.cumsum(-1)
    above = torch.ones(size, size, dtype=torch.bool, device=v.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(above, float("-inf")).exp()
    # --- 2. the UT system: U = W_v - W_k S_0, one triangular solve per chunk ---
    k_beta = k * beta[..., None]
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    w_v, w_k = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
        [dv, k.shape[-1]], dim=-1)
    attn = (q @ k.transpose(-1, -2)) * decay  # [M, H, C, C]
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [M, H, 1, 1]

    # --- 3. the scan over chunks, all sequences at once ---
    parts = lay.steps(w_v, w_k, q_decayed, attn, chunk_decay, k_decayed)

    def step(j: int, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w_v_j, w_k_j, q_decayed_j, attn_j, chunk_decay_j, k_decayed_j = parts[j]
        u = w_v_j - w_k_j @ s
        out = q_decayed_j @ s + attn_j @ u
        return out, s * chunk_decay_j + k_decayed_j.transpose(-1, -2) @ u

    out, final = lay.scan(state, step)
    if out is None:
        out = v.new_zeros(0, v.shape[1], size, dv)
    o = lay.to_tokens(out).reshape(shape).to(out_dtype)
    return o, (final if output_final_state else None)


def _recurrent_torch(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                     use_qk_l2norm=True, cu_seqlens=None):
    """The token-by-token form (``recurrent_gated_delta_rule`` without the input checks)."""
    shape, out_dtype = v.shape, v.dtype
    q, k, v, g, beta, cu, state = _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm, cu_seqlens)
    lay = _Layout.build(cu, 1, v.device)  # one token per "chunk": step j = token j of each sequence
    q, k, v = (x[lay.index[:, 0]] for x in (q, k, v))  # [M, H, d], step-major
    decay, beta = g[lay.index[:, 0]].exp()[..., None, None], beta[lay.index[:, 0]][..., None]

    parts = lay.steps(q, k, v, decay, beta)

    def step(j: int, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q_j, k_j, v_j, decay_j, beta_j = parts[j]
        s = s * decay_j
        delta = (v_j - (k_j[..., None, :] @ s)[..., 0, :]) * beta_j
        s = s + k_j[..., :, None] * delta[..., None, :]
        return (q_j[..., None, :] @ s)[..., 0, :], s

    out, final = lay.scan(state, step)
    if out is None:
        out = v
    o = out[lay.inverse].reshape(shape).to(out_dtype)
    return o, (final if output_final_state else None)


@functools.cache
def _fla_chunk() -> Callable | None:
    """flash-linear-attention's chunked kernel, or None when it does not import."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception:  # not installed, or installed without a working Triton
        return None
    return fla_chunk


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, *, scale: float | None = None,
                           initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm: bool = True, cu_seqlens: torch.Tensor | None = None,
                           chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over ``q, k [B, T, Hk, dk]``, ``v [B, T, Hv, dv]``, ``g`` (log decay <= 0) and
    ``beta`` ``[B, T, Hv]``, chunk by chunk (module docstring) -> (``o [B, T, Hv, dv]`` in ``v``'s
    dtype, final state ``[B or N, Hv, dk, dv]`` fp32 or None). ``cu_seqlens [N+1]`` (``B == 1``): N
    independent packed sequences, ``initial_state`` then ``[N, Hv, dk, dv]``. ``scale`` defaults to
    ``dk ** -0.5`` and multiplies q after its l2norm. On CUDA with flash-linear-attention importable,
    its ``chunk_gated_delta_rule`` computes the result (q, k repeated to Hv heads first)."""
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive int, got {chunk_size!r}")
    if q.is_cuda and _fla_chunk() is not None:
        r = v.shape[2] // q.shape[2]
        if r > 1:
            q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
        o, final = _fla_chunk()(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                use_qk_l2norm_in_kernel=use_qk_l2norm)
        return o.to(v.dtype), final
    return _chunk_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                        cu_seqlens=cu_seqlens, chunk_size=chunk_size)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, *, scale: float | None = None,
                               initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                               use_qk_l2norm: bool = True, cu_seqlens: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule token by token (what a decoder runs); arguments and results as
    ``chunk_gated_delta_rule``. Pure torch on every device; saves one ``[Hv, dk, dv]`` state per token."""
    _check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return _recurrent_torch(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                            cu_seqlens=cu_seqlens)
