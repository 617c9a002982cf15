"""Triton kernels for the chunk loop of ``mcore_engine.ops`` (installed as ``mcore_engine_kernels``).
Importing the package, ``layout`` or ``dispatch`` does not import Triton.
"""

from .dispatch import triton_available

__all__ = ["triton_available"]
