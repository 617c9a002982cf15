"""Engine checkpoints on Megatron-Core ``dist_checkpointing`` (``torch_dist``), reshardable.

Folder ``path/``::

    __<rank>_<i>.distcp, .metadata    sharded tensors (torch.distributed.checkpoint), global keys
    common.pt, metadata.json          rank 0's plain entries; dist_checkpointing's backend record
                                      (Megatron-Core >= 0.19 keeps the plain entries in the .distcp
                                      files, as the sharded object ``common_state``: no common.pt)
    mcore_engine.json                 written last: format, step, layout, precision, config record

Holds each model chunk's ``sharded_state_dict()`` (global layer and expert ids: any TP / PP / VPP /
EP cut loads it), the optimizer's fp32 main weights and Adam moments (none before the first step;
loading that clears Adam state), scheduler, step counters and each rank's RNG states (restored for
the same layout only). A LoRA engine's checkpoint holds only the adapters and their optimizer state;
the base comes from ``model.hf_path``, which the marker records and a load requires to be the same.

A save writes ``path.tmp/``; rank 0 then writes the marker and swaps it in through ``path.old``, so
a crash leaves a loadable checkpoint; a folder holding other files is never deleted. A load checks
on every rank the marker, the config (:data:`IGNORED_CONFIG` aside), the storage files and every
tensor's global shape and dtype before changing anything (``ValueError``); the vocab rows of the
embeddings and output layer may differ, since their padding changes with TP (rows past the saved
ones load as zeros). Shared filesystem assumed.
Memory: the distributed optimizer's ``fully_reshardable`` form gathers a DP group's optimizer state
(once the model's fp32 state) on each of its ranks.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import queue
import re
import shutil
import warnings
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.config import EngineConfig
from mcore_engine.parallel.platform import get_device
from mcore_engine.state.engine_state import restore_scheduler, rng_state, set_rng_state

__all__ = ["FORMAT", "IGNORED_CONFIG", "checkpoint_layout", "config_mismatch", "config_record",
           "load_engine_checkpoint", "rng_state", "save_engine_checkpoint", "set_rng_state"]

FORMAT = "mcore-engine-dist-v1"
MARKER = "mcore_engine.json"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
"""Megatron's optimizer ``sharded_state_dict`` metadata: model-space optimizer state (reshardable in
TP, PP, EP and DP; ``fully_sharded_model_space`` needs the flattened tensors 0.16 no longer supports)."""

IGNORED_CONFIG: dict[str, frozenset[str]] = {
    "model": frozenset({"hf_path", "fused_lm_head", "init_method_std", "max_sequence_length",
                        "core_attention"}),
    "parallel": frozenset({"tensor_model_parallel_size", "pipeline_model_parallel_size",
                           "virtual_pipeline_model_parallel_size", "sequence_parallel", "batch_p2p_comm",
                           "expert_model_parallel_size", "expert_tensor_parallel_size",
                           "context_parallel_size", "cp_comm_type"}),
}
"""Config fields a load may change: where the initial weights came from, how the lm head and the
attention compute, the longest accepted sequence and the whole parallel layout (context parallelism
included: it holds no state); every other ``model`` field must match."""

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
        record["model"]["lora"] = {"rank": lora.rank, "alpha": float(lora.alpha),
                                   "targets": lora.hf_target_modules(config.model.swiglu)}
        base = config.model.hf_path
        record["lora"] = {"base_model": os.path.realpath(base) if base else None}
    return record


def _adapters_only(config: dict[str, Any]) -> bool:
    """A LoRA engine's checkpoint holds the adapters (and their optimizer state) only."""
    return (config.get("model") or {}).get("lora") is not None


def _is_adapter(key: str) -> bool:
    return ".lora_A." in key or ".lora_B." in key


