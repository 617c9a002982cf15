"""mcore-engine as a verl training engine (verl 0.9.1 ``BaseEngine``, backend ``"mcore_engine"``).

    import mcore_engine.integrations.verl   # registers the engines with verl's EngineRegistry
    # verl config: actor.strategy=mcore_engine, its engine block a McoreEngineVerlConfig

Two registrations: ``model_type="language_model"`` (:class:`McoreEngineVerl`, the lm-head) and
``"value_model"`` (:class:`McoreEngineVerlValue`, the core's value head: verl's critic, outputs
``{"values": jagged [B, j]}``). ``engine_config.forward_only`` (a reference policy) is the core's
``EngineConfig.forward_only``: an engine that only infers, without grad buffers or optimizer.

verl's ``TrainingWorker`` builds :class:`McoreEngineVerl` from ``model_config`` (``HFModelConfig``),
``engine_config`` (:class:`McoreEngineVerlConfig`: verl's Megatron engine fields), ``optimizer_config``
and ``checkpoint_config``. :func:`engine_config_from_verl` maps every field with a meaning here onto
an :class:`mcore_engine.EngineConfig` and raises ``ValueError`` naming the field for every setting the
engine cannot honour; the fields in :data:`NOT_APPLICABLE` have no meaning for this engine.
Expert-parallel sizes go to ``ParallelConfig``, whose layout checks (a dense model has no experts)
reach the user naming both the verl and the core field.

Offload as verl's Megatron engine: with ``param_offload`` the parameters and grad buffers, with
``optimizer_offload`` the optimizer state, live in host memory (``engine.offload``: device storage
resized to 0) except inside ``train_mode()`` (all of them onloaded) and ``eval_mode()`` (parameters
only); ``to(device, model, optimizer, grad)`` moves parts by hand. Checkpoints are the core's
reshardable ``torch_dist`` folders, one per ``save_checkpoint`` call, loadable at another layout.

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

Top-k distillation runs the core's built-in chunked top-k forward KL (``mcore_engine.ops``) instead of
calling verl's loss as a logits processor; ``log_prob_min_clamp`` of a ``functools.partial`` of
verl's ``distillation_ppo_loss`` (its ``distillation_config.distillation_loss``) becomes the batch
flag ``distillation_log_prob_min_clamp``.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict

try:
    from verl.utils import tensordict_utils as tu
    from verl.utils.py_functional import append_to_dict
    from verl.workers.config.actor import McoreActorConfig
    from verl.workers.config.engine import EngineConfig as _VerlEngineConfig
    from verl.workers.config.engine import McoreEngineConfig as _VerlMcoreEngineConfig
    from verl.workers.config.optimizer import McoreOptimizerConfig, OptimizerConfig
    from verl.workers.engine.base import BaseEngine, BaseEngineCtx, EngineRegistry
except ImportError as exc:  # pragma: no cover - exercised only without verl
    raise ImportError("mcore_engine.integrations.verl needs verl: pip install --no-deps verl==0.9.1 "
                      "plus its light dependencies (`pip install -e '.[verl]' -c constraints.txt`)") from exc

from mcore_engine import EngineConfig, MegatronEngine
from mcore_engine.config import OptimizerConfig as CoreOptimizerConfig
from mcore_engine.config import ParallelConfig

__all__ = ["BACKEND", "NOT_APPLICABLE", "McoreEngineActorConfig", "McoreEngineVerl", "McoreEngineVerlConfig",
           "McoreEngineVerlValue", "VerlLossBridge", "engine_config_from_verl"]

BACKEND = "mcore_engine"

NOT_APPLICABLE: dict[str, str] = {
    "engine_config.use_mbridge": "HF weights are imported by mcore_engine.hf, not by mbridge",
    "engine_config.vanilla_mbridge": "HF weights are imported by mcore_engine.hf, not by mbridge",
    "engine_config.pad_bshd_to_minibatch_max": "a cuDNN plan-reuse knob; the core pads per micro-batch",
    "engine_config.entropy_from_logits_with_chunking": "entropy is always computed chunk by chunk",
    "engine_config.dist_ckpt_optim_fully_reshardable": "checkpoints are always reshardable",
    "engine_config.infer_max_token_len_per_gpu / infer_micro_batch_size_per_gpu":
        "TrainingWorker puts them on each inference batch, where the core reads them",
    "model_config.trust_remote_code / external_lib / tokenizer / custom_chat_template":
        "tokenizer-side settings; the engine sees token ids",
    "checkpoint_config.strict / save_lora_only": "no LoRA adapters; HF export is always complete",
    "optimizer_config.use_checkpoint_opt_param_scheduler":
        "the scheduler state is always restored with the checkpoint",
}

_DTYPES = {"float32": "fp32", "fp32": "fp32", "bfloat16": "bf16", "bf16": "bf16"}
_CKPT_CONTENTS = {"model", "optimizer", "extra"}


@dataclass
class McoreEngineVerlConfig(_VerlMcoreEngineConfig):
    """verl's Megatron engine config, selecting this backend (``strategy="mcore_engine"``).

    Same fields and YAML keys as verl's ``McoreEngineConfig`` (``tensor_model_parallel_size`` ...),
    plus ``logits_chunk_size`` (tokens per chunk of the lm-head pass; None: the ops' default).
    ``dtype`` may also be ``"float32"``; ``sequence_parallel`` defaults to False (CPU machines cannot
    run it)."""

    strategy: str = BACKEND
    dtype: str = "bfloat16"
    sequence_parallel: bool = False
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


def _refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"{field}={value!r} is not supported by the mcore_engine backend: {why}")


def _check(ok: bool, field: str, value: Any, why: str) -> None:
    if not ok:
        _refuse(field, value, why)


# ------------------------------------------------------------------------------------------- config
def engine_config_from_verl(model_config: Any, engine_config: Any, optimizer_config: Any,
                            checkpoint_config: Any = None) -> EngineConfig:
    """The core :class:`EngineConfig` for verl's four config objects; ``ValueError`` naming the
    first field that cannot be honoured. Architecture from the HF ``config.json``
    (``mcore_engine.hf.from_hf_config``), weights from ``model_config.local_path``."""
    from mcore_engine.hf import from_hf_config, read_hf_config

    e, m, o = engine_config, model_config, optimizer_config
    _check(getattr(e, "strategy", None) == BACKEND, "engine_config.strategy", getattr(e, "strategy", None),
           f"build the engine block as McoreEngineVerlConfig (strategy={BACKEND!r})")
    # --- engine_config
    _check(e.dtype in _DTYPES, "engine_config.dtype", e.dtype, "use float32 or bfloat16")
    _check(e.context_parallel_size == 1, "engine_config.context_parallel_size", e.context_parallel_size,
           "only TP / PP / VPP / EP / DP")
    flags_off = {
        "dynamic_context_parallel": "no context parallelism",
        "full_determinism": "no deterministic-kernel mode",
        "pad_to_length": "micro-batches are packed to their own length",
        "use_dist_checkpointing": "initial weights come from model_config.path (HF)",
        "use_megatron_fsdp": "Megatron DDP / distributed optimizer only",
        "distrib_optim_fully_reshardable_mem_efficient": "not implemented",
    }
    for name, why in flags_off.items():
        _check(not getattr(e, name, False), f"engine_config.{name}", getattr(e, name, None), why)
    for name in ("max_seqlen_per_dp_cp_rank", "dist_checkpointing_path"):
        _check(getattr(e, name, None) is None, f"engine_config.{name}", getattr(e, name, None),
               "no context parallelism / dist-checkpoint weight import")
    for name in ("override_ddp_config", "override_mcore_model_config"):
        _check(not getattr(e, name, None), f"engine_config.{name}", getattr(e, name, None),
               "the model and DDP are built from the HF config and EngineConfig only")
    extra = sorted(set(getattr(e, "override_transformer_config", None) or {}) - set(_RECOMPUTE_KEYS))
    _check(not extra, "engine_config.override_transformer_config", extra,
           f"only {list(_RECOMPUTE_KEYS)} are mapped; the model is built from the HF config and EngineConfig")
    if e.sequence_parallel:
        from mcore_engine.model import has_te

        _check(has_te(), "engine_config.sequence_parallel", True,
               "needs Transformer Engine (GPU); the local layer spec's torch norms do not support it")
    mode = e.router_replay.mode if getattr(e, "router_replay", None) is not None else "disabled"
    _check(mode == "disabled", "engine_config.router_replay.mode", mode, "dense models only")
    qat = getattr(e, "qat", None)
    _check(not getattr(qat, "enable", False), "engine_config.qat.enable", True,
           "no quantisation-aware training")
    _check(e.micro_batch_size_per_gpu is None or e.micro_batch_size_per_gpu >= 1,
           "engine_config.micro_batch_size_per_gpu", e.micro_batch_size_per_gpu, "must be >= 1")
    # --- model_config
    model_type = getattr(m, "model_type", "language_model")
    _check(model_type in ("language_model", "value_model"), "model_config.model_type", model_type,
           "language models and value models (critics) only")
    value = model_type == "value_model"
    for name in ("use_fused_kernels", "logits_chunk_size"):  # lm-head settings: a critic has no lm-head
        _check(not value or not getattr(e, name, None), f"engine_config.{name}", getattr(e, name, None),
               "a value model (model_type='value_model') has no lm-head")
    lora = getattr(m, "lora_rank", 0) or getattr(m, "lora", None) or getattr(m, "lora_adapter_path", None)
    _check(not lora, "model_config.lora_rank", getattr(m, "lora_rank", None), "no LoRA")
    for name, why in (("enable_activation_offload", "no activation offload"),
                      ("use_liger", "Liger kernels are for the FSDP backend")):
        _check(not getattr(m, name, False), f"model_config.{name}", getattr(m, name, None), why)
    _check(not getattr(m, "fused_kernel_options", None), "model_config.fused_kernel_options",
           getattr(m, "fused_kernel_options", None), "the fused lm-head has no options")
    tiled = getattr(m, "tiled_mlp", None) or {}
    _check(not tiled.get("enabled", False), "model_config.tiled_mlp.enabled", True, "no tiled MLP")
    mtp = getattr(m, "mtp", None)
    _check(not getattr(mtp, "enable", False), "model_config.mtp.enable", True, "no multi-token prediction")
    extra = sorted(set(getattr(m, "override_config", None) or {}) - {"attn_implementation"})
    _check(not extra, "model_config.override_config", extra, "the architecture comes from config.json only")
    weights = getattr(m, "local_path", None) or getattr(m, "path", None)
    hf_dir = getattr(m, "local_hf_config_path", None) or weights
    model = from_hf_config(read_hf_config(hf_dir), hf_path=weights, head="value" if value else "lm",
                           fused_lm_head=bool(getattr(e, "use_fused_kernels", False)) and not value)
    # --- optimizer_config (a reference policy may have none)
    forward_only = bool(getattr(e, "forward_only", False))
    optimizer = CoreOptimizerConfig() if forward_only and o is None else _optimizer_from_verl(o, e)
    # --- checkpoint_config
    if checkpoint_config is not None:
        c = checkpoint_config
        for name in ("save_contents", "load_contents"):
            contents = set(getattr(c, name, None) or _CKPT_CONTENTS)
            _check(_CKPT_CONTENTS <= contents and contents <= _CKPT_CONTENTS | {"hf_model"},
                   f"checkpoint_config.{name}", sorted(contents),
                   "model, optimizer and extra are always saved and loaded together (+ optional hf_model)")
        _check(not getattr(c, "async_save", False), "checkpoint_config.async_save", True, "no async save")
    parallel = {name: getattr(e, name) for name in _PARALLEL_FIELDS}
    recompute, recompute_source = _recompute_from_verl(m, e)
    try:
        layout = ParallelConfig(**parallel, sequence_parallel=bool(e.sequence_parallel))
        return EngineConfig(model=model, parallel=layout, optimizer=optimizer, precision=_DTYPES[e.dtype],
                            seed=int(e.seed), micro_batch_size=int(e.micro_batch_size_per_gpu or 1),
                            logits_chunk_size=getattr(e, "logits_chunk_size", None),
                            data_format="thd" if e.use_remove_padding else "bshd",
                            forward_only=forward_only, **recompute)
    except ValueError as exc:  # the core's checks name its own fields: name verl's too
        if "EngineConfig.recompute_" in str(exc):
            raise ValueError(f"{recompute_source} is not supported by the mcore_engine backend: "
                             f"{exc}") from exc
        named = [n for n in _PARALLEL_FIELDS if re.search(rf"(?<![A-Za-z_]){n}", str(exc))]
        named = [n for n in named if parallel[n] not in (None, 1)] or named
        if not named:
            raise
        fields = ", ".join(f"engine_config.{n}={parallel[n]!r}" for n in named)
        raise ValueError(f"{fields} is not supported by the mcore_engine backend: {exc}") from exc


_PARALLEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                    "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                    "expert_tensor_parallel_size")
_RECOMPUTE_KEYS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")


def _recompute_from_verl(m: Any, e: Any) -> tuple[dict[str, Any], str]:
    """The core's recompute fields and the verl fields they come from (for error messages).

    ``engine_config.override_transformer_config.recompute_granularity`` (verl's Megatron engine's
    switch) wins, with its ``recompute_method`` / ``recompute_num_layers`` for ``"full"`` and
    ``recompute_modules`` for ``"selective"``; when it is null, ``model_config.
    enable_gradient_checkpointing=True`` means full recompute (by default uniform, one layer per
    unit: every layer keeps only its input ``[s, b, h]``)."""
    otc = dict(getattr(e, "override_transformer_config", None) or {})
    granularity = otc.get("recompute_granularity")
    if granularity is None:
        if not getattr(m, "enable_gradient_checkpointing", False):
            return {}, "model_config.enable_gradient_checkpointing"
        granularity, source = "full", "model_config.enable_gradient_checkpointing=True"
    else:
        source = f"engine_config.override_transformer_config.recompute_granularity={granularity!r}"
    out = {"recompute_granularity": granularity}
    keys = ("recompute_method", "recompute_num_layers") if granularity == "full" else ("recompute_modules",)
    for key in keys:
        if otc.get(key) is not None:
            out[key] = list(otc[key]) if key == "recompute_modules" else otc[key]
            source += f", engine_config.override_transformer_config.{key}={otc[key]!r}"
    if "layernorm" in (out.get("recompute_modules") or ()):
        from mcore_engine.model import has_te

        _check(has_te(), "engine_config.override_transformer_config.recompute_modules",
               out["recompute_modules"], "'layernorm' needs Transformer Engine (GPU); use core_attn / mlp")
    return out, source


def _optimizer_from_verl(o: Any, e: Any) -> CoreOptimizerConfig:
    """Adam(W) + warm-up + decay with verl's Megatron step rules: decay steps default to
    ``total_training_steps``; warm-up is ``lr_warmup_steps`` when > 0, else
    ``int(lr_warmup_steps_ratio * decay_steps)``."""
    _check(isinstance(o, OptimizerConfig) and type(o) in (OptimizerConfig, McoreOptimizerConfig),
           "optimizer_config", type(o).__name__, "use verl's McoreOptimizerConfig (or OptimizerConfig)")
    mcore = isinstance(o, McoreOptimizerConfig)
    style = o.lr_decay_style if mcore else "constant"
    if mcore:
        _check(o.optimizer in ("adam", "adamw"), "optimizer_config.optimizer", o.optimizer, "Adam(W) only")
        _check(o.lr_warmup_init == 0, "optimizer_config.lr_warmup_init", o.lr_warmup_init,
               "warm-up starts at 0")
        _check(style in ("constant", "cosine", "linear"), "optimizer_config.lr_decay_style", style,
               "constant, cosine or linear")
        _check(o.weight_decay_incr_style == "constant", "optimizer_config.weight_decay_incr_style",
               o.weight_decay_incr_style, "constant weight decay only")
        _check(o.lr_wsd_decay_steps is None, "optimizer_config.lr_wsd_decay_steps", o.lr_wsd_decay_steps,
               "no WSD schedule")
        for name in ("use_precision_aware_optimizer", "use_layer_wise_distributed_optimizer"):
            _check(not getattr(o, name), f"optimizer_config.{name}", getattr(o, name), "not implemented")
        _check(not o.override_optimizer_config, "optimizer_config.override_optimizer_config",
               o.override_optimizer_config, "set the fields of OptimizerConfig instead")
    decay = (o.lr_decay_steps if mcore and o.lr_decay_steps is not None else o.total_training_steps)
    warmup = o.lr_warmup_steps if o.lr_warmup_steps is not None and o.lr_warmup_steps > 0 else None
    if warmup is None:
        warmup = int((o.lr_warmup_steps_ratio or 0.0) * max(decay, 0))
    if style != "constant":
        _check(isinstance(decay, int) and decay > warmup, "optimizer_config.total_training_steps", decay,
               f"lr_decay_style={style!r} needs lr_decay_steps or total_training_steps > warm-up ({warmup})")
    beta1, beta2 = o.betas
    return CoreOptimizerConfig(lr=float(o.lr), min_lr=float(o.min_lr) if mcore else 0.0,
                               adam_beta1=float(beta1), adam_beta2=float(beta2),
                               weight_decay=float(o.weight_decay), clip_grad=float(o.clip_grad),
                               lr_warmup_steps=int(warmup), lr_decay_style=style,
                               lr_decay_steps=int(decay) if style != "constant" else None,
                               use_distributed_optimizer=bool(e.use_distributed_optimizer))


# ---------------------------------------------------------------------------------- loss conversion
def _flag(data: TensorDict, key: str, default: Any = False) -> Any:
    return tu.get_non_tensor_data(data, key, default)


class VerlLossBridge:
    """A verl loss function on the core's ``loss_convention="micro_batch"``: verl's normalisation and
    result format, nothing else.

    The core calls ``bridge(model_output=..., data=micro_batch, ctx=...)`` once per micro-batch with
    the outputs as jagged ``[b, j]`` tensors and verl's own rows of the batch (dense ``[b, R]`` fields,
    jagged fields, the non-tensor entries, ``batch_num_tokens`` / ``dp_size`` included). The bridge
    calls ``loss_function(model_output=..., data=micro_batch, dp_group=...)``, records ``L_i.item()``
    and returns ``L_i / dp_size`` to the core (module docstring) with verl's metrics, which the core
    hands back per micro-batch (``micro_batch_metrics``) for :meth:`results`.
    """

    def __init__(self, loss_function: Callable, *, dp_size: int, dp_group: Any) -> None:
        self.loss_function = loss_function
        self.dp_size = dp_size
        self.dp_group = dp_group
        self.losses: list[float] = []

    def __call__(self, model_output: dict[str, torch.Tensor], data: TensorDict, ctx: Any
                 ) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, metrics = self.loss_function(model_output=model_output, data=data, dp_group=self.dp_group)
        if not isinstance(loss, torch.Tensor):
            loss = torch.as_tensor(float(loss), dtype=torch.float32)
        self.losses.append(loss.detach().item())
        return loss / self.dp_size, metrics


def verl_results(out: TensorDict, losses: list[float] | None,
                 keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """verl's ``{"model_output": {key: jagged [B, j]}, "loss": [...], "metrics": {key: [...]}}`` from
    the core's result (``keys``: only those outputs); ``losses`` None (no loss function): 1.0 per
    micro-batch, as verl's Megatron engine reports."""
    per_micro_batch = out.get_non_tensor("micro_batch_metrics")
    metrics: dict[str, list] = {}
    for entry in per_micro_batch:
        append_to_dict(metrics, entry)
    names = [k for k in out.keys() if k not in ("loss", "metrics", "micro_batch_metrics")]
    model_output = {key: out.get(key) for key in names if keys is None or key in keys}
    loss = list(losses) if losses is not None else [1.0] * len(per_micro_batch)
    return {"model_output": model_output, "loss": loss, "metrics": metrics}


