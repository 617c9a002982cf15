"""MegatronEngine: Megatron-Core GPT training and inference on TensorDict batches (TP / PP / CP / DP).

A facade: each public method checks the engine's state and delegates. One ``train_batch``::

    step = prepare_pass(batch)            # flags, validation, micro-batches, packing, global counts
    zero_grad()                           # after every DP rank accepted the batch
    run_schedule(step)                    # Megatron's schedule; outputs, loss, metrics on every rank
    optimizer_step()                      # clip; step, or skip on non-finite gradients

Set-up: ``model/wrap.py``; the step: ``step/`` (layout, prepare, schedule, lm_head, optimizer);
state: ``state/`` (in-memory state, checkpoints, offload, adapters).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict, TensorDictBase

from mcore_engine.config import EngineConfig
from mcore_engine.hf import load_hf_weights
from mcore_engine.layers.lora import adapters_disabled
from mcore_engine.model.build import build_model_chunks
from mcore_engine.model.moe import MoERuntime
from mcore_engine.model.wrap import wrap_model
from mcore_engine.parallel.platform import apply_cpu_device_layer, get_device, init_distributed
from mcore_engine.processor import process_lm_head_logits
from mcore_engine.state.adapters import attach_lora
from mcore_engine.state.checkpoint import load_engine_checkpoint, save_engine_checkpoint
from mcore_engine.state.engine_state import (
    capture_state,
    check_state,
    restore_state,
    rng_state,
    set_rng_state,
)
from mcore_engine.state.offload import HostOffloader
from mcore_engine.state.weights import (
    require_lora,
    weight_buckets,
    weight_tensors,
    write_adapter_folder,
    write_hf_folder,
)
from mcore_engine.step.layout import StepLayout, step_layout
from mcore_engine.step.loss_guard import LossGuard
from mcore_engine.step.optimizer import build_optimizer, build_scheduler, step_optimizer
from mcore_engine.step.prepare import PreparedStep
from mcore_engine.step.schedule import LossFunction, Pass, eval_mode, prepare_pass, run_schedule
from mcore_engine.weight_sync import BucketMeta

__all__ = ["MegatronEngine"]


def _parts(params: bool, grads: bool, optimizer: bool) -> list[str]:
    return [name for name, on in (("params", params), ("grads", grads), ("optimizer", optimizer)) if on]


class MegatronEngine:
    """Megatron-Core GPT policy engine. After ``initialize()``: ``model`` (DDP-wrapped ``GPTModel``
    chunks, one per virtual pipeline stage), ``optimizer``, ``lr_scheduler``, ``global_step`` (applied
    updates), ``num_skipped_steps``. With ``config.forward_only`` the chunks wrap the ``GPTModel``
    without DDP (``.module``) and ``optimizer`` / ``lr_scheduler`` stay ``None``."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model: list[torch.nn.Module] = []
        self.optimizer = None
        self.lr_scheduler = None
        self.global_step = 0
        self.num_skipped_steps = 0
        self._last_distillation_use_topk = False
        self._grads_pending = False  # a backward pass since the last zero_grad
        self._offloader: HostOffloader | None = None
        self._moe: MoERuntime | None = None
        self._layout: StepLayout | None = None

    # ------------------------------------------------------------------ set-up
    def initialize(self) -> None:
        """Bring up distributed state, build the DDP-wrapped model chunks (from ``model.hf_path``
        when set), the optimizer and scheduler; with ``forward_only`` the chunks alone (no grad
        buffers: memory is the parameters). Config errors raise before any process-group work."""
        cfg = self.config
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        cfg.validate_world_size(world)
        apply_cpu_device_layer()
        init_distributed(cfg.parallel, cfg.seed)

        chunks = build_model_chunks(cfg)
        if cfg.model.hf_path is not None:  # before the DDP wrap and the optimizer's main-weight copies
            load_hf_weights(chunks, cfg.model.hf_path, cfg)
        if cfg.model.lora is not None:  # frozen base (no grad buffer, no optimizer state) + adapters
            attach_lora(chunks, cfg)
        self._moe = MoERuntime(chunks, cfg) if cfg.model.moe is not None else None
        self.model = wrap_model(chunks, cfg)
        if not cfg.forward_only:
            self.optimizer = build_optimizer(cfg, self.model)
            self.lr_scheduler = build_scheduler(cfg, self.optimizer)
        self._offloader = HostOffloader(self.model, self.optimizer)
        self._layout = step_layout(cfg)

    def _require_initialized(self) -> None:
        if self.optimizer is None and not self.model:  # a forward_only engine has no optimizer
            raise RuntimeError("MegatronEngine.initialize() must be called first")

    def _require_training(self, what: str) -> None:
        """``RuntimeError`` for a training call on a ``forward_only`` engine."""
        self._require_initialized()
        if self.config.forward_only:
            raise RuntimeError(f"{what}: the engine was built with EngineConfig.forward_only=True "
                               "(inference only: no grad buffers, optimizer or scheduler); build it "
                               "with forward_only=False to train")

    def _require_onloaded(self, what: str, *parts: str) -> None:
        """``RuntimeError`` before ``initialize()`` or while one of ``parts`` is offloaded."""
        self._require_initialized()
        offloader = getattr(self, "_offloader", None)  # None on a bare engine (tests)
        if offloader is not None:
            offloader.require(what, parts)

    # ------------------------------------------------------------------ offload / onload
    @property
    def offloaded(self) -> frozenset[str]:
        """The parts (``"params"``, ``"grads"``, ``"optimizer"``) held in host memory now."""
        offloader = getattr(self, "_offloader", None)
        return offloader.offloaded if offloader is not None else frozenset()

    def offload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Move the chosen parts to host memory (pinned on CUDA), freeing their device storage; local
        to this rank. Until :meth:`onload`, calls that need an offloaded part raise ``RuntimeError``.
        A ``forward_only`` engine has the parameters only."""
        self._require_initialized()
        self._offloader.offload(_parts(params, grads, optimizer))

    def onload(self, params: bool = True, grads: bool = True, optimizer: bool = True) -> None:
        """Bring the chosen offloaded parts back to the device, bit-identical."""
        self._require_initialized()
        self._offloader.onload(_parts(params, grads, optimizer))

    # ------------------------------------------------------------------ logits -> per-token outputs
    def _lm_head_logits_processor(self, logits: torch.Tensor, label: torch.Tensor | None, temperature, *,
                                  calculate_sum_pi_squared: bool, calculate_entropy: bool,
                                  distillation_use_topk: bool, distillation_only: bool,
                                  logits_processor_func: Callable | None = None, batch: Any = None,
                                  data_format: str = "thd", log_prob_min_clamp: float | None = None
                                  ) -> dict[str, torch.Tensor]:
        """``process_lm_head_logits`` over the true vocab size (padded ids get no mass)."""
        return process_lm_head_logits(
            logits, label, temperature, calculate_sum_pi_squared=calculate_sum_pi_squared,
            calculate_entropy=calculate_entropy, distillation_use_topk=distillation_use_topk,
            distillation_only=distillation_only, logits_processor_func=logits_processor_func,
            batch=batch, data_format=data_format, log_prob_min_clamp=log_prob_min_clamp,
            vocab_size=self.config.model.vocab_size,
            chunk_size=self.config.logits_chunk_size)

    # ------------------------------------------------------------------ one pass of the schedule
    def _prepare(self, batch: TensorDictBase, logits_processor_func: Callable | None,
                 logits_func: Callable | None = None, loss_convention: str = "flat") -> PreparedStep:
        self._require_initialized()
        return prepare_pass(batch, self.config, self._layout, logits_processor_func=logits_processor_func,
                            logits_func=logits_func, loss_convention=loss_convention)

    def _run(self, step: PreparedStep, loss_function: LossFunction | None, forward_only: bool,
             logits_processor_func: Callable | None, logits_func: Callable | None = None,
             builtin_outputs: bool = True, loss_convention: str = "flat") -> TensorDict:
        if not forward_only:  # optimizer_step's empty_cache hook follows the last pass with gradients
            self._last_distillation_use_topk = step.flags.distillation_use_topk
        run = Pass(config=self.config, step=step, loss_function=loss_function,
                   logits_processor=self._lm_head_logits_processor,
                   logits_processor_func=logits_processor_func, logits_func=logits_func,
                   builtin_outputs=builtin_outputs, guard=LossGuard(),
                   needs_grad=not forward_only and torch.is_grad_enabled(), loss_convention=loss_convention)
        if forward_only:
            return run_schedule(self.model, run, self._layout, forward_only=True, moe=self._moe)
        # Megatron's grad finalisation (TP sums of sequence-parallel grads, DP reduce(-scatter), the
        # tied-embedding sum over PP) is linear but not idempotent: it must see each pass's gradients
        # once. A pass after an earlier one therefore runs on zeroed buffers and adds the earlier,
        # already finalised gradients back (one copy of the grad buffers meanwhile).
        earlier = self._take_grads() if self._grads_pending else None

        def failed() -> None:  # the pass's partial gradients go; the earlier ones stay
            self.zero_grad()
            if earlier is not None:
                self._add_grads(earlier)
                self._grads_pending = True

        out = run_schedule(self.model, run, self._layout, forward_only=False, moe=self._moe,
                           on_failure=failed)
        if earlier is not None:
            self._add_grads(earlier)
        self._grads_pending = True
        return out

    def _grad_buffers(self) -> list[torch.Tensor]:
        return [buf.grad_data for chunk in self.model
                for buf in (*chunk.buffers, *chunk.expert_parallel_buffers)]

    def _take_grads(self) -> list[torch.Tensor]:
        """Clones of the DDP grad buffers, which are then zeroed (MoE load counts keep counting)."""
        saved = [g.clone() for g in self._grad_buffers()]
        for chunk in self.model:
            chunk.zero_grad_buffer()
        return saved

    def _add_grads(self, saved: list[torch.Tensor]) -> None:
        for g, s in zip(self._grad_buffers(), saved, strict=True):
            g.add_(s)

    # ------------------------------------------------------------------ public steps
    def forward_backward_batch(self, batch: TensorDictBase, loss_function: LossFunction | None,
                               forward_only: bool = False, *,
                               logits_processor_func: Callable | None = None,
                               loss_convention: str = "flat") -> TensorDict:
        """Forward (and backward unless ``forward_only``, then in eval mode) over all micro-batches;
        gradients accumulate into the DDP grad buffers, across calls too until :meth:`zero_grad`
        (each call's gradients are finalised once, on their own; a call after an earlier one holds one
        copy of the grad buffers). Returns on every rank a TensorDict ``[B]``: per-token outputs in the
        layout of ``input_ids``, non-tensor ``loss`` (global, 0-d) and ``metrics`` (summed over
        micro-batches and DP ranks). A loss function that raises or returns anything but ``(0-d float
        loss requiring grad, {name: number or one-element tensor})`` fails the step on every rank: this
        call's gradients are dropped, those of earlier calls kept. ``loss_convention="flat"``:
        ``loss_function(outputs, data, ctx)``, fields flat ``[T]`` in packed order; ``"micro_batch"``
        (verl): ``loss_function(model_output=, data=, ctx=)`` in the micro-batch's ``input_ids``
        layout, its metrics unsummed in ``micro_batch_metrics`` (one per micro-batch, this DP rank's).
        A ``forward_only`` engine takes ``forward_only=True`` only (under ``no_grad``)."""
        if not forward_only:
            self._require_training("forward_backward_batch(forward_only=False)")
        if loss_function is None and not forward_only:
            raise ValueError("forward_backward_batch: loss_function=None needs forward_only=True")
        self._require_onloaded("forward_backward_batch", "params", *(() if forward_only else ("grads",)))
        step = self._prepare(batch, logits_processor_func, loss_convention=loss_convention)
        with (torch.no_grad() if self.config.forward_only else contextlib.nullcontext(),
              eval_mode(self.model) if forward_only else contextlib.nullcontext()):
            return self._run(step, loss_function, forward_only, logits_processor_func,
                             loss_convention=loss_convention)

    def zero_grad(self) -> None:
        """Zero the DDP grad buffers and the optimizer's main grads."""
        self._require_training("zero_grad")
        self._require_onloaded("zero_grad", "grads")
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._grads_pending = False
        if self._moe is not None:  # the expert-bias update counts the tokens of one optimizer step
            self._moe.reset_expert_load()

    def train_batch(self, batch: TensorDictBase, loss_function: LossFunction, *,
                    logits_processor_func: Callable | None = None,
                    loss_convention: str = "flat") -> TensorDict:
        """Validate -> zero_grad -> forward_backward_batch -> optimizer_step. A bad batch raises
        ``ValueError`` before anything changes. The metrics gain ``grad_norm``, ``update_skipped``
        (1.0 when non-finite gradients skipped the update) and ``lr``."""
        self._require_training("train_batch")
        self._require_onloaded("train_batch", "params", "grads", "optimizer")
        step = self._prepare(batch, logits_processor_func, loss_convention=loss_convention)
        for chunk in self.model:
            chunk.train()
        self.zero_grad()
        out = self._run(step, loss_function, False, logits_processor_func, loss_convention=loss_convention)
        skipped_before = self.num_skipped_steps
        grad_norm = self.optimizer_step()
        metrics = dict(out.get_non_tensor("metrics"))
        metrics["grad_norm"] = grad_norm
        metrics["update_skipped"] = float(self.num_skipped_steps > skipped_before)
        metrics["lr"] = float(self.optimizer.param_groups[0]["lr"])
        out.set_non_tensor("metrics", metrics)
        return out

    @torch.no_grad()
    def infer_batch(self, batch: TensorDictBase, loss_function: LossFunction | None = None, *,
                    logits_processor_func: Callable | None = None, logits_func: Callable | None = None,
                    builtin_outputs: bool = True, loss_convention: str = "flat") -> TensorDict:
        """Forward only, under ``no_grad`` and eval mode (modes restored): per-token outputs in the
        layout of ``input_ids``; gradients and the ``empty_cache`` hook untouched. ``logits_func(
        student_logits=logits / temperature, data={"teacher_ids", "teacher_logprobs"}, data_format)``
        adds its per-token outputs (a key clash: ``ValueError``); ``builtin_outputs=False``: only those."""
        if not builtin_outputs and logits_func is None:
            raise ValueError("infer_batch: builtin_outputs=False needs a logits_func (nothing to compute)")
        self._require_onloaded("infer_batch", "params")
        step = self._prepare(batch, logits_processor_func, logits_func, loss_convention)
        with eval_mode(self.model):
            return self._run(step, loss_function, True, logits_processor_func, logits_func, builtin_outputs,
                             loss_convention)

    # ------------------------------------------------------------------ optimizer
    def optimizer_step(self) -> float:
        """Clip to ``optimizer.clip_grad`` and step; returns the pre-clip global grad norm. Non-finite
        gradients skip the update (counted in ``num_skipped_steps``; the MoE expert biases stay too).
        ``empty_cache()`` first iff the last ``forward_backward_batch`` ran with ``distillation_use_topk``."""
        self._require_training("optimizer_step")
        self._require_onloaded("optimizer_step", "params", "grads", "optimizer")
        if self._last_distillation_use_topk:
            get_device().empty_cache()
        result = step_optimizer(self.optimizer, self.config.optimizer.clip_grad)
        if result.skipped:
            self.num_skipped_steps += 1
        else:
            self.global_step += 1
        if self._moe is not None:  # the aux-loss-free expert-bias update follows an applied step only
            self._moe.end_optimizer_step(updated=not result.skipped)
        return result.grad_norm

    def lr_scheduler_step(self) -> float:
        """Advance the learning-rate schedule by one step; returns the new learning rate."""
        self._require_training("lr_scheduler_step")
        self.lr_scheduler.step(1)
        return float(self.optimizer.param_groups[0]["lr"])

    # ------------------------------------------------------------------ weight export (Hugging Face names)
    def per_tensor_generator(self, dtype: torch.dtype | None = None, *, adapter_only: bool = False
                             ) -> Iterator[tuple[str, torch.Tensor]]:
        """``(hf_name, full_tensor)`` for the whole model (TP shards gathered, vocab padding dropped,
        LoRA merged), or with ``adapter_only`` the adapters in PEFT key names. Collective over TP and
        PP: every model-parallel rank consumes it to the end. ``dtype`` None: the training precision
        (MoE expert biases stay fp32). No tensor shares storage with a live parameter. Memory: one
        gathered parameter (``adapter_only``: the adapters)."""
        self._require_onloaded("per_tensor_generator", "params")
        return weight_tensors(self.model, self.config, dtype, adapter_only)

    def bucketed_weight_generator(self, bucket_bytes: int, dtype: torch.dtype | None = None, *,
                                  adapter_only: bool = False) -> Iterator[tuple[torch.Tensor, BucketMeta]]:
        """``per_tensor_generator`` packed into flat 1-D ``(bucket, meta)`` of one dtype, at most
        ``bucket_bytes`` (a larger tensor alone; ``weight_sync.unflatten_bucket`` splits one), each
        valid until the next is requested (``ValueError`` unless ``bucket_bytes`` is a positive int).
        Memory: one bucket plus one gathered parameter."""
        self._require_onloaded("bucketed_weight_generator", "params")
        return weight_buckets(self.model, self.config, bucket_bytes, dtype, adapter_only)

    def export_hf(self, out_dir: str | os.PathLike, **kwargs: Any) -> None:
        """Collective: write the model as a Hugging Face folder (safetensors + ``config.json``, the
        tokenizer files of ``model.hf_path`` when set; with LoRA the merged weights, what an inference
        engine without LoRA loads); ``kwargs``: ``dtype``, ``max_shard_bytes``."""
        self._require_onloaded("export_hf", "params")
        write_hf_folder(self.model, self.config, out_dir, **kwargs)

    # ------------------------------------------------------------------ LoRA
    @contextlib.contextmanager
    def adapters_disabled(self) -> Iterator[None]:
        """Inside, every LoRA linear runs its base forward: ``infer_batch`` gives the base model's
        outputs (verl's reference policy from the actor: no second engine, no weight copy)."""
        self._require_initialized()
        require_lora(self.config, "adapters_disabled()")
        with adapters_disabled([chunk.module for chunk in self.model]):
            yield

    def export_adapter(self, out_dir: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """Collective: write the LoRA adapters as a PEFT folder (``adapter_config.json`` +
        ``adapter_model.safetensors``) from global rank 0. ``dtype`` None: the training precision."""
        self._require_onloaded("export_adapter", "params")
        write_adapter_folder(self.model, self.config, out_dir, dtype)

    # ------------------------------------------------------------------ state and checkpoints
    def _counters(self) -> dict[str, int]:
        return {"global_step": self.global_step, "num_skipped_steps": self.num_skipped_steps}

    def _set_counters(self, saved: dict[str, Any]) -> None:
        self.global_step, self.num_skipped_steps = saved["global_step"], saved["num_skipped_steps"]

    def state_dict(self) -> dict[str, Any]:
        """This rank's state in memory for this parallel layout (resharding: :meth:`save_checkpoint`):
        model chunks, optimizer, scheduler (not under ``forward_only``), step counters, RNG states.
        Memory: one copy of the optimizer's main parameters; the rest references live tensors."""
        self._require_onloaded("state_dict", "params", "optimizer")
        return {**capture_state(self.model, self.optimizer, self.lr_scheduler), **self._counters(),
                "rng": rng_state()}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """``ValueError`` unless ``state`` (from :meth:`state_dict`) fits this engine exactly: the
        model chunks' parameter names and shapes, the optimizer's stepped parameter shapes (a
        ``forward_only`` engine checks the model only)."""
        check_state(state, self.model, self.optimizer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (checked first), including the process-global
        RNG states; a ``forward_only`` engine ignores the optimizer and scheduler entries."""
        self._require_onloaded("load_state_dict", "params", "optimizer")
        restore_state(state, self.model, self.optimizer, self.lr_scheduler)
        self._set_counters(state)
        set_rng_state(state["rng"])

    def _checkpoint_path(self, path: str | None) -> str:
        path = path if path is not None else self.config.checkpoint_dir
        if not path:
            raise ValueError("checkpoint path is None and EngineConfig.checkpoint_dir is not set")
        return str(path)

    def save_checkpoint(self, path: str | None = None) -> None:
        """Collective: write model, optimizer, scheduler, step counters and RNG atomically to ``path``
        (default ``config.checkpoint_dir``, shared by all ranks) in the reshardable ``torch_dist`` format.
        A ``forward_only`` engine writes no optimizer or scheduler."""
        self._require_onloaded("save_checkpoint", "params", "optimizer")
        save_engine_checkpoint(self._checkpoint_path(path), self.config, self.model, self.optimizer,
                               self.lr_scheduler, self._counters())

    def load_checkpoint(self, path: str | None = None) -> None:
        """Collective: restore what ``save_checkpoint`` wrote, at this engine's layout (RNG states for
        the same layout only). A torn checkpoint or one of another model: ``ValueError`` on every
        rank, the engine untouched. A training engine given a ``forward_only`` engine's checkpoint
        starts its optimizer afresh and keeps its schedule."""
        self._require_onloaded("load_checkpoint", "params", "optimizer")
        self._set_counters(load_engine_checkpoint(self._checkpoint_path(path), self.config, self.model,
                                                  self.optimizer, self.lr_scheduler))
