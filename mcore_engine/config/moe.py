"""``MoEConfig`` (``ModelConfig.moe``): mixture-of-experts layers, their checks against the model and
the layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_engine.config.checks import Block, is_int, require

__all__ = ["MoEConfig"]

_MOE_DISPATCHERS = ("alltoall", "allgather")
_MOE_AUX_LOSS_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "none")


@dataclass(kw_only=True)
class MoEConfig(Block):
    """Megatron-Core ``MoELayer`` (``TopKRouter``, token dispatcher, ``SequentialMLP`` / grouped-GEMM
    experts, optional shared expert). Routing of one token, router logits ``z = x W_r^T`` ``[E]``::

        s = softmax(z) (or sigmoid(z))
        ids = topk(s, k)
        w = s[ids] / s[ids].sum() unless router_pre_softmax    # (+ 1e-20 for sigmoid)
        y = sum_i w_i * scaling * expert_{ids_i}(x) (+ shared expert)

    HF ``norm_topk_prob`` is ``not router_pre_softmax`` (sigmoid scores too: ``layers.router``).
    """

    PATH = "model.moe"

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
    """The k weights not renormalised (see above); required for k = 1 with softmax scores."""
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
    """Grouped routing (DeepSeek-V3's ``n_group``): the E experts form this many equal groups."""
    router_group_topk: int | None = None
    """Groups a token may use (``topk_group``); a group scores the sum of its top-2 (bias-corrected)
    expert scores, whatever ``router_topk`` is (DeepSeek-V3's and ``transformers``' rule)."""
    router_expert_bias: bool = False
    """Aux-loss-free balancing (``e_score_correction_bias``): a per-expert bias ``[E]`` added to the
    scores for the top-k choice only; a buffer that loads, exports and checkpoints like a weight.
    Needs sigmoid scores."""
    router_bias_update_rate: float = 0.0
    """Per-step ``b += rate * sign(mean load - load)`` from the step's tokens per expert summed over
    the data-parallel ranks (Megatron's ``moe_router_bias_update_rate``); 0: the bias stays as loaded."""

    def __post_init__(self) -> None:
        self._ints("num_experts", "router_topk")
        self._ints("ffn_hidden_size", "shared_expert_ffn_hidden_size", optional=True)
        self._bools("shared_expert_gate", "router_pre_softmax", "pad_expert_input_to_capacity",
                    "grouped_gemm", "router_expert_bias")
        self._require(self.router_topk <= self.num_experts, f"MoEConfig.router_topk ({self.router_topk}) "
                      f"must be <= MoEConfig.num_experts ({self.num_experts})", "router_topk", "num_experts")
        freq = self.layer_freq
        self._require(is_int(freq, 1) or (isinstance(freq, list) and freq
                                          and all(is_int(v) and v in (0, 1) for v in freq)),
                      f"MoEConfig.layer_freq must be an int >= 1 or a list of 0/1 per layer, got {freq!r}",
                      "layer_freq")
        self._choice("router_score_function", ("softmax", "sigmoid"))
        self._require(not (self.router_topk == 1 and self.router_score_function == "softmax"
                           and not self.router_pre_softmax),
                      "MoEConfig.router_topk=1 with softmax scores needs MoEConfig.router_pre_softmax=True "
                      "(a softmax over one logit has no gradient)", "router_pre_softmax", "router_topk")
        self._numbers("router_topk_scaling_factor", strict=True, optional=True)
        self._choice("router_dtype", (None, "fp32", "fp64"))
        self._choice("aux_loss_type", _MOE_AUX_LOSS_TYPES)
        self._numbers("aux_loss_coeff")
        self._numbers("z_loss_coeff", optional=True)
        self._numbers("capacity_factor", strict=True, optional=True)
        self._require(not self.pad_expert_input_to_capacity or self.capacity_factor is not None,
                      "MoEConfig.pad_expert_input_to_capacity needs MoEConfig.capacity_factor",
                      "pad_expert_input_to_capacity", "capacity_factor")
        self._choice("token_drop_policy", ("probs", "position"))
        self._choice("token_dispatcher", _MOE_DISPATCHERS)
        self._require(not self.shared_expert_gate or self.shared_expert_ffn_hidden_size is not None,
                      "MoEConfig.shared_expert_gate needs MoEConfig.shared_expert_ffn_hidden_size",
                      "shared_expert_gate", "shared_expert_ffn_hidden_size")
        self._check_routing_groups()

    def _check_routing_groups(self) -> None:
        groups, group_topk, e = self.router_num_groups, self.router_group_topk, self.num_experts
        self._require((groups is None) == (group_topk is None), "MoEConfig.router_num_groups and "
                      "MoEConfig.router_group_topk are set together", "router_num_groups",
                      "router_group_topk")
        if groups is not None:
            self._ints("router_num_groups", "router_group_topk")
            self._require(e % groups == 0 and e // groups >= 2, f"MoEConfig.router_num_groups ({groups}) "
                          f"must divide MoEConfig.num_experts ({e}) into groups of at least 2 experts",
                          "router_num_groups", "num_experts")
            self._require(group_topk <= groups, f"MoEConfig.router_group_topk ({group_topk}) must be <= "
                          f"MoEConfig.router_num_groups ({groups})", "router_group_topk", "router_num_groups")
            self._require(self.router_topk <= group_topk * (e // groups),
                          f"MoEConfig.router_topk ({self.router_topk}) must be <= the experts of "
                          f"router_group_topk groups ({group_topk * (e // groups)})",
                          "router_topk", "router_group_topk")
        self._require(not self.router_expert_bias or self.router_score_function == "sigmoid",
                      "MoEConfig.router_expert_bias needs MoEConfig.router_score_function='sigmoid'",
                      "router_expert_bias", "router_score_function")
        self._numbers("router_bias_update_rate")
        self._require(self.router_bias_update_rate == 0 or self.router_expert_bias,
                      "MoEConfig.router_bias_update_rate > 0 needs MoEConfig.router_expert_bias=True",
                      "router_bias_update_rate", "router_expert_bias")

    def layer_pattern(self, num_layers: int) -> list[int]:
        """1 for each MoE layer, 0 for each dense one (``num_layers`` entries)."""
        if isinstance(self.layer_freq, int):
            return [int(i % self.layer_freq == 0) for i in range(num_layers)]
        return list(self.layer_freq)

    def check(self, model: Any, parallel: Any) -> None:
        """The per-layer pattern against ``num_layers``; experts against EP / ETP / TP / PP."""
        if isinstance(self.layer_freq, list):
            require(len(self.layer_freq) == model.num_layers, f"MoEConfig.layer_freq has "
                    f"{len(self.layer_freq)} entries, ModelConfig.num_layers is {model.num_layers}",
                    "model.moe.layer_freq", "model.num_layers")
        if parallel is None:
            return
        ep, etp, tp = parallel.expert_model_parallel_size, parallel.expert_tensor_size, \
            parallel.tensor_model_parallel_size
        require(self.num_experts % ep == 0, f"MoEConfig.num_experts ({self.num_experts}) must be divisible "
                f"by ParallelConfig.expert_model_parallel_size ({ep})",
                "parallel.expert_model_parallel_size", "model.moe.num_experts")
        ffn = self.ffn_hidden_size or model.ffn_size
        require(ffn % etp == 0, f"MoEConfig.ffn_hidden_size ({ffn}) must be divisible by "
                f"ParallelConfig.expert_tensor_parallel_size ({etp})",
                "parallel.expert_tensor_parallel_size", "model.moe.ffn_hidden_size")
        require(not getattr(model, "add_bias_linear", False) or etp == 1, "ModelConfig.add_bias_linear: "
                f"Megatron-Core's expert biases need ParallelConfig.expert_tensor_parallel_size 1, got {etp} "
                "(set it to 1 at TP > 1)", "parallel.expert_tensor_parallel_size", "model.add_bias_linear")
        shared = self.shared_expert_ffn_hidden_size
        require(shared is None or shared % tp == 0, f"MoEConfig.shared_expert_ffn_hidden_size ({shared}) "
                f"must be divisible by ParallelConfig.tensor_model_parallel_size ({tp})",
                "parallel.tensor_model_parallel_size", "model.moe.shared_expert_ffn_hidden_size")
        pp = parallel.pipeline_model_parallel_size
        require(self.token_dispatcher != "allgather" or (ep == 1 and pp == 1),
                "MoEConfig.token_dispatcher='allgather' gathers equal token counts over the expert-parallel "
                "ranks; with ParallelConfig.expert_model_parallel_size > 1 or "
                "ParallelConfig.pipeline_model_parallel_size > 1 micro-batches differ in length: use "
                "'alltoall'",
                "model.moe.token_dispatcher", "parallel.expert_model_parallel_size",
                "parallel.pipeline_model_parallel_size")
