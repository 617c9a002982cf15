"""The ONE dispatch point of the chunk math: Triton kernels on CUDA when Triton imports, torch otherwise.

A backend is three functions on one chunk of rows ``x = logits.view(N, V_local)[r0:r1, :V_valid]``
(a view, never copied), the chunk's temperature ``t`` (None / float / fp32 ``[c]``) and global row
max ``m`` (fp32 ``[c]``), with the definitions of ``stats.py``::

    workspace(rows, v_valid, device) -> ws or None                   once per pass, for every chunk
    row_max(x, t) -> [c]                                              (x / t).amax(-1) in fp32
    chunk_stats(x, t, m, layout, out, *, label, teacher, ws=None) -> out   packed statistics [c, width]
    chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, a_tail=None, tail_cols=None, out=None, ws=None)
                                                                      d/dx = stats.chunk_grad(...) / t

``chunk_grad`` writes into ``out`` (any float dtype, e.g. a view of the preallocated logits gradient)
and returns it; with ``out=None`` it returns the gradient in an fp32 ``[c, V_valid]`` tensor (the
torch backend hands back its own workspace: no extra buffer, no copy; it is overwritten by the next
call with the same ``ws``).

The torch backend builds them from ``stats.py`` (the reference). Its workspace is two fp32
``[rows, V_valid]`` tensors (``zm`` and ``e`` / ``p``) that a pass allocates once and hands to every
chunk: per-chunk allocations of this size sit at glibc's mmap / trim threshold and were returned to
the OS and page-faulted back on every chunk (most of the CPU time at N=4096, V_local=32768). With
``ws=None`` each call allocates its own. The Triton backend (``mcore_engine_kernels``) streams the
logits without workspaces (``workspace`` returns None), so its default chunks are larger.
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


def _no_workspace(rows: int, v_valid: int, device: torch.device) -> None:
    return None


@dataclass(frozen=True, slots=True)
class ChunkBackend:
    """The chunk math of one implementation (see the module docstring).

    name:           "torch" or "triton".
    row_max, chunk_stats, chunk_grad: the three chunk functions.
    chunk_elements: default rows per chunk x V_local (``chunk_size=None``).
    workspace:      ``(rows, v_valid, device) -> ws`` passed to every chunk of a pass (default: None).
    """

    name: str
    row_max: Callable[..., torch.Tensor]
    chunk_stats: Callable[..., torch.Tensor]
    chunk_grad: Callable[..., torch.Tensor]
    chunk_elements: int
    workspace: Callable[[int, int, torch.device], tuple[torch.Tensor, ...] | None] = _no_workspace


Workspace = tuple[torch.Tensor, torch.Tensor]


def _torch_workspace(rows: int, v_valid: int, device: torch.device) -> Workspace:
    return tuple(torch.empty(rows, v_valid, dtype=torch.float32, device=device) for _ in range(2))


def _buffers(ws: Workspace | None, c: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    return (None, None) if ws is None else (ws[0][:c], ws[1][:c])


def _torch_chunk_stats(x, t, m, layout, out, *, label=None, teacher=None, ws=None):
    zm_buf, e_buf = _buffers(ws, x.shape[0])
    return _stats.chunk_stats(_stats.shifted(x, t, m, out=zm_buf), layout, out, label=label, teacher=teacher,
                              e=e_buf)


def _torch_chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, a_tail=None, tail_cols=None, out=None,
                      ws=None):
    zm_buf, p_buf = _buffers(ws, x.shape[0])
    gz = _stats.chunk_grad(_stats.shifted(x, t, m, out=zm_buf), inv_s, a, b, mu, c2, cols, vals, a_tail,
                           tail_cols, p=p_buf)
    if t is None:
        return gz if out is None else out.copy_(gz)
    # one pass: divide by t and store (cast to out's dtype) in the same kernel
    return torch.div(gz, t[:, None] if isinstance(t, torch.Tensor) else t, out=gz if out is None else out)


TORCH_BACKEND = ChunkBackend("torch", _stats.row_max, _torch_chunk_stats, _torch_chunk_grad,
                             DEFAULT_CHUNK_ELEMENTS, _torch_workspace)


@functools.cache
def triton_backend() -> ChunkBackend:
    """The Triton kernels as a backend (imports Triton)."""
    from mcore_engine_kernels import backward, forward

    def chunk_stats(x, t, m, layout, out, *, label=None, teacher=None, ws=None, **launch):
        return forward.chunk_stats(x, t, m, layout, out, label=label, teacher=teacher, **launch)

    def chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, a_tail=None, tail_cols=None, out=None, ws=None,
                   **launch):
        if out is None:
            out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return backward.chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, out, a_tail=a_tail,
                                   tail_cols=tail_cols, **launch)

    return ChunkBackend("triton", forward.row_max, chunk_stats, chunk_grad, TRITON_CHUNK_ELEMENTS)


def chunk_backend(device: torch.device) -> ChunkBackend:
    """Triton on a CUDA device when ``mcore_engine_kernels`` and Triton import; the torch path otherwise."""
    try:
        from mcore_engine_kernels.dispatch import triton_available
    except ImportError:
        return TORCH_BACKEND
    return triton_backend() if triton_available(device) else TORCH_BACKEND
