"""Engine checkpoints on Megatron-Core ``dist_checkpointing`` (``torch_dist``), reshardable.

Folder ``path/``::

    __<rank>_<i>.distcp, .metadata    sharded tensors (torch.distributed.checkpoint), global keys
    common.pt, metadata.json          rank 0's plain entries (Megatron-Core >= 0.19: in the .distcp
                                      files as ``common_state``, no common.pt); the backend record
    mcore_engine.json                 written last: format, step, layout, precision, config record

Holds each model chunk's ``sharded_state_dict()`` (global layer and expert ids: any TP / PP / VPP /
EP cut loads it), the optimizer's fp32 main weights and Adam moments (none before the first step;
loading that clears Adam state), scheduler, step counters and each rank's RNG states (restored for
the same layout only). A LoRA engine's checkpoint holds the adapters and their optimizer state only;
the base is ``model.hf_path``, which the marker records and a load requires to be the same.

A save writes ``path.tmp/``; rank 0 then writes the marker and swaps it in through ``path.old``, so
a crash leaves a loadable checkpoint; a folder holding other files is never deleted. A load checks
everything first on every rank (:mod:`.checkpoint_checks`). Shared filesystem assumed.
Memory: the distributed optimizer's ``fully_reshardable`` form gathers a DP group's optimizer state
(once the model's fp32 state) on each of its ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.config import EngineConfig
from mcore_engine.parallel.platform import get_device
from mcore_engine.state.checkpoint_checks import (
    FORMAT,
    IGNORED_CONFIG,
    MARKER,
    check_files,
    check_tensors,
    config_mismatch,
    read_marker,
)
from mcore_engine.state.engine_state import restore_scheduler, rng_state, set_rng_state
from mcore_engine.state.megatron_compat import adam_step_kept, in_process_write_results, load_fitted
from mcore_engine.step.optimizer import init_optimizer_state, reset_optimizer_state, sub_optimizers

__all__ = ["FORMAT", "IGNORED_CONFIG", "checkpoint_layout", "config_mismatch", "config_record",
           "load_engine_checkpoint", "rng_state", "save_engine_checkpoint", "set_rng_state"]

OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
"""Megatron's optimizer ``sharded_state_dict`` metadata: model-space optimizer state (reshardable in
TP, PP, EP and DP; ``fully_sharded_model_space`` needs the flattened tensors 0.16 no longer supports)."""

_OUR_FILE = re.compile(r"(__\d+_\d+\.distcp|\.metadata|common\.pt|metadata\.json|mcore_engine\.json"
                       r"|engine_config\.yaml)")


def _replaceable(folder: str) -> bool:
    """True when ``folder`` is absent or holds nothing but checkpoint files (ours to delete)."""
    if not os.path.lexists(folder):
        return True
    return os.path.isdir(folder) and not os.path.islink(folder) and all(
        _OUR_FILE.fullmatch(name) for name in os.listdir(folder))


# ------------------------------------------------------------------ config, layout
def config_record(config: EngineConfig) -> dict[str, Any]:
    """``{"model": ModelConfig as dict, "parallel": ParallelConfig as dict}`` for the marker; with
    LoRA also ``"lora": {"base_model": the real path of model.hf_path}`` (an adapter checkpoint holds
    no base weights: it loads only on the same base) and ``model.lora`` as rank, alpha and the
    adapted projections (not the dropout, a training setting, nor ``adapter_path``, where the
    initial adapters came from)."""
    record = {"model": asdict(config.model), "parallel": asdict(config.parallel)}
    lora = config.model.lora
    if lora is not None:  # what the adapters are: rank, alpha, adapted projections (any spelling)
        hybrid = config.model.linear_attention is not None
        record["model"]["lora"] = {"rank": lora.rank, "alpha": float(lora.alpha),
                                   "targets": lora.hf_target_modules(config.model.swiglu, hybrid)}
        base = config.model.hf_path
        record["lora"] = {"base_model": os.path.realpath(base) if base else None}
    return record


def _adapters_only(config: dict[str, Any]) -> bool:
    """A LoRA engine's checkpoint holds the adapters (and their optimizer state) only."""
    return (config.get("model") or {}).get("lora") is not None


