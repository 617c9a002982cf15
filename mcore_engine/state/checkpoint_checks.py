"""What a checkpoint load checks on every rank before it changes anything (``ValueError`` naming the
problem): the marker (format, config less :data:`IGNORED_CONFIG`, precision), the storage files
(every byte the metadata records) and every tensor's global shape and dtype against the engine's.
The vocab rows of the embeddings and output layer may differ: their padding changes with TP (rows
past the saved ones load as zeros)."""

from __future__ import annotations

import json
import os
from typing import Any

from mcore_engine.state.megatron_compat import common_reader

__all__ = ["FORMAT", "IGNORED_CONFIG", "MARKER", "check_files", "check_tensors", "config_mismatch",
           "read_marker", "same_but_vocab_rows"]

FORMAT = "mcore-engine-dist-v1"
MARKER = "mcore_engine.json"

IGNORED_CONFIG: dict[str, frozenset[str]] = {
    "model": frozenset({"hf_path", "fused_lm_head", "init_method_std", "max_sequence_length",
                        "core_attention", "linear_attention.chunk_size", "linear_attention.recompute"}),
    "parallel": frozenset({"tensor_model_parallel_size", "pipeline_model_parallel_size",
                           "virtual_pipeline_model_parallel_size", "sequence_parallel", "batch_p2p_comm",
                           "expert_model_parallel_size", "expert_tensor_parallel_size",
                           "context_parallel_size", "cp_comm_type"}),
}
"""Config fields a load may change: where the initial weights came from, how the lm head and the
attention (and the GDN layers' chunked rule) compute, the longest accepted sequence and the whole
parallel layout (context parallelism included: it holds no state); every other ``model`` field must
match. ``"block.field"``: a field of a nested block (``model.linear_attention.chunk_size``)."""


def config_mismatch(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{"section.field": (checkpoint's, current)}`` for differing fields, :data:`IGNORED_CONFIG` aside."""
    diff = {}
    for section in sorted(saved.keys() | current.keys()):
        ours, theirs = current.get(section) or {}, saved.get(section) or {}
        ignored = IGNORED_CONFIG.get(section, frozenset())
        for name in sorted(ours.keys() | theirs.keys()):
            if name not in ignored and (_kept(ours.get(name), ignored, name)
                                        != _kept(theirs.get(name), ignored, name)):
                diff[f"{section}.{name}"] = (theirs.get(name), ours.get(name))
    return diff


def _kept(value: Any, ignored: frozenset[str], name: str) -> Any:
    """A nested block's fields (``value`` a dict) less its ignored ``"name.field"`` entries."""
    if not isinstance(value, dict):
        return value
    inner = {k.split(".", 1)[1] for k in ignored if k.startswith(f"{name}.")}
    return {k: v for k, v in value.items() if k not in inner}


def read_marker(path: str, config: dict[str, Any], precision: str) -> dict[str, Any]:
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


def check_files(path: str) -> dict[str, Any]:
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
    if (not os.path.exists(os.path.join(path, "common.pt")) and common_reader() != "load_common_state_dict"
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


def same_but_vocab_rows(sh, saved_shape: tuple[int, ...]) -> bool:
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


def check_tensors(path: str, wanted: dict[str, Any], saved: dict[str, Any], stepped: bool) -> None:
    """Every sharded tensor of ``wanted`` (the engine's model state) is in ``saved`` with the same
    global shape and dtype, and so are its Adam moments (parameters only) when the checkpoint holds
    optimizer state.
    Vocab-padded tensors (Megatron's ``allow_shape_mismatch``: word embeddings, output layer) may
    differ in their vocab rows only (:func:`same_but_vocab_rows`)."""
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
            elif tuple(have.global_shape) != tuple(sh.global_shape) and not same_but_vocab_rows(
                    sh, tuple(have.global_shape)):
                problems.append(f"{key} shape {tuple(have.global_shape)} vs {tuple(sh.global_shape)}")
            elif key == sh.key and have.dtype != sh.dtype:
                problems.append(f"{key} dtype {have.dtype} vs {sh.dtype}")
    if problems:
        raise ValueError(f"load_checkpoint: {path!r} does not fit this model ({len(problems)} tensors; "
                         f"first: {problems[:4]})")
