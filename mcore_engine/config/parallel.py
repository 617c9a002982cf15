"""``ParallelConfig``: the parallel layout, and its checks against the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_engine.config.checks import Block, require

__all__ = ["ParallelConfig"]


@dataclass(kw_only=True)
class ParallelConfig(Block):
    """Parallel layout; the data-parallel size is what is left of the world size."""

    PATH = "parallel"

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
    """ETP: ranks that shard each expert's FFN; ``None`` means ``tensor_model_parallel_size`` (1 for
    biased experts, ``model.add_bias_linear``: Megatron-Core splits no expert bias).
    Per pipeline stage ``tp * cp * dp == etp * ep * edp`` (edp: the experts' data-parallel size)."""
    context_parallel_size: int = 1
    """CP: ranks that split every sequence (load-balanced: 2 x CP chunks, rank r holds r and
    2CP-1-r); each receives the whole batch, like TP ranks. World = TP x PP x CP x DP."""
    cp_comm_type: str = "p2p"
    """Transformer Engine's CP exchange (GPU with TE): ``p2p``, ``all_gather`` or ``a2a``. Without TE
    the engine's own attention all-gathers K / V."""

    def __post_init__(self) -> None:
        self._ints("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                   "context_parallel_size")
        self._choice("cp_comm_type", ("p2p", "all_gather", "a2a"))
        self._bools("batch_p2p_comm", "sequence_parallel")
        self._ints("expert_tensor_parallel_size", optional=True)
        vpp, pp = self.virtual_pipeline_model_parallel_size, self.pipeline_model_parallel_size
        if vpp is not None:
            self._ints("virtual_pipeline_model_parallel_size", low=2)
            self._require(pp > 1, "ParallelConfig.virtual_pipeline_model_parallel_size needs "
                          f"ParallelConfig.pipeline_model_parallel_size > 1, got {pp}",
                          "virtual_pipeline_model_parallel_size", "pipeline_model_parallel_size")
            self._require(not self.batch_p2p_comm, "ParallelConfig.batch_p2p_comm must be False with "
                          "ParallelConfig.virtual_pipeline_model_parallel_size (interleaved schedule): "
                          "batched send/recv to one peer swaps directions and gives wrong results",
                          "batch_p2p_comm", "virtual_pipeline_model_parallel_size")
        self._require(not (self.sequence_parallel and self.tensor_model_parallel_size == 1),
                      "ParallelConfig.sequence_parallel needs ParallelConfig.tensor_model_parallel_size > 1",
                      "sequence_parallel", "tensor_model_parallel_size")

    @property
    def model_parallel_size(self) -> int:
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size

    @property
    def expert_tensor_size(self) -> int:
        """Resolved ETP."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def check(self, model: Any, parallel: Any = None) -> None:
        """Heads, groups and FFN divisible by TP; layers by PP x VPP; EP / ETP only with experts; CP
        only with the SDPA core attention."""
        m, tp, pp = model, self.tensor_model_parallel_size, self.pipeline_model_parallel_size
        vpp = self.virtual_pipeline_model_parallel_size or 1
        t = "ParallelConfig.tensor_model_parallel_size"
        for name, value in (("num_attention_heads", m.num_attention_heads),
                            ("num_query_groups", m.query_groups), ("ffn_hidden_size", m.ffn_size)):
            require(value % tp == 0, f"ModelConfig.{name} ({value}) must be divisible by {t} ({tp})",
                    "parallel.tensor_model_parallel_size", f"model.{name}")
        require(m.num_layers % (pp * vpp) == 0,
                f"ModelConfig.num_layers ({m.num_layers}) must be divisible by "
                f"ParallelConfig.pipeline_model_parallel_size ({pp}) x "
                f"ParallelConfig.virtual_pipeline_model_parallel_size ({vpp})",
                "parallel.pipeline_model_parallel_size", "parallel.virtual_pipeline_model_parallel_size",
                "model.num_layers")
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_parallel_size
        expert = ["parallel.expert_model_parallel_size"] * (ep != 1) + \
            ["parallel.expert_tensor_parallel_size"] * (etp is not None)
        require(m.moe is not None or not expert,
                "ParallelConfig.expert_model_parallel_size / expert_tensor_parallel_size need "
                "ModelConfig.moe (a dense model has no experts)", *expert, "model.moe")
        require(self.context_parallel_size == 1 or m.core_attention == "sdpa",
                "ParallelConfig.context_parallel_size > 1 needs ModelConfig.core_attention='sdpa' (or "
                "Transformer Engine): Megatron's local DotProductAttention ('local') cannot split sequences",
                "parallel.context_parallel_size", "model.core_attention")

    def data_parallel_size(self, world_size: int) -> int:
        """``world_size // (tp * pp * cp)``; ``ConfigError`` unless ``world_size`` is a multiple of it
        and of ``etp * ep * pp``."""
        tp, pp, cp = (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                      self.context_parallel_size)
        require(isinstance(world_size, int) and world_size >= 1 and world_size % (tp * pp * cp) == 0,
                f"world_size ({world_size}) must be a positive multiple of "
                f"ParallelConfig.tensor_model_parallel_size ({tp}) x "
                f"ParallelConfig.pipeline_model_parallel_size ({pp}) x "
                f"ParallelConfig.context_parallel_size ({cp})",
                "parallel.tensor_model_parallel_size", "parallel.pipeline_model_parallel_size",
                "parallel.context_parallel_size")
        ep, etp = self.expert_model_parallel_size, self.expert_tensor_size
        require(world_size % (etp * ep * pp) == 0, f"world_size ({world_size}) must be a multiple of "
                f"ParallelConfig.expert_tensor_parallel_size ({etp}) x "
                f"ParallelConfig.expert_model_parallel_size ({ep}) x "
                f"ParallelConfig.pipeline_model_parallel_size ({pp})",
                "parallel.expert_tensor_parallel_size", "parallel.expert_model_parallel_size",
                "parallel.pipeline_model_parallel_size")
        return world_size // (tp * pp * cp)
