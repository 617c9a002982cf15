"""The process's compute device: :class:`Device` and :func:`get_device`."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["Device", "get_device"]


def _rss_bytes(field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of this process from /proc (Linux), else 0."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@dataclass
class Device:
    """The process's compute device, ``type`` ``"cuda"`` or ``"cpu"``. On CUDA the methods forward to
    ``torch.cuda``; on the CPU the memory statistics are the process's RSS (``VmRSS``, peak ``VmHWM``)
    and ``empty_cache`` / ``synchronize`` do nothing. Not frozen, so tests can spy on a method."""

    type: str

    @property
    def torch_device(self) -> torch.device:
        if self.type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def empty_cache(self) -> None:
        if self.type == "cuda":
            torch.cuda.empty_cache()

    def synchronize(self) -> None:
        if self.type == "cuda":
            torch.cuda.synchronize()

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.type == "cuda" else _rss_bytes("VmRSS")

    def max_memory_allocated(self) -> int:
        return torch.cuda.max_memory_allocated() if self.type == "cuda" else _rss_bytes("VmHWM")

    def reset_peak_memory_stats(self) -> None:
        if self.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            return
        with contextlib.suppress(OSError):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")


_DEVICE: Device | None = None


def get_device() -> Device:
    """The process-wide :class:`Device` (one instance, so tests can spy on its methods)."""
    global _DEVICE
    if _DEVICE is None:
        _DEVICE = Device(type="cuda" if torch.cuda.is_available() else "cpu")
    return _DEVICE
