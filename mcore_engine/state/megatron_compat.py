"""Megatron-Core internals the checkpoint code adapts, one version shim each (0.16 to 0.19)."""

from __future__ import annotations

import contextlib
import copy
import queue
from typing import Any

import torch

from mcore_engine.step.optimizer import sub_optimizers

__all__ = ["adam_step_kept", "common_reader", "fit_optimizer_common", "in_process_write_results",
           "load_fitted"]


def in_process_write_results() -> None:
    """Megatron's module-level writer-results queue as a plain ``queue.Queue`` for synchronous saves
    (no multiprocessing Manager server, whose socket path breaks under a long ``TMPDIR``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


@contextlib.contextmanager
def adam_step_kept(optimizer):
    """Megatron 0.16's ``fully_reshardable`` load with torch Adam: ``step`` is read from the state
    itself (the checkpoint keeps it in the param groups), and each parameter then gets its own
    ``step`` tensor (a shared one would be bumped once per parameter)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer._set_main_param_and_optimizer_states

    def setter(self, model_param, tensors):
        if "step" not in tensors and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group, order = self.model_param_group_index_map[model_param]
            state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
            if "step" in state:
                tensors = {**tensors, "step": state["step"]}
        return original(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = setter
    try:
        yield
    finally:
        DistributedOptimizer._set_main_param_and_optimizer_states = original
    for sub in sub_optimizers(optimizer):
        for state in (sub.optimizer.state.values() if sub.optimizer is not None else ()):
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


_GROUP_KIND = ("wd_mult", "lr_mult", "is_decoupled_lr")


def fit_optimizer_common(saved: dict, optimizer) -> dict:
    """The checkpoint's plain optimizer entries (param-group hyperparameters, Adam's step) in this
    engine's optimizer structure: one Megatron optimizer at EP=1, a dense + expert chain at EP > 1.
    Each param group takes the saved group of its kind (``_GROUP_KIND``), every other entry the
    first saved optimizer's (a chain keeps its steps equal)."""
    def split(tree):  # one optimizer's dict, or {index: dict} for a chain
        return [tree[k] for k in sorted(tree)] if tree and all(isinstance(k, int) for k in tree) else [tree]

    def holder(sub):  # the dict holding "param_groups" (the distributed optimizer nests it)
        return sub["optimizer"] if "param_groups" not in sub and "optimizer" in sub else sub

    subs, ours = split(saved), sub_optimizers(optimizer)
    if len(subs) == len(ours) or "param_groups" not in holder(subs[0]):
        return saved
    kinds = {tuple(g.get(k) for k in _GROUP_KIND): g for sub in subs for g in holder(sub)["param_groups"]}
    fitted = []
    for sub in ours:
        out = copy.deepcopy(subs[0])
        groups = []
        for group in sub.optimizer.param_groups:
            mine = {k: v for k, v in group.items() if k != "params"}
            groups.append({**mine, **kinds.get(tuple(mine.get(k) for k in _GROUP_KIND), {}),
                           "is_expert_parallel": mine.get("is_expert_parallel", False)})
        holder(out)["param_groups"] = groups
        fitted.append(out)
    return fitted[0] if len(fitted) == 1 else dict(enumerate(fitted))


def _fitted(common: dict, optimizer) -> dict:
    if optimizer is not None and isinstance(common.get("optimizer"), dict):
        common["optimizer"] = fit_optimizer_common(common["optimizer"], optimizer)
    return common


def common_reader() -> str:
    """The name through which ``dist_checkpointing.load`` reads the common state: ``load_common``
    (0.16: a method of its ``common_strategy``; 0.17 / 0.18: a function of ``serialization``; both
    read ``common.pt``), or from 0.19 ``serialization.load_common_state_dict`` (the DCP object
    ``common_state``, else a legacy ``common.pt``)."""
    from megatron.core.dist_checkpointing import serialization

    names = serialization.load.__code__.co_names
    return "load_common_state_dict" if "load_common_state_dict" in names else "load_common"


def load_fitted(state: dict[str, Any], path: str, optimizer) -> dict[str, Any]:
    """``dist_checkpointing.load`` with :func:`fit_optimizer_common` applied to the common state.
    Megatron-Core 0.16 takes a common-state loader (``common_strategy``); 0.17 and later removed it,
    so the ``serialization`` function it reads the common state with (:func:`common_reader`) is
    wrapped for the call."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.dist_checkpointing.strategies import common as common_strategies

    if hasattr(common_strategies, "TorchCommonLoadStrategy"):  # 0.16
        class Loader(common_strategies.TorchCommonLoadStrategy):
            def load_common(self, checkpoint_dir):
                return _fitted(super().load_common(checkpoint_dir), optimizer)

        return dist_checkpointing.load(state, path, common_strategy=Loader())
    name = common_reader()
    original = getattr(serialization, name)
    setattr(serialization, name, lambda checkpoint_dir: _fitted(original(checkpoint_dir), optimizer))
    try:
        return serialization.load(state, path)
    finally:
        setattr(serialization, name, original)
