"""Devices, distributed bring-up, seeding, and the CPU device layer for Megatron-Core.

``init_distributed`` brings up ``torch.distributed`` (NCCL with CUDA, gloo without), Megatron-Core's
``parallel_state`` and the RNG streams; ``get_device`` returns the process's :class:`Device`.
Without CUDA, :func:`apply_cpu_device_layer` runs Megatron-Core 0.16's CUDA calls on the CPU:

1. ``torch.cuda.current_device`` -> ``"cpu"``.
2. CUDA RNG calls -> the CPU default generator (Megatron's seed layout kept).
3. Streams, events, ``synchronize``, ``set_stream`` and NVTX ranges -> no-ops.
4. A ``TorchFunctionMode`` maps ``device='cuda'`` / ``device=<int>`` / ``.to('cuda')`` to the CPU,
   drops ``pin_memory`` and keeps the ``torch.cuda.`` prefix of ``Tensor.type()``; ~1-2 us a call.
5. MoE and sequence parallelism on gloo: :func:`apply_moe_compat`.
6. Multi-latent attention without Transformer Engine: :func:`apply_mla_compat`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import socket
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from mcore_engine.config import ParallelConfig
from mcore_engine.parallel.gloo_collectives import apply_gloo_collectives

__all__ = ["Device", "apply_cpu_device_layer", "apply_mla_compat", "apply_moe_compat",
           "cpu_device_layer_active",
           "destroy_distributed",
           "get_device", "init_distributed", "mcore_version", "quiet_cpu_warnings", "seed_everything"]

_CPU_LAYER_MODE: _CudaToCpuMode | None = None
_OWNS_DEFAULT_GROUP = False


# ----------------------------------------------------------------------------------------------------
# Third-party hints that say nothing on a CPU machine
# ----------------------------------------------------------------------------------------------------
# Megatron-Core warns at import that Transformer Engine / Apex (from 0.19 also absl) are missing
# (extras here: the torch fallbacks are the intended CPU path), on every TransformerConfig that its
# default CUDA-graph scope "full" is deprecated, and on the first TP linear that
# CUDA_DEVICE_MAX_CONNECTIONS=1 speeds up async all-reduces (a CUDA stream setting); torch.fx logs an
# is_fx_tracing deprecation hint from Megatron's forward; torch 2.13 deprecates
# ``all_gather_into_tensor``, which Megatron's MoE dispatcher and distributed optimizer call (a
# FutureWarning for Megatron, not for our users).
# Filtered once per process, before megatron.core is imported (mcore_engine's package import calls
# quiet_cpu_warnings), and only without CUDA: GPU runs keep every warning.
_CPU_NOISE = (
    r"Transformer Engine and Apex are not installed",
    r"Apex is not installed",
    r"absl\.logging is not installed",  # Megatron-Core >= 0.19 (hyper_comm_grid), at import
    r"full scope is deprecated",
    r"When using (sequence parallelism|async grad allreduce) it is recommended to set the environment "
    r"variable CUDA_DEVICE_MAX_CONNECTIONS",
)
_QUIETED = False


def quiet_cpu_warnings() -> None:
    """Ignore the third-party hints above when CUDA is absent; idempotent."""
    global _QUIETED
    if _QUIETED or torch.cuda.is_available():
        return
    for message in _CPU_NOISE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    warnings.filterwarnings("ignore", message=r"`torch.distributed.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    _QUIETED = True


# ----------------------------------------------------------------------------------------------------
# CPU device layer
# ----------------------------------------------------------------------------------------------------
def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, int) and not isinstance(device, bool)


_IDENTITY_METHODS = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory})


class _CudaToCpuMode(TorchFunctionMode):
    """Redirects CUDA placements to the CPU (module docstring, item 4); ~1-2 us per torch call."""

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


_MOE_COMPAT = False


def apply_moe_compat() -> None:
    """Megatron-Core 0.16 MoE without Transformer Engine / on gloo, and routing as the checkpoints
    route; idempotent. Binds ``moe_utils.te_general_gemm`` to ``None`` (the router's torch path),
    installs the checkpoints' routing (:mod:`mcore_engine.layers.router`: DeepSeek-V3's grouped top-k,
    sigmoid weights renormalised unless ``moe_router_pre_softmax``, on CPU and GPU) and, CPU only,
    :mod:`mcore_engine.parallel.gloo_collectives` (split sizes as lists, unequal all-gathers)."""
    global _MOE_COMPAT
    if _MOE_COMPAT:
        return
    from megatron.core.transformer.moe import moe_utils

    from mcore_engine.layers.router import install_checkpoint_routing

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    install_checkpoint_routing()
    apply_gloo_collectives()
    _MOE_COMPAT = True


_MLA_COMPAT = False


def apply_mla_compat() -> None:
    """Megatron-Core 0.16 multi-latent attention without Transformer Engine; idempotent, a no-op when
    TE imports. Without TE, ``megatron.core.extensions.transformer_engine`` binds ``MagicMock``
    stand-ins, so ``multi_latent_attention`` imports them and sets ``HAVE_TE = True``; its
    ``isinstance(self.linear_proj, TELinear)`` then raises ``TypeError``. This sets that module's
    ``HAVE_TE`` to False and its TE names to ``None`` (what its own ``ImportError`` branch binds). MLA's
    rotary tables are placed by ``torch.cuda.current_device()``: :func:`apply_cpu_device_layer` on CPU."""
    global _MLA_COMPAT
    if _MLA_COMPAT:
        return
    from megatron.core.extensions import transformer_engine as te_ext

    if not te_ext.HAVE_TE:
        from megatron.core.transformer import multi_latent_attention as mla

        mla.HAVE_TE = False
        mla.TEColumnParallelLinear = mla.TELinear = mla.Linear = mla.set_save_original_input = None
    _MLA_COMPAT = True


def mcore_version() -> tuple[int, int]:
    """The installed Megatron-Core's ``(major, minor)``, e.g. ``(0, 16)``: for the few places whose
    behaviour differs across the supported range (setup.py: ``>=0.16.1,<0.20``)."""
    from megatron.core import __version__

    major, minor = __version__.split(".")[:2]
    return int(major), int(minor)


def cpu_device_layer_active() -> bool:
    """True once :func:`apply_cpu_device_layer` has patched this process."""
    return _CPU_LAYER_MODE is not None


def apply_cpu_device_layer() -> None:
    """Make Megatron-Core 0.16's CUDA calls run on the CPU (module docstring, items 1-4). Idempotent;
    a no-op when CUDA is available. Never reverted: a CPU-only process stays CPU-only."""
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


# ----------------------------------------------------------------------------------------------------
# Device abstraction
# ----------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------
# Distributed bring-up and seeding
# ----------------------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_size_before_init() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def seed_everything(seed: int) -> None:
    """Megatron's seed layout, offset by ``100 * pp_rank``: Python / NumPy / torch and the DP stream
    get ``seed``, the TP stream ``seed + 2718 + tp_rank``. Needs ``parallel_state``."""
    import numpy as np
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def init_distributed(parallel: ParallelConfig, seed: int) -> None:
    """Bring up ``torch.distributed``, ``parallel_state`` and the RNG streams. The default group comes
    from torchrun's environment (NCCL with CUDA, gloo without; one process without torchrun) unless
    one exists. ``ValueError`` before any process-group work when the world size does not fit
    ``parallel``. An initialised ``parallel_state`` of the same layout (tp, pp, vpp) is kept and
    reseeded, so several engines share one process; another layout raises ``ValueError`` (call
    :func:`destroy_distributed` first; engines on the old groups stop working)."""
    world_size = _world_size_before_init()
    parallel.data_parallel_size(world_size)
    use_cuda = torch.cuda.is_available()
    if not use_cuda:
        apply_cpu_device_layer()
    global _OWNS_DEFAULT_GROUP
    if not dist.is_initialized():
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if use_cuda else "gloo"
        if "RANK" in os.environ or world_size > 1:  # torchrun (or a hand-made env://) job
            dist.init_process_group(backend, init_method="env://")
            # kept for the process's life: a second env:// rendezvous of the same job meets stale
            # store entries (gloo's connect is refused, or it hangs), so destroy_distributed keeps it
            # and a later init_distributed (another layout) reuses it
            atexit.register(_destroy_default_group)
        else:
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                                    world_size=1)
            _OWNS_DEFAULT_GROUP = True

    from megatron.core import parallel_state

    wanted = _layout_text(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                          parallel.virtual_pipeline_model_parallel_size, parallel.expert_model_parallel_size,
                          parallel.expert_tensor_size, parallel.context_parallel_size)
    if parallel_state.model_parallel_is_initialized():
        current = _layout_text(parallel_state.get_tensor_model_parallel_world_size(),
                               parallel_state.get_pipeline_model_parallel_world_size(),
                               parallel_state.get_virtual_pipeline_model_parallel_world_size(),
                               parallel_state.get_expert_model_parallel_world_size(),
                               parallel_state.get_expert_tensor_parallel_world_size(),
                               parallel_state.get_context_parallel_world_size())
        if current != wanted:
            raise ValueError(f"init_distributed: parallel_state is already initialised with {current}, but "
                             f"parallel asks for {wanted}; call "
                             "mcore_engine.parallel.platform.destroy_distributed() first "
                             "(engines built on the old layout stop working)")
    else:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            expert_tensor_parallel_size=parallel.expert_tensor_size,
            context_parallel_size=parallel.context_parallel_size,
            create_gloo_process_groups=True,
        )
    seed_everything(seed)


def _layout_text(tp: int, pp: int, vpp: int | None, ep: int = 1, etp: int | None = None, cp: int = 1) -> str:
    text = (f"tensor_model_parallel_size={tp}, pipeline_model_parallel_size={pp}, "
            f"virtual_pipeline_model_parallel_size={vpp}")
    if cp != 1:
        text += f", context_parallel_size={cp}"
    if ep != 1 or (etp or tp) != tp:
        text += f", expert_model_parallel_size={ep}, expert_tensor_parallel_size={etp}"
    return text


def _destroy_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def destroy_distributed() -> None:
    """Tear down ``parallel_state``, and the default group when :func:`init_distributed` created a
    one-process one. A torchrun job's default group stays (destroyed at exit): the next
    :func:`init_distributed`, at any layout, builds its groups on it."""
    global _OWNS_DEFAULT_GROUP
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if _OWNS_DEFAULT_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWNS_DEFAULT_GROUP = False
