"""Per-token outputs of the output head for one micro-batch, and the step flags the head can serve:
logits ``[b, s, V/tp]``, hidden states ``[b, s, H]`` (``fused_lm_head``) or values ``[b, s, 1]``
(``head: value``) -> per-token outputs ``[b, s]``, on every row or on the selected rows only
(``outputs_on_loss_mask_only``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from mcore_engine.model.build import apply_output_layer, lm_head_weight
from mcore_engine.processor import RowSelection, process_lm_head_hidden

if TYPE_CHECKING:
    from mcore_engine.config import EngineConfig
    from mcore_engine.data.flags import StepFlags

__all__ = ["check_head_flags", "lm_head_outputs", "merge_logits_func"]


def lm_head_outputs(config: EngineConfig, model: torch.nn.Module, output: torch.Tensor,
                    label: torch.Tensor | None, temperature, flags: StepFlags, *,
                    logits_processor: Callable[..., dict[str, torch.Tensor]],
                    logits_processor_func: Callable | None = None, batch: dict[str, Any] | None = None,
                    data_format: str = "thd", select: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-token outputs ``[b, s]`` from logits ``[b, s, V/tp]``, hidden states ``[b, s, H]``
    (``fused_lm_head``) or values ``[b, s, 1]`` (``head: value``), as ``flags`` ask.
    ``logits_processor(logits, label, temperature, **process_lm_head_logits' keywords)`` turns logits
    into outputs (the engine's ``_lm_head_logits_processor``). With ``select``
    (``outputs_on_loss_mask_only``) only the ``n`` rows with ``select != 0`` go through the output
    layer and the processor, as ``[1, n, ...]``; the rest get outputs and gradients 0 (a value head
    computes every row and keeps the selected ones). One host sync."""
    cfg = config.model
    rows = None
    if select is not None:
        rows = RowSelection(select)
        output, label, temperature = rows.take(output), rows.take(label), rows.take(temperature)
        if batch is not None:
            batch = {k: rows.take(v) for k, v in batch.items()}
    kwargs = dict(calculate_entropy=flags.calculate_entropy,
                  calculate_sum_pi_squared=flags.calculate_sum_pi_squared,
                  distillation_use_topk=flags.distillation_use_topk,
                  distillation_only=flags.distillation_only,
                  log_prob_min_clamp=flags.distillation_log_prob_min_clamp,
                  logits_processor_func=logits_processor_func, batch=batch, data_format=data_format)
    if cfg.head == "value":  # the model's own head ran on every row (H -> 1: no saving to make)
        out = {"values": output[..., 0]}
    elif cfg.fused_lm_head:
        out = process_lm_head_hidden(output, lm_head_weight(model), label, temperature,
                                     vocab_size=cfg.vocab_size, chunk_size=config.logits_chunk_size,
                                     **kwargs)
    else:
        logits = apply_output_layer(model, output) if rows is not None else output
        out = logits_processor(logits, label, temperature, **kwargs)
    return out if rows is None else {k: rows.put(v) for k, v in out.items()}


def check_head_flags(config: EngineConfig, flags: StepFlags, logits_processor_func: Callable | None,
                     logits_func: Callable | None) -> None:
    """``ValueError`` for step flags the output head cannot serve (same on every rank)."""
    if config.model.head == "value":
        asked = [name for name in ("calculate_entropy", "calculate_sum_pi_squared",
                                   "distillation_use_topk") if getattr(flags, name)]
        asked += [name for name, func in (("logits_processor_func", logits_processor_func),
                                          ("logits_func", logits_func)) if func is not None]
        if asked:
            raise ValueError(f"model.head='value' has no vocabulary: {asked} need model.head='lm'")
    if flags.outputs_on_loss_mask_only:
        if logits_func is not None:
            raise ValueError("outputs_on_loss_mask_only=True: logits_func needs the logits of every row; "
                             "drop the flag for sampling / scoring passes")


def merge_logits_func(outputs: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]
                      ) -> dict[str, torch.Tensor]:
    """``outputs`` plus a ``logits_func``'s outputs; ``ValueError`` on a key both produce."""
    clash = sorted(outputs.keys() & extra.keys())
    if clash:
        raise ValueError(f"logits_func returned {clash}, which the built-in outputs already hold; "
                         "rename them or pass builtin_outputs=False")
    return {**outputs, **extra}
