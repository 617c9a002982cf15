"""mcore-engine as a verl 0.9.1 training engine (``BaseEngine``, backend ``"mcore_engine"``).

    import mcore_engine.integrations.verl   # registers the engines with verl's EngineRegistry
    # verl's trainer, every role: --config-path pkg://mcore_engine.integrations.verl_hydra
    #                             --config-name ppo_mcore_engine_trainer

``model_type="language_model"``: :class:`McoreEngineVerl` (the lm-head); ``"value_model"``:
:class:`McoreEngineVerlValue` (verl's critic, ``{"values": jagged [B, j]}``). The configs are mapped by
``verl_config.engine_config_from_verl``; the config classes live here, with the registration, so a
process that builds or unpickles one has the backend registered.

Batches go to the core as verl builds them (jagged ``input_ids`` ``[B, j]``, dense ``response_mask`` /
``loss_mask`` ``[B, R]``, per-sample fields, non-tensor flags) on its ``loss_convention="micro_batch"``.
verl's normalisation (:class:`~mcore_engine.integrations.verl_loss.VerlLossBridge`): each micro-batch
sees ``batch_num_tokens`` (the core's ``ctx.global_num_tokens``) and ``dp_size``; its loss ``L_i``
enters the core as ``L_i / dp_size``, since the core sums gradients over micro-batches and DP ranks
(verl's Megatron engine: ``L_i * num_micro_batch`` under Megatron's ``1 / num_micro_batch`` and DP mean).
Images (``multi_modal_inputs``) and verl's ``[4, L]`` mRoPE positions: ``verl_multimodal``.
MoE routing replay: ``verl_router_replay``. Offload, weight sync, checkpoints and LoRA: ``verl_state``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tensordict import TensorDict

try:
    from verl.utils import tensordict_utils as tu
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.config.engine import EngineConfig as _VerlEngineConfig
    from verl.workers.config.engine import McoreEngineConfig as _VerlMcoreEngineConfig
    from verl.workers.engine.base import BaseEngine, EngineRegistry
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("mcore_engine.integrations.verl needs verl: pip install --no-deps verl==0.9.1 "
                      "plus its light dependencies (`pip install -e '.[verl]' -c constraints.txt`)") from exc

from mcore_engine import MegatronEngine
from mcore_engine.integrations.verl_config import (
    BACKEND,
    NOT_APPLICABLE,
    _refuse,
    engine_config_from_verl,
    router_replay_mode,
)
from mcore_engine.integrations.verl_loss import VerlLossBridge, _topk_clamp, verl_results
from mcore_engine.integrations.verl_multimodal import prepare_multimodal
from mcore_engine.integrations.verl_router_replay import prepare_routing
from mcore_engine.integrations.verl_state import VerlEngineState

__all__ = ["BACKEND", "NOT_APPLICABLE", "McoreEngineActorConfig", "McoreEngineVerl", "McoreEngineVerlConfig",
           "McoreEngineVerlValue", "VerlLossBridge", "engine_config_from_verl"]


@dataclass
class McoreEngineVerlConfig(_VerlMcoreEngineConfig):
    """verl's ``McoreEngineConfig`` selecting this backend, plus ``logits_chunk_size`` (tokens per
    lm-head chunk; None: the ops' default); ``dtype`` may be ``"float32"``; ``sequence_parallel`` is
    off at TP = 1."""

    strategy: str = BACKEND
    dtype: str = "bfloat16"
    sequence_parallel: bool = True
    logits_chunk_size: int | None = None

    def __post_init__(self) -> None:
        _VerlEngineConfig.__post_init__(self)  # not verl's Megatron checks: strategy / bf16 only
        if self.strategy != BACKEND:
            raise ValueError(f"engine_config.strategy must be {BACKEND!r}, got {self.strategy!r}")
        if self.tensor_model_parallel_size == 1:
            self.sequence_parallel = False


@dataclass
class McoreEngineActorConfig(McoreActorConfig):
    """verl's Megatron actor config; its ``megatron:`` block a :class:`McoreEngineVerlConfig`."""

    strategy: str = BACKEND
    megatron: McoreEngineVerlConfig = field(default_factory=McoreEngineVerlConfig)


