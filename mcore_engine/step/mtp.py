"""The multi-token prediction loss (DeepSeek-V3's MTP; the modules: :mod:`mcore_engine.layers.mtp`).

Module ``k = 1..D`` predicts ``x_{t+k+1}`` at position ``t``. Per micro-batch, on the whole pack
(context-parallel shares gathered, as the main loss sees them), with the packed next-token
``labels[t] = x_{t+1}`` and ``loss_mask`` of the main loss::

    labels_k[t] = labels[t + k]     mask_k[t] = loss_mask[t + k]     (0 where t + k leaves t's sequence)
    ce_k        = -sum_t mask_k[t] * log softmax(logits^k_t)[labels_k[t]]
    mtp_loss    = (1 / D) sum_k ce_k / N                                  # N = ctx.global_num_tokens
    loss        = loss_function(...) + mtp_loss_scaling_factor * mtp_loss

So every module is scored on the main loss's own target tokens (those at least ``k + 1`` tokens into
their sequence), and ``mtp_loss`` summed over micro-batches and data-parallel ranks is a global token
mean with the main loss's normaliser: independent of the micro-batch split and of context
parallelism. The log-probs come from the engine's vocab-parallel lm-head op at temperature 1 over
the true vocabulary (padded ids get no mass), for the ``mask_k`` rows only. Gradients reach the MTP
modules and, through the shared embedding, output layer and the trunk's hidden states, the trunk.
The step's metrics carry ``mtp_loss`` (unscaled). Memory: per module the lm-head pass of its
``mask_k`` rows (logits ``[n_k, V / tp]``; none with the fused lm-head).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

from mcore_engine.data.context_parallel import ContextParallelSplit, gather_tokens
from mcore_engine.data.flags import StepFlags
from mcore_engine.step.lm_head import lm_head_outputs

if TYPE_CHECKING:
    from mcore_engine.config import EngineConfig
    from mcore_engine.losses.context import LossContext
    from mcore_engine.step.prepare import MicroBatch

__all__ = ["MTP_METRIC", "loss_with_mtp", "mtp_loss", "shift_in_sequence"]

MTP_METRIC = "mtp_loss"
_LOG_PROBS_ONLY = StepFlags()


def shift_in_sequence(t: torch.Tensor, slot_sequence: torch.Tensor, k: int) -> torch.Tensor:
    """``out[r, c] = t[r, c + k]`` where slot ``c + k`` of row ``r`` holds the same sequence as slot
    ``c``, else 0; ``t`` ``[rows, cols]`` (thd ``[1, T]``, bshd ``[b, S]``), ``slot_sequence`` its
    ``[rows * cols]`` sequence ids. One copy of ``t``."""
    rows, cols = t.shape
    out = torch.zeros_like(t)
    if k < cols:
        seq = slot_sequence.to(t.device).reshape(rows, cols)
        out[:, :-k] = torch.where(seq[:, k:] == seq[:, :-k], t[:, k:], torch.zeros_like(t[:, k:]))
    return out


def _cp_share(t: torch.Tensor, split: ContextParallelSplit) -> torch.Tensor:
    """This context-parallel rank's tokens of a whole-pack ``[rows, cols]`` tensor."""
    return t.reshape(-1).index_select(0, split.slots[split.rank]).reshape(split.local_shape)


def mtp_loss(config: EngineConfig, model: torch.nn.Module, hidden: list[torch.Tensor], mb: MicroBatch,
             ctx: LossContext, logits_processor: Callable[..., dict[str, torch.Tensor]]) -> torch.Tensor:
    """The micro-batch's ``mtp_loss`` contribution (0-d fp32, differentiable) from the MTP modules'
    hidden states ``hidden[k - 1]`` ``[s, b, H]`` (this rank's share under sequence / context
    parallelism); ``logits_processor`` is the engine's (see :func:`lm_head_outputs`)."""
    full = mb.inputs
    total = torch.zeros((), dtype=torch.float32, device=full.loss_mask.device)
    for k, h in enumerate(hidden, start=1):
        labels = shift_in_sequence(full.labels, full.slot_sequence, k)
        mask = shift_in_sequence(full.loss_mask, full.slot_sequence, k)
        local_labels, local_mask = (labels, mask) if mb.cp is None else (_cp_share(labels, mb.cp),
                                                                         _cp_share(mask, mb.cp))
        if config.parallel.sequence_parallel:  # the lm-head runs on the gathered sequence, as the trunk's
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)
        out = lm_head_outputs(config, model, h.transpose(0, 1), local_labels, 1.0, _LOG_PROBS_ONLY,
                              logits_processor=logits_processor, select=local_mask)
        log_probs = out["log_probs"]
        if mb.cp is not None:
            log_probs = gather_tokens(log_probs, mb.cp)
        total = total - (log_probs.float() * mask).sum()
    return total / (len(hidden) * ctx.global_num_tokens)


def loss_with_mtp(compute: Callable[[], tuple[Any, Any]], config: EngineConfig, model: torch.nn.Module,
                  hidden: list[torch.Tensor], mb: MicroBatch, ctx: LossContext,
                  logits_processor: Callable[..., dict[str, torch.Tensor]]) -> tuple[Any, Any]:
    """``compute() -> (result, extra)`` with the MTP term added to ``result = (loss, metrics)``:
    ``(loss + mtp_loss_scaling_factor * mtp_loss, {**metrics, "mtp_loss": mtp_loss})``. A result of
    another shape is returned as it is (the engine's loss guard rejects it); a ``metrics`` key
    ``"mtp_loss"`` is a ``ValueError``."""
    result, extra = compute()
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[0], torch.Tensor)
            and isinstance(result[1], Mapping)):
        return result, extra
    loss, metrics = result
    if MTP_METRIC in metrics:
        raise ValueError(f"loss_function's metric {MTP_METRIC!r} clashes with the engine's multi-token "
                         "prediction loss metric; rename it")
    value = mtp_loss(config, model, hidden, mb, ctx, logits_processor)
    factor = config.model.mtp_loss_scaling_factor
    return (loss + factor * value.to(loss.dtype), {**metrics, MTP_METRIC: value.detach()}), extra