def config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{"section.field": (checkpoint's, current)}`` for differing fields, :data:`IGNORED_CONFIG` aside."""
    diff = {}
    for section in sorted(saved.keys() | current.keys()):
        ours, theirs = current.get(section) or {}, saved.get(section) or {}
        for name in sorted(ours.keys() | theirs.keys()):
            if name not in IGNORED_CONFIG.get(section, ()) and ours.get(name) != theirs.get(name):
                diff[f"{section}.{name}"] = (theirs.get(name), ours.get(name))
    return diff


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
    from mcore_engine.step.optimizer import sub_optimizers

    return any(sub.optimizer is not None and len(sub.optimizer.state) > 0
               for sub in sub_optimizers(optimizer))


def _in_process_write_results() -> None:
    """Megatron's module-level writer-results queue as a plain ``queue.Queue`` for synchronous saves
    (no multiprocessing Manager server, whose socket path breaks under a long ``TMPDIR``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


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
    _in_process_write_results()
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


def _read_marker(path: str, config: dict[str, Any], precision: str) -> dict[str, Any]:
    marker_path = os.path.join(path, MARKER)
    if not os.path.isdir(path):
        raise ValueError(f"load_checkpoint: {path!r} is not a checkpoint folder")
    if not os.path.isfile(marker_path):
        raise ValueError(f"load_checkpoint: {path!r} has no {MARKER}: torn or incomplete checkpoint")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"load_checkpoint: unreadable {marker_path!r}: {exc}") from exc
    if marker.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {path!r} has format {marker.get('format')!r}, "
                         f"expected {FORMAT!r}")
    diff = config_mismatch(marker.get("config") or {}, config)
    if marker.get("precision") != precision:
        diff["precision"] = (marker.get("precision"), precision)
    if diff:
        raise ValueError(f"load_checkpoint: {path!r} was written for another model; "
                         f"(checkpoint, current) differ in {diff}")
    return marker


def _check_files(path: str) -> dict[str, Any]:
    """The checkpoint's tensor metadata ``{key: ShardedTensor}``; ``ValueError`` when a storage file
    it lists is missing or shorter than the bytes recorded for it, or the plain entries are unreadable
    (``common.pt``; from Megatron-Core 0.19 a DCP object in a storage file, so read after the sizes)."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    def unreadable(exc: Exception) -> ValueError:
        return ValueError(f"load_checkpoint: {path!r} is torn: unreadable metadata ({exc})")

    try:
        storage = FileSystemReader(path).read_metadata().storage_data
        tensors = dist_checkpointing.load_tensors_metadata(path)
    except Exception as exc:  # missing / truncated metadata raise anything from pickle or the reader
        raise unreadable(exc) from exc
    ends: dict[str, int] = {}
    for info in storage.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        file = os.path.join(path, name)
        size = os.path.getsize(file) if os.path.isfile(file) else -1
        if size < end:
            what = "missing" if size < 0 else f"{size} bytes, {end} expected"
            raise ValueError(f"load_checkpoint: {path!r} is torn: storage file {name} {what}")
    if (not os.path.exists(os.path.join(path, "common.pt")) and _common_reader() != "load_common_state_dict"
            and any(getattr(key, "fqn", "").startswith("common_state") for key in storage)):
        from megatron.core import __version__ as mcore_version

        raise ValueError(f"load_checkpoint: {path!r} was written by Megatron-Core >= 0.19 (its plain entries "
                         f"are in the .distcp files, there is no common.pt); megatron-core {mcore_version} "
                         "cannot read it: load it with megatron-core >= 0.19")
    try:
        dist_checkpointing.load_common_state_dict(path)
    except (Exception, CheckpointException) as exc:  # the DCP read raises a BaseException subclass
        raise unreadable(exc) from exc
    return tensors


def _same_but_vocab_rows(sh, saved_shape: tuple[int, ...]) -> bool:
    """True when ``sh`` is vocab-padded (``allow_shape_mismatch``) and ``saved_shape`` differs from its
    global shape in the vocab rows only (the tensor's first axis). The padded vocab is a multiple of
    ``make_vocab_size_divisible_by * TP``, so it changes with TP while ``vocab_size`` (checked with the
    config) does not. Megatron's loader then zeroes the local shard and reads the saved rows that
    overlap it: rows ``[0, vocab_size)`` always, saved padding rows where both have them, zeros
    beyond the saved rows (their logits are masked and their gradients 0). No extra memory: each
    rank reads only the saved rows overlapping its own (the model's and Adam's) shards."""
    axis, want = sh.prepend_axis_num, tuple(sh.global_shape)
    return (bool(getattr(sh, "allow_shape_mismatch", False)) and len(saved_shape) == len(want)
            and saved_shape[:axis] + saved_shape[axis + 1:] == want[:axis] + want[axis + 1:])


def _check_tensors(path: str, wanted: dict[str, Any], saved: dict[str, Any], stepped: bool) -> None:
    """Every sharded tensor of ``wanted`` (the engine's model state) is in ``saved`` with the same
    global shape and dtype, and so are its Adam moments (parameters only) when the checkpoint holds
    optimizer state.
    Vocab-padded tensors (Megatron's ``allow_shape_mismatch``: word embeddings, output layer) may
    differ in their vocab rows only (:func:`_same_but_vocab_rows`)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(wanted)
    problems = []
    for sh in nested_values(wanted):
        if not isinstance(sh, ShardedTensor):
            continue
        # buffers (a router's expert bias) have no Adam moments
        moments = ("exp_avg", "exp_avg_sq") if stepped and getattr(sh.data, "requires_grad", True) else ()
        keys = [sh.key, *(f"optimizer.state.{s}.{sh.key}" for s in moments)]
        for key in keys:
            have = saved.get(key)
            if have is None:
                problems.append(f"{key} missing")
            elif tuple(have.global_shape) != tuple(sh.global_shape) and not _same_but_vocab_rows(
                    sh, tuple(have.global_shape)):
                problems.append(f"{key} shape {tuple(have.global_shape)} vs {tuple(sh.global_shape)}")
            elif key == sh.key and have.dtype != sh.dtype:
                problems.append(f"{key} dtype {have.dtype} vs {sh.dtype}")
    if problems:
        raise ValueError(f"load_checkpoint: {path!r} does not fit this model ({len(problems)} tensors; "
                         f"first: {problems[:4]})")


@contextlib.contextmanager
def _adam_step_kept(optimizer):
    """Megatron 0.16's ``fully_reshardable`` load with torch Adam: ``step`` is read from the state
    itself (the checkpoint keeps it in the param groups), and each parameter then gets its own
    ``step`` tensor (a shared one would be bumped once per parameter)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from mcore_engine.step.optimizer import sub_optimizers

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def setter(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = setter
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original
    for sub in sub_optimizers(optimizer):
        for state in (sub.optimizer.state.values() if sub.optimizer is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


_GROUP_KIND = ("wd_mult", "lr_mult", "is_decoupled_lr")


def _fit_optimizer_common(saved: dict, optimizer) -> dict:
    """The checkpoint's plain optimizer entries (param-group hyperparameters, Adam's step) in this
    engine's optimizer structure: one Megatron optimizer at EP=1, a dense + expert chain at EP > 1.
    Each param group takes the saved group of its kind (``_GROUP_KIND``), every other entry the
    first saved optimizer's (a chain keeps its steps equal)."""
    from mcore_engine.step.optimizer import sub_optimizers

    def split(tree):  # one optimizer's dict, or {index: dict} for a chain
        return [tree[k] for k in sorted(tree)] if tree and all(isinstance(k, int) for k in tree) else [tree]

    def holder(sub):  # the dict holding "param_groups" (the distributed optimizer nests it)
        return sub["optimizer"] if "param_groups" not in sub and "optimizer" in sub else sub

    subs, ours = split(saved), sub_optimizers(optimizer)
    if len(subs) == len(ours) or "param_groups" not in holder(subs[0]):
        return saved
    kinds = {tuple(g.get(k) for k in _GROUP_KIND): g for sub in subs for g in holder(sub)["param_groups"]}
    fitted = []
    for sub in ours:
        out = copy.deepcopy(subs[0])
        groups = []
        for group in sub.optimizer.param_groups:
            mine = {k: v for k, v in group.items() if k != "params"}
            groups.append({**mine, **kinds.get(tuple(mine.get(k) for k in _GROUP_KIND), {}),
                           "is_expert_parallel": mine.get("is_expert_parallel", False)})
        holder(out)["param_groups"] = groups
        fitted.append(out)
    return fitted[0] if len(fitted) == 1 else dict(enumerate(fitted))


def _fitted(common: dict, optimizer) -> dict:
    if optimizer is not None and isinstance(common.get("optimizer"), dict):
        common["optimizer"] = _fit_optimizer_common(common["optimizer"], optimizer)
    return common


def _common_reader() -> str:
    """The name through which ``dist_checkpointing.load`` reads the common state: ``load_common``
    (0.16: a method of its ``common_strategy``; 0.17 / 0.18: a function of ``serialization``; both
    read ``common.pt``), or from 0.19 ``serialization.load_common_state_dict`` (the DCP object
    ``common_state``, else a legacy ``common.pt``)."""
    from megatron.core.dist_checkpointing import serialization

    names = serialization.load.__code__.co_names
    return "load_common_state_dict" if "load_common_state_dict" in names else "load_common"


def _load_fitted(state: dict[str, Any], path: str, optimizer) -> dict[str, Any]:
    """``dist_checkpointing.load`` with :func:`_fit_optimizer_common` applied to the common state.
    Megatron-Core 0.16 takes a common-state loader (``common_strategy``); 0.17 and later removed it,
    so the ``serialization`` function it reads the common state with (:func:`_common_reader`) is
    wrapped for the call."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common as common_strategies

    if hasattr(common_strategies, "TorchCommonLoadStrategy"):  # 0.16
        class Loader(common_strategies.TorchCommonLoadStrategy):
            def load_common(self, checkpoint_dir):
                return _fitted(super().load_common(checkpoint_dir), optimizer)

        return dist_checkpointing.load(state, path, common_strategy=Loader())
    name = _common_reader()
    original = getattr(serialization, name)
    setattr(serialization, name, lambda checkpoint_dir: _fitted(original(checkpoint_dir), optimizer))
    try:
        return serialization.load(state, path)
    finally:
        setattr(serialization, name, original)


def load_engine_checkpoint(path: str, engine_config: EngineConfig, chunks: list[torch.nn.Module], optimizer,
                           scheduler) -> dict[str, int]:
    """Collective: check ``path`` (module docstring; ``ValueError`` on every rank, nothing changed),
    then load the model chunks, optimizer and scheduler in place, restore the RNG states when the
    layout is the checkpoint's, and return the saved counters. ``optimizer`` None: the model part of
    any checkpoint."""
    from mcore_engine.step.optimizer import init_optimizer_state, reset_optimizer_state

    layout, config = checkpoint_layout(engine_config), config_record(engine_config)
    path = _resolve(os.path.abspath(path))
    marker, error = None, None
    try:
        marker = _read_marker(path, config, engine_config.precision)
        saved_dist, dist_opt = marker["layout"].get("distributed_optimizer"), layout["distributed_optimizer"]
        if optimizer is not None and marker["optimizer_state"] and saved_dist != dist_opt:
            raise ValueError(f"load_checkpoint: {path!r} holds the optimizer state of "
                             f"optimizer.use_distributed_optimizer={saved_dist}, this engine has "
                             f"{dist_opt}: load it with the same setting")
        saved = _check_files(path)
        _check_tensors(path, _model_sharded(chunks, _adapters_only(config)), saved, marker["optimizer_state"])
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
    loaded = _load_fitted(state, path, optimizer)
    names = ["model"] if len(chunks) == 1 else [f"model{i}" for i in range(len(chunks))]
    for chunk, name in zip(chunks, names, strict=True):
        result = chunk.module.load_state_dict(loaded[name], strict=not adapters_only)
        missing = [k for k in getattr(result, "missing_keys", ()) if _is_adapter(k)]
        if missing:  # an adapter checkpoint must fill every adapter (the base stays as loaded)
            raise ValueError(f"load_checkpoint: {path!r} lacks the adapters {missing[:4]}")
    if with_optimizer:
        with _adam_step_kept(optimizer):
            optimizer.load_state_dict(loaded["optimizer"])
    elif optimizer is not None:
        reset_optimizer_state(optimizer)
    if same_layout:
        set_rng_state(loaded["rng"])
    common = loaded["engine"]
    if scheduler is not None and "scheduler" in common:
        restore_scheduler(scheduler, common["scheduler"])
    return {"global_step": common["global_step"], "num_skipped_steps": common["num_skipped_steps"]}
