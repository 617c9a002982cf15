"""``McoreEngineBackend``: SkyRL 0.3.0's ``AbstractBackend`` on ``MegatronEngine`` (one engine per model).

Built on every rank of the engine process (``torchrun``, TP x PP ranks, DP = 1): global rank 0 is the
controller that SkyRL's engine loop calls; ranks >= 1 run :func:`control.run_worker`. Collective
commands (create / delete, forward, forward_backward, optim_step, checkpoints, sampler export) are
validated on the controller, then broadcast (``control.Controller.call``) and run by
``control.RankState`` on every rank. ``has_model``, ``sample``, tar writing / reading stay on the
controller.

- forward / forward_backward: requests validated (``batch.py``; a bad one gets an ``ErrorResponse``
  naming the field and datum, before any engine call), grouped by ``(model_id, loss_fn, config)``, one
  engine pass per group with the sum loss of ``losses.py``. Gradients accumulate over calls until
  ``optim_step``. Per datum: ``logprobs`` (critic: ``values``) and ``elementwise_loss = w * l``
  (recomputed on the controller from the returned log-probs); metrics ``{"loss:sum": sum}``.
- optim_step: the request's Adam parameters on every param group (``lr * lr_mult``,
  ``weight_decay * wd_mult``, betas, eps), ``grad_clip_norm`` (> 0) for this step, step, zero grads.
- LoRA: ``rank > 0`` adapts ``q/k/v/o_proj`` (``train_attn``) and ``gate/up/down_proj``
  (``train_mlp``); ``train_unembed`` is ignored (no LoRA on the output layer; logged); ``rank == 0``
  is full fine-tuning. ``model_role="critic"``: a value head, full fine-tuning only.
"""

from __future__ import annotations

import atexit
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.integrations.tinker.skyrl_types import types

# isort: split
from skyrl.backends.backend import AbstractBackend

from mcore_engine.integrations.tinker import store
from mcore_engine.integrations.tinker.batch import Datum, ModelLimits, group_requests
from mcore_engine.integrations.tinker.config import McoreBackendConfig
from mcore_engine.integrations.tinker.control import Controller, engine_config, run_worker, setup
from mcore_engine.integrations.tinker.losses import NOT_FINITE, elementwise

__all__ = ["ATTN_TARGETS", "MLP_TARGETS", "McoreEngineBackend", "ModelSpec", "engine_config", "run_worker"]

logger = logging.getLogger(__name__)

ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
ROLES = ("policy", "critic")


@dataclass(frozen=True)
class ModelSpec:
    """What a model id is: role, LoRA (``rank`` 0: full fine-tuning) and the seed of its adapters."""

    role: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    seed: int

    def meta(self) -> dict[str, Any]:
        lora = None if self.rank == 0 else {"rank": self.rank, "alpha": self.alpha,
                                            "targets": list(self.targets)}
        return {"role": self.role, "lora": lora}


def spec_from_lora(lora_config: Any, model_role: str, alpha: float | None) -> ModelSpec:
    """SkyRL's ``LoraConfig`` + role -> :class:`ModelSpec`; ``ValueError`` naming the field."""
    if model_role not in ROLES:
        raise ValueError(f"model_role: {model_role!r}; expected one of {list(ROLES)}")
    rank = lora_config.rank
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"lora_config.rank must be an int >= 0 (0: full fine-tuning), got {rank!r}")
    if model_role == "critic" and rank != 0:
        raise ValueError(f"lora_config.rank: a critic is trained in full (rank 0), got rank {rank}")
    targets: tuple[str, ...] = ()
    if rank > 0:
        targets = ((ATTN_TARGETS if lora_config.train_attn else ())
                   + (MLP_TARGETS if lora_config.train_mlp else ()))
        if not targets:
            raise ValueError("lora_config.train_attn / train_mlp: both False leaves nothing to train")
        if getattr(lora_config, "train_unembed", False):
            logger.warning("lora_config.train_unembed=True is ignored: the engine has no LoRA on the "
                           "output layer (the adapters cover attention / MLP only)")
    alpha = float(alpha if alpha is not None else lora_config.alpha)
    return ModelSpec(role=model_role, rank=rank, alpha=alpha, targets=targets, seed=int(lora_config.seed))


