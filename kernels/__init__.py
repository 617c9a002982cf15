"""Triton kernels for the chunk loop of ``mcore_engine.ops`` (installed as ``mcore_engine_kernels``).

The statistics of ``layout.py`` (which the ops share), streamed from the logits without a workspace::

    forward.row_max(x, t)                                       -> m_local [c]
    forward.chunk_stats(x, t, m, layout, out, label=, teacher=) -> out [c, layout.width]
    backward.chunk_grad(x, t, m, coef, out)                     -> out [c, V] (logits' dtype)

``dispatch.triton_available(device)`` says whether they can run. Importing this package, ``layout``
or ``dispatch`` does not import Triton (the kernel modules do).
"""

from .dispatch import triton_available

__all__ = ["triton_available"]
