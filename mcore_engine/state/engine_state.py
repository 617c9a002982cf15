"""The engine's state in memory, for this parallel layout only (resharding: :mod:`.checkpoint`):
model chunks, optimizer and scheduler (none under ``forward_only``), RNG states; the checks that a
state fits, and the scheduler restore both paths share."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from mcore_engine.step.optimizer import (
    load_optimizer_state_dict,
    optimizer_param_shapes,
    optimizer_state_dict,
)

__all__ = ["check_state", "capture_state", "restore_scheduler", "restore_state", "rng_state", "set_rng_state"]


def rng_state() -> dict[str, Any]:
    """This rank's RNG states: torch CPU, CUDA (when present), Python, NumPy, Megatron's tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` returned (the process-global generators)."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def restore_scheduler(scheduler, saved: dict[str, Any]) -> None:
    """``scheduler.load_state_dict(saved)`` from step 0 (Megatron's adds the saved step count)."""
    scheduler.num_steps = 0
    scheduler.load_state_dict(saved)


def _shapes(state: dict[str, Any]) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def capture_state(chunks: list[torch.nn.Module], optimizer, scheduler) -> dict[str, Any]:
    """``{"model": [chunk state dicts], "optimizer", "scheduler"}`` (no optimizer: the model only).
    Memory: one copy of the optimizer's main parameters; the rest references live tensors."""
    state: dict[str, Any] = {"model": [chunk.module.state_dict() for chunk in chunks]}
    if optimizer is not None:
        state["optimizer"] = optimizer_state_dict(optimizer)
        state["scheduler"] = scheduler.state_dict()
    return state


def check_state(state: dict[str, Any], chunks: list[torch.nn.Module], optimizer) -> None:
    """``ValueError`` unless ``state`` fits exactly: the chunks' parameter names and shapes, the
    optimizer's stepped parameter shapes (``optimizer`` None: the model only)."""
    if len(state["model"]) != len(chunks):
        raise ValueError(f"load_state_dict: checkpoint holds {len(state['model'])} model chunks, "
                         f"engine has {len(chunks)}")
    for i, (chunk, chunk_state) in enumerate(zip(chunks, state["model"], strict=True)):
        ours, theirs = _shapes(chunk.module.state_dict()), _shapes(chunk_state)
        if ours != theirs:
            diff = sorted(set(ours.items()) ^ set(theirs.items()))[:4]
            raise ValueError(f"load_state_dict: model chunk {i} differs from the checkpoint's "
                             f"(parameter names / shapes, first differences: {diff})")
    if optimizer is None:
        return
    if "optimizer" not in state:
        raise ValueError("load_state_dict: the state holds no optimizer (a forward_only engine's)")
    shapes = optimizer_param_shapes(optimizer)
    if len(shapes) != len(state["optimizer"]):
        raise ValueError(f"load_state_dict: checkpoint holds {len(state['optimizer'])} optimizers, "
                         f"engine has {len(shapes)}")
    for ours, saved in zip(shapes, state["optimizer"], strict=True):
        if ours != [tuple(p.shape) for p in saved["main_params"]]:
            raise ValueError("load_state_dict: optimizer parameter shapes differ from the checkpoint's")


def restore_state(state: dict[str, Any], chunks: list[torch.nn.Module], optimizer, scheduler) -> None:
    """Load what :func:`capture_state` returned (checked by :func:`check_state` first)."""
    check_state(state, chunks, optimizer)
    for chunk, chunk_state in zip(chunks, state["model"], strict=True):
        chunk.module.load_state_dict(chunk_state, strict=True)
    if optimizer is not None:
        load_optimizer_state_dict(optimizer, state["optimizer"])
        restore_scheduler(scheduler, state["scheduler"])
