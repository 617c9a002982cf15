"""``MoEConfig`` (mixture-of-experts layers) and its checks against the parallel layout.

``ModelConfig.moe`` holds a ``MoEConfig``; ``EngineConfig`` calls ``_validate_moe_layout`` with its
model and parallel configs. This module does not import ``config`` (``config`` imports it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from mcore_engine.config.checks import _bools, _positive_int, _require

__all__ = ["MoEConfig"]

_MOE_DISPATCHERS = ("alltoall", "allgather")
_MOE_AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


@dataclass(kw_only=True)
class MoEConfig:
    """Mixture-of-experts layers (Megatron-Core ``MoELayer``: ``TopKRouter``, token dispatcher,
    ``SequentialMLP`` / grouped-GEMM experts, optional shared expert).

    Routing of one token with router logits ``z = x W_r^T`` ``[E]``::

        s = softmax(z) (or sigmoid(z))                         # scores over all experts
        ids = topk(s, k)                                       # router_topk experts
        w = s[ids] / s[ids].sum() unless router_pre_softmax    # (any k; + 1e-20 for sigmoid)
        y = sum_i w_i * scaling * expert_{ids_i}(x) (+ shared expert)

    HF mapping: ``norm_topk_prob=True`` (Qwen3-MoE, Mixtral, DeepSeek-V3, GLM-4.5) is
    ``router_pre_softmax=False``; ``norm_topk_prob=False`` (Qwen2-MoE) is ``router_pre_softmax=True``,
    with sigmoid scores too (``mcore_engine.layers.router``; Megatron-Core alone would renormalise
    sigmoid weights for k > 1 and never for k = 1).
    """

    num_experts: int
    """Routed experts E per MoE layer."""
    router_topk: int = 2
    """Experts k per token."""
    ffn_hidden_size: int | None = None
    """FFN width of one routed expert; ``None`` means ``ModelConfig.ffn_hidden_size``."""
    shared_expert_ffn_hidden_size: int | None = None
    """FFN width of the shared expert (all shared experts together); ``None``: no shared expert."""
    shared_expert_gate: bool = False
    """Scale the shared expert's output by ``sigmoid(x w_g)`` (Qwen2-MoE)."""
    layer_freq: int | list[int] = 1
    """Which layers are MoE: an int N means every N-th layer (0, N, 2N, ...); a 0/1 list of
    ``num_layers`` entries gives each layer (``[0, 1, 1, 1]``: one dense first layer)."""
    router_score_function: str = "softmax"
    """``"softmax"`` or ``"sigmoid"``."""
    router_pre_softmax: bool = False
    """Scores over all experts before the top-k, the k weights not renormalised (see above; sigmoid
    scores: HF ``norm_topk_prob=False``); required for k = 1 with softmax scores."""
    router_topk_scaling_factor: float | None = None
    """Multiply the k routing weights by this factor; ``None`` means 1."""
    router_dtype: str | None = "fp32"
    """Routing arithmetic dtype: ``"fp32"``, ``"fp64"`` or ``None`` (the activations' dtype)."""
    aux_loss_type: str = "aux_loss"
    """Load-balancing loss: ``"aux_loss"`` (per micro-batch), ``"seq_aux_loss"`` (per sequence),
    ``"global_aux_loss"`` (over data-parallel ranks) or ``"none"``."""
    aux_loss_coeff: float = 0.0
    """Coefficient of the load-balancing loss (0 disables it)."""
    z_loss_coeff: float | None = None
    """Coefficient of the router z-loss ``mean_t logsumexp(z_t)^2``; ``None`` disables it."""
    capacity_factor: float | None = None
    """Expert capacity ``capacity_factor * tokens * k / E``; tokens over it are dropped. ``None``: no
    dropping."""
    token_drop_policy: str = "probs"
    """Which tokens are dropped over capacity: ``"probs"`` (lowest weights) or ``"position"`` (last)."""
    pad_expert_input_to_capacity: bool = False
    """Pad each expert's input to its capacity (needs ``capacity_factor``)."""
    token_dispatcher: str = "alltoall"
    """``"alltoall"`` (any token counts) or ``"allgather"`` (equal token counts on the ranks of the
    expert-parallel group: only without expert or pipeline parallelism here)."""
    grouped_gemm: bool = False
    """Grouped-GEMM experts (``TEGroupedMLP``; needs Transformer Engine) instead of ``SequentialMLP``."""
    router_num_groups: int | None = None
    """Grouped (node-limited) routing, DeepSeek-V3's ``n_group``: the E experts form this many equal
    groups; ``None``: no groups."""
    router_group_topk: int | None = None
    """Groups a token may use (``topk_group``). A group's score is the sum of its top-2 (bias-corrected)
    expert scores, whatever ``router_topk`` is: the rule of DeepSeek-V3 and of ``transformers``."""
    router_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3's ``e_score_correction_bias``): a per-expert bias ``[E]``
    added to the scores for the top-k choice only (the weights use the unbiased scores); a buffer
    that loads, exports and checkpoints like a weight. Needs sigmoid scores."""
    router_bias_update_rate: float = 0.0
    """Per-step update of the expert bias, ``b += rate * sign(mean load - load)`` from each step's
    tokens per expert summed over the data-parallel ranks (Megatron's
    ``moe_router_bias_update_rate``). 0 (default): the bias stays as loaded, the usual choice for RL
    fine-tuning."""

    def __post_init__(self) -> None:
        _positive_int(self, "num_experts", "router_topk")
        _bools(self, "shared_expert_gate", "router_pre_softmax", "pad_expert_input_to_capacity",
               "grouped_gemm")
        for name in ("ffn_hidden_size", "shared_expert_ffn_hidden_size"):
            if getattr(self, name) is not None:
                _positive_int(self, name)
        _require(self.router_topk <= self.num_experts,
                 f"MoEConfig.router_topk ({self.router_topk}) must be <= MoEConfig.num_experts "
                 f"({self.num_experts})")
        freq = self.layer_freq
        _require((isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1)
                 or (isinstance(freq, list) and freq and all(v in (0, 1) and not isinstance(v, bool)
                                                            for v in freq)),
                 f"MoEConfig.layer_freq must be an int >= 1 or a list of 0/1 per layer, got {freq!r}")
        _require(self.router_score_function in ("softmax", "sigmoid"),
                 "MoEConfig.router_score_function must be 'softmax' or 'sigmoid', got "
                 f"{self.router_score_function!r}")
        _require(not (self.router_topk == 1 and self.router_score_function == "softmax"
                      and not self.router_pre_softmax),
                 "MoEConfig.router_topk=1 with softmax scores needs MoEConfig.router_pre_softmax=True "
                 "(a softmax over one logit has no gradient)")
        f = self.router_topk_scaling_factor
        _require(f is None or (isinstance(f, (int, float)) and not isinstance(f, bool)
                               and math.isfinite(f) and f > 0),
                 f"MoEConfig.router_topk_scaling_factor must be None or a finite number > 0, got {f!r}")
        _require(self.router_dtype in (None, "fp32", "fp64"),
                 f"MoEConfig.router_dtype must be None, 'fp32' or 'fp64', got {self.router_dtype!r}")
        _require(self.aux_loss_type in _MOE_AUX_LOSS_TYPES,
                 f"MoEConfig.aux_loss_type must be one of {_MOE_AUX_LOSS_TYPES}, got {self.aux_loss_type!r}")
        for name, optional in (("aux_loss_coeff", False), ("z_loss_coeff", True), ("capacity_factor", True)):
            v = getattr(self, name)
            _require((optional and v is None) or (isinstance(v, (int, float)) and not isinstance(v, bool)
                                                  and math.isfinite(v) and v >= 0),
                     f"MoEConfig.{name} must be {'None or ' if optional else ''}a finite number >= 0, "
                     f"got {v!r}")
        _require(self.capacity_factor is None or self.capacity_factor > 0,
                 f"MoEConfig.capacity_factor must be None or > 0, got {self.capacity_factor!r}")
        _require(not self.pad_expert_input_to_capacity or self.capacity_factor is not None,
                 "MoEConfig.pad_expert_input_to_capacity needs MoEConfig.capacity_factor")
        _require(self.token_drop_policy in ("probs", "position"),
                 f"MoEConfig.token_drop_policy must be 'probs' or 'position', got {self.token_drop_policy!r}")
        _require(self.token_dispatcher in _MOE_DISPATCHERS,
                 f"MoEConfig.token_dispatcher must be one of {_MOE_DISPATCHERS}, "
                 f"got {self.token_dispatcher!r}")
        _require(isinstance(self.shared_expert_gate, bool) and isinstance(self.grouped_gemm, bool)
                 and isinstance(self.router_pre_softmax, bool)
                 and isinstance(self.pad_expert_input_to_capacity, bool),
                 "MoEConfig.shared_expert_gate, grouped_gemm, router_pre_softmax and "
                 "pad_expert_input_to_capacity must be bools")
        _require(not self.shared_expert_gate or self.shared_expert_ffn_hidden_size is not None,
                 "MoEConfig.shared_expert_gate needs MoEConfig.shared_expert_ffn_hidden_size")
        self._check_routing_groups()

    def _check_routing_groups(self) -> None:
        groups, group_topk = self.router_num_groups, self.router_group_topk
        _require((groups is None) == (group_topk is None),
                 "MoEConfig.router_num_groups and MoEConfig.router_group_topk are set together")
        if groups is not None:
            _positive_int(self, "router_num_groups", "router_group_topk")
            _require(self.num_experts % groups == 0 and self.num_experts // groups >= 2,
                     f"MoEConfig.router_num_groups ({groups}) must divide MoEConfig.num_experts "
                     f"({self.num_experts}) into groups of at least 2 experts")
            _require(group_topk <= groups,
                     f"MoEConfig.router_group_topk ({group_topk}) must be <= MoEConfig.router_num_groups "
                     f"({groups})")
            _require(self.router_topk <= group_topk * (self.num_experts // groups),
                     f"MoEConfig.router_topk ({self.router_topk}) must be <= the experts of "
                     f"router_group_topk groups ({group_topk * (self.num_experts // groups)})")
        _bools(self, "router_expert_bias")
        _require(not self.router_expert_bias or self.router_score_function == "sigmoid",
                 "MoEConfig.router_expert_bias needs MoEConfig.router_score_function='sigmoid'")
        rate = self.router_bias_update_rate
        _require(isinstance(rate, (int, float)) and not isinstance(rate, bool) and math.isfinite(rate)
                 and rate >= 0,
                 f"MoEConfig.router_bias_update_rate must be a finite number >= 0, got {rate!r}")
        _require(rate == 0 or self.router_expert_bias,
                 "MoEConfig.router_bias_update_rate > 0 needs MoEConfig.router_expert_bias=True")

    def layer_pattern(self, num_layers: int) -> list[int]:
        """1 for each MoE layer, 0 for each dense one (``num_layers`` entries)."""
        if isinstance(self.layer_freq, int):
            return [int(i % self.layer_freq == 0) for i in range(num_layers)]
        return list(self.layer_freq)


def _validate_moe_layout(m: Any, p: Any) -> None:
    """MoE x parallel-layout rules (``ValueError`` naming the fields).

    ``m`` is a ``ModelConfig``, ``p`` a ``ParallelConfig`` (not annotated as such: ``config`` imports
    this module, so this module cannot import ``config``, not even for types)."""
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_size
    if m.moe is None:
        _require(ep == 1 and p.expert_tensor_parallel_size is None,
                 "ParallelConfig.expert_model_parallel_size / expert_tensor_parallel_size need "
                 "ModelConfig.moe (a dense model has no experts)")
        return
    moe = m.moe
    _require(moe.num_experts % ep == 0,
             f"MoEConfig.num_experts ({moe.num_experts}) must be divisible by "
             f"ParallelConfig.expert_model_parallel_size ({ep})")
    expert_ffn = moe.ffn_hidden_size or m.ffn_size
    _require(expert_ffn % etp == 0,
             f"MoEConfig.ffn_hidden_size ({expert_ffn}) must be divisible by "
             f"ParallelConfig.expert_tensor_parallel_size ({etp})")
    shared = moe.shared_expert_ffn_hidden_size
    _require(shared is None or shared % p.tensor_model_parallel_size == 0,
             f"MoEConfig.shared_expert_ffn_hidden_size ({shared}) must be divisible by "
             f"ParallelConfig.tensor_model_parallel_size ({p.tensor_model_parallel_size})")
    _require(moe.token_dispatcher != "allgather" or (ep == 1 and p.pipeline_model_parallel_size == 1),
             "MoEConfig.token_dispatcher='allgather' gathers equal token counts over the expert-parallel "
             "ranks; with ParallelConfig.expert_model_parallel_size > 1 or "
             "ParallelConfig.pipeline_model_parallel_size > 1 micro-batches differ in length: use 'alltoall'")
