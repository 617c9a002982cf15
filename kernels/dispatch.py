"""Whether the Triton backend runs on a device: CUDA, ``triton`` importable, interpreter off (imported
only when asked about CUDA)."""

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
    """True when ``TRITON_INTERPRET`` is set to a true value (kernels then run on CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() not in ("", "0", "false", "off", "no")


def triton_available(device: torch.device | str) -> bool:
    """True iff the ops should use this package's Triton kernels for tensors on ``device``."""
    return torch.device(device).type == "cuda" and not interpreter_enabled() and _triton_imports()