def _flag(data: TensorDict, key: str, default: Any = False) -> Any:
    return tu.get_non_tensor_data(data, key, default)


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cpu", "cuda"])
class McoreEngineVerl(VerlEngineState, BaseEngine):
    """verl ``BaseEngine`` on :class:`mcore_engine.MegatronEngine` (``engine``). Construction maps the
    configs and brings up the parallel state (``TrainingWorker`` asks for the DP rank before
    ``initialize``). Step outputs: verl's dict on the last pipeline stage, ``{}`` elsewhere.
    ``engine_config.forward_only`` (verl's reference policy) is the core's inference-only engine:
    training calls raise ``RuntimeError`` (the core's; ``train_mode`` here)."""

    head = "lm"  # the core ModelConfig.head this registration builds

    def __init__(self, model_config: Any, engine_config: Any, optimizer_config: Any,
                 checkpoint_config: Any = None) -> None:
        super().__init__()
        from mcore_engine.parallel.platform import init_distributed

        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.config = engine_config_from_verl(model_config, engine_config, optimizer_config,
                                              checkpoint_config)
        self.router_replay = router_replay_mode(engine_config)  # verl_router_replay's modes
        if self.config.model.head != self.head:
            model_type = getattr(model_config, "model_type", None)
            _refuse("model_config.model_type", model_type,
                    f"{type(self).__name__} builds model.head={self.head!r}; "
                    f"build it through EngineRegistry with model_type={model_type!r}")
        init_distributed(self.config.parallel, self.config.seed)  # verl asks for the DP rank first
        self.engine = MegatronEngine(self.config)
        self.mode = None
        self._saved: list[str] = []
        self._initialized = False

    # --- set-up
    def initialize(self) -> None:
        """Build the core engine, then offload what ``param_offload`` / ``optimizer_offload`` name; a
        second call (``TrainingWorker.reset``) builds a fresh one from the same configs."""
        if self._initialized:
            self.engine = MegatronEngine(self.config)
        self.engine.initialize()
        self._initialized = True
        param = self.is_param_offload_enabled
        self.engine.offload(params=param, grads=param, optimizer=self.is_optimizer_offload_enabled)

    @property
    def forward_only(self) -> bool:
        return self.config.forward_only

    def _refuse_if_forward_only(self, what: str) -> None:
        if self.forward_only:
            raise RuntimeError(f"{what}: engine_config.forward_only=True builds an inference-only engine "
                               "(verl's reference policy); build the engine without forward_only to train")

    # --- parallel layout
    def get_data_parallel_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    def get_data_parallel_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        from megatron.core import parallel_state as ps

        return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
                and ps.get_pipeline_model_parallel_rank() == ps.get_pipeline_model_parallel_world_size() - 1)

    # --- optimizer
    def optimizer_zero_grad(self) -> None:
        self.engine.zero_grad()

    def optimizer_step(self) -> float:
        """The core's step; returns the pre-clip grad norm (a non-finite one skips the update)."""
        return self.engine.optimizer_step()

    def lr_scheduler_step(self) -> float:
        return self.engine.lr_scheduler_step()

    # --- the step
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None,
                               forward_only: bool = False) -> dict[str, Any]:
        """verl's step on the core's ``loss_convention="micro_batch"`` (module docstring); a verl
        distillation loss's clamp becomes the flag ``distillation_log_prob_min_clamp``."""
        from megatron.core import parallel_state

        pad_mode = _flag(data, "pad_mode", None)
        if pad_mode is not None and str(getattr(pad_mode, "value", pad_mode)).lower() != "no_padding":
            raise ValueError(f"pad_mode={pad_mode!r}: only verl's no-padding batches are supported")
        fused = _flag(data, "use_fused_kernels", self.config.model.fused_lm_head)
        if bool(fused) != bool(self.config.model.fused_lm_head):
            raise ValueError(f"use_fused_kernels={fused!r} on the batch must match "
                             "engine_config.use_fused_kernels")
        prepare_multimodal(data)  # images and 3-D positions in the core's layout (verl_multimodal)
        clamp = _topk_clamp(loss_function)
        if clamp is not None:
            tu.assign_non_tensor(data, distillation_log_prob_min_clamp=clamp)
        routing = prepare_routing(data, self.router_replay, self.config.model, forward_only=forward_only,
                                  replay_enabled=_flag(data, "enable_routing_replay", None))
        bridge = None if loss_function is None else VerlLossBridge(loss_function,
                                                                    dp_group=self.get_data_parallel_group())
        out = self.engine.forward_backward_batch(routing.data, bridge, forward_only,
                                                 loss_convention="micro_batch")
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        results = verl_results(out, None if bridge is None else bridge.losses, keys=self.output_keys)
        routing.outputs(results["model_output"])
        return results

    output_keys: tuple[str, ...] | None = None  # the per-token outputs returned to verl (None: all)


@EngineRegistry.register(model_type="value_model", backend=BACKEND, device=["cpu", "cuda"])
class McoreEngineVerlValue(McoreEngineVerl):
    """verl's critic on the core's value head (``model.head="value"``): ``model_output`` is
    ``{"values": jagged [B, j]}`` in the layout of ``input_ids``, unshifted, as verl's critics return
    it."""

    head = "value"
    output_keys = ("values",)