def _datum_tensors(d: Datum) -> dict[str, Any]:
    n = d.num_targets

    def t(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32) if values else torch.zeros(n)

    return dict(sampling_logprobs=t(d.sampling_logprobs), advantages=t(d.advantages), old_values=t(d.values),
                returns=t(d.returns), has_old_values=torch.ones(n) if d.values else None)


def datum_losses(loss_fn: str, cfg: dict[str, float], d: Datum, x: torch.Tensor,
                 critic: bool) -> torch.Tensor:
    """``w * l`` per token of datum ``d`` from its log-probs / values ``x`` ``[N]`` (fp32, no grad)."""
    with torch.no_grad():
        per_token = elementwise(loss_fn, x, cfg, critic=critic, **_datum_tensors(d))
        return per_token * torch.tensor(d.weights, dtype=torch.float32)


def _tensor_data(t: torch.Tensor) -> dict[str, Any]:
    return {"data": t.float().tolist(), "dtype": "float32", "shape": [int(t.numel())]}


class McoreEngineBackend(AbstractBackend):
    """SkyRL's backend on the engine (module docstring). ``checkpoints_base``: when set (by the engine
    process), every checkpoint path must lie inside it. ``_sampler``: the ``sampling.Sampler``, built on
    first use (a test may set its own)."""

    def __init__(self, base_model: str, config: McoreBackendConfig) -> None:
        from mcore_engine.hf import from_hf_config, read_hf_config

        if isinstance(config, dict):
            config = McoreBackendConfig(**config)
        self.base_model, self.config = str(base_model), config
        self.metrics = types.EngineMetrics()
        self.checkpoints_base: Path | None = None
        self._sampler: Any = None
        model = from_hf_config(read_hf_config(self.base_model))
        self._vocab_size, self._max_positions = int(model.vocab_size), int(model.max_sequence_length)
        state, group = setup(self.base_model, config)
        self._impl = state
        self._ctrl = Controller(state, group)
        self.is_controller = not dist.is_initialized() or dist.get_rank() == 0
        if self.is_controller:  # the workers wait in a broadcast until told to stop
            atexit.register(self.shutdown)

    # ------------------------------------------------------------------ registry
    def _require_controller(self, what: str) -> None:
        if not self.is_controller:
            raise RuntimeError(f"{what}: only the controller (global rank 0) drives the backend")

    def _spec(self, model_id: str) -> ModelSpec:
        spec = self._impl.specs.get(model_id)
        if spec is None:
            raise ValueError(f"model_id: model {model_id!r} not found")
        return spec

    def has_model(self, model_id: str) -> bool:
        return model_id in self._impl.specs

    def create_model(self, model_id: str, lora_config: types.LoraConfig, model_role: str = "policy") -> None:
        self._require_controller("create_model")
        if self.has_model(model_id):
            raise ValueError(f"model_id: model {model_id!r} already exists")
        if len(self._impl.specs) >= self.config.max_models:
            raise ValueError(f"max_models: this server holds at most {self.config.max_models} models (one "
                             "engine each); unload one first or raise max_models in the backend config")
        spec = spec_from_lora(lora_config, model_role, self.config.lora_alpha)
        try:
            self._ctrl.call("create", model_id=model_id, spec=spec)
        except Exception:  # no rank keeps a half-created model (a failure on some ranks only)
            self._ctrl.call("delete", model_id=model_id)
            raise

    def delete_model(self, model_id: str) -> None:
        self._require_controller("delete_model")
        self._spec(model_id)
        self._ctrl.call("delete", model_id=model_id)
        if self._sampler is not None:
            self._sampler.drop(model_id)

    def shutdown(self) -> None:
        """Release the worker ranks (their ``run_worker`` returns); idempotent, and a no-op once the
        process group is gone."""
        if self.is_controller and dist.is_initialized():
            self._ctrl.shutdown()

    # ------------------------------------------------------------------ passes
    def _limits(self) -> dict[str, ModelLimits]:
        return {mid: ModelLimits(role=s.role, vocab_size=self._vocab_size, max_positions=self._max_positions,
                                 max_tokens_per_micro_batch=self.config.max_token_len_per_gpu)
                for mid, s in self._impl.specs.items()}

    def _model_pass(self, prepared: types.PreparedModelPassBatch, backward: bool
                    ) -> dict[str, types.ForwardBackwardOutput | types.ErrorResponse]:
        self._require_controller("forward_backward" if backward else "forward")
        groups, errors = group_requests(prepared, self._limits())
        results: dict[str, Any] = {rid: types.ErrorResponse(error=e, status="failed")
                                   for rid, e in errors.items()}
        for group in groups:
            critic = self._impl.specs[group.model_id].role == "critic"
            try:
                xs = self._ctrl.call("run_pass", model_id=group.model_id, datums=group.datums,
                                     loss_fn=group.loss_fn, config=group.config, backward=backward)
            except Exception as exc:  # an engine failure (collective): every request of the group failed
                for request_id, _, _ in group.requests:
                    results[request_id] = types.ErrorResponse(error=str(exc), status="failed")
                continue
            for request_id, start, end in group.requests:
                outputs, total = [], 0.0
                for i, (d, x) in enumerate(zip(group.datums[start:end], xs[start:end], strict=True)):
                    ell = datum_losses(group.loss_fn, group.config, d, x, critic)
                    if not torch.isfinite(ell).all():  # (forward; forward_backward raised in the engine)
                        results[request_id] = types.ErrorResponse(error=f"datum {i}: {NOT_FINITE}",
                                                                  status="failed")
                        break
                    total += float(ell.double().sum())
                    outputs.append({"values" if critic else "logprobs": _tensor_data(x),
                                    "elementwise_loss": _tensor_data(ell)})
                else:
                    results[request_id] = types.ForwardBackwardOutput(
                        loss_fn_output_type="scalar", loss_fn_outputs=outputs, metrics={"loss:sum": total})
        return results

    def forward_backward(self, prepared_batch: types.PreparedModelPassBatch
                         ) -> dict[str, types.ForwardBackwardOutput | types.ErrorResponse]:
        return self._model_pass(prepared_batch, backward=True)

    def forward(self, prepared_batch: types.PreparedModelPassBatch
                ) -> dict[str, types.ForwardBackwardOutput | types.ErrorResponse]:
        return self._model_pass(prepared_batch, backward=False)

    def optim_step(self, model_id: str, request_data: types.OptimStepInput) -> types.OptimStepOutput:
        self._require_controller("optim_step")
        self._spec(model_id)
        p = request_data.adam_params
        clip = float(getattr(p, "grad_clip_norm", 0.0) or 0.0)
        for name, value in (("learning_rate", p.learning_rate), ("eps", p.eps),
                            ("weight_decay", p.weight_decay), ("grad_clip_norm", clip)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"adam_params.{name} must be a finite number >= 0, got {value}")
        for name, value in (("beta1", p.beta1), ("beta2", p.beta2)):
            if not 0 <= value < 1:
                raise ValueError(f"adam_params.{name} must be in [0, 1), got {value}")
        metrics = self._ctrl.call("step", model_id=model_id, lr=float(p.learning_rate), beta1=float(p.beta1),
                                  beta2=float(p.beta2), eps=float(p.eps), weight_decay=float(p.weight_decay),
                                  grad_clip_norm=clip)
        return types.OptimStepOutput(metrics=metrics)

    # ------------------------------------------------------------------ sampling
    def _sampler_instance(self) -> Any:
        """The sampler, built on first use (``sampling.Sampler``, a transformers model per checkpoint)."""
        if self._sampler is None:
            from mcore_engine.integrations.tinker.sampling import Sampler

            self._sampler = Sampler(self.base_model, self.config)
        return self._sampler

    def sample(self, prepared_batch: types.PreparedSampleBatch
               ) -> dict[str, types.SampleOutput | types.ErrorResponse]:
        self._require_controller("sample")
        critics = {mid for mid, s in self._impl.specs.items() if s.role == "critic"}
        bad = {s[0] for s in prepared_batch.request_batch_slices if s[1] in critics}
        if not bad:
            return self._sampler_instance().sample(prepared_batch)
        error = "model_id: sampling needs a policy model, this is a critic"
        results: dict[str, Any] = {rid: types.ErrorResponse(error=error, status="failed") for rid in bad}
        keep = [s for s in prepared_batch.request_batch_slices if s[0] not in bad]
        if keep:
            results.update(self._sampler_instance().sample(_sub_sample_batch(prepared_batch, keep)))
        return results

    # ------------------------------------------------------------------ checkpoints
    def _path(self, path: Any) -> Path:
        return store.check_inside(path, self.checkpoints_base)

    def save_checkpoint(self, output_path: Any, model_id: str) -> None:
        """``save_state``: the engine's reshardable checkpoint + ``tinker_meta.json`` as a plain tar."""
        self._require_controller("save_checkpoint")
        spec, out = self._spec(model_id), self._path(output_path)
        staging = store.staging_dir(out)
        try:
            staging.mkdir(parents=True)
            self._ctrl.call("save", model_id=model_id, folder=str(staging / "engine"))
            store.write_meta(staging, {"base_model": self.base_model, **spec.meta()})
            store.write_tar(staging, out, gzip=False)
        finally:
            store.remove(staging)

    def load_checkpoint(self, checkpoint_path: Any, model_id: str, *, optimizer: bool = True) -> None:
        """``load_state`` (``optimizer=False``: Adam state reset) / ``load_state_with_optimizer``; a
        checkpoint of another role or LoRA setting: ``ValueError`` naming it, the model untouched."""
        self._require_controller("load_checkpoint")
        spec, path = self._spec(model_id), self._path(checkpoint_path)
        staging = store.staging_dir(path)
        try:
            store.extract(path, staging)
            store.check_meta(store.read_meta(staging), spec.meta())
            self._ctrl.call("load", model_id=model_id, folder=str(staging / "engine"),
                            optimizer=bool(optimizer))
        finally:
            store.remove(staging)

    def save_sampler_checkpoint(self, output_path: Any, model_id: str, persist: bool = True) -> None:
        """The merged weights to the sampler (``Sampler.put``) and a gzip tar: a PEFT folder (LoRA), an
        HF folder (full fine-tuning, ``persist``) or ``MARKER`` (full fine-tuning, not ``persist``)."""
        self._require_controller("save_sampler_checkpoint")
        spec, out = self._spec(model_id), self._path(output_path)
        if spec.role != "policy":
            raise ValueError("model_id: sampler weights need a policy model, this is a critic")
        kind = "adapter" if spec.rank > 0 else ("hf" if persist else None)
        staging = store.staging_dir(out)
        try:
            state = self._ctrl.call("export", model_id=model_id, folder=str(staging) if kind else None,
                                    kind=kind)
            if kind is None:
                store.write_marker(out, model_id)
            else:
                store.write_tar(staging, out, gzip=True)
        finally:
            store.remove(staging)
        name = out.name
        checkpoint_id = name[: -len(".tar.gz")] if name.endswith(".tar.gz") else name
        self._sampler_instance().put(model_id, checkpoint_id, state)


def _sub_sample_batch(batch: types.PreparedSampleBatch, keep: list[tuple]) -> types.PreparedSampleBatch:
    """The samples of the requests in ``keep`` (their slices renumbered)."""
    fields = ("all_model_inputs", "all_sampling_params", "all_model_ids", "all_checkpoint_ids",
              "all_checkpoint_paths", "all_session_ids")
    out: dict[str, list] = {f: [] for f in fields}
    slices = []
    for request_id, model_id, start, end, wants in keep:
        slices.append((request_id, model_id, len(out["all_model_ids"]),
                       len(out["all_model_ids"]) + end - start, wants))
        for f in fields:
            out[f].extend(getattr(batch, f)[start:end])
    return types.PreparedSampleBatch(**out, needs_prompt_logprobs=any(s[4] for s in keep),
                                     request_batch_slices=slices)