def _topk_clamp(loss_function: Callable | None) -> float | None:
    """``log_prob_min_clamp`` of a ``partial(distillation_ppo_loss, distillation_config=...)``."""
    is_partial = isinstance(loss_function, functools.partial)
    cfg = loss_function.keywords.get("distillation_config") if is_partial else None
    loss_cfg = getattr(cfg, "distillation_loss", None)
    return getattr(loss_cfg, "log_prob_min_clamp", None)


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
        from mcore_engine.platform import apply_cpu_device_layer, init_distributed

        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.config = engine_config_from_verl(model_config, engine_config, optimizer_config,
                                              checkpoint_config)
        if self.config.model.head != self.head:
            model_type = getattr(model_config, "model_type", None)
            _refuse("model_config.model_type", model_type,
                    f"{type(self).__name__} builds model.head={self.head!r}; "
                    f"build it through EngineRegistry with model_type={model_type!r}")
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        self.config.validate_world_size(world)
        apply_cpu_device_layer()
        init_distributed(self.config.parallel, self.config.seed)
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

        from mcore_engine.platform import get_device

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

        return (ps.get_tensor_model_parallel_rank() == 0
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

    def train_batch(self, data: TensorDict, loss_function: Callable) -> Any:
        """verl's ``BaseEngine.train_batch`` (forward-backward, then the optimizer step and its grad
        norm in the metrics); refused under ``forward_only``."""
        self._refuse_if_forward_only("train_batch()")
        return super().train_batch(data, loss_function)

    # --- the step
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None,
                               forward_only: bool = False) -> dict[str, Any]:
        """verl's semantics on the core's ``loss_convention="micro_batch"`` (module docstring): sets
        ``batch_num_tokens``, ``dp_size`` and ``sp_size`` (and ``distillation_log_prob_min_clamp``
        from a verl distillation loss) on ``data``, hands ``data`` itself to the core, returns
        verl's result dict on the last pipeline stage."""
        from megatron.core import parallel_state

        if not forward_only:  # before the token count's all-reduce
            self._refuse_if_forward_only("forward_backward_batch(forward_only=False)")
        pad_mode = _flag(data, "pad_mode", None)
        if pad_mode is not None and str(getattr(pad_mode, "value", pad_mode)).lower() != "no_padding":
            raise ValueError(f"pad_mode={pad_mode!r}: only verl's no-padding batches are supported")
        fused = _flag(data, "use_fused_kernels", self.config.model.fused_lm_head)
        if bool(fused) != bool(self.config.model.fused_lm_head):
            raise ValueError(f"use_fused_kernels={fused!r} on the batch must match "
                             "engine_config.use_fused_kernels")
        loss_mask = data["loss_mask"]
        num_tokens = (loss_mask.values().sum() if loss_mask.is_nested else loss_mask.sum()).to(torch.float64)
        group = self.get_data_parallel_group()
        dp_size = self.get_data_parallel_size()
        if dp_size > 1:
            dist.all_reduce(num_tokens, group=group)
        tu.assign_non_tensor(data, batch_num_tokens=int(num_tokens.item()), dp_size=dp_size, sp_size=1)
        clamp = _topk_clamp(loss_function)
        if clamp is not None:
            tu.assign_non_tensor(data, distillation_log_prob_min_clamp=clamp)
        temperature = data.get("temperature") if "temperature" in data.keys() else None
        if isinstance(temperature, torch.Tensor) and temperature.shape != data.batch_size:
            data = data.copy()  # shallow: a per-sample [B, 1] temperature as the core's [B]
            data.set("temperature", temperature.reshape(data.batch_size).to(torch.float32))
        bridge = None if loss_function is None else VerlLossBridge(loss_function, dp_size=dp_size,
                                                                    dp_group=group)
        out = self.engine.forward_backward_batch(data, bridge, forward_only, loss_convention="micro_batch")
        if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        return verl_results(out, None if bridge is None else bridge.losses, keys=self.output_keys)

    output_keys: tuple[str, ...] | None = None  # the per-token outputs returned to verl (None: all)

    # --- weights and checkpoints
    def get_per_tensor_param(self, **kwargs) -> tuple[Generator[tuple[str, torch.Tensor], None, None], None]:
        """``(generator of (hf_name, full tensor), None)``: no PEFT config. Onloads the parameters and
        leaves them onloaded (verl's worker offloads them after the weight sync when
        ``param_offload``). The tensors may share storage with the parameters: consume them before
        offloading. Collective over TP / PP: every rank consumes the generator to the end."""
        self.engine.onload(params=True, grads=False, optimizer=False)
        return self.engine.per_tensor_generator(), None

    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **kwargs) -> None:
        """Collective: the core checkpoint (``torch_dist``, reshardable) in folder ``local_path`` (+ an
        HF folder ``local_path/huggingface`` when ``checkpoint_config.save_contents`` holds
        ``hf_model``). Offloaded parameters / optimizer state are onloaded for the write and offloaded
        again. Retention as verl's checkpoint managers: of the folders this engine saved, the oldest
        are deleted before the write so that ``max_ckpt_to_keep - 1`` remain (when it is > 1), and
        after it so that ``max_ckpt_to_keep`` remain. ``hdfs_path`` is refused; under ``forward_only``
        the model only is saved."""
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
