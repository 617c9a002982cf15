"""Causal attention of a query chunk to its key range in pieces, with attention sinks and sliding
windows; exact gradients, no ``[s, s]`` tensor kept for backward.

Math, for queries at sequence positions ``a .. a + c - 1`` (rows ``r``, ``pos = a + r``), keys / values
at positions ``k0 .. a + c - 1`` (``k0`` = the first key any query may see), query head ``h`` and its KV
group ``g``::

    z[r, j]   = scale * q[r, h] . k[j, g]          if pos - W < j <= pos (no window: 0 <= j <= pos)
    lse[r]    = logsumexp_j z[r, j]
    lse_t[r]  = logaddexp(lse[r], sink[h])          # sinks: one more logit per row (no value)
    out[r, h] = sum_j exp(z[r, j] - lse_t[r]) v[j, g]

Pieces (``_plan``): with the CPU flash kernel and no window, the full prefix ``[k0, a)`` and the causal
diagonal block ``[a, a + c)`` (two calls over all rows, merged by log-sum-exp); otherwise query blocks
of ``B`` rows (64 for ``W <= 256``, else 128), each against the keys ``[max(k0, pos_first - W + 1),
pos_last]`` with an additive band mask ``[B, B + W - 1]`` built per block (rebuilt in backward, never
saved). Every row sees its own key, so no row is fully masked (the CPU flash kernel returns ``lse = 0``
for one).

Backward: each piece's kernel backward with the MERGED ``out`` and ``lse_t`` (its probabilities are
``exp(z - lse_t)`` and ``rowsum(dout * out)`` is the merged one: exact, the ring-attention identity);
``d sink[h] = -sum_{batch, r} exp(sink[h] - lse_t[r]) * rowsum(dout[r] * out[r])``.

Kernels: ``cpu_flash`` = ``aten._scaled_dot_product_flash_attention_for_cpu`` (GQA native, additive mask
in the query's dtype); otherwise a device-generic fp32 ``matmul`` softmax per piece (scores ``[b, h, B,
keys]`` live only inside the piece; used on GPUs without Transformer Engine, tested on CPU only).
Saved for backward: ``q``, the key range of ``k`` / ``v``, ``out`` and an fp32 ``lse_t`` per row and
head: linear in ``s``; with a window the compute is ``O(s (B + W))`` per head, without ``O(s^2 / 2)``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["block_attention"]

def _plan(a: int, c: int, k0: int, window: int | None,
          two_pieces: bool) -> list[tuple[int, int, int, int, bool]]:
    """Pieces ``(r0, r1, j0, j1, causal)``: rows ``[r0, r1)`` attend key indices ``[j0, j1)`` (key index
    ``j`` is position ``k0 + j``); ``causal``: the piece is the square diagonal block (kernel's causal
    flag), else :func:`_mask` decides."""
    if two_pieces:  # no window: full prefix + causal diagonal, both over every row
        return ([(0, c, 0, a - k0, False)] if a > k0 else []) + [(0, c, a - k0, a - k0 + c, True)]
    block = 64 if window is not None and window <= 256 else 128  # fastest on CPU (W = 16 .. 1024)
    pieces = []
    for r0 in range(0, c, block):
        r1 = min(c, r0 + block)
        first = k0 if window is None else max(k0, a + r0 - window + 1)
        pieces.append((r0, r1, first - k0, a + r1 - k0, False))
    return pieces


def _mask(a: int, k0: int, piece: tuple[int, int, int, int, bool], window: int | None, dtype: torch.dtype,
          device: torch.device) -> Tensor | None:
    """Additive ``[r1 - r0, j1 - j0]`` mask (0 / -inf) of ``pos - W < key <= pos``; None if all visible."""
    r0, r1, j0, j1, causal = piece
    last_key_first_row = k0 + j1 - 1 <= a + r0  # every key at or before the first query
    inside_window = window is None or k0 + j0 > a + r1 - 1 - window  # ... and within the last's window
    if causal or (last_key_first_row and inside_window):  # all visible: no mask, no host sync
        return None
    pos = torch.arange(a + r0, a + r1, device=device)[:, None]
    key = torch.arange(k0 + j0, k0 + j1, device=device)[None, :]
    visible = key <= pos
    if window is not None:
        visible &= key > pos - window
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, float("-inf"))


# ----------------------------------------------------------------------------------------------------
# Kernels: (out, lse) of one piece and its backward given the merged out / lse
# ----------------------------------------------------------------------------------------------------
def _flash_forward(q, k, v, mask, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=mask,
                                                                      scale=scale)


def _flash_backward(grad, q, k, v, out, lse, mask, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


def _math_scores(q: Tensor, k: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """fp32 scores ``[b, hk, g, r, n]`` (query head ``h = group * g + i``)."""
    b, h, r, d = q.shape
    hk = k.size(1)
    acc = torch.promote_types(q.dtype, torch.float32)
    z = torch.einsum("bkgrd,bknd->bkgrn", q.reshape(b, hk, h // hk, r, d).to(acc), k.to(acc)) * scale
    return z if mask is None else z + mask.to(acc)


def _math_forward(q, k, v, mask, causal, scale):  # causal is never set: the block plan masks explicitly
    z = _math_scores(q, k, mask, scale)
    lse = z.logsumexp(-1)
    out = torch.einsum("bkgrn,bknd->bkgrd", (z - lse[..., None]).exp(), v.to(z.dtype))
    return out.flatten(1, 2), lse.flatten(1, 2)


def _math_backward(grad, q, k, v, out, lse, mask, causal, scale):
    b, h, r, _ = q.shape
    hk = k.size(1)
    split = (b, hk, h // hk, r)
    z = _math_scores(q, k, mask, scale)
    p = (z - lse.to(z.dtype).reshape(split)[..., None]).exp()
    dout = grad.to(z.dtype).reshape(*split, -1)
    dv = torch.einsum("bkgrn,bkgrd->bknd", p, dout)
    dp = torch.einsum("bkgrd,bknd->bkgrn", dout, v.to(z.dtype))
    ds = p * (dp - (dout * out.to(z.dtype).reshape(*split, -1)).sum(-1, keepdim=True)) * scale
    dq = torch.einsum("bkgrn,bknd->bkgrd", ds, k.to(z.dtype)).reshape(b, h, r, -1)
    dk = torch.einsum("bkgrn,bkgrd->bknd", ds, q.to(z.dtype).reshape(*split, -1))
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------
# The autograd Function
# ----------------------------------------------------------------------------------------------------
class _BlockAttention(torch.autograd.Function):
    """``q [b, h, c, d]`` (positions ``a ..``), ``k, v [b, hk, a + c - k0, d]`` (positions ``k0 ..``),
    ``sinks [h]`` or None -> ``out [b, h, c, d]``; steps as in the module docstring."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, a: int, k0: int,
                window: int | None, scale: float, cpu_flash: bool) -> Tensor:
        kernel = _flash_forward if cpu_flash else _math_forward
        mask_dtype = q.dtype if cpu_flash else torch.float32
        pieces = _plan(a, q.size(2), k0, window, cpu_flash and window is None)
        # --- 1. pieces, merged by log-sum-exp where they share rows (fp32; float64 inputs: float64) ---
        acc = torch.promote_types(q.dtype, torch.float32)
        out = q.new_empty(q.shape, dtype=acc)
        lse = q.new_empty(q.shape[:3], dtype=acc)
        seen = set()
        for piece in pieces:
            r0, r1, j0, j1, causal = piece
            mask = _mask(a, k0, piece, window, mask_dtype, q.device)
            o, l_ = kernel(q[:, :, r0:r1], k[:, :, j0:j1], v[:, :, j0:j1], mask, causal, scale)
            o, l_ = o.to(acc), l_.to(acc)
            if (r0, r1) in seen:
                new = torch.logaddexp(lse[:, :, r0:r1], l_)
                out[:, :, r0:r1] = (out[:, :, r0:r1] * (lse[:, :, r0:r1] - new).exp()[..., None]
                                    + o * (l_ - new).exp()[..., None])
                lse[:, :, r0:r1] = new
            else:
                out[:, :, r0:r1], lse[:, :, r0:r1] = o, l_
                seen.add((r0, r1))
        # --- 2. the sink: one more logit in every row's denominator ---
        if sinks is not None:
            total = torch.logaddexp(lse, sinks.to(acc)[None, :, None])
            out *= (lse - total).exp()[..., None]
            lse = total
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (a, k0, window, scale, cpu_flash)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        a, k0, window, scale, cpu_flash = ctx.args
        kernel = _flash_backward if cpu_flash else _math_backward
        mask_dtype = q.dtype if cpu_flash else torch.float32
        grad = grad.contiguous()
        acc = lse.dtype
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.zeros(k.shape, dtype=acc, device=k.device)
        dv = torch.zeros(v.shape, dtype=acc, device=v.device)
        for piece in _plan(a, q.size(2), k0, window, cpu_flash and window is None):
            r0, r1, j0, j1, causal = piece
            mask = _mask(a, k0, piece, window, mask_dtype, q.device)
            g_dq, g_dk, g_dv = kernel(grad[:, :, r0:r1], q[:, :, r0:r1], k[:, :, j0:j1], v[:, :, j0:j1],
                                      out[:, :, r0:r1], lse[:, :, r0:r1], mask, causal, scale)
            dq[:, :, r0:r1] += g_dq
            dk[:, :, j0:j1] += g_dk
            dv[:, :, j0:j1] += g_dv
        d_sinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            rowdot = (grad.to(acc) * out.to(acc)).sum(-1)  # [b, h, c]
            d_sinks = -((sinks.to(acc)[None, :, None] - lse).exp() * rowdot).sum((0, 2)).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), d_sinks, None, None, None, None, None


