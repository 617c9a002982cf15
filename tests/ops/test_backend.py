"""The ops' one dispatch point (``ops/backend.py``): which chunk math runs; the torch backend's contract."""

from __future__ import annotations

import sys
from unittest import mock

import pytest
import torch
from mcore_engine_kernels.layout import Coefficients

from mcore_engine.ops import _common, backend, plan, vocab_parallel_logits_outputs
from mcore_engine.ops import stats as _stats


def test_cpu_tensors_take_the_torch_backend():
    assert backend.chunk_backend(torch.device("cpu")) is backend.TORCH_BACKEND
    assert backend.TORCH_BACKEND.chunk_elements == _common.DEFAULT_CHUNK_ELEMENTS


def test_dispatch_follows_triton_available_and_survives_a_missing_kernels_package():
    pytest.importorskip("mcore_engine_kernels")
    from mcore_engine_kernels import dispatch

    sentinel = backend.ChunkBackend("triton", max, max, max, 2**28)
    with mock.patch.object(dispatch, "triton_available", lambda device: True), \
            mock.patch.object(backend, "triton_backend", lambda: sentinel):
        assert backend.chunk_backend(torch.device("cpu")) is sentinel
    with mock.patch.dict(sys.modules, {"mcore_engine_kernels.dispatch": None}):  # import raises ImportError
        assert backend.chunk_backend(torch.device("cuda")) is backend.TORCH_BACKEND


def test_chunk_size_default_follows_the_backend():
    x = torch.randn(9, 50)
    rows_seen = []

    def row_max(xc, t):
        rows_seen.append(xc.shape[0])
        return _stats.row_max(xc, t)

    small = backend.ChunkBackend("torch", row_max, backend.TORCH_BACKEND.chunk_stats,
                                 backend.TORCH_BACKEND.chunk_grad, chunk_elements=4 * 50)
    with mock.patch.object(plan, "chunk_backend", lambda device: small):
        out = vocab_parallel_logits_outputs(x, entropy=True)
    assert rows_seen == [4, 4, 1]
    ref = vocab_parallel_logits_outputs(x, entropy=True)
    torch.testing.assert_close(out["entropy"], ref["entropy"], rtol=1e-6, atol=0)
    assert _common.check_chunk_size(None, 50, default_elements=200) == 4
    assert _common.check_chunk_size(7, 50, default_elements=200) == 7


def test_torch_chunk_grad_with_and_without_out():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 23, generator=g).bfloat16()
    t = torch.rand(5, generator=g) + 0.5
    m = _stats.row_max(x, t)
    inv_s, a, b, mu, c2 = (torch.rand(5, generator=g) + 0.1 for _ in range(5))
    cols = torch.randint(0, 23, (5, 2), generator=g)
    vals = torch.randn(5, 2, generator=g)
    coef = Coefficients(inv_s, a, b, mu, c2, cols, vals)
    gz = backend.TORCH_BACKEND.chunk_grad(x, t, m, coef)
    assert gz.dtype == torch.float32 and gz.shape == x.shape
    ref = _stats.chunk_grad(_stats.shifted(x, t, m), coef) / t[:, None]
    assert torch.equal(gz, ref)
    out = torch.full((5, 30), float("nan"), dtype=torch.bfloat16)[:, :23]
    res = backend.TORCH_BACKEND.chunk_grad(x, t, m, coef, out=out)
    assert res is out and torch.equal(out, ref.bfloat16())
