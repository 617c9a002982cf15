"""One pass of Megatron's pipeline schedule over a prepared step, and its per-micro-batch callbacks::

    step = prepare_pass(batch)          # argument checks, prepare_step, the head's flag check
    store = get_forward_backward_func()(forward_step, micro_batches, ...)
        forward_step(mb):  output = model(mb.model_inputs)                 -> (output, loss_func)
        loss_func(output): outputs = lm_head_outputs(output, flags)        # per token, CP gathered
                           loss, metrics = guard.run(loss_function(outputs, data, ctx) [+ MTP term])
                           -> (loss, num_tokens, record)
    guard.raise_if_failed()                                                # agreed on every rank
    gather_results(store)                        # outputs, loss, metrics: last stage -> every rank

``loss_i`` is divided by ``ctx.global_num_tokens`` and never averaged over micro-batches or DP, so
the gradient is that of ``sum_{dp, mb} loss_i``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from tensordict import TensorDict, TensorDictBase

from mcore_engine.config import EngineConfig
from mcore_engine.data.context_parallel import gather_tokens
from mcore_engine.layers.mtp import arm_mtp, pop_mtp_hidden
from mcore_engine.layers.value_head import sequence_scores
from mcore_engine.model.build import is_last_stage_chunk, output_hidden_states
from mcore_engine.ops import scale_logits_by_temperature
from mcore_engine.step.layout import StepLayout
from mcore_engine.step.lm_head import check_head_flags, lm_head_outputs, merge_logits_func
from mcore_engine.step.loss_guard import LossGuard
from mcore_engine.step.mtp import loss_with_mtp
from mcore_engine.step.prepare import (
    LOSS_CONVENTIONS,
    MicroBatch,
    PreparedStep,
    attention_mask,
    collect_outputs,
    gather_micro_batch_metrics,
    gather_results,
    loss_data,
    micro_batch_iterator,
    micro_batch_loss_result,
    micro_batch_outputs,
    prepare_step,
)

__all__ = ["LossFunction", "Pass", "eval_mode", "forward_step", "prepare_pass", "run_schedule"]

LossFunction = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]


@dataclass(frozen=True)
class Pass:
    """What one forward(-backward) pass over a prepared step needs in the schedule's callbacks."""

    config: EngineConfig
    step: PreparedStep
    loss_function: LossFunction | None
    logits_processor: Callable[..., dict[str, torch.Tensor]]
    """Logits -> per-token outputs (the engine's ``_lm_head_logits_processor``)."""
    logits_processor_func: Callable | None
    logits_func: Callable | None
    builtin_outputs: bool
    guard: LossGuard
    needs_grad: bool
    loss_convention: str = "flat"


def prepare_pass(batch: TensorDictBase, config: EngineConfig, layout: StepLayout, *,
                 logits_processor_func: Callable | None, logits_func: Callable | None = None,
                 loss_convention: str = "flat") -> PreparedStep:
    """:func:`prepare_step` after the checks of the pass's arguments, then the head's check of the
    step flags (``ValueError``, the same on every rank)."""
    if loss_convention not in LOSS_CONVENTIONS:
        raise ValueError(f"loss_convention must be one of {LOSS_CONVENTIONS}, got {loss_convention!r}")
    for name, func in (("logits_processor_func", logits_processor_func), ("logits_func", logits_func)):
        if config.model.fused_lm_head and func is not None:
            raise ValueError(f"{name} needs the logits, which model.fused_lm_head=True never builds; "
                             "use the built-in outputs or fused_lm_head: false")
    step = prepare_step(batch, layout, has_logits_processor_func=logits_processor_func is not None)
    check_head_flags(config, step.flags, logits_processor_func, logits_func)
    return step


def _outputs_and_loss(run: Pass, mb: MicroBatch, model: torch.nn.Module, output: torch.Tensor):
    """``(loss_function's result, (detached outputs, micro_batch metrics or None))``."""
    inp, flags, fmt = mb.model_inputs, run.step.flags, run.config.data_format
    teacher = {"teacher_ids": inp.teacher_ids, "teacher_logprobs": inp.teacher_logprobs}
    outputs = {}
    if run.builtin_outputs:
        select = inp.loss_mask if flags.outputs_on_loss_mask_only else None
        outputs = lm_head_outputs(run.config, model, output, inp.labels, inp.temperature, flags,
                                  logits_processor=run.logits_processor,
                                  logits_processor_func=run.logits_processor_func, batch=teacher,
                                  data_format=fmt, select=select)
    if run.logits_func is not None:
        scaled = scale_logits_by_temperature(output, inp.temperature)
        outputs = merge_logits_func(outputs, run.logits_func(student_logits=scaled, data=teacher,
                                                             data_format=fmt))
    if mb.cp is not None:  # every CP rank's tokens, in the whole pack's layout (the loss sees CP = 1)
        outputs = {k: gather_tokens(v, mb.cp) for k, v in outputs.items()}
    kept = {k: v.detach() for k, v in outputs.items()}
    by_micro_batch = run.loss_convention == "micro_batch"
    if run.loss_function is None:
        return (output.new_zeros((), dtype=torch.float32), {}), (kept, {} if by_micro_batch else None)
    if by_micro_batch:
        result, metrics = micro_batch_loss_result(run.loss_function(
            model_output=micro_batch_outputs(outputs, mb), data=mb.data, ctx=run.step.ctx))
        return result, (kept, metrics)
    flat = {k: v.reshape(-1) for k, v in outputs.items()}
    return run.loss_function(flat, loss_data(mb), run.step.ctx), (kept, None)


