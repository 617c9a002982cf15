"""Kernel tests run the Triton kernels in interpreter mode on CPU machines.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here, before
any test module imports ``mcore_engine_kernels.forward`` / ``.backward``. On a CUDA machine it is left
alone and the same tests run the compiled kernels on the GPU. The ops never pick the Triton backend
for CPU tensors (``dispatch.triton_available``), so other tests are unaffected. Without Triton (an
optional extra) these tests are not collected.
"""

import importlib.util
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]
