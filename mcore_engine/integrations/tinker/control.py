"""Every rank's state (one engine per model id) and the controller -> worker commands (TP / PP > 1).

Global rank 0 (the controller, inside SkyRL's engine loop) runs each collective command itself and
first broadcasts ``(method, kwargs)`` to the workers (ranks >= 1) over a gloo group of its own with a
one-year timeout (idle workers wait in that broadcast while the server waits for clients). After every
command all ranks all-gather their status, so a rank that failed alone cannot leave the others
waiting in a collective, and the controller raises one error naming each failed rank::

    controller: broadcast (method, kwargs) -> result = impl.method(**kwargs) -> all-gather errors
    worker:     loop { receive -> impl.method(**kwargs) -> all-gather errors } until "shutdown"

Kwargs are plain python or pydantic objects (pickled). With one rank nothing is broadcast.
:class:`RankState` is what the commands run on; :func:`setup` builds it (and the groups) on every
rank, in the same order, for the controller's backend and for :func:`run_worker`.
"""

from __future__ import annotations

import gc
import math
import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.integrations.tinker.batch import Datum, to_tensordict
from mcore_engine.integrations.tinker.config import McoreBackendConfig
from mcore_engine.integrations.tinker.losses import engine_loss_fn

__all__ = ["SHUTDOWN", "Controller", "RankState", "control_group", "engine_config", "run_worker", "serve",
           "setup"]

SHUTDOWN = "shutdown"
_TIMEOUT = timedelta(days=365)


def control_group() -> Any:
    """A new gloo group over the whole world with a one-year timeout (collective: every rank calls
    it, in the same order as its other ``new_group`` calls); ``None`` for a world of one."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo", timeout=_TIMEOUT)


def _status(group: Any, error: str | None) -> list[str | None]:
    errors: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(errors, error, group=group)
    return errors


def _run(impl: Any, method: str, kwargs: dict[str, Any]) -> tuple[Any, str | None]:
    try:
        return getattr(impl, method)(**kwargs), None
    except Exception as exc:  # reported to every rank through the status all-gather
        return None, f"{type(exc).__name__}: {exc}"


class Controller:
    """Rank 0's side: :meth:`call` runs a command on every rank and returns rank 0's result."""

    def __init__(self, impl: Any, group: Any) -> None:
        self.impl, self.group = impl, group
        self.closed = False

    def call(self, method: str, **kwargs: Any) -> Any:
        """``impl.method(**kwargs)`` on every rank; rank 0's result, or ``RuntimeError`` naming the
        ranks that failed (a failure of rank 0 alone with one rank: its own exception)."""
        if self.closed:
            raise RuntimeError(f"{method}: the backend was shut down")
        if self.group is None:
            return getattr(self.impl, method)(**kwargs)
        dist.broadcast_object_list([(method, kwargs)], src=0, group=self.group)
        result, error = _run(self.impl, method, kwargs)
        errors = _status(self.group, error)
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            if len(failed) == 1 and failed[0][0] == 0:
                raise RuntimeError(failed[0][1])
            raise RuntimeError("; ".join(f"rank {r}: {e}" for r, e in failed))
        return result

    def shutdown(self) -> None:
        """Release the workers (their :func:`serve` returns); idempotent."""
        if self.closed:
            return
        self.closed = True
        if self.group is not None:
            dist.broadcast_object_list([(SHUTDOWN, {})], src=0, group=self.group)


def serve(impl: Any, group: Any) -> None:
    """A worker's loop: run each broadcast command, report its status, return at shutdown."""
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0, group=group)
        method, kwargs = message[0]
        if method == SHUTDOWN:
            return
        _, error = _run(impl, method, kwargs)
        _status(group, error)


def setup(base_model: str, config: McoreBackendConfig) -> tuple[RankState, Any]:
    """On every rank: the default group and Megatron's from torchrun's environment (``ValueError`` when
    the world is not ``tensor_parallel_size * pipeline_parallel_size``: DP = 1), the control group, an
    empty :class:`RankState`."""
    from mcore_engine.config import ParallelConfig
    from mcore_engine.parallel.platform import init_distributed

    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if world != config.world_size:
        raise ValueError(f"tensor_parallel_size * pipeline_parallel_size = {config.world_size} must "
                         f"equal the engine process's world size {world} (no data parallelism)")
    init_distributed(ParallelConfig(tensor_model_parallel_size=config.tensor_parallel_size,
                                    pipeline_model_parallel_size=config.pipeline_parallel_size), 1234)
    return RankState(base_model, config), control_group()


def run_worker(base_model: str, config: McoreBackendConfig | dict) -> None:
    """Ranks >= 1 of the engine process: the same set-up as the controller's backend, then follow its
    commands until it shuts down."""
    if isinstance(config, dict):
        config = McoreBackendConfig(**config)
    state, group = setup(base_model, config)
    if _rank() == 0:
        raise RuntimeError("run_worker is for ranks >= 1; rank 0 is the controller (McoreEngineBackend)")
    serve(state, group)


