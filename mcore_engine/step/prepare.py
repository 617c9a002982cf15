"""One engine step's data side (:func:`prepare_step`), before any model work::

    flags = parse_step_flags(batch); validate_batch(batch, ...)              # ValueError naming the key
    micro_batches, order = split_micro_batches(batch, flags, ...)
    inputs = [pack_micro_batch(mb, ...) for mb in micro_batches]
    counts = all_gather([sum(loss_mask), num_seqs, failed], group=dp)    # [dp, 3], one collective
    ctx = LossContext(global_num_tokens=counts[:, 0].sum().clamp_min(1), global_num_seqs=counts[:, 1].sum())

A bad batch on one DP rank raises on every rank (the others a ``ValueError`` naming it). Counts
travel as float64; the context holds float32 0-d tensors. The interleaved schedule needs fixed
shapes, so every micro-batch is padded to one model shape (``layout.common_shape``, ``loss_mask`` 0).
Memory: the packed inputs of all micro-batches, O(tokens); one bshd mask ``[b, 1, S, S]`` at a time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from mcore_engine.data.context_parallel import ContextParallelSplit, context_parallel_split, split_inputs
from mcore_engine.data.flags import StepFlags, parse_step_flags
from mcore_engine.data.micro_batching import merge_micro_batches, split_micro_batches
from mcore_engine.data.multimodal import VisionBatch, check_multi_modal_inputs, vision_batch
from mcore_engine.data.packing import ModelInputs, flatten_per_token, pack_micro_batch, unpack_per_token
from mcore_engine.data.validation import validate_batch
from mcore_engine.losses.context import LossContext
from mcore_engine.step.layout import StepLayout

__all__ = ["LOSS_CONVENTIONS", "MicroBatch", "PreparedStep", "attention_mask", "collect_outputs",
           "gather_micro_batch_metrics", "gather_results", "micro_batch_iterator", "micro_batch_loss_result",
           "micro_batch_outputs", "pad_inputs", "prepare_step"]

LOSS_CONVENTIONS = ("flat", "micro_batch")


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch as the forward step sees it."""

    index: int
    data: TensorDictBase
    """The micro-batch's slice of the user's batch."""
    inputs: ModelInputs
    """Its packed model inputs, ``attention_mask`` dropped (see :func:`attention_mask`): the whole
    pack, what the loss and the outputs' unpacking see."""
    sample_ids: torch.Tensor
    """int64 ``[b]``: global batch indices of the micro-batch's sequences (lower DP ranks first)."""
    cp: ContextParallelSplit | None = None
    """Context parallelism: this rank's share of the pack (None at CP = 1)."""
    model_inputs: ModelInputs | None = None
    """What this rank's model and lm-head see: ``inputs`` cut to the CP share (``inputs`` at CP = 1)."""
    vision: VisionBatch | None = None
    """A vision-language model's pixels, visual-token slots (this CP rank's) and 3-D positions."""

    def __post_init__(self) -> None:
        if self.model_inputs is None:
            object.__setattr__(self, "model_inputs", self.inputs)


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
    max_rows: int
    """Largest model-layout row count over the micro-batches (1 for thd, b for bshd)."""


