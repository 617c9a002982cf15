"""One engine step's data side: validate, split, pack, and agree on the global normalisers.

``prepare_step`` turns a TensorDict batch into a :class:`PreparedStep` BEFORE any model work:

    flags = parse_step_flags(batch); validate_batch(batch, ...)              # ValueError naming the key
    micro_batches, order = split_micro_batches(batch, flags, ...)
    inputs = [pack_micro_batch(mb, ...) for mb in micro_batches]
    counts = all_reduce_sum([sum(loss_mask), num_seqs, failed], group=dp)    # one fused collective
    ctx = LossContext(global_num_tokens=counts[0], global_num_seqs=counts[1], ...)

The failure flag rides on the same all-reduce, so a bad batch on one data-parallel rank raises
``ValueError`` on every rank (no rank is left waiting in a collective) and nothing has been touched.

``micro_batch_iterator`` yields what the forward step consumes; ``collect_outputs`` puts the
per-token outputs of every micro-batch back into the layout and order of the input batch.
Memory: the packed inputs of all micro-batches (O(tokens) ints/floats; bshd masks O(b S^2) bools).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from mcore_engine.data import (
    ModelInputs,
    StepFlags,
    flatten_per_token,
    merge_micro_batches,
    pack_micro_batch,
    parse_step_flags,
    split_micro_batches,
    unpack_per_token,
    validate_batch,
)
from mcore_engine.losses.context import LossContext

__all__ = ["MicroBatch", "PreparedStep", "collect_outputs", "micro_batch_iterator", "prepare_step"]


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the forward step sees it."""

    index: int
    """Position in the step's micro-batch list."""
    data: TensorDictBase
    """The micro-batch's slice of the user's batch."""
    inputs: ModelInputs
    """Its packed model inputs."""
    sample_ids: torch.Tensor
    """int64 ``[b]``: the micro-batch's sequences' indices in the (local) batch."""


@dataclass(frozen=True)
class PreparedStep:
    """A validated, split and packed batch plus the step's global normalisers."""

    flags: StepFlags
    micro_batches: list[MicroBatch]
    order: list[int]
    """``order[i]``: original batch index of the i-th sequence of the concatenated micro-batches."""
    ctx: LossContext
    batch_size: int
    max_seq_len: int
    """Largest model-layout length over the micro-batches (T for thd, S for bshd)."""


def prepare_step(batch: TensorDictBase, *, vocab_size: int, max_sequence_length: int, data_format: str,
                 default_micro_batch_size: int, has_logits_processor_func: bool, pad_multiple: int,
                 thd_attention_mask: bool, min_num_micro_batches: int, device: torch.device,
                 dp_group: Any) -> PreparedStep:
    """Validate and pack ``batch`` for one step; ``ValueError`` on every DP rank if any rank's batch
    is bad (see the module docstring). Teacher tensors are required under ``distillation_use_topk``
    unless a custom logits processor brings its own. ``min_num_micro_batches``: the interleaved
    schedule needs at least ``pp`` micro-batches."""
    error: ValueError | None = None
    prepared = None
    local_tokens = torch.zeros((), dtype=torch.float32)
    local_seqs = 0
    try:
        flags = parse_step_flags(batch)
        validate_batch(batch, vocab_size=vocab_size, max_sequence_length=max_sequence_length,
                       require_teacher=flags.distillation_use_topk and not has_logits_processor_func)
        mbs, order = split_micro_batches(batch, flags, default_micro_batch_size=default_micro_batch_size,
                                         min_num_micro_batches=1)
        if len(mbs) < min_num_micro_batches:
            raise ValueError(f"the interleaved pipeline schedule needs at least {min_num_micro_batches} "
                             f"micro-batches, the batch gives {len(mbs)}: lower micro_batch_size_per_gpu "
                             "(or max_token_len_per_gpu) or send more sequences")
        micro_batches, start = [], 0
        for i, mb in enumerate(mbs):
            inputs = pack_micro_batch(mb, data_format=data_format, temperature=flags.temperature,
                                      pad_multiple=pad_multiple, thd_attention_mask=thd_attention_mask,
                                      device=device)
            b = mb.batch_size[0]
            sample_ids = torch.tensor(order[start:start + b], dtype=torch.int64)
            start += b
            micro_batches.append(MicroBatch(index=i, data=mb, inputs=inputs, sample_ids=sample_ids))
            local_tokens = local_tokens + inputs.loss_mask.sum().float().cpu()
        local_seqs = batch.batch_size[0]
        prepared = (flags, micro_batches, order)
    except ValueError as exc:
        error = exc

    counts = torch.stack([local_tokens, torch.tensor(float(local_seqs)),
                          torch.tensor(0.0 if error is None else 1.0)]).to(device)
    if dp_group is not None and dist.get_world_size(dp_group) > 1:
        dist.all_reduce(counts, group=dp_group)
    if error is not None:
        raise error
    if float(counts[2]) > 0:
        raise ValueError("the batch on another data-parallel rank was rejected (see that rank's error); "
                         "nothing was run")
    flags, micro_batches, order = prepared
    ctx = LossContext(global_num_tokens=counts[0], global_num_seqs=counts[1],
                      dp_size=dist.get_world_size(dp_group) if dp_group is not None else 1,
                      distillation_only=flags.distillation_only)
    max_len = max(int(mb.inputs.input_ids.shape[1]) for mb in micro_batches)
    return PreparedStep(flags=flags, micro_batches=micro_batches, order=order, ctx=ctx,
                        batch_size=batch.batch_size[0], max_seq_len=max_len)


def micro_batch_iterator(step: PreparedStep) -> Iterator[MicroBatch]:
    """The micro-batches in schedule order (one fresh iterator per model chunk)."""
    return iter(step.micro_batches)


def loss_data(mb: MicroBatch) -> TensorDict:
    """The loss function's ``data``: the micro-batch's per-token fields flat ``[T]`` in packed order."""
    return flatten_per_token(mb.data, mb.inputs, sample_ids=mb.sample_ids)


def collect_outputs(step: PreparedStep, per_mb: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-token outputs of every micro-batch (model layout, ``per_mb[i]`` for micro-batch i) back in
    the layout (jagged or padded) and order of the input batch."""
    if not per_mb:
        return {}
    keys = per_mb[0].keys()
    out = {}
    for key in keys:
        parts = [unpack_per_token(outs[key], mb.inputs) for outs, mb in zip(per_mb, step.micro_batches,
                                                                            strict=True)]
        out[key] = merge_micro_batches(parts, step.order)
    return out
