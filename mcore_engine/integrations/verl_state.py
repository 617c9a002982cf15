"""The verl engine's state: train / eval modes with verl's offload, manual moves, LoRA (reference
policy, PEFT config), the weight sync and checkpoints with verl's retention; a mixin of
:class:`mcore_engine.integrations.verl.McoreEngineVerl`, delegating to the core engine.

Offload as verl's Megatron engine: with ``param_offload`` the parameters and grad buffers, with
``optimizer_offload`` the optimizer state, live in host memory except inside ``train_mode()`` (all
onloaded) and ``eval_mode()`` (parameters only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from verl.workers.engine.base import BaseEngineCtx

from mcore_engine.integrations.verl_config import _refuse, lora_merge

__all__ = ["VerlEngineState"]

def _device_type(device: str) -> str | None:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError):
        return None


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


class VerlEngineState:
    """The state side of :class:`~mcore_engine.integrations.verl.McoreEngineVerl`: verl's modes and
    offload, LoRA, weight sync and checkpoints, on the core engine ``self.engine``."""

    # --- modes and offload
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

        from mcore_engine.hf.peft import fused_gdn, peft_config

        m = self.config.model  # a hybrid model's GDN targets, Qwen3-Next's as in_proj_qkvz / in_proj_ba
        config = peft_config(lora, swiglu=m.swiglu, hybrid=m.linear_attention is not None, fused=fused_gdn(m))
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