def _is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def checkpoint_layout(config: EngineConfig) -> dict[str, Any]:
    """The parallel layout of ``config`` on this world (RNG states are per layout)."""
    par = config.parallel
    return {"world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "tp": par.tensor_model_parallel_size,
            "pp": par.pipeline_model_parallel_size, "vpp": par.virtual_pipeline_model_parallel_size,
            "ep": par.expert_model_parallel_size, "etp": par.expert_tensor_size,
            "cp": par.context_parallel_size,
            "distributed_optimizer": config.optimizer.use_distributed_optimizer}


def _agree(error: str | None, what: str) -> None:
    """Raise ``ValueError`` on every rank when any rank has an ``error`` (one MAX all-reduce)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=get_device().torch_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    else:
        failed = error is not None
    if failed:
        raise ValueError(error if error is not None else f"{what}: refused because another rank failed")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


# ------------------------------------------------------------------ sharded state dicts
def _model_sharded(chunks: list[torch.nn.Module], adapters_only: bool = False) -> dict[str, Any]:
    """``{"model": ...}`` (one chunk) or ``{"model0": ..., "model1": ...}`` (virtual stages);
    ``adapters_only``: the LoRA adapters' entries only."""
    def one(chunk: torch.nn.Module) -> dict[str, Any]:
        state = chunk.module.sharded_state_dict()
        return {k: v for k, v in state.items() if _is_adapter(k)} if adapters_only else state

    if len(chunks) == 1:
        return {"model": one(chunks[0])}
    return {f"model{i}": one(chunk) for i, chunk in enumerate(chunks)}


def _rng_object(layout: dict[str, Any], state: Any):
    from megatron.core.dist_checkpointing import ShardedObject

    tag = "_".join(f"{k}{v}" for k, v in layout.items())
    return ShardedObject(f"rng_state.{tag}", state, (layout["world_size"],), (_rank(),), replica_id=0)


def _has_state(optimizer) -> bool:
    return any(sub.optimizer is not None and len(sub.optimizer.state) > 0
               for sub in sub_optimizers(optimizer))


