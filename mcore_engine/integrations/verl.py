"""mcore-engine as a verl training engine (verl 0.9.1 ``BaseEngine``, backend ``"mcore_engine"``).

    import mcore_engine.integrations.verl   # registers the engines with verl's EngineRegistry
    # verl config: actor.strategy=mcore_engine, its engine block a McoreEngineVerlConfig; for verl's
    # trainer, every role at once: --config-path pkg://mcore_engine.integrations.verl_hydra
    #                              --config-name ppo_mcore_engine_trainer

Two registrations: ``model_type="language_model"`` (:class:`McoreEngineVerl`, the lm-head) and
``"value_model"`` (:class:`McoreEngineVerlValue`, the core's value head: verl's critic, outputs
``{"values": jagged [B, j]}``). ``engine_config.forward_only`` (a reference policy) is the core's
``EngineConfig.forward_only``: an engine that only infers, without grad buffers or optimizer.

verl's ``TrainingWorker`` builds :class:`McoreEngineVerl` from ``model_config`` (``HFModelConfig``),
``engine_config`` (:class:`McoreEngineVerlConfig`: verl's Megatron engine fields), ``optimizer_config``
and ``checkpoint_config``. :func:`engine_config_from_verl` maps every field with a meaning here onto
an :class:`mcore_engine.EngineConfig` and raises ``ValueError`` naming the field for every setting the
engine cannot honour; the fields in :data:`NOT_APPLICABLE` have no meaning for this engine. The
config classes live here, beside the registration: whatever process builds or unpickles one (verl's
workers instantiate the actor's and the reference's from ``_target_``; the critic's arrives pickled
from the driver) has the backend registered, so the packaged Hydra config is the only switch.
Expert-parallel sizes go to ``ParallelConfig``, whose layout checks (a dense model has no experts)
reach the user naming both the verl and the core field.

Offload as verl's Megatron engine: with ``param_offload`` the parameters and grad buffers, with
``optimizer_offload`` the optimizer state, live in host memory (``engine.offload``: device storage
resized to 0) except inside ``train_mode()`` (all of them onloaded) and ``eval_mode()`` (parameters
only); ``to(device, model, optimizer, grad)`` moves parts by hand. Checkpoints are the core's
reshardable ``torch_dist`` folders, one per ``save_checkpoint`` call, loadable at another layout.

LoRA (``model_config.lora.rank > 0`` or ``lora_rank > 0``: ``verl_config.lora_from_verl``) is the core's
``ModelConfig.lora`` on a frozen base. verl's trainer then computes the reference log-probs on the
actor (``ref_in_actor``, batch flag ``no_lora_adapter``) inside :meth:`McoreEngineVerl.disable_adapter`
(the core's ``adapters_disabled()``), and its weight sync follows ``model_config.lora.merge``
(:meth:`McoreEngineVerl.get_per_tensor_param`): merged weights, or the base once and then the adapters
in PEFT key names with a PEFT config.

Batches arrive as verl builds them (``left_right_2_no_padding``): jagged ``input_ids`` /
``position_ids`` ``[B, j]``, dense ``response_mask`` / ``loss_mask`` ``[B, R]``, dense per-sample
fields (``prompts``, ``responses``, ``old_log_probs``, ``advantages`` ...), non-tensor flags; they go
to the core as they are, on its ``loss_convention="micro_batch"`` (the core derives the next-token
loss mask from the dense response mask and hands verl's loss its own micro-batch rows and jagged
outputs). :class:`VerlLossBridge` keeps verl's normalisation: ``batch_num_tokens`` (``loss_mask``
summed over the data-parallel group) and ``dp_size`` are set on the batch before the step, and since
the core sums gradients over micro-batches and DP ranks without averaging, each micro-batch's verl
loss ``L_i`` enters the core as ``L_i / dp_size`` (verl's Megatron engine gets the same gradient from
``L_i * num_micro_batch`` under Megatron's ``1 / num_micro_batch`` and DP averaging).

MoE: ``engine_config.router_replay.mode`` (verl's ``"disabled"`` / ``"R2"`` / ``"R3"``) decides per
pass whether the batch's ``routed_experts`` reach the core's router replay and whether the recorded
routing goes back to verl (:mod:`mcore_engine.integrations.verl_router_replay`: R2 records at the
actor's old-log-prob pass and replays in the update, R3 replays the rollout's routing in every actor
pass; without replay no routing is returned, so verl's trainer never replays one by accident). verl's
worker sets its ``enable_routing_replay`` flag for its own engines only, so the mode is read here from
the engine's config (an explicit ``enable_routing_replay=False`` on a batch still turns replay off).
``override_transformer_config.moe_router_bias_update_rate`` is the core's expert-bias update rate and
verl's ``model_config.mtp`` the core's MTP modules (``verl_config``).

Top-k distillation runs the core's built-in chunked top-k forward KL (``mcore_engine.ops``) instead of
calling verl's loss as a logits processor; ``log_prob_min_clamp`` of a ``functools.partial`` of
verl's ``distillation_ppo_loss`` (its ``distillation_config.distillation_loss``) becomes the batch
flag ``distillation_log_prob_min_clamp``.
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


# --- the config classes that select the backend: here, with the registration, so a process that
# unpickles one (verl sends the critic's config pickled to its workers) registers the engines
@dataclass
class McoreEngineVerlConfig(_VerlMcoreEngineConfig):
    """verl's Megatron engine config, selecting this backend (``strategy="mcore_engine"``).

    Same fields and YAML keys as verl's ``McoreEngineConfig`` (``tensor_model_parallel_size`` ...),
    plus ``logits_chunk_size`` (tokens per chunk of the lm-head pass; None: the ops' default).
    ``dtype`` may also be ``"float32"``; ``sequence_parallel`` defaults to True like verl's (off at
    TP=1), on CPU and GPU."""

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
    """verl's Megatron actor config with ``strategy="mcore_engine"`` and the engine block
    (``megatron:``) a :class:`McoreEngineVerlConfig`."""

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
    """verl's train / eval context: onload on entry and offload on exit what the offload flags name
    (eval: the parameters; train: parameters + grad buffers and the optimizer state), module modes;
    the train context zeroes gradients on exit (moves by :meth:`McoreEngineVerl.onload_parts` /
    ``offload_parts``)."""

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
    """verl ``BaseEngine`` on :class:`mcore_engine.MegatronEngine` (attribute ``engine``).

    Construction maps the configs (``ValueError`` for what cannot be honoured) and brings up the
    parallel state, since ``TrainingWorker`` asks for the data-parallel rank before ``initialize``.
    Outputs of ``forward_backward_batch`` / ``train_batch`` / ``infer_batch`` are verl's dict on the
    last pipeline stage and ``{}`` on the other stages (verl's Megatron engine's contract).

    ``engine_config.forward_only`` (verl's reference policy): the core's inference-only engine (no
    grad buffers, optimizer or scheduler). ``train_mode``, ``train_batch`` and
    ``forward_backward_batch(forward_only=False)`` raise ``RuntimeError`` naming ``forward_only``
    here, the optimizer calls in the core; checkpoints save the model only and load the model
    part of any checkpoint (a reference policy from the actor's).
    """

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
        """Build model, optimizer and scheduler (HF weights from ``model_config.path``), then offload
        what ``param_offload`` / ``optimizer_offload`` name (verl's Megatron engine); a second call
        (``TrainingWorker.reset``) builds a fresh engine from the same configs."""
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
        """verl's manual load / offload, whatever the offload flags: ``"cpu"`` offloads the named
        parts to host memory (``model`` releases the parameters and the grad buffers, as verl's
        Megatron engine does; on a CPU host too); ``"device"``, verl's device name
        (``verl.utils.device.get_device_name()``: ``"cuda"`` on a CPU-only host as well, which is what
        ``TrainingWorker.to("device")`` passes) and the engine's own device (``"cuda"``, ``"cuda:0"``)
        onload them to the engine's device (the grad buffers only with ``grad``). ``grad`` needs
        ``model``. A ``forward_only`` engine has only the parameters to move."""
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
        """``to("cpu", ...)``: parameters and grad buffers with ``model``, optimizer state with
        ``optimizer`` (``engine.offload``: host copy, device storage resized to 0)."""
        self.engine.offload(params=model, grads=model, optimizer=optimizer)

    def onload_parts(self, model: bool, optimizer: bool, grad: bool = True) -> None:
        """``to(device, ...)``: parameters with ``model``, grad buffers with ``model and grad``,
        optimizer state with ``optimizer``, bit-identical (``engine.onload``)."""
        self.engine.onload(params=model, grads=model and grad, optimizer=optimizer)

    def _reoffload(self, before: frozenset[str], *, optimizer: bool) -> None:
        """After a checkpoint call: offload what was offloaded before, and what verl's Megatron engine
        offloads after it (parameters + grads with ``param_offload``; the optimizer state with
        ``optimizer_offload`` when ``optimizer``)."""
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
        """The core's step: ``empty_cache()`` first iff the last pass with gradients ran top-k
        distillation; returns the pre-clip grad norm (a non-finite one skips the update)."""
        return self.engine.optimizer_step()

    def lr_scheduler_step(self) -> float:
        return self.engine.lr_scheduler_step()

    # --- the step
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None,
                               forward_only: bool = False) -> dict[str, Any]:
        """verl's semantics on the core's ``loss_convention="micro_batch"`` (module docstring): sets
        ``batch_num_tokens``, ``dp_size`` and ``sp_size`` (and ``distillation_log_prob_min_clamp``
        from a verl distillation loss) on ``data``, hands ``data`` itself to the core, returns
        verl's result dict on the last pipeline stage."""
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
        """verl's reference policy from the actor (``ref_in_actor``: the trainer sets ``no_lora_adapter``
        on the batch, ``TrainingWorker.infer_batch`` runs the engine inside this context): the core's
        ``adapters_disabled()``, every LoRA linear computing its frozen base only; without LoRA a no-op
        (verl's ``BaseEngine``)."""
        if self.config.model.lora is None:
            return contextlib.nullcontext()
        return self.engine.adapters_disabled()

    def peft_config(self) -> dict[str, Any] | None:
        """The PEFT config verl hands the rollout with adapter-only syncs
        (``BaseEngine.get_per_tensor_param``): ``peft_type`` / ``task_type`` as PEFT's enums, ``r``,
        ``lora_alpha``, ``target_modules`` (the adapted projections' Hugging Face names),
        ``lora_dropout``, ``bias``; None without LoRA."""
        lora = self.config.model.lora
        if lora is None:
            return None
        from peft import PeftType, TaskType

        return {"task_type": TaskType.CAUSAL_LM, "peft_type": PeftType.LORA, "r": lora.rank,
                "lora_alpha": lora.alpha, "target_modules": lora.hf_target_modules(self.config.model.swiglu),
                "bias": "none", "lora_dropout": lora.dropout}

    # --- weights and checkpoints
    def get_per_tensor_param(self, base_sync_done: bool = False, **kwargs) -> tuple[
            Generator[tuple[str, torch.Tensor], None, None], dict[str, Any] | None]:
        """verl's weight sync (``ActorRolloutRefWorker.update_weights``): ``(generator of (name, full
        tensor), peft_config)``, as verl's Megatron engine:

        - no LoRA, or LoRA with ``model_config.lora.merge=True``: the whole model in Hugging Face names
          (with LoRA the merged ``W + scaling B A``), ``peft_config`` None;
        - LoRA with ``merge=False`` (verl's default): with ``base_sync_done`` the adapters only, in PEFT
          key names (``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight``), else the
          frozen base in Hugging Face names (verl sends it once, when the rollout started from dummy
          weights); either with :meth:`peft_config`.

        ``layered_summon`` (FSDP's gather mode) has no meaning here: the tensors are gathered one at a
        time anyway. Onloads the parameters and leaves them onloaded (verl's worker offloads them after
        the weight sync when ``param_offload``). No tensor shares storage with a parameter. Collective
        over TP / PP: every rank consumes the generator to the end."""
        self.engine.onload(params=True, grads=False, optimizer=False)
        if self.config.model.lora is None or lora_merge(self.model_config):
            return self.engine.per_tensor_generator(), None
        if base_sync_done:
            return self.engine.per_tensor_generator(adapter_only=True), self.peft_config()
        from mcore_engine.hf.export import iter_hf_tensors

        return iter_hf_tensors(self.engine.model, self.config), self.peft_config()  # no merge overrides

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **kwargs) -> None:
        """Collective: the core checkpoint (``torch_dist``, reshardable) in folder ``local_path`` (+ an
        HF folder ``local_path/huggingface`` when ``checkpoint_config.save_contents`` holds
        ``hf_model``; with LoRA the merged weights there and the PEFT adapter folder in
        ``huggingface/adapter``, verl's Megatron layout). With LoRA the checkpoint holds the adapters
        and their optimizer state only. Offloaded parameters / optimizer state are onloaded for the
        write and offloaded again. Retention as verl's checkpoint managers: of the folders this engine
        saved, the oldest are deleted before the write so that ``max_ckpt_to_keep - 1`` remain (when it
        is > 1), and after it so that ``max_ckpt_to_keep`` remain. ``hdfs_path`` is refused; under
        ``forward_only`` the model only is saved."""
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
        """Collective: restore what :meth:`save_checkpoint` wrote, at this engine's TP / PP / DP layout
        (the core reshards). Offloaded parts are onloaded for the read; afterwards what
        ``param_offload`` / ``optimizer_offload`` name is offloaded (verl's Megatron engine), and what
        was offloaded before. A local checkpoint is never deleted (verl deletes only downloaded
        copies); ``hdfs_path`` is refused. Under ``forward_only`` the model part of any checkpoint
        (the actor's, for a reference policy) is loaded."""
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
    """verl's critic (``model_type="value_model"``) on the core's value head (``model.head="value"``:
    the trunk of ``model_config.path`` with a replicated ``Linear(H, 1)``, freshly initialised from
    the seed for a causal-LM folder, loaded from a ``*ForTokenClassification`` folder).

    ``model_output`` is ``{"values": jagged [B, j]}`` in the layout of ``input_ids``, unshifted (the
    value after each token), as verl's Megatron and FSDP critics return it: verl's ``value_loss`` and
    ``_compute_values`` read the response part with ``no_padding_2_padding`` (positions
    ``P_i - 1 .. P_i + R_i - 2``). The lm-head settings (``use_fused_kernels``, ``logits_chunk_size``)
    are refused by name; so are the batch flags that need a vocabulary (``calculate_entropy``,
    top-k distillation)."""

    head = "value"
    output_keys = ("values",)
