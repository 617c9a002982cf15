"""Triton kernels for the chunk loop of ``mcore_engine.ops`` (installed as ``mcore_engine_kernels``).

``forward.row_max`` / ``forward.chunk_stats`` / ``backward.chunk_grad`` stream the logits without a
workspace; ``layout`` holds the definitions shared with the ops; ``dispatch.triton_available``
says whether they run. Importing the package, ``layout`` or ``dispatch`` does not import Triton.
"""

from .dispatch import triton_available

__all__ = ["triton_available"]