def save_engine_checkpoint(path: str, engine_config: EngineConfig, chunks: list[torch.nn.Module], optimizer,
                           scheduler, counters: dict[str, int]) -> None:
    """Collective: write the model chunks, optimizer and scheduler (``None``: none), ``counters``
    (``global_step``, ``num_skipped_steps``) and this rank's RNG states into ``path`` atomically
    (module docstring)."""
    from megatron.core import dist_checkpointing

    layout, config = checkpoint_layout(engine_config), config_record(engine_config)
    common = dict(counters) if scheduler is None else {**counters, "scheduler": scheduler.state_dict()}

    path = os.path.abspath(path)
    tmp, old = path + ".tmp", path + ".old"
    rank, error = _rank(), None
    if rank == 0:
        try:
            for folder in (path, tmp, old):
                if not _replaceable(folder):
                    raise OSError(f"{folder!r} exists and is not an mcore-engine checkpoint; "
                                  "refusing to replace it")
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as exc:
            error = f"save_checkpoint: cannot create {tmp!r}: {exc}"
    _agree(error, "save_checkpoint")

    stepped = optimizer is not None and _has_state(optimizer)
    state = _model_sharded(chunks, _adapters_only(config))
    if stepped:
        state["optimizer"] = optimizer.sharded_state_dict(state, False, metadata=OPTIMIZER_METADATA)
    state["rng"] = _rng_object(layout, rng_state())
    state["engine"] = common
    in_process_write_results()
    dist_checkpointing.save(state, tmp, async_sharded_save=False)  # ends with a barrier

    error = None
    if rank == 0:
        try:
            marker = {"format": FORMAT, "step": counters["global_step"], "layout": layout,
                      "precision": engine_config.precision,
                      "optimizer_state": stepped, "config": config}
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump(marker, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            if os.path.exists(path):
                if os.path.exists(old):
                    shutil.rmtree(old)
                os.rename(path, old)
            os.rename(tmp, path)
            if os.path.exists(old):
                shutil.rmtree(old)
        except OSError as exc:
            error = f"save_checkpoint: could not finalise {path!r}: {exc}"
    _agree(error, "save_checkpoint")


def _resolve(path: str) -> str:
    """``path``, or ``path.old`` (with a ``RuntimeWarning``) when a save crashed between its renames."""
    old = path + ".old"
    if os.path.lexists(path) or not os.path.isfile(os.path.join(old, MARKER)):
        return path
    warnings.warn(f"load_checkpoint: {path!r} is missing but {old!r} holds the previous checkpoint: a save "
                  f"was interrupted between its renames (its complete new state may be in {path}.tmp); "
                  f"loading {old!r}. The next save_checkpoint({path!r}) cleans up.", RuntimeWarning,
                  stacklevel=3)
    return old


def load_engine_checkpoint(path: str, engine_config: EngineConfig, chunks: list[torch.nn.Module], optimizer,
                           scheduler) -> dict[str, int]:
    """Collective: check ``path`` (module docstring; ``ValueError`` on every rank, nothing changed),
    then load the model chunks, optimizer and scheduler in place, restore the RNG states when the
    layout is the checkpoint's, and return the saved counters. ``optimizer`` None: the model part of
    any checkpoint."""
    layout, config = checkpoint_layout(engine_config), config_record(engine_config)
    path = _resolve(os.path.abspath(path))
    marker, error = None, None
    try:
        marker = read_marker(path, config, engine_config.precision)
        saved_dist, dist_opt = marker["layout"].get("distributed_optimizer"), layout["distributed_optimizer"]
        if optimizer is not None and marker["optimizer_state"] and saved_dist != dist_opt:
            raise ValueError(f"load_checkpoint: {path!r} holds the optimizer state of "
                             f"optimizer.use_distributed_optimizer={saved_dist}, this engine has "
                             f"{dist_opt}: load it with the same setting")
        saved = check_files(path)
        check_tensors(path, _model_sharded(chunks, _adapters_only(config)), saved, marker["optimizer_state"])
    except ValueError as exc:
        error = str(exc)
    _agree(error, f"load_checkpoint({path!r})")

    adapters_only = _adapters_only(config)
    state = _model_sharded(chunks, adapters_only)
    with_optimizer = optimizer is not None and marker["optimizer_state"]
    if with_optimizer:
        init_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, True, metadata=OPTIMIZER_METADATA)
    same_layout = {"cp": 1, **marker["layout"]} == layout  # older markers have no "cp"
    if same_layout:
        state["rng"] = _rng_object(layout, None)
    loaded = load_fitted(state, path, optimizer)
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, name in zip(chunks, names, strict=True):
        result = chunk.module.load_state_dict(loaded[name], strict=not adapters_only)
        missing = [k for k in getattr(result, "missing_keys", ()) if _is_adapter(k)]
        if missing:  # an adapter checkpoint must fill every adapter (the base stays as loaded)
            raise ValueError(f"load_checkpoint: {path!r} lacks the adapters {missing[:4]}")
    if with_optimizer:
        with adam_step_kept(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        reset_optimizer_state(optimizer)
    if same_layout:
        set_rng_state(loaded["rng"])
    common = loaded["engine"]
    if scheduler is not None and "scheduler" in common:
        restore_scheduler(scheduler, common["scheduler"])
    return {"global_step": common["global_step"], "num_skipped_steps": common["num_skipped_steps"]}
