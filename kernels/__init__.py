"""Triton kernels for the chunk loop of ``mcore_engine.ops`` (installed as ``mcore_engine_kernels``).

The same statistics as ``mcore_engine.ops.stats``, streamed from the logits without a chunk workspace:

    forward.row_max(x, t)                                    -> m_local [c]
    forward.chunk_stats(x, t, m, layout, out, label=, teacher=) -> out [c, layout.width]
    backward.chunk_grad(x, t, m, inv_s, a, b, mu, c2, cols, vals, out, a_tail=, tail_cols=)
                                                             -> out [c, V] (logits' dtype)

``dispatch.triton_available(device)`` says whether they can run; importing this package does not
import Triton (the kernel modules do).
"""

from .dispatch import triton_available

__all__ = ["triton_available"]
