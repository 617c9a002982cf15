"""Megatron-Core optimizer, learning-rate schedule and a step that skips non-finite gradients.

``build_optimizer`` / ``build_scheduler`` map our config onto Megatron's Adam(W) (fp32 main params
under bf16) and ``OptimizerParamScheduler``. ``step_optimizer`` is ``ChainedOptimizer.step`` with the
norm checked before any update, so a skipped step leaves parameters and Adam state bit-identical::

    found_inf = optimizer.prepare_grads()          # model grads -> main grads (+ unscale)
    norm = ||main grads||_2 over the grad-stats group (one fp32 all-reduce)
    if found_inf or not isfinite(norm): skip
    else: grads *= min(1, clip / (norm + 1e-6)); optimizer.step_with_ready_grads()
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.optimizer import MegatronOptimizer, get_megatron_optimizer
from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mcore_engine.config import EngineConfig

__all__ = ["StepResult", "build_optimizer", "build_scheduler", "load_optimizer_state_dict",
           "init_optimizer_state", "optimizer_param_shapes", "optimizer_state_dict", "reset_optimizer_state",
           "step_optimizer", "sub_optimizers"]


def build_optimizer(cfg: EngineConfig, model_chunks: list[torch.nn.Module]) -> MegatronOptimizer:
    """Megatron optimizer for the DDP-wrapped ``model_chunks`` from ``cfg: EngineConfig``."""
    opt = cfg.optimizer
    bf16 = cfg.precision == "bf16"
    mcfg = MegatronOptimizerConfig(
        optimizer="adam",
        lr=opt.lr,
        min_lr=opt.min_lr,
        weight_decay=opt.weight_decay,
        adam_beta1=opt.adam_beta1,
        adam_beta2=opt.adam_beta2,
        adam_eps=opt.adam_eps,
        clip_grad=opt.clip_grad,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=opt.use_distributed_optimizer,
    )
    return get_megatron_optimizer(mcfg, model_chunks)


def build_scheduler(cfg: EngineConfig, optimizer: MegatronOptimizer) -> OptimizerParamScheduler:
    """Megatron's ``OptimizerParamScheduler``: warm-up from 0 to ``lr`` over ``lr_warmup_steps``,
    then ``lr_decay_style`` down to ``min_lr`` at ``lr_decay_steps``; constant weight decay."""
    opt = cfg.optimizer
    warmup = int(opt.lr_warmup_steps or 0)
    decay = opt.lr_decay_steps if opt.lr_decay_steps is not None else warmup + 1
    decay = max(int(decay), warmup + 1)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else opt.lr,
        max_lr=opt.lr,
        min_lr=opt.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=opt.lr_decay_style,
        start_wd=opt.weight_decay,
        end_wd=opt.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )


def sub_optimizers(optimizer: MegatronOptimizer) -> list[MegatronOptimizer]:
    """The Megatron optimizers inside ``optimizer`` (itself, or the members of a ChainedOptimizer)."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _stepped_params(sub: MegatronOptimizer) -> list[torch.Tensor]:
    inner = sub.optimizer
    return [p for g in inner.param_groups for p in g["params"]] if inner is not None else []


def optimizer_state_dict(optimizer: MegatronOptimizer) -> list[dict[str, Any]]:
    """Per sub-optimizer: the inner optimizer's state dict, a copy of the parameters it steps (fp32
    main / this rank's slice) and the grad scaler's state. Memory: one copy of the stepped parameters."""
    states = []
    for sub in sub_optimizers(optimizer):
        inner = sub.optimizer
        state = {"inner": inner.state_dict() if inner is not None else None,
                 "main_params": [p.detach().clone() for p in _stepped_params(sub)]}
        if getattr(sub, "grad_scaler", None) is not None:
            state["grad_scaler"] = sub.grad_scaler.state_dict()
        states.append(state)
    return states


def optimizer_param_shapes(optimizer: MegatronOptimizer) -> list[list[tuple[int, ...]]]:
    """Shapes of the parameters each sub-optimizer steps (to check a state dict before loading)."""
    return [[tuple(p.shape) for p in _stepped_params(sub)] for sub in sub_optimizers(optimizer)]


def load_optimizer_state_dict(optimizer: MegatronOptimizer, states: list[dict[str, Any]]) -> None:
    """Restore what :func:`optimizer_state_dict` returned (shapes already checked)."""
    for sub, state in zip(sub_optimizers(optimizer), states, strict=True):
        if sub.optimizer is None:
            continue
        with torch.no_grad():
            for p, saved in zip(_stepped_params(sub), state["main_params"], strict=True):
                p.copy_(saved)
        sub.optimizer.load_state_dict(state["inner"])
        if "grad_scaler" in state:
            sub.grad_scaler.load_state_dict(state["grad_scaler"])


def init_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Adam's first-step state (``step`` 0, zero moments) for every stepped parameter without one, so
    Megatron's sharded state dict for loading can be built on a never-stepped optimizer."""
    for sub in sub_optimizers(optimizer):
        inner = sub.optimizer
        if inner is None:
            continue
        for p in _stepped_params(sub):
            if len(inner.state[p]) == 0:
                inner.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}


def reset_optimizer_state(optimizer: MegatronOptimizer) -> None:
    """Back to a never-stepped optimizer on the current model weights: Adam state cleared, main
    parameters copied from the model parameters."""
    for sub in sub_optimizers(optimizer):
        if sub.optimizer is not None:
            sub.optimizer.state.clear()
    optimizer.reload_model_params()


@dataclass(frozen=True)
class StepResult:
    grad_norm: float
    """Global L2 norm of the gradients before clipping (nan / inf when the step was skipped)."""
    skipped: bool
    """True when the gradients were not finite and nothing was updated."""


@torch.no_grad()
def step_optimizer(optimizer: MegatronOptimizer, clip_grad: float) -> StepResult:
    """Clip to ``clip_grad`` (0 = none) and step, or skip on non-finite gradients. Every rank decides
    the same: the norm is all-reduced over the model-parallel group (the world for the distributed
    optimizer), and DP replicas hold identical reduced gradients."""
    found_inf = bool(optimizer.prepare_grads())
    if found_inf:
        return StepResult(grad_norm=float("inf"), skipped=True)
    grad_norm = float(optimizer.get_grad_norm())
    if not math.isfinite(grad_norm):
        return StepResult(grad_norm=grad_norm, skipped=True)
    clip_coeff = clip_grad / (grad_norm + 1.0e-6)
    if clip_grad > 0.0 and clip_coeff < 1.0:
        # Megatron's clip_grad_by_total_norm_fp32, without its CUDA-only type assertion.
        grads = [p.grad for sub in sub_optimizers(optimizer) if not getattr(sub, "is_stub_optimizer", False)
                 for p in sub.get_parameters() if p.grad is not None]
        torch._foreach_mul_(grads, clip_coeff)
    success = optimizer.step_with_ready_grads()
    return StepResult(grad_norm=grad_norm, skipped=not success)