def prepare_step(batch: TensorDictBase, layout: StepLayout, *,
                 has_logits_processor_func: bool) -> PreparedStep:
    """Validate and pack ``batch`` for one step; one host sync beyond ``validate_batch``'s. The
    micro-batch count is a multiple of ``layout.min_num_micro_batches``. Teacher tensors are required
    under ``distillation_use_topk`` unless a custom logits processor brings its own. At CP > 1 each
    micro-batch also gets this rank's share (:mod:`mcore_engine.data.context_parallel`). The ranks of
    ``layout.micro_batch_count_group`` split into the largest count of any (one all-reduce of one
    number), as verl does; a rank whose batch cannot give that many fails the step by name."""
    device, dp_group, parts = layout.device, layout.dp_group, layout.min_num_micro_batches
    split = partial(split_micro_batches, batch, default_micro_batch_size=layout.default_micro_batch_size)
    error: Exception | None = None
    prepared = None
    local_tokens = torch.zeros((), dtype=torch.float64, device=device)
    local_seqs = 0
    try:
        flags = parse_step_flags(batch)
        validate_batch(batch, vocab_size=layout.vocab_size, max_sequence_length=layout.max_sequence_length,
                       require_teacher=flags.distillation_use_topk and not has_logits_processor_func)
        check_multi_modal_inputs(batch, layout.vision)
        mbs, order = split(flags, min_num_micro_batches=1)
        if len(mbs) % parts and flags.use_dynamic_bsz:  # more, smaller micro-batches
            mbs, order = split(flags, min_num_micro_batches=-(-len(mbs) // parts) * parts)
        if len(mbs) % parts:
            raise ValueError(f"the interleaved pipeline schedule needs a multiple of {parts} "
                             f"(pipeline_model_parallel_size) micro-batches, the batch gives {len(mbs)}: "
                             "change micro_batch_size_per_gpu or the number of sequences")
    except Exception as exc:  # any failure, not only validation: the other DP ranks must hear of it
        error = exc
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    count_group = layout.micro_batch_count_group
    if count_group is not None and dist.get_world_size(count_group) > 1:
        count = torch.tensor(0 if error is not None else len(mbs), dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=count_group)
        if error is None and len(mbs) != int(count):
            try:
                mbs, order = split(flags, num_micro_batches=int(count))
            except Exception as exc:
                error = exc
    try:
        if error is not None:
            raise error
        micro_batches, start = [], 0
        for i, mb in enumerate(mbs):
            inputs = pack_micro_batch(mb, data_format=layout.data_format, temperature=flags.temperature,
                                      pad_multiple=layout.pad_multiple, device=device)
            b = mb.batch_size[0]
            sample_ids = torch.tensor(order[start:start + b], dtype=torch.int64)
            start += b
            micro_batches.append(MicroBatch(
                index=i, data=mb, inputs=dataclasses.replace(inputs, attention_mask=None),
                sample_ids=sample_ids))
            local_tokens = local_tokens + inputs.loss_mask.sum(dtype=torch.float64)
        if layout.common_shape:
            shape = tuple(max(int(mb.inputs.input_ids.shape[d]) for mb in micro_batches) for d in (0, 1))
            micro_batches = [dataclasses.replace(mb, inputs=pad_inputs(mb.inputs, shape), model_inputs=None)
                             for mb in micro_batches]
        if layout.vision is not None:
            micro_batches = [dataclasses.replace(mb, vision=vision_batch(mb.data, mb.inputs, layout.vision))
                             for mb in micro_batches]
        cp_size, cp_rank, cp_group = layout.context_parallel
        if cp_size > 1:
            micro_batches = [_with_cp_share(mb, cp_size, cp_rank, cp_group) for mb in micro_batches]
        local_seqs = batch.batch_size[0]
        prepared = (flags, micro_batches, order)
    except Exception as exc:  # any failure, not only validation: the other DP ranks must hear of it
        error = exc

    local = torch.stack([local_tokens,
                         torch.tensor(float(local_seqs), dtype=torch.float64, device=device),
                         torch.tensor(0.0 if error is None else 1.0, dtype=torch.float64, device=device)])
    counts = local[None]                                                  # [dp, 3]
    if dp_size > 1:
        gathered = [torch.empty_like(local) for _ in range(dp_size)]
        dist.all_gather(gathered, local, group=dp_group)
        counts = torch.stack(gathered)
    host = counts[:, 1:].tolist()                                         # the step's one host sync
    if error is not None:
        raise error
    failed = [i for i, (_, bad) in enumerate(host) if bad]
    if failed:
        ranks = dist.get_process_group_ranks(dp_group) if dp_size > 1 else [0]
        raise ValueError(f"the batch on data-parallel rank(s) {failed} (global rank(s) "
                         f"{[ranks[i] for i in failed]}) was rejected (see that rank's error); "
                         "nothing was run")
    flags, micro_batches, order = prepared
    offset = int(sum(seqs for seqs, _ in host[: dist.get_rank(dp_group) if dp_size > 1 else 0]))
    if offset:
        micro_batches = [dataclasses.replace(mb, sample_ids=mb.sample_ids + offset) for mb in micro_batches]
    # clamp: a batch without any loss token gives zero contributions, not 0 / 0
    ctx = LossContext(global_num_tokens=counts[:, 0].sum().clamp_min(1.0).float(),
                      global_num_seqs=counts[:, 1].sum().float(), dp_size=dp_size,
                      distillation_only=flags.distillation_only)
    max_len = max(int(mb.inputs.input_ids.shape[1]) for mb in micro_batches)
    max_rows = max(int(mb.inputs.input_ids.shape[0]) for mb in micro_batches)
    return PreparedStep(flags=flags, micro_batches=micro_batches, order=order, ctx=ctx,
                        batch_size=batch.batch_size[0], max_seq_len=max_len, max_rows=max_rows)


def _with_cp_share(mb: MicroBatch, size: int, rank: int, group: Any) -> MicroBatch:
    split = context_parallel_split(mb.inputs, size, rank, group)
    vision = mb.vision.local(split.slots[rank]) if mb.vision is not None else None
    return dataclasses.replace(mb, cp=split, model_inputs=split_inputs(mb.inputs, split), vision=vision)


def _pad(t: torch.Tensor, shape: tuple[int, int], fill: float | int = 0) -> torch.Tensor:
    out = t.new_full((*shape, *t.shape[2:]), fill)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def pad_inputs(inputs: ModelInputs, shape: tuple[int, int]) -> ModelInputs:
    """``inputs`` padded to ``shape`` (``[1, T']`` thd, ``[b', S']`` bshd) with ``loss_mask`` 0, label
    0, temperature 1 slots that leave the real tokens' outputs unchanged: thd grows the last block to
    ``T'``, bshd adds masked columns and empty rows. ``attention_mask`` stays None."""
    rows, cols = inputs.input_ids.shape
    if (rows, cols) == tuple(shape):
        return inputs
    device = inputs.input_ids.device
    new_rows, new_cols = shape
    temperature = inputs.temperature
    if isinstance(temperature, torch.Tensor) and temperature.dim() == 2:
        temperature = _pad(temperature, shape, 1.0)
    teacher = {k: None if getattr(inputs, k) is None else _pad(getattr(inputs, k), shape)
               for k in ("teacher_ids", "teacher_logprobs")}
    slot = torch.arange(new_rows * new_cols, device=device)
    if inputs.data_format == "thd":
        starts = inputs.cu_seqlens_padded.clone()
        starts[-1] = new_cols
        seq = torch.cat([inputs.slot_sequence, inputs.slot_sequence[-1:].expand(new_cols - cols)])
        positions = (slot - starts.to(device, torch.int64)[seq]).reshape(shape)
        packed = inputs.packed_seq_params
        cu = starts.to(device=packed.cu_seqlens_q.device)
        max_len = int((starts[1:] - starts[:-1]).max())
        packed = dataclasses.replace(packed, cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                                     cu_seqlens_kv_padded=cu, max_seqlen_q=max_len, max_seqlen_kv=max_len)
        token_index = inputs.token_index
    else:
        starts = torch.arange(inputs.lengths.numel() + 1, dtype=torch.int32) * new_cols
        row_seq = torch.arange(new_rows, device=device).clamp_max(inputs.lengths.numel() - 1)
        seq = row_seq.repeat_interleave(new_cols)
        positions = torch.arange(new_cols, device=device).expand(new_rows, new_cols).clone()
        positions[:rows, :cols] = inputs.position_ids
        packed = None
        token_index = inputs.token_index // cols * new_cols + inputs.token_index % cols
    return dataclasses.replace(
        inputs, input_ids=_pad(inputs.input_ids, shape), position_ids=positions,
        labels=_pad(inputs.labels, shape), loss_mask=_pad(inputs.loss_mask, shape), attention_mask=None,
        packed_seq_params=packed, temperature=temperature, cu_seqlens_padded=starts, token_index=token_index,
        slot_sequence=seq, **teacher)


def attention_mask(mb: MicroBatch) -> torch.Tensor | None:
    """Bool attention mask (True = masked): bshd ``causal | key_is_padding`` ``[b, 1, S, S]``; thd
    None (the packed attention masks by ``cu_seqlens``)."""
    inputs = mb.inputs
    if inputs.data_format != "bshd":
        return None
    rows, cols = inputs.input_ids.shape
    device = inputs.input_ids.device
    pos = torch.arange(cols, device=device)
    causal = pos[None, :] > pos[:, None]
    lengths = torch.zeros(rows, dtype=torch.int64, device=device)
    lengths[: inputs.lengths.numel()] = inputs.lengths.to(device)
    return causal[None, None] | (pos[None, :] >= lengths[:, None])[:, None, None, :]


def micro_batch_iterator(step: PreparedStep) -> Iterator[MicroBatch]:
    """The micro-batches in schedule order (one fresh iterator per model chunk)."""
    return iter(step.micro_batches)


def loss_data(mb: MicroBatch) -> TensorDict:
    """The loss function's ``data``: the micro-batch's per-token fields flat ``[T]`` in packed order."""
    return flatten_per_token(mb.data, mb.inputs, sample_ids=mb.sample_ids)


def micro_batch_outputs(outputs: dict[str, torch.Tensor], mb: MicroBatch) -> dict[str, torch.Tensor]:
    """The ``"micro_batch"`` loss's ``model_output``: each output in the layout of the micro-batch's
    ``input_ids`` (jagged ``[b, j, ...]`` or padded ``[b, S, ...]``). Differentiable; one copy each."""
    return {key: unpack_per_token(value, mb.inputs) for key, value in outputs.items()}


def micro_batch_loss_result(result: Any) -> tuple[tuple[Any, dict], dict[str, Any]]:
    """``(loss, metrics)`` -> ``((loss, {}), metrics)``: the loss checked by ``check_loss_result``,
    the metrics kept (tensors detached). ``ValueError`` unless a pair with a str-keyed mapping."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError(f"loss_function must return (loss, metrics), got {type(result).__name__}")
    loss, metrics = result
    if not isinstance(metrics, Mapping) or not all(isinstance(k, str) for k in metrics):
        raise ValueError(f"loss_function's metrics must be a dict with str keys, got {metrics!r:.80}")
    kept = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in metrics.items()}
    return (loss, {}), kept


def gather_micro_batch_metrics(step: PreparedStep, store: list[dict[str, Any]], layout: StepLayout
                               ) -> list[dict[str, Any]]:
    """One metrics dict per micro-batch (this DP rank's) from the last stage's ``store``; with PP > 1
    broadcast to the other stages (one object broadcast)."""
    pp_group, pp_last_rank, num_micro_batches = layout.pp_group, layout.pp_last_rank, len(step.micro_batches)
    metrics = [r["raw_metrics"] for r in sorted(store, key=lambda r: r["index"])]
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        box = [metrics]
        dist.broadcast_object_list(box, src=pp_last_rank, group=pp_group)
        metrics = box[0]
    if len(metrics) != num_micro_batches:
        raise RuntimeError(f"{len(metrics)} micro-batch metric records for {num_micro_batches} micro-batches")
    return metrics


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


def gather_results(step: PreparedStep, store: list[dict[str, Any]], layout: StepLayout
                   ) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor, dict[str, float]]:
    """Per-micro-batch outputs (model layout), global loss (0-d) and global metrics on every rank,
    from ``store`` (the last stage's records; empty elsewhere). Loss and metrics are contributions:
    their sum over micro-batches and DP ranks is the global value. PP > 1: the last stage broadcasts
    the metrics (one object) and each output key (one flat tensor). One host sync (a float64
    ``[num_micro_batches, 1 + num_metrics]`` sum). Memory: one flat copy of the outputs."""
    is_last_stage, pp_group, pp_last_rank = layout.is_last_stage, layout.pp_group, layout.pp_last_rank
    dp_group, device = layout.dp_group, layout.device
    meta: dict[str, Any] | None = None
    per_mb: list[dict[str, torch.Tensor]] = []
    if is_last_stage:
        store = sorted(store, key=lambda r: r["index"])
        per_mb = [r["outputs"] for r in store]
        names = sorted(set().union(*(r["metrics"].keys() for r in store)))
        zero = torch.zeros((), dtype=torch.float64, device=device)
        values = [v.reshape(()).to(device=device, dtype=torch.float64)
                  for r in store for v in (r["loss"], *(r["metrics"].get(k, zero) for k in names))]
        totals = torch.stack(values).view(len(store), 1 + len(names)).sum(0).tolist() if values else [0.0]
        keys = {k: (v.dtype, tuple(v.shape[step.micro_batches[0].inputs.input_ids.dim():]))
                for k, v in (per_mb[0].items() if per_mb else ())}
        meta = {"keys": keys, "loss": totals[0], "metrics": dict(zip(names, totals[1:], strict=True))}
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        box = [meta]
        dist.broadcast_object_list(box, src=pp_last_rank, group=pp_group)
        meta = box[0]
        sizes = [mb.inputs.input_ids.numel() for mb in step.micro_batches]
        shared: list[dict[str, torch.Tensor]] = [{} for _ in step.micro_batches]
        for key, (dtype, tail) in meta["keys"].items():
            if is_last_stage:
                flat = torch.cat([o[key].reshape(-1, *tail) for o in per_mb]).contiguous()
            else:
                flat = torch.empty((sum(sizes), *tail), dtype=dtype, device=device)
            dist.broadcast(flat, src=pp_last_rank, group=pp_group)
            for i, (mb, part) in enumerate(zip(step.micro_batches, flat.split(sizes), strict=True)):
                shared[i][key] = part.reshape(*mb.inputs.input_ids.shape, *tail)
        per_mb = shared
    loss = torch.tensor(meta["loss"], dtype=torch.float32, device=device)
    metrics = meta["metrics"]
    dp_size = dist.get_world_size(dp_group) if dp_group is not None else 1
    if dp_size > 1:
        dist.all_reduce(loss, group=dp_group)
        gathered: list[dict[str, float]] = [{} for _ in range(dp_size)]
        dist.all_gather_object(gathered, metrics, group=dp_group)
        metrics = {k: sum(g.get(k, 0.0) for g in gathered) for k in sorted(set().union(*gathered))}
    return per_mb, loss, metrics
