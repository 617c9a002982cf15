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
MoE routing replay: ``verl_router_replay``. Offload, weight sync, checkpoints and LoRA: ``verl_state``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

try:
    from verl.utils import tensordict_utils as tu
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.config.engine import EngineConfig as _VerlEngineConfig
    from verl.workers.config.engine import McoreEngineConfig as _VerlMcoreEngineConfig
    from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("mcore_engine.integrations.verl needs verl: pip install --no-deps verl==0.9.1 "
                      "plus its light dependencies (`pip install -e '.[verl]' -c constraints.txt`)") from exc

from mcore_engine import MegatronEngine
from mcore_engine.integrations.verl_config import (
    BACKEND,
    NOT_APPLICABLE,
    _refuse,
    engine_config_from_verl,
    lora_merge,
    router_replay_mode,
)
from mcore_engine.integrations.verl_loss import VerlLossBridge, _topk_clamp, verl_results
from mcore_engine.integrations.verl_router_replay import prepare_routing

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


def _device_type(device: str) -> str | None:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return None


def _flag(data: TensorDict, key: str, default: Any = False) -> Any:
    return tu.get_non_tensor_data(data, key, default)


# ------------------------------------------------------------------------------------------- engine
class _ModeCtx(BaseEngineCtx):
    """verl's train / eval context: onload on entry, offload on exit what the offload flags name (eval:
    parameters; train: parameters, grad buffers, optimizer state); train zeroes gradients on exit."""

    def _switch(self, onload: bool) -> None:
        engine = self.engine
        param, optim = engine.is_param_offload_enabled, engine.is_optimizer_offload_enabled
        if self.disable_auto_offload or not (param or optim):
            return
        train = self.mode == "train"
        move = engine.onload_parts if onload else engine.offload_parts
        move(model=param, optimizer=train and optim, grad=train and param)

    def __enter__(self):
        if self.mode == "train":
            self.engine._refuse_if_forward_only("train_mode()")
        self.engine.mode = self.mode
        self._switch(onload=True)
        for chunk in self.engine.engine.model:
            chunk.train(self.mode == "train")

    def __exit__(self, exc_type, exc_value, traceback):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None):
            self.engine.optimizer_zero_grad()
        self._switch(onload=False)
        self.engine.mode = None


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cpu", "cuda"])
class McoreEngineVerl(BaseEngine):
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

    # --- set-up and modes
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

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(getattr(self.engine_config, "param_offload", False))

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(getattr(self.engine_config, "optimizer_offload", False))

    def train_mode(self, **kwargs):
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs):
        return _ModeCtx(self, "eval", **kwargs)

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """verl's manual move: ``"cpu"`` offloads the named parts (``model``: parameters and grad
        buffers); ``"device"``, verl's device name (``"cuda"`` even on a CPU host) or the engine's own
        device onload them (grad buffers only with ``grad``)."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        from verl.utils.device import get_device_name

        from mcore_engine.parallel.platform import get_device

        own = get_device().type
        if device == "cpu":
            self.offload_parts(model=model, optimizer=optimizer, grad=grad)
        elif device in ("device", get_device_name()) or _device_type(device) == own:
            self.onload_parts(model=model, optimizer=optimizer, grad=grad)
        else:
            onload = sorted({"device", get_device_name(), own} - {"cpu"})
            raise ValueError(f"McoreEngineVerl.to: device={device!r}; expected 'cpu' (offload to host "
                             f"memory) or one of {onload} (onload to the engine's device {own!r})")

    def offload_parts(self, model: bool, optimizer: bool, grad: bool = True) -> None:
        """Parameters and grad buffers with ``model``, optimizer state with ``optimizer``."""
        self.engine.offload(params=model, grads=model, optimizer=optimizer)

    def onload_parts(self, model: bool, optimizer: bool, grad: bool = True) -> None:
        """Parameters with ``model``, grad buffers with ``model and grad``, optimizer state with
        ``optimizer``, bit-identical."""
        self.engine.onload(params=model, grads=model and grad, optimizer=optimizer)

    def _reoffload(self, before: frozenset[str], *, optimizer: bool) -> None:
        """After a checkpoint call: offload what was offloaded before and what the offload flags name
        (the optimizer state only when ``optimizer``), as verl's Megatron engine."""
        param, optim = self.is_param_offload_enabled, optimizer and self.is_optimizer_offload_enabled
        self.engine.offload(params=param or "params" in before, grads=param or "grads" in before,
                            optimizer=optim or "optimizer" in before)

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

    # --- LoRA
    def disable_adapter(self) -> contextlib.AbstractContextManager:
        """verl's ``ref_in_actor`` (batch flag ``no_lora_adapter``): the core's ``adapters_disabled()``,
        the frozen base alone; without LoRA a no-op."""
        if self.config.model.lora is None:
            return contextlib.nullcontext()
        return self.engine.adapters_disabled()

    def peft_config(self) -> dict[str, Any] | None:
        """The PEFT config of the adapter syncs (``hf.peft.peft_config``, types as PEFT's enums);
        None without LoRA."""
        lora = self.config.model.lora
        if lora is None:
            return None
        from peft import PeftType, TaskType

        from mcore_engine.hf.peft import peft_config

        config = peft_config(lora, swiglu=self.config.model.swiglu)
        return config | {"peft_type": PeftType(config["peft_type"]),
                         "task_type": TaskType(config["task_type"])}

    # --- weights and checkpoints
    def get_per_tensor_param(self, base_sync_done: bool = False, **kwargs) -> tuple[
            Generator[tuple[str, torch.Tensor], None, None], dict[str, Any] | None]:
        """verl's weight sync: ``(generator of (name, full tensor), peft_config)``. Without LoRA or with
        ``model_config.lora.merge``: the whole model in HF names (merged ``W + scaling B A``), None;
        else with ``base_sync_done`` the adapters in PEFT key names, without it the frozen base in HF
        names, each with :meth:`peft_config`. Leaves the parameters onloaded. Collective over TP / PP:
        every rank consumes the generator to the end."""
        self.engine.onload(params=True, grads=False, optimizer=False)
        if self.config.model.lora is None or lora_merge(self.model_config):
            return self.engine.per_tensor_generator(), None
        if base_sync_done:
            return self.engine.per_tensor_generator(adapter_only=True), self.peft_config()
        from mcore_engine.hf.export import iter_hf_tensors

        return iter_hf_tensors(self.engine.model, self.config), self.peft_config()  # no merge overrides

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **kwargs) -> None:
        """Collective: the core's reshardable checkpoint in ``local_path`` (+ ``huggingface/`` with
        ``save_contents`` ``hf_model``; with LoRA the merged model there and the PEFT folder in
        ``huggingface/adapter``). Retention as verl's checkpoint managers: the oldest folders this
        engine saved go so that ``max_ckpt_to_keep - 1`` remain before the write (when > 1) and
        ``max_ckpt_to_keep`` after it. ``hdfs_path`` is refused."""
        if hdfs_path is not None:
            _refuse("hdfs_path", hdfs_path, "no HDFS client; save to a shared local path")
        path = os.path.abspath(local_path)
        self._saved = [p for p in self._saved if p != path]
        keep = max_ckpt_to_keep if isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep > 0 else None
        if keep is not None and keep > 1 and len(self._saved) >= keep:
            self._prune(len(self._saved) - keep + 1)
        before = self.engine.offloaded
        self.engine.onload(params=True, grads=False, optimizer=True)
        try:
            self.engine.save_checkpoint(path)
            contents = getattr(self.checkpoint_config, "save_contents", None) or ()
            if "hf_model" in contents:
                self.engine.export_hf(os.path.join(path, "huggingface"))
                if self.config.model.lora is not None:  # verl's Megatron layout: huggingface/adapter
                    self.engine.export_adapter(os.path.join(path, "huggingface", "adapter"))
        finally:
            self._reoffload(before, optimizer=False)
        self._saved.append(path)
        if keep is not None and len(self._saved) > keep:
            self._prune(len(self._saved) - keep)
        dist.barrier()

    def _prune(self, count: int) -> None:
        """Delete the ``count`` oldest folders this engine saved (rank 0 deletes)."""
        old, self._saved = self._saved[:count], self._saved[count:]
        if dist.get_rank() == 0:
            for p in old:
                shutil.rmtree(p, ignore_errors=True)

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None,
                        del_local_after_load: bool = True, **kwargs) -> None:
        """Collective: restore a :meth:`save_checkpoint` folder at this layout (the core reshards; a
        ``forward_only`` engine loads the model part of an actor's). Never deletes a local checkpoint;
        ``hdfs_path`` is refused."""
        if hdfs_path is not None:
            _refuse("hdfs_path", hdfs_path, "no HDFS client; load from a shared local path")
        before = self.engine.offloaded
        self.engine.onload(params=True, grads=False, optimizer=True)
        try:
            self.engine.load_checkpoint(local_path)
        finally:
            self._reoffload(before, optimizer=True)


@EngineRegistry.register(model_type="value_model", backend=BACKEND, device=["cpu", "cuda"])
class McoreEngineVerlValue(McoreEngineVerl):
    """verl's critic on the core's value head (``model.head="value"``): ``model_output`` is
    ``{"values": jagged [B, j]}`` in the layout of ``input_ids``, unshifted, as verl's critics return
    it."""

    head = "value"
    output_keys = ("values",)
