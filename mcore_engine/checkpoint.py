"""Per-rank checkpoints: model, optimizer, scheduler, step and RNG, written atomically.

Layout of a checkpoint folder ``path/``::

    rank_00000.pt ... rank_{W-1}.pt   one shard per global rank (torch.save of a plain dict)
    meta.json                         written last: format, parallel layout, world size, shard list,
                                      the engine's model and parallel config (``config``)

Every rank writes its own shard: the state dicts of its model chunks, of its optimizer (the inner
torch optimizer's state and the main parameters it steps, which are the fp32 master copies under
bf16 and this rank's slice under the distributed optimizer), the scheduler, the step counters and
its RNG states (torch, Python, NumPy, Megatron's model-parallel tracker, CUDA when present).

Atomicity: shards and meta go to ``path.tmp/``; rank 0 renames it to ``path`` only after every rank
finished writing (a barrier), replacing an older checkpoint at ``path`` by a rename too. A ``path``
(or ``path.tmp`` / ``path.old``) holding anything but checkpoint files is never deleted: the save
is refused with ``ValueError`` before anything is written. A crash between the two renames leaves
the previous checkpoint intact at ``path.old`` (and the interrupted new one, complete, at
``path.tmp``); ``load_checkpoint(path)`` then finds no ``path``, loads ``path.old`` with a
``RuntimeWarning`` saying so, and the next save cleans up. A folder without ``meta.json``, with a
missing or unreadable shard, written by another parallel layout, or for another model (``config``:
every ``ModelConfig`` field but the ones that do not define the weights, :data:`IGNORED_CONFIG`;
the error names the differing fields) is refused with ``ValueError`` on EVERY rank (the failure is
agreed with one all-reduce, so no rank hangs in a collective while another raises). A shared
filesystem is assumed.

RNG: loading restores the PROCESS-GLOBAL generators of every rank (torch CPU and CUDA, Python's
``random``, NumPy's global state, Megatron's model-parallel tracker), as a bit-identical resume
needs; anything else in the process drawing from them continues from the checkpoint's streams.

Memory: one rank's state at a time on the host (``torch.save`` / ``torch.load`` on CPU).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from mcore_engine.engine import MegatronEngine

__all__ = ["FORMAT", "IGNORED_CONFIG", "CheckpointLayout", "config_mismatch", "engine_config_record",
           "engine_layout", "load_engine_state", "load_shard", "rng_state", "save_engine_state", "save_shard",
           "set_rng_state"]

FORMAT = "mcore-engine-per-rank-v1"
_META = "meta.json"

IGNORED_CONFIG: dict[str, frozenset[str]] = {
    "model": frozenset({"hf_path", "fused_lm_head", "init_method_std", "max_sequence_length"}),
    "parallel": frozenset({"sequence_parallel", "batch_p2p_comm"}),
}
"""Config fields a load may change: where the initial weights came from, how the lm head computes,
the longest accepted sequence and communication options; every other ``model`` / ``parallel``
field must match the checkpoint's."""


@dataclass(frozen=True)
class CheckpointLayout:
    """The parallel layout a checkpoint was written under; a load must run under the same one."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    virtual_pipeline_model_parallel_size: int | None
    data_parallel_size: int
    precision: str
    use_distributed_optimizer: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _shard_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


_OUR_FILE = re.compile(r"(rank_\d{5}\.pt(\.part)?|meta\.json)")


def _replaceable(folder: str) -> bool:
    """True when ``folder`` is absent or holds nothing but checkpoint files (ours to delete)."""
    if not os.path.lexists(folder):
        return True
    return os.path.isdir(folder) and not os.path.islink(folder) and all(
        _OUR_FILE.fullmatch(name) for name in os.listdir(folder))


def rng_state() -> dict[str, Any]:
    """This rank's RNG states: torch CPU, CUDA (when present), Python, NumPy, Megatron's tracker."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _agree(error: str | None, what: str) -> None:
    """Raise ``ValueError`` on every rank when any rank has an ``error`` (one MAX all-reduce)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        from mcore_engine.platform import get_device

        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=get_device().torch_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        failed = bool(flag.item())
    else:
        failed = error is not None
    if failed:
        raise ValueError(error if error is not None else f"{what}: refused because another rank failed")


def config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{"section.field": (checkpoint's, current)}`` for the fields of ``engine_config_record``
    dicts that differ, :data:`IGNORED_CONFIG` left out."""
    diff = {}
    for section in sorted(saved.keys() | current.keys()):
        ours, theirs = current.get(section) or {}, saved.get(section) or {}
        for name in sorted(ours.keys() | theirs.keys()):
            if name not in IGNORED_CONFIG.get(section, ()) and ours.get(name) != theirs.get(name):
                diff[f"{section}.{name}"] = (theirs.get(name), ours.get(name))
    return diff


