"""MXFP4 expert weights of Hub gpt-oss folders (``*_blocks`` / ``*_scales``), as ``transformers`` 5.24's
``integrations/mxfp4.py`` reads them.

A weight ``W [..., R, C]`` (``C = 32 G``) is stored as ``blocks`` uint8 ``[..., R, G, 16]`` (two FP4
E2M1 codes a byte, low nibble first) and ``scales`` uint8 ``[..., R, G]`` (one power of two per block
of 32, exponent bias 127)::

    codes = stack([blocks & 0xF, blocks >> 4], -1).reshape(..., R, G, 32)
    W = ldexp(FP4_VALUES[codes], scales - 127).reshape(..., R, C)

``transformers`` then transposes ``W`` to its parameter layout (``gate_up_proj [E, H, 2I]`` from
``[E, 2I, H]``, ``down_proj [E, I, H]`` from ``[E, H, I]``); :func:`dequantize` returns ``W`` itself,
the rows of which are Megatron's (``linear_fc1`` / ``linear_fc2``). Every FP4 value times a power of
two is exact in bf16 and fp32, so the result is the same in either dtype. Memory: the output.
"""

from __future__ import annotations

import torch

__all__ = ["FP4_VALUES", "dequantize", "quantize"]

FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
               name: str = "scales") -> torch.Tensor:
    """``W [..., R, 32 G]`` in ``dtype`` from ``blocks [..., R, G, 16]`` and ``scales [..., R, G]``
    (see the module docstring); ``ValueError`` when the shapes disagree or a scale gives a
    non-finite weight (the E8M0 NaN code 255, or an exponent beyond ``dtype``'s range), naming
    ``name``."""
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"blocks / scales: expected blocks [..., R, G, 16] and scales [..., R, G], got "
                         f"{tuple(blocks.shape)} and {tuple(scales.shape)}")
    *prefix, g, b = blocks.shape
    blocks = blocks.to(torch.uint8).reshape(-1, b)
    exp = (scales.to(torch.int32) - 127).reshape(-1, 1)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(blocks.shape[0], 2 * b, dtype=dtype, device=blocks.device)
    out[:, 0::2] = lut[(blocks & 0x0F).to(torch.int)]
    out[:, 1::2] = lut[(blocks >> 4).to(torch.int)]
    torch.ldexp(out, exp, out=out)
    if not bool(torch.isfinite(out).all()):
        bad = sorted({int(v) for v in scales.reshape(-1, 1)[~torch.isfinite(out).all(-1, keepdim=True)]})
        raise ValueError(f"{name}: scale byte(s) {bad[:4]} give non-finite weights (255 is E8M0's NaN; "
                         f"an exponent byte - 127 must stay within {dtype}'s range)")
    return out.reshape(*prefix, g * 2 * b)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of ``w [..., R, C]`` (``C % 32 == 0``) with :func:`dequantize` the inverse on
    its image: per block of 32 the smallest power of two that brings ``max |w|`` within 6, then each
    value rounded to the nearest FP4 value (ties to the lower code). Builds Hub-layout test folders."""
    if w.shape[-1] % 32:
        raise ValueError(f"w: the last dimension must be a multiple of 32, got {tuple(w.shape)}")
    *prefix, c = w.shape
    w = w.detach().to(torch.float32).reshape(*prefix, c // 32, 32)
    amax = w.abs().amax(-1, keepdim=True).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 128)
    scaled = torch.ldexp(w, -exp.to(torch.int32))
    lut = torch.tensor(FP4_VALUES[:8])
    mag = (scaled.abs()[..., None] - lut).abs().argmin(-1)
    codes = (mag | ((scaled < 0).to(torch.int64) << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exp[..., 0].to(torch.int32) + 127).to(torch.uint8)
