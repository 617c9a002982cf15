"""The loss function inside Megatron's schedule, with failures agreed by every rank.

An exception on the last pipeline stage would leave the other ranks waiting in a collective, so
:class:`LossGuard` records it and the schedule runs on with a zero gradient::

    try:    loss, metrics = check_loss_result(loss_function(outputs, data, ctx), needs_grad)
    except Exception as exc:
            guard.error = exc; loss = 0.0 * output.sum()
    guard.raise_if_failed()     # after the schedule: one MAX all-reduce; on failure one all_gather_object

The failing rank re-raises; the others raise ``ValueError`` (when it was one) or ``RuntimeError``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.parallel.platform import get_device

__all__ = ["LossGuard", "check_loss_result"]


def check_loss_result(result: Any, *, needs_grad: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Checked ``(loss 0-d, metrics {str: detached 0-d})`` from a loss function's result (``ValueError``)."""
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ValueError(f"loss_function must return (loss, metrics), got {type(result).__name__}")
    loss, metrics = result
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point() or loss.numel() != 1:
        what = (f"{loss.dtype} tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor)
                else type(loss).__name__)
        raise ValueError(f"loss_function's loss must be a floating 0-d tensor (the micro-batch's "
                         f"contribution to the global loss), got a {what}")
    if needs_grad and not loss.requires_grad:
        raise ValueError("loss_function's loss does not require grad (detached, or not computed from "
                         "`outputs`); for a micro-batch without loss tokens return e.g. "
                         "(outputs['log_probs'] * data['loss_mask']).sum() / ctx.global_num_tokens")
    if not isinstance(metrics, Mapping):
        raise ValueError(f"loss_function's metrics must be a dict, got {type(metrics).__name__}")
    clean: dict[str, torch.Tensor] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise ValueError(f"loss_function's metric names must be str, got {key!r}")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            clean[key] = value.detach().reshape(())
        elif isinstance(value, (int, float)):
            clean[key] = torch.tensor(float(value), dtype=torch.float64, device=loss.device)
        else:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"loss_function's metric {key!r} must be a number or a one-element tensor "
                             f"(a contribution to the global value), got {shape}")
    return (loss if loss.dim() == 0 else loss.sum()), clean  # not a view: Megatron frees outputs


class LossGuard:
    """One step's guard: :meth:`run` per micro-batch, then :meth:`raise_if_failed` on every rank."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    def run(self, compute: Callable[[], tuple[Any, Any]], output: torch.Tensor, *, needs_grad: bool
            ) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
        """``compute() -> (result, extra)`` -> checked ``(loss, metrics, extra)``; after any failure this
        step, ``(0 * output.sum(), {}, None)`` (a zero gradient into the model)."""
        if self.error is None:
            try:
                result, extra = compute()
                loss, metrics = check_loss_result(result, needs_grad=needs_grad)
                return loss, metrics, extra
            except Exception as exc:  # re-raised, agreed, by raise_if_failed after the schedule
                self.error = exc
        return output.sum().float() * 0.0, {}, None

    def raise_if_failed(self, what: str = "the loss function") -> None:
        """Collective over the default group: raise on every rank when any rank recorded an error."""
        error = self.error
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world == 1:
            if error is not None:
                raise error
            return
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=get_device().torch_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        mine = None if error is None else (isinstance(error, ValueError), f"{type(error).__name__}: {error}")
        reports: list[Any] = [None] * world
        dist.all_gather_object(reports, mine)
        if error is not None:
            raise error
        failed = [rank for rank, report in enumerate(reports) if report is not None]
        is_value_error, message = reports[failed[0]]
        cls = ValueError if is_value_error else RuntimeError
        raise cls(f"{what} failed on rank(s) {failed} (this rank stopped with them): {message}")
