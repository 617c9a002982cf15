"""Whether the Triton backend can run on a device; no Triton import unless asked.

``triton_available(device)`` is True when ``device`` is a CUDA device and ``triton`` imports, or
when ``TRITON_INTERPRET=1`` is set (the CPU interpreter, used by the kernel tests).
"""

from __future__ import annotations

import functools
import os

import torch


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1`` is set (kernels then run on CPU tensors, slowly)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_available(device: torch.device | str) -> bool:
    """True iff the Triton kernels of this package can run on tensors of ``device``."""
    device = torch.device(device)
    if device.type == "cuda":
        return _triton_imports() and not interpreter_enabled()
    return device.type == "cpu" and interpreter_enabled() and _triton_imports()
