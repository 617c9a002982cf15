"""``ZeroCenteredRMSNorm`` (Qwen3.5 / Qwen3-Next): ``rmsnorm(x) * (1 + w)`` in fp32 against a float64
reference and ``transformers``' ``Qwen3NextRMSNorm`` (values and gradients, fp32 and bf16), and the
spec's ``TorchNorm`` picking it under ``layernorm_zero_centered_gamma``."""

from __future__ import annotations

import pytest
import torch

from mcore_engine.layers.norm import TorchNorm, ZeroCenteredRMSNorm


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x, w = x.double(), w.double()
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * (1 + w)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_zero_centered_rms_norm_values_and_grads(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 3, 24, generator=g) * 3).to(dtype).requires_grad_()
    norm = ZeroCenteredRMSNorm(24, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g) * 0.5)
    y = norm(x)
    assert y.dtype == dtype
    dy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(dy)
    xr = x.detach().double().requires_grad_()
    wr = norm.weight.detach().double().requires_grad_()
    yr = _reference(xr, wr, 1e-6)
    yr.backward(dy.double())
    scale = yr.abs().max()
    assert (y.double() - yr).abs().max() <= tol * scale
    assert (x.grad.double() - xr.grad).abs().max() <= tol * xr.grad.abs().max()
    assert (norm.weight.grad.double() - wr.grad).abs().max() <= tol * wr.grad.abs().max()


def test_zero_centered_rms_norm_matches_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    g = torch.Generator().manual_seed(1)
    ours, theirs = ZeroCenteredRMSNorm(16, eps=1e-6), Qwen3NextRMSNorm(16, eps=1e-6)
    w = torch.randn(16, generator=g) * 0.3
    with torch.no_grad():
        ours.weight.copy_(w)
        theirs.weight.copy_(w)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 16, generator=g).to(dtype)
        assert torch.equal(ours.to(dtype)(x), theirs.to(dtype)(x)), dtype
    assert torch.equal(ZeroCenteredRMSNorm(8).weight, torch.zeros(8))  # init: scale 1


def test_torch_norm_picks_zero_centered_rms_norm():
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                            layernorm_zero_centered_gamma=True, sequence_parallel=False)
    norm = TorchNorm(cfg, 8, eps=1e-5)
    assert isinstance(norm, ZeroCenteredRMSNorm) and norm.eps == 1e-5
    cfg.normalization = "LayerNorm"
    with pytest.raises(ValueError, match="zero-centred LayerNorm"):
        TorchNorm(cfg, 8)
