"""The ONE dispatch point of the chunk math: Triton kernels on CUDA when Triton imports, torch otherwise.

A backend is three functions on one chunk of rows ``x = logits.view(N, V_local)[r0:r1, :V_valid]``
(a view, never copied), the chunk's temperature ``t`` (None / float / fp32 ``[c]``) and global row
max ``m`` (fp32 ``[c]``), with the definitions of ``stats.py``::

    row_max(x, t) -> [c]                                              (x / t).amax(-1) in fp32
    chunk_stats(x, t, m, layout, out, *, label, teacher) -> out      packed statistics [c, layout.width]
    chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, a_tail=None, tail_cols=None, out=None)
                                                                      d/dx = stats.chunk_grad(...) / t

``chunk_grad`` writes into ``out`` (any float dtype, e.g. a view of the preallocated logits gradient)
and returns it; with ``out=None`` it returns the gradient in a new fp32 ``[c, V_valid]`` tensor (the
torch backend hands back its own workspace: no extra buffer, no copy).

The torch backend builds them from ``stats.py`` (the reference; two fp32 ``[c, V_valid]`` chunk
workspaces); the Triton backend (``mcore_engine_kernels``) streams the logits without workspaces, so
its default chunks are larger (they only bound the per-chunk all-reduce size).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from mcore_engine.ops import stats as _stats
from mcore_engine.ops._common import DEFAULT_CHUNK_ELEMENTS

# The Triton kernels keep no [chunk, V] workspace: chunks only bound the per-chunk all-reduce size.
TRITON_CHUNK_ELEMENTS = 2**28


@dataclass(frozen=True, slots=True)
class ChunkBackend:
    """The chunk math of one implementation (see the module docstring).

    name:           "torch" or "triton".
    row_max, chunk_stats, chunk_grad: the three chunk functions.
    chunk_elements: default rows per chunk x V_local (``chunk_size=None``).
    """

    name: str
    row_max: Callable[..., torch.Tensor]
    chunk_stats: Callable[..., torch.Tensor]
    chunk_grad: Callable[..., torch.Tensor]
    chunk_elements: int


def _torch_chunk_stats(x, t, m, layout, out, *, label=None, teacher=None):
    return _stats.chunk_stats(_stats.shifted(x, t, m), layout, out, label=label, teacher=teacher)


def _torch_chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, a_tail=None, tail_cols=None, out=None):
    gz = _stats.chunk_grad(_stats.shifted(x, t, m), inv_s, a, b, mu, c2, cols, vals, a_tail, tail_cols)
    if t is not None:
        gz.div_(t[:, None] if isinstance(t, torch.Tensor) else t)
    return gz if out is None else out.copy_(gz)


TORCH_BACKEND = ChunkBackend("torch", _stats.row_max, _torch_chunk_stats, _torch_chunk_grad,
                             DEFAULT_CHUNK_ELEMENTS)


@functools.cache
def triton_backend() -> ChunkBackend:
    """The Triton kernels as a backend (imports Triton)."""
    from mcore_engine_kernels import backward, forward

    def chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, a_tail=None, tail_cols=None, out=None, **launch):
        if out is None:
            out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return backward.chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, out, a_tail=a_tail,
                                   tail_cols=tail_cols, **launch)

    return ChunkBackend("triton", forward.row_max, forward.chunk_stats, chunk_grad, TRITON_CHUNK_ELEMENTS)


def chunk_backend(device: torch.device) -> ChunkBackend:
    """Triton on a CUDA device when ``mcore_engine_kernels`` and Triton import; the torch path otherwise."""
    try:
        from mcore_engine_kernels.dispatch import triton_available
    except ImportError:
        return TORCH_BACKEND
    return triton_backend() if triton_available(device) else TORCH_BACKEND
