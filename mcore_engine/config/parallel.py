"""``ParallelConfig``: the parallel layout; the data-parallel size is what is left of the world size."""

from __future__ import annotations

from dataclasses import dataclass

from mcore_engine.config.checks import _bools, _positive_int, _require

__all__ = ["ParallelConfig"]


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout; the data-parallel size is what is left of the world size."""

    tensor_model_parallel_size: int = 1
    """TP: ranks that shard each layer (and the vocab)."""
    pipeline_model_parallel_size: int = 1
    """PP: pipeline stages."""
    virtual_pipeline_model_parallel_size: int | None = None
    """VPP: model chunks per pipeline rank for the interleaved schedule (>= 2, needs PP > 1)."""
    batch_p2p_comm: bool = False
    """Batch the pipeline's send/recv pairs. Must stay off with VPP (results are silently wrong)."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism (needs TP > 1): norms, dropout and the MoE router see ``s / tp``
    tokens; micro-batches are padded to a multiple of TP. CPU (gloo) and GPU."""
    expert_model_parallel_size: int = 1
    """EP: ranks that split each MoE layer's experts (carved out of TP x DP, as Megatron does)."""
    expert_tensor_parallel_size: int | None = None
    """ETP: ranks that shard each expert's FFN; ``None`` means ``tensor_model_parallel_size``.
    Per pipeline stage ``tp * cp * dp == etp * ep * edp`` (edp: the experts' data-parallel size)."""
    context_parallel_size: int = 1
    """CP: ranks that split every sequence (load-balanced: 2 x CP chunks, rank r holds r and
    2CP-1-r); each receives the whole batch, like TP ranks. World = TP x PP x CP x DP."""
    cp_comm_type: str = "p2p"
    """Transformer Engine's CP exchange (GPU with TE): ``p2p``, ``all_gather`` or ``a2a``. Without TE
    the engine's own attention all-gathers K / V."""

    def __post_init__(self) -> None:
        _positive_int(self, "tensor_model_parallel_size", "pipeline_model_parallel_size",
                      "expert_model_parallel_size", "context_parallel_size")
        _require(self.cp_comm_type in ("p2p", "all_gather", "a2a"),
                 "ParallelConfig.cp_comm_type must be 'p2p', 'all_gather' or 'a2a', "
                 f"got {self.cp_comm_type!r}")
        _bools(self, "batch_p2p_comm", "sequence_parallel")
        if self.expert_tensor_parallel_size is not None:
            _positive_int(self, "expert_tensor_parallel_size")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None:
            _positive_int(self, "virtual_pipeline_model_parallel_size")
            _require(vpp >= 2, "ParallelConfig.virtual_pipeline_model_parallel_size must be None or >= 2, "
                               f"got {vpp}")
            _require(self.pipeline_model_parallel_size > 1,
                     "ParallelConfig.virtual_pipeline_model_parallel_size needs "
                     "ParallelConfig.pipeline_model_parallel_size > 1, got "
                     f"{self.pipeline_model_parallel_size}")
            _require(not self.batch_p2p_comm,
                     "ParallelConfig.batch_p2p_comm must be False with "
                     "ParallelConfig.virtual_pipeline_model_parallel_size (interleaved schedule): "
                     "batched send/recv to one peer swaps directions and gives wrong results")
        _require(not (self.sequence_parallel and self.tensor_model_parallel_size == 1),
                 "ParallelConfig.sequence_parallel needs ParallelConfig.tensor_model_parallel_size > 1")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def expert_tensor_size(self) -> int:
        """Resolved ETP."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size // (tp * pp * cp)``; ``ValueError`` unless ``world_size`` is a multiple of it."""
        tp, pp, cp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                      self.context_parallel_size)
        _require(isinstance(world_size, int) and world_size >= 1 and world_size % (tp * pp * cp) == 0,
                 f"world_size ({world_size}) must be a positive multiple of "
                 f"ParallelConfig.tensor_model_parallel_size ({tp}) x "
                 f"ParallelConfig.pipeline_model_parallel_size ({pp}) x "
                 f"ParallelConfig.context_parallel_size ({cp})")
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_size
        _require(world_size % (etp * ep * pp) == 0,
                 f"world_size ({world_size}) must be a multiple of "
                 f"ParallelConfig.expert_tensor_parallel_size ({etp}) x "
                 f"ParallelConfig.expert_model_parallel_size ({ep}) x "
                 f"ParallelConfig.pipeline_model_parallel_size ({pp})")
        return world_size // (tp * pp * cp)
