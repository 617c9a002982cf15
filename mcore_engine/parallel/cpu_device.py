"""The CPU device layer: Megatron-Core 0.16's CUDA calls run on the CPU when CUDA is absent.

:func:`apply_cpu_device_layer` patches, once per process and never reverted:

1. ``torch.cuda.current_device`` -> ``"cpu"``.
2. CUDA RNG calls -> the CPU default generator (Megatron's seed layout kept).
3. Streams, events, ``synchronize``, ``set_stream`` and NVTX ranges -> no-ops.
4. A ``TorchFunctionMode`` maps ``device='cuda'`` / ``device=<int>`` / ``.to('cuda')`` to the CPU,
   drops ``pin_memory`` and keeps the ``torch.cuda.`` prefix of ``Tensor.type()``; ~1-2 us a call.
5. MoE and sequence parallelism on gloo: :func:`~mcore_engine.parallel.compat.apply_moe_compat`.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from mcore_engine.parallel.compat import apply_moe_compat

__all__ = ["apply_cpu_device_layer", "cpu_device_layer_active"]

_CPU_LAYER_MODE: _CudaToCpuMode | None = None
_IDENTITY_METHODS = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory})


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placements to the CPU (module docstring, item 4)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _IDENTITY_METHODS:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if not kwargs:
            return func(*args)
        if _is_cuda_device(kwargs.get("device")):
            kwargs = {**kwargs, "device": "cpu"}
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        return func(*args, **kwargs)


class _NullStream:
    """Stand-in for ``torch.cuda.Stream``: every operation completes immediately on the CPU."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _NullEvent:
        return event if event is not None else _NullEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class _NullEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.default_generator.get_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.default_generator.set_state(new_state)


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(seed)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def cpu_device_layer_active() -> bool:
    """True once :func:`apply_cpu_device_layer` has patched this process."""
    return _CPU_LAYER_MODE is not None


def apply_cpu_device_layer() -> None:
    """Make Megatron-Core 0.16's CUDA calls run on the CPU (module docstring). Idempotent; a no-op
    when CUDA is available. Never reverted: a CPU-only process stays CPU-only."""
    global _CPU_LAYER_MODE
    if _CPU_LAYER_MODE is not None or torch.cuda.is_available():
        return
    cuda = torch.cuda
    # --- 1. current device ---
    cuda.current_device = lambda: "cpu"
    # --- 2. RNG: the CPU default generator plays the CUDA generator ---
    # (``manual_seed_all`` stays: ``torch.manual_seed`` calls it, and on a CPU build it only queues.)
    cuda.get_rng_state = cuda.random.get_rng_state = _cpu_get_rng_state
    cuda.set_rng_state = cuda.random.set_rng_state = _cpu_set_rng_state
    cuda.manual_seed = cuda.random.manual_seed = _cpu_manual_seed
    from megatron.core.tensor_parallel import random as mcore_random

    mcore_random._set_cuda_rng_state = _cpu_set_rng_state
    # --- 3. streams, events, synchronisation, profiling ranges ---
    cuda.Stream = _NullStream
    cuda.Event = _NullEvent
    cuda.current_stream = cuda.default_stream = lambda device=None: _NullStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.set_stream = _noop
    cuda.synchronize = _noop
    cuda.nvtx.range_push = _noop
    cuda.nvtx.range_pop = _noop
    cuda.nvtx.range = lambda *args, **kwargs: contextlib.nullcontext()
    # --- 4. device='cuda' placements ---
    mode = _CudaToCpuMode()
    mode.__enter__()
    _CPU_LAYER_MODE = mode
    # --- 5. MoE layers without Transformer Engine, on gloo ---
    apply_moe_compat()
