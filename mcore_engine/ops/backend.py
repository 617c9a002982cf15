"""The one dispatch point of the chunk math (Triton on CUDA when it imports, else torch), on
``x [c, V_valid]`` with temperature ``t`` and global row max ``m``::

    workspace(rows, v_valid, device) -> ws or None     # torch: two fp32 [rows, V_valid]; Triton: None
    row_max(x, t) -> [c]                                            (x / t).amax(-1) in fp32
    chunk_stats(x, t, m, layout, out, *, label, teacher, ws=None)   packed statistics into out
    chunk_grad(x, t, m, coef, out=None, ws=None)                    stats.chunk_grad(...) / t
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from mcore_engine_kernels.layout import Coefficients

from mcore_engine.ops import stats as _stats
from mcore_engine.ops._common import DEFAULT_CHUNK_ELEMENTS

# The Triton kernels keep no [chunk, V] workspace: chunks only bound the per-chunk all-reduce size.
TRITON_CHUNK_ELEMENTS = 2**28


def _no_workspace(rows: int, v_valid: int, device: torch.device) -> None:
    return None


@dataclass(frozen=True, slots=True)
class ChunkBackend:
    """The chunk functions of one implementation, its default rows x V_local and its workspace."""

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


def _torch_chunk_grad(x: torch.Tensor, t, m: torch.Tensor, coef: Coefficients, out=None, ws=None):
    zm_buf, p_buf = _buffers(ws, x.shape[0])
    gz = _stats.chunk_grad(_stats.shifted(x, t, m, out=zm_buf), coef, p=p_buf)
    if t is None:
        return gz if out is None else out.copy_(gz)
    # one pass: divide by t and store (cast to out's dtype) in the same kernel
    return torch.div(gz, t[:, None] if isinstance(t, torch.Tensor) else t, out=gz if out is None else out)


TORCH_BACKEND = ChunkBackend("torch", _stats.row_max, _torch_chunk_stats, _torch_chunk_grad,
                             DEFAULT_CHUNK_ELEMENTS, _torch_workspace)


@functools.cache
def triton_backend() -> ChunkBackend:
    from mcore_engine_kernels import backward, forward

    def chunk_stats(x, t, m, layout, out, *, label=None, teacher=None, ws=None, **launch):
        return forward.chunk_stats(x, t, m, layout, out, label=label, teacher=teacher, **launch)

    def chunk_grad(x, t, m, coef, out=None, ws=None, **launch):
        if out is None:
            out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        return backward.chunk_grad(x, t, m, coef, out, **launch)

    return ChunkBackend("triton", forward.row_max, chunk_stats, chunk_grad, TRITON_CHUNK_ELEMENTS)


def chunk_backend(device: torch.device) -> ChunkBackend:
    """Triton on a CUDA device when ``mcore_engine_kernels`` and Triton import; the torch path otherwise."""
    try:
        from mcore_engine_kernels.dispatch import triton_available
    except ImportError:
        return TORCH_BACKEND
    return triton_backend() if triton_available(device) else TORCH_BACKEND
