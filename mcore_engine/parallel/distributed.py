"""Distributed bring-up and seeding: ``torch.distributed`` (NCCL with CUDA, gloo without),
Megatron-Core's ``parallel_state`` and its RNG streams."""

from __future__ import annotations

import atexit
import os
import random
import socket

import torch
import torch.distributed as dist

from mcore_engine.config import ParallelConfig
from mcore_engine.parallel.cpu_device import apply_cpu_device_layer

__all__ = ["destroy_distributed", "init_distributed", "seed_everything"]

_OWNS_DEFAULT_GROUP = False


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
            # store entries, so destroy_distributed keeps it and a later init_distributed reuses it
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