def _loss_func(run: Pass, mb: MicroBatch, model: torch.nn.Module, output: torch.Tensor, *,
               mtp_hidden: list[torch.Tensor] | None = None):
    """Megatron's loss callback: ``(loss, num_tokens, record for gather_results)``."""
    compute = partial(_outputs_and_loss, run, mb, model, output)
    if mtp_hidden is not None:  # the multi-token prediction term joins the loss, inside the guard
        compute = partial(loss_with_mtp, compute, run.config, model, mtp_hidden, mb, run.step.ctx,
                          run.logits_processor)
    loss, metrics, extra = run.guard.run(compute, output, needs_grad=run.needs_grad)
    kept, raw = extra if extra is not None else (None, None)
    record = {"index": mb.index, "loss": loss.detach(), "metrics": metrics, "outputs": kept,
              "raw_metrics": raw}
    return loss, mb.inputs.loss_mask.sum().to(torch.int), record


def forward_step(run: Pass, data_iterator: Iterator[MicroBatch], model: torch.nn.Module):
    """Megatron's forward step: the model's output and the loss callback for it."""
    mb = next(data_iterator)
    inp, cfg = mb.model_inputs, run.config.model
    if not cfg.fused_lm_head and cfg.head == "lm" and is_last_stage_chunk(model):
        output_hidden_states(model, enable=run.step.flags.outputs_on_loss_mask_only)  # rows to select
    # the SDPA core attention masks causally by itself (no [b, 1, S, S] mask)
    mask = attention_mask(mb) if cfg.core_attention == "local" else None
    # MTP modules (last stage) run in training passes only (layers/mtp.py, step/mtp.py)
    arm_mtp(model, run.needs_grad and cfg.mtp_loss_scaling_factor > 0)
    extra = {} if mb.vision is None else {"vision": mb.vision}  # model.multimodal: pixels, 3-D positions
    output = model(input_ids=inp.input_ids, position_ids=inp.position_ids, attention_mask=mask,
                   packed_seq_params=inp.packed_seq_params, **extra)
    return output, partial(_loss_func, run, mb, model, mtp_hidden=pop_mtp_hidden(model))


def run_schedule(chunks: list[torch.nn.Module], run: Pass, layout: StepLayout, *, forward_only: bool,
                 moe: Any = None, on_failure: Callable[[], None] | None = None) -> TensorDict:
    """The schedule over ``run.step``'s micro-batches; a TensorDict ``[B]`` of the outputs, ``loss``
    and ``metrics`` on every rank. ``on_failure()`` runs before a failed loss is re-raised."""
    step = run.step
    iterators = [micro_batch_iterator(step) for _ in chunks]
    if moe is not None:  # aux-loss scale, router replay / recording (mcore_engine.model.moe)
        moe.begin(step, training=not forward_only)
    store = get_forward_backward_func()(
        forward_step_func=partial(forward_step, run),
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(step.micro_batches), seq_length=step.max_seq_len,
        micro_batch_size=step.max_rows, forward_only=forward_only)
    try:
        run.guard.raise_if_failed()
    except Exception:
        if on_failure is not None:
            on_failure()
        raise

    per_mb, loss, metrics = gather_results(step, store, layout)
    out = TensorDict({}, batch_size=[step.batch_size])
    for key, value in collect_outputs(step, per_mb).items():
        out.set(key, value)
    if run.config.model.head == "value" and per_mb and not step.flags.outputs_on_loss_mask_only:
        out.set("scores", sequence_scores(per_mb, step.micro_batches, step.order))
    out.set_non_tensor("loss", loss)
    out.set_non_tensor("metrics", metrics)
    if moe is not None:  # routed_experts per token, router metrics (collective over PP and DP)
        try:
            per_mb, moe_metrics = moe.finish()
        finally:
            moe.reset()
        for key, value in collect_outputs(step, per_mb).items():
            out.set(key, value)
        out.set_non_tensor("metrics", {**metrics, **moe_metrics})
    if run.loss_convention == "micro_batch":
        out.set_non_tensor("micro_batch_metrics", gather_micro_batch_metrics(step, store, layout))
    return out


@contextlib.contextmanager
def eval_mode(chunks: list[torch.nn.Module]) -> Iterator[None]:
    """Every module of ``chunks`` in eval mode (no dropout; Megatron's MoELayer takes TP > 1 without
    SP), each module's own mode restored after."""
    modes = [(module, module.training) for chunk in chunks for module in chunk.modules()]
    for chunk in chunks:
        chunk.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training
