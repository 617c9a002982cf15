"""Kernel tests run the Triton kernels in interpreter mode on CPU machines.

``TRITON_INTERPRET`` is read when a ``@triton.jit`` function is defined, so it is set here, before
the test modules import ``mcore_engine_kernels.forward`` / ``.backward`` (modules imported earlier in
the session are reloaded so their kernels are defined again, interpreted). On a CUDA machine it is
left alone and the same tests run the compiled kernels on the GPU. The ops never pick the Triton
backend for CPU tensors (``dispatch.triton_available``), so other tests are unaffected. Without
Triton (an optional extra) these tests are not collected.
"""

import importlib
import importlib.util
import os
import sys

import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    os.environ["TRITON_INTERPRET"] = "1"
    for name in ("_common", "forward", "backward"):
        module = sys.modules.get(f"mcore_engine_kernels.{name}")
        if module is not None:
            importlib.reload(module)

collect_ignore_glob = [] if importlib.util.find_spec("triton") else ["test_*.py"]