def save_shard(path: str, shard: dict[str, Any], layout: CheckpointLayout, *, step: int,
               config: dict[str, Any] | None = None) -> None:
    """Collective: write this rank's ``shard`` into checkpoint folder ``path`` atomically;
    ``config`` (JSON-serialisable, e.g. :func:`engine_config_record`) goes into ``meta.json``."""
    path = os.path.abspath(path)
    tmp = path + ".tmp"
    rank = dist.get_rank() if dist.is_initialized() else 0
    error = None
    if rank == 0:
        try:
            for folder in (path, tmp, path + ".old"):
                if not _replaceable(folder):
                    raise OSError(f"{folder!r} exists and is not an mcore-engine checkpoint; refusing to "
                                  "replace it")
            if os.path.exists(tmp):
                shutil.rmtree(tmp)
            os.makedirs(tmp)
        except OSError as exc:
            error = f"save_checkpoint: cannot create {tmp!r}: {exc}"
    _agree(error, "save_checkpoint")
    error = None
    try:
        part = os.path.join(tmp, _shard_name(rank) + ".part")
        torch.save({"format": FORMAT, "rank": rank, "layout": layout.to_dict(), **shard}, part)
        os.replace(part, os.path.join(tmp, _shard_name(rank)))
    except OSError as exc:
        error = f"save_checkpoint: rank {rank} could not write its shard: {exc}"
    _agree(error, "save_checkpoint")
    error = None
    if rank == 0:
        try:
            meta = {"format": FORMAT, "layout": layout.to_dict(), "step": step,
                    "shards": [_shard_name(r) for r in range(layout.world_size)], "config": config}
            missing = [s for s in meta["shards"] if not os.path.isfile(os.path.join(tmp, s))]
            if missing:
                raise OSError(f"shards missing after the barrier: {missing}")
            with open(os.path.join(tmp, _META), "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            old = path + ".old"
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
    """``path``, or ``path.old`` (with a ``RuntimeWarning``) when a save crashed between its two
    renames: no ``path``, a complete previous checkpoint at ``path.old``."""
    old = path + ".old"
    if os.path.lexists(path) or not os.path.isfile(os.path.join(old, _META)):
        return path
    tmp = path + ".tmp"
    warnings.warn(f"load_checkpoint: {path!r} is missing but {old!r} holds the previous checkpoint: a save "
                  f"was interrupted between its renames (its complete new state may be in {tmp!r}); "
                  f"loading {old!r}. The next save_checkpoint({path!r}) cleans up.", RuntimeWarning,
                  stacklevel=3)
    return old


def _read_shard(path: str, layout: CheckpointLayout, rank: int, config: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    meta_path = os.path.join(path, _META)
    if not os.path.isdir(path):
        raise ValueError(f"load_checkpoint: {path!r} is not a checkpoint folder")
    if not os.path.isfile(meta_path):
        raise ValueError(f"load_checkpoint: {path!r} has no {_META}: torn or incomplete checkpoint")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"load_checkpoint: unreadable {meta_path!r}: {exc}") from exc
    if meta.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {path!r} has format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("layout") != layout.to_dict():
        diff = {k: (meta.get("layout", {}).get(k), v) for k, v in layout.to_dict().items()
                if meta.get("layout", {}).get(k) != v}
        raise ValueError(f"load_checkpoint: {path!r} was written under another parallel layout; "
                         f"(checkpoint, current) differ in {diff}")
    if config is not None and meta.get("config") is not None:
        diff = config_mismatch(meta["config"], config)
        if diff:
            raise ValueError(f"load_checkpoint: {path!r} was written for another model / parallel config; "
                             f"(checkpoint, current) differ in {diff}")
    missing = [s for s in meta.get("shards", []) if not os.path.isfile(os.path.join(path, s))]
    if missing or len(meta.get("shards", [])) != layout.world_size:
        raise ValueError(f"load_checkpoint: {path!r} is torn: missing shards {missing} "
                         f"(expected {layout.world_size})")
    shard_path = os.path.join(path, _shard_name(rank))
    try:
        shard = torch.load(shard_path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a truncated file raises anything from pickle / zipfile
        raise ValueError(f"load_checkpoint: unreadable shard {shard_path!r}: {exc}") from exc
    if shard.get("format") != FORMAT or shard.get("rank") != rank or shard.get("layout") != layout.to_dict():
        raise ValueError(f"load_checkpoint: shard {shard_path!r} does not belong to rank {rank} "
                         "of this layout")
    return shard


def load_shard(path: str, layout: CheckpointLayout,
               check: Callable[[dict[str, Any]], None] | None = None, *,
               config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Collective: read and check this rank's shard of checkpoint ``path`` (``path.old`` after a save
    that crashed between its renames, with a warning) against ``layout``, ``config`` (when both it
    and the checkpoint have one; :func:`config_mismatch`) and ``check(shard)``, which raises
    ``ValueError`` on a mismatch; ``ValueError`` on every rank when any rank finds the checkpoint
    torn, foreign or mismatched."""
    path = _resolve(os.path.abspath(path))
    rank = dist.get_rank() if dist.is_initialized() else 0
    shard, error = None, None
    try:
        shard = _read_shard(path, layout, rank, config)
        if check is not None:
            check(shard)
    except ValueError as exc:
        error = str(exc)
    _agree(error, f"load_checkpoint({path!r})")
    return shard


# ---------------------------------------------------------------------- the engine's state
def engine_layout(engine: MegatronEngine) -> CheckpointLayout:
    """The current parallel layout of ``engine`` (a ``MegatronEngine``)."""
    par = engine.config.parallel
    world = dist.get_world_size() if dist.is_initialized() else 1
    return CheckpointLayout(
        world_size=world, tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
        data_parallel_size=world // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size),
        precision=engine.config.precision,
        use_distributed_optimizer=engine.config.optimizer.use_distributed_optimizer)


def engine_config_record(engine: MegatronEngine) -> dict[str, Any]:
    """``{"model": ModelConfig as dict, "parallel": ParallelConfig as dict}`` of ``engine``."""
    return {"model": asdict(engine.config.model), "parallel": asdict(engine.config.parallel)}


def _optimizer_state(optimizer) -> list[dict[str, Any]]:
    """Per sub-optimizer: the inner torch optimizer's state dict and the parameters it steps (the
    fp32 main copies under bf16, this rank's slice under the distributed optimizer)."""
    from mcore_engine.optim import sub_optimizers

    states = []
    for sub in sub_optimizers(optimizer):
        inner = sub.optimizer
        state = {"inner": inner.state_dict() if inner is not None else None,
                 "main_params": [p.detach().clone() for g in inner.param_groups for p in g["params"]]
                 if inner is not None else []}
        if getattr(sub, "grad_scaler", None) is not None:
            state["grad_scaler"] = sub.grad_scaler.state_dict()
        states.append(state)
    return states


def _load_optimizer_state(optimizer, states: list[dict[str, Any]]) -> None:
    from mcore_engine.optim import sub_optimizers

    for sub, state in zip(sub_optimizers(optimizer), states, strict=True):
        inner = sub.optimizer
        if inner is None:
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        with torch.no_grad():
            for p, saved in zip(params, state["main_params"], strict=True):
                p.copy_(saved)
        inner.load_state_dict(state["inner"])
        if "grad_scaler" in state:
            sub.grad_scaler.load_state_dict(state["grad_scaler"])


def save_engine_state(engine: MegatronEngine, path: str) -> None:
    """Collective: checkpoint ``engine`` (model chunks, optimizer, scheduler, step counters, RNG)."""
    shard = {
        "model": [chunk.module.state_dict() for chunk in engine.model],
        "optimizer": _optimizer_state(engine.optimizer),
        "scheduler": engine.lr_scheduler.state_dict(),
        "global_step": engine.global_step,
        "num_skipped_steps": engine.num_skipped_steps,
        "rng": rng_state(),
    }
    save_shard(path, shard, engine_layout(engine), step=engine.global_step,
               config=engine_config_record(engine))


def _shapes(state: dict[str, Any]) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in state.items() if isinstance(v, torch.Tensor)}


def _check_matches(engine: MegatronEngine, shard: dict[str, Any]) -> None:
    """``ValueError`` unless the shard's model and optimizer fit ``engine`` exactly."""
    from mcore_engine.optim import sub_optimizers

    if len(shard["model"]) != len(engine.model):
        raise ValueError(f"load_checkpoint: checkpoint holds {len(shard['model'])} model chunks, "
                         f"engine has {len(engine.model)}")
    for i, (chunk, state) in enumerate(zip(engine.model, shard["model"], strict=True)):
        ours, theirs = _shapes(chunk.module.state_dict()), _shapes(state)
        if ours != theirs:
            diff = sorted(set(ours.items()) ^ set(theirs.items()))[:4]
            raise ValueError(f"load_checkpoint: model chunk {i} differs from the checkpoint's "
                             f"(parameter names / shapes, first differences: {diff})")
    subs = sub_optimizers(engine.optimizer)
    if len(subs) != len(shard["optimizer"]):
        raise ValueError(f"load_checkpoint: checkpoint holds {len(shard['optimizer'])} optimizers, "
                         f"engine has {len(subs)}")
    for sub, state in zip(subs, shard["optimizer"], strict=True):
        params = [p for g in sub.optimizer.param_groups for p in g["params"]] if sub.optimizer else []
        if [tuple(p.shape) for p in params] != [tuple(p.shape) for p in state["main_params"]]:
            raise ValueError("load_checkpoint: optimizer parameter shapes differ from the checkpoint's")


def load_engine_state(engine: MegatronEngine, path: str) -> None:
    """Collective: restore ``engine`` from checkpoint ``path`` (checked before anything changes),
    including every rank's process-global RNG states (module docstring)."""
    shard = load_shard(path, engine_layout(engine), check=partial(_check_matches, engine),
                       config=engine_config_record(engine))
    for chunk, state in zip(engine.model, shard["model"], strict=True):
        chunk.module.load_state_dict(state, strict=True)
    _load_optimizer_state(engine.optimizer, shard["optimizer"])
    engine.lr_scheduler.num_steps = 0  # load_state_dict ADDS the saved step count
    engine.lr_scheduler.load_state_dict(shard["scheduler"])
    engine.global_step = shard["global_step"]
    engine.num_skipped_steps = shard["num_skipped_steps"]
    set_rng_state(shard["rng"])