def engine_config(base_model: str, cfg: Any, spec: Any) -> Any:
    """The ``EngineConfig`` of one model: architecture and weights from the base folder, the backend's
    layout and precision, a constant-lr Adam whose values ``optim_step`` overwrites, no clipping;
    ``cfg.engine_overrides`` last."""
    from mcore_engine.config import EngineConfig, LoRAConfig, OptimizerConfig, ParallelConfig
    from mcore_engine.hf import from_hf_config, read_hf_config

    lora = None if spec.rank == 0 else LoRAConfig(rank=spec.rank, alpha=spec.alpha, dropout=0.0,
                                                  target_modules=list(spec.targets))
    model = from_hf_config(read_hf_config(base_model), hf_path=base_model,
                           head="value" if spec.role == "critic" else "lm", lora=lora)
    tp = cfg.tensor_parallel_size
    kwargs: dict[str, Any] = dict(
        model=model,
        parallel=ParallelConfig(tensor_model_parallel_size=tp,
                                pipeline_model_parallel_size=cfg.pipeline_parallel_size,
                                sequence_parallel=cfg.sequence_parallel and tp > 1),
        optimizer=OptimizerConfig(lr=1e-4, min_lr=0.0, weight_decay=0.0, clip_grad=0.0, adam_beta1=0.9,
                                  adam_beta2=0.95, adam_eps=1e-12, lr_warmup_steps=0,
                                  lr_decay_style="constant"),
        precision=cfg.precision, seed=spec.seed)
    kwargs.update(cfg.engine_overrides)
    return EngineConfig(**kwargs)


class RankState:
    """One rank's state: a ``MegatronEngine`` per model id (``specs``: the backend's ``ModelSpec``s).
    Every method is collective (the controller broadcasts it); return values matter on rank 0 only."""

    def __init__(self, base_model: str, cfg: Any) -> None:
        self.base_model, self.cfg = base_model, cfg
        self.engines: dict[str, Any] = {}
        self.specs: dict[str, Any] = {}

    def create(self, model_id: str, spec: Any) -> None:
        from mcore_engine.engine import MegatronEngine

        engine = MegatronEngine(engine_config(self.base_model, self.cfg, spec))
        engine.initialize()
        engine.zero_grad()
        self.engines[model_id], self.specs[model_id] = engine, spec

    def delete(self, model_id: str) -> None:
        self.engines.pop(model_id, None)
        self.specs.pop(model_id, None)
        gc.collect()

    def run_pass(self, model_id: str, datums: list[Datum], loss_fn: str, config: dict[str, float],
                 backward: bool) -> list[torch.Tensor]:
        """Forward (and backward, adding into the grad buffers) over ``datums``; per datum its ``N``
        log-probs (critic: values), fp32."""
        engine, critic = self.engines[model_id], self.specs[model_id].role == "critic"
        batch = to_tensordict(datums, self.cfg.max_token_len_per_gpu)
        if backward:
            out = engine.forward_backward_batch(batch, engine_loss_fn(loss_fn, config, critic))  # accumulates
        else:
            out = engine.infer_batch(batch)
        rows = out["values" if critic else "log_probs"].unbind()
        return [row[: d.num_targets].detach().float().clone() for row, d in zip(rows, datums, strict=True)]

    def step(self, model_id: str, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
             grad_clip_norm: float) -> dict[str, float]:
        """One Adam step with these parameters on the accumulated gradients, then zero them."""
        from mcore_engine.step.optimizer import sub_optimizers

        engine = self.engines[model_id]
        for sub in sub_optimizers(engine.optimizer):
            if sub.optimizer is None:
                continue
            for group in sub.optimizer.param_groups:
                group["lr"] = lr * group.get("lr_mult", 1.0)
                group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
                group["betas"] = (beta1, beta2)
                group["eps"] = eps
        opt_cfg = engine.config.optimizer
        saved, skipped = opt_cfg.clip_grad, engine.num_skipped_steps
        opt_cfg.clip_grad = float(grad_clip_norm)
        try:
            grad_norm = engine.optimizer_step()
        finally:
            opt_cfg.clip_grad = saved
            engine.zero_grad()
        metrics = {"skyrl.ai/learning_rate": float(lr),
                   "update_skipped": float(engine.num_skipped_steps > skipped)}
        if math.isfinite(grad_norm):  # a skipped step's inf / nan norm is not JSON: left out
            metrics["skyrl.ai/grad_norm"] = float(grad_norm)
        return metrics

    def save(self, model_id: str, folder: str) -> None:
        self.engines[model_id].save_checkpoint(folder)

    def load(self, model_id: str, folder: str, optimizer: bool) -> None:
        from mcore_engine.step.optimizer import reset_optimizer_state

        engine = self.engines[model_id]
        engine.load_checkpoint(folder)
        if not optimizer:
            reset_optimizer_state(engine.optimizer)
        engine.zero_grad()

    def export(self, model_id: str, folder: str | None, kind: str | None) -> dict[str, torch.Tensor]:
        """The merged weights in Hugging Face names (fp32; every rank iterates, rank 0 keeps them), and
        with ``kind`` ``"adapter"`` / ``"hf"`` a PEFT / HF folder written to ``folder``."""
        engine = self.engines[model_id]
        state = {name: t for name, t in engine.per_tensor_generator(torch.float32)}
        if kind == "adapter":
            engine.export_adapter(folder, torch.float32)
        elif kind == "hf":
            engine.export_hf(folder, dtype=torch.float32)
        return state if _rank() == 0 else {}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0
