"""What the config and the parallel layout fix for every step, resolved once by ``initialize()``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from megatron.core import parallel_state

from mcore_engine.config import EngineConfig, VisionConfig
from mcore_engine.parallel.platform import get_device

__all__ = ["StepLayout", "step_layout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class StepLayout:
    """The step's fixed values; the defaults are one rank without model or data parallelism."""

    vocab_size: int
    max_sequence_length: int
    data_format: str
    default_micro_batch_size: int
    device: torch.device
    pad_multiple: int = 1
    """Every packed sequence is padded to a multiple: TP under sequence parallelism, times ``2 * CP``
    at CP > 1 (the load-balanced context-parallel split)."""
    min_num_micro_batches: int = 1
    """The micro-batch count is a multiple of it: PP under the interleaved schedule, else 1."""
    common_shape: bool = False
    """The interleaved schedule: every micro-batch padded to one model shape."""
    dp_group: Any = None
    micro_batch_count_group: Any = None
    """MoE: Megatron's expert-tensor-and-model-parallel group, whose ranks (their token all-to-all
    spans data-parallel ranks) split into one micro-batch count."""
    context_parallel: tuple[int, int, Any] = (1, 0, None)
    """``(size, rank, group)`` of context parallelism."""
    pp_group: Any = None
    pp_last_rank: int = 0
    is_last_stage: bool = True
    """This rank holds the last pipeline stage (the outputs and the loss)."""
    vision: VisionConfig | None = None
    """A vision-language model's vision side: the batch's ``multi_modal_inputs`` and 3-D positions."""


def step_layout(config: EngineConfig) -> StepLayout:
    """The layout of ``config`` on the process groups of ``parallel_state`` (initialised)."""
    par = config.parallel
    cp = par.context_parallel_size
    interleaved = (par.virtual_pipeline_model_parallel_size or 1) > 1
    sp = par.tensor_model_parallel_size if par.sequence_parallel else 1
    return StepLayout(
        vocab_size=config.model.vocab_size, max_sequence_length=config.model.max_sequence_length,
        data_format=config.data_format, default_micro_batch_size=config.micro_batch_size,
        device=get_device().torch_device,
        pad_multiple=sp * (2 * cp if cp > 1 else 1),
        min_num_micro_batches=par.pipeline_model_parallel_size if interleaved else 1,
        common_shape=interleaved, dp_group=parallel_state.get_data_parallel_group(),
        micro_batch_count_group=parallel_state.get_expert_tensor_and_model_parallel_group()
        if config.model.moe is not None else None,
        context_parallel=(cp, parallel_state.get_context_parallel_rank(),
                          parallel_state.get_context_parallel_group()) if cp > 1 else (1, 0, None),
        pp_group=parallel_state.get_pipeline_model_parallel_group(),
        pp_last_rank=parallel_state.get_pipeline_model_parallel_last_rank(),
        is_last_stage=parallel_state.is_pipeline_last_stage(ignore_virtual=True), vision=config.model.vision)