def block_attention(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, q_start: int, k_start: int,
                    window: int | None, scale: float, cpu_flash: bool) -> Tensor:
    """Queries ``q [b, h, c, d]`` at positions ``q_start ..`` attend causally (within ``window`` keys,
    itself included, if given; plus ``sinks [h]``) to ``k, v [b, hk, q_start + c - k_start, d]`` at
    positions ``k_start ..``; ``k_start`` must be ``max(0, q_start - window + 1)`` (0 without a window)
    or less. Returns ``[b, h, c, d]``. ``cpu_flash``: the CPU flash kernels, else the fp32 math ones."""
    if k.size(2) != q_start + q.size(2) - k_start or k_start > q_start:
        raise ValueError(f"block_attention: k / v must hold the key positions [{k_start}, "
                         f"{q_start + q.size(2)}), "
                         f"got {k.size(2)} keys")
    if window is not None and window < 1:
        raise ValueError(f"block_attention: window must be >= 1 keys, got {window}")
    if sinks is not None and sinks.shape != (q.size(1),):
        raise ValueError(f"block_attention: sinks must be [{q.size(1)}] (one per query head), "
                         f"got {tuple(sinks.shape)}")
    return _BlockAttention.apply(q, k, v, sinks, q_start, k_start, window, scale, cpu_flash)
