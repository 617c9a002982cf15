"""The train / infer step's internals: the layout's fixed values (``layout``), batch preparation into
micro-batches (``prepare``), the schedule's callbacks (``schedule``), the lm-head outputs, the loss
guard, MTP losses and the optimizer.

The names of the old ``mcore_engine.step`` module load lazily from ``step.prepare``."""

from typing import Any

_OLD_NAMES = ("LOSS_CONVENTIONS", "MicroBatch", "PreparedStep", "attention_mask", "collect_outputs",
              "gather_micro_batch_metrics", "gather_results", "micro_batch_iterator",
              "micro_batch_loss_result", "micro_batch_outputs", "pad_inputs", "prepare_step")


def __getattr__(name: str) -> Any:
    if name not in _OLD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from mcore_engine.step import prepare

    return getattr(prepare, name)
