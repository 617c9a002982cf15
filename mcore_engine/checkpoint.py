"""Per-rank checkpoints written atomically: ``save_shard`` / ``load_shard`` of any picklable state.

Folder ``path/``::

    rank_00000.pt ... rank_{W-1}.pt   one shard per global rank (torch.save of a plain dict)
    meta.json                         written last: format, parallel layout, shard list, config record

Atomicity: shards and meta go to ``path.tmp/``; after a barrier rank 0 renames an older ``path`` to
``path.old``, ``path.tmp`` to ``path``, and deletes ``path.old``. A folder holding anything but
checkpoint files is never deleted (the save is refused first). A crash between the two renames
leaves the previous checkpoint at ``path.old``: a load then reads it with a ``RuntimeWarning``. A
folder without ``meta.json``, with a missing or unreadable shard, from another parallel layout or
for another model (``config``, :data:`IGNORED_CONFIG` aside; the differing fields are named) is
refused with ``ValueError`` on every rank (one MAX all-reduce agrees on it). Shared filesystem
assumed. Memory: one rank's state on the host at a time.
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
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mcore_engine.config import EngineConfig
from mcore_engine.platform import get_device

__all__ = ["FORMAT", "IGNORED_CONFIG", "CheckpointLayout", "checkpoint_layout", "config_mismatch",
           "config_record", "load_shard", "rng_state", "save_shard", "set_rng_state"]

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
    """This rank's RNG states: torch CPU, CUDA (when present), Python, NumPy, Megatron's tracker.
    Loading them (:func:`set_rng_state`) resets the process-global generators, as a bit-identical
    resume needs."""
    # here, not at the top: megatron.core costs ~5 s to import and save_shard / load_shard never need it
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
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker  # see rng_state

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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


def config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{"section.field": (checkpoint's, current)}`` for the fields of ``config_record``
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
    ``config`` (JSON-serialisable, e.g. :func:`config_record`) goes into ``meta.json``."""
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


def checkpoint_layout(config: EngineConfig, world_size: int) -> CheckpointLayout:
    """The parallel layout of an engine with ``config`` on ``world_size`` ranks."""
    par = config.parallel
    return CheckpointLayout(
        world_size=world_size, tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=par.virtual_pipeline_model_parallel_size,
        data_parallel_size=world_size // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size),
        precision=config.precision, use_distributed_optimizer=config.optimizer.use_distributed_optimizer)


def config_record(config: EngineConfig) -> dict[str, Any]:
    """``{"model": ModelConfig as dict, "parallel": ParallelConfig as dict}`` for ``meta.json``."""
    return {"model": asdict(config.model), "parallel": asdict(config.parallel)}
