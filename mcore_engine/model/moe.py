"""Mixture-of-experts side of one engine step: aux-loss normalisation, router metrics, expert bias,
and the router replay of :mod:`.routing`.

Aux-loss normalisation. Each router attaches its losses to the activations with
``MoEAuxLossAutoScaler`` (``calculate_per_token_loss=True``: micro-batch ``m``'s loss times its
routed-token count ``n_m``), and the backward multiplies that by the class-wide scale the schedule
sets. The schedule's scale is multiplied here by ``1 / N`` (``N = sum_{dp, m} n_m``), so the
objective's router term is the token-weighted mean over the step, like the main loss::

    objective = main_loss + sum_layers sum_{dp, m} (n_m / N) * (c_aux * lb_m + c_z * z_m)

independent of how the tokens are split into micro-batches and DP ranks (as far as each ``lb_m``,
a per-micro-batch statistic, is). Padding slots are not routed tokens (``padding_mask``).

Metrics (token-weighted means over the step, every rank): ``moe/load_balancing_loss`` and
``moe/z_loss`` (mean over MoE layers of the coefficient-free losses; per layer under
``.../layer_{i}``, ``i`` counting MoE layers), ``moe/tokens_per_expert_imbalance`` (max over layers
of ``max_e tokens_e / mean_e tokens_e`` over the step; 1 is perfectly balanced) and ``moe/aux_loss``
(the coefficient-weighted router term that entered the objective).

Expert bias (aux-loss-free balancing, ``MoEConfig.router_expert_bias``). Each router's
``expert_bias`` ``[E]`` (a buffer) shifts the top-k choice only (:mod:`mcore_engine.layers.router`).
With ``router_bias_update_rate`` > 0, an optimizer step that updated the weights ends with
Megatron's update (:meth:`MoERuntime.end_optimizer_step`)::

    n = sum over TP x CP x DP of each rank's routed real tokens per expert    # [L, E], this step
    b += rate * sign(mean_e(n) - n)

``n`` counts the real tokens of the training passes since the last ``zero_grad`` (a forward-only
pass leaves it as it was). The engine, not ``finalize_model_grads``, runs the update, so a failed
pass or a skipped optimizer step leaves the bias unchanged; rate 0 never touches it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron.core.transformer.moe.router import TopKRouter

from mcore_engine.config import EngineConfig
from mcore_engine.model.routing import ROUTING_KEY, RoutingReplay, has_routing, validate_routing

__all__ = ["ROUTING_KEY", "MoERuntime", "has_routing", "validate_routing"]

_LOSS_NAMES = {"load_balancing_loss": ("load_balancing_loss", "seq_load_balancing_loss",
                                       "global_load_balancing_loss"),
               "z_loss": ("z_loss",)}


class _StepScaledAuxLoss:
    """Stands in for ``MoEAuxLossAutoScaler`` in Megatron's schedules module: ``set_loss_scale(s)``
    sets ``s * factor`` on the real class (``factor`` = the running step's ``1 / N``)."""

    factor: torch.Tensor | None = None

    @staticmethod
    def set_loss_scale(scale: torch.Tensor) -> None:
        factor = _StepScaledAuxLoss.factor
        moe_utils.MoEAuxLossAutoScaler.set_loss_scale(scale if factor is None else scale * factor)


def _install_step_scale() -> None:
    from megatron.core.pipeline_parallel import schedules

    schedules.MoEAuxLossAutoScaler = _StepScaledAuxLoss


class MoERuntime:
    """Drives the routers of one engine's model chunks through a step (module docstring).

    ``chunks``: the unwrapped ``GPTModel`` chunks of this rank. Use::

        runtime.begin(step, training=...)    # validates routed_experts, sets 1/N, arms the hooks
        ... the schedule runs ...
        outputs, metrics = runtime.finish()  # routed_experts per micro-batch, metrics (collective)
        runtime.reset()                      # always (finally): replay state and hooks disarmed
    """

    def __init__(self, chunks: list[torch.nn.Module], cfg: EngineConfig) -> None:
        moe = cfg.model.moe
        self.cfg = cfg
        self._routing = RoutingReplay(chunks, cfg)
        self.topk, self.num_experts = moe.router_topk, moe.num_experts
        self.moe_index = self._routing.moe_index
        self.num_moe_layers = self._routing.num_moe_layers
        self.chunk_routers = self._routing.chunk_routers
        # every router, the MTP modules' too (those route freely: no replay, no routed_experts, no
        # router metrics); read at construction; the engine's loss is per token
        for chunk in chunks:
            for router in (m for m in chunk.modules() if isinstance(m, TopKRouter)):
                router.calculate_per_token_loss = True
        _install_step_scale()
        # aux-loss-free balancing: the engine runs the expert-bias update (module docstring), so
        # Megatron's finalize_model_grads must not (it reads this flag; the routers read it at build)
        self._bias_routers = [m for chunk in chunks for m in chunk.modules()
                              if isinstance(m, TopKRouter) and getattr(m, "expert_bias", None) is not None]
        for chunk in chunks:
            chunk.config.moe_router_enable_expert_bias = False
        self._bias_rate = moe.router_bias_update_rate
        self._armed = False
        for i, chunk in enumerate(chunks):
            chunk.register_forward_pre_hook(self._make_pre_hook(i), with_kwargs=True)
            chunk.register_forward_hook(self._make_post_hook(i))
            for _, router in self.chunk_routers[i]:
                router.register_forward_pre_hook(self._router_pre_hook)
                router.register_forward_hook(self._router_post_hook)
        self._stats: dict[str, torch.Tensor] = {}
        self._training = False
        self._held_counts: list[torch.Tensor] | None = None
        self._snapshot: dict[int, dict[str, float]] = {}

    # ------------------------------------------------------------------ step boundaries
    def begin(self, step: Any, *, training: bool) -> None:
        """Check and stage ``routed_experts`` (every DP rank agrees on failure), set the step's
        ``1 / N`` (one all-reduce of two numbers over DP), arm the hooks."""
        par = self.cfg.parallel
        if training and par.tensor_model_parallel_size > 1 and not par.sequence_parallel:
            raise ValueError("training a MoE model with ParallelConfig.tensor_model_parallel_size > 1 needs "
                             "ParallelConfig.sequence_parallel: true (Megatron-Core's MoELayer "
                             "refuses otherwise); inference works without it")
        error: Exception | None = None
        targets: list[torch.Tensor | None] = []
        tokens = 0
        try:
            tokens = sum(int(mb.inputs.token_index.numel()) for mb in step.micro_batches)
            targets = self._routing.stage(step.micro_batches)
        except Exception as exc:  # the other DP ranks must hear of it
            error = exc
        device = step.micro_batches[0].inputs.input_ids.device
        counts = torch.tensor([float(tokens), 0.0 if error is None else 1.0], dtype=torch.float64,
                              device=device)
        group = parallel_state.get_data_parallel_group()
        if dist.get_world_size(group) > 1:
            dist.all_reduce(counts, group=group)
        if error is not None:
            raise error
        if counts[1] > 0:
            raise ValueError(f"the batch's {ROUTING_KEY} was rejected on another data-parallel rank "
                             "(see that rank's error); nothing was run")
        _StepScaledAuxLoss.factor = (1.0 / counts[0].clamp_min(1.0)).float()
        self._routing.start(step.micro_batches, targets)
        self._stats = {"tokens_per_expert": torch.zeros(self.num_moe_layers, self.num_experts,
                                                        dtype=torch.float64, device=device)}
        for name in _LOSS_NAMES:
            self._stats[name] = torch.zeros(self.num_moe_layers, dtype=torch.float64, device=device)
        self._num_tokens = counts[0].clamp_min(1.0)
        # Megatron's per-layer loss tracker only grows and is global: emptied per step (its entries
        # are re-made at this model's layer count, which another engine in the process may not
        # share), the per-router differences read from it stay exact in fp32 however long the run
        _empty_loss_tracker()
        self._step = step
        self._training = training
        # a forward-only pass (with grad enabled, the routers count) leaves the step's counts as they were
        self._held_counts = None if training else [r.local_tokens_per_expert.clone()
                                                   for r in self._bias_routers]
        self._armed = True

    def finish(self) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per micro-batch ``{"routed_experts": [rows, cols, L, k]}`` (model layout; every layer
        filled on every rank) and the step's metrics (collective over PP and DP)."""
        step = self._step
        if self._held_counts is not None:
            for router, counts in zip(self._bias_routers, self._held_counts, strict=True):
                router.local_tokens_per_expert.copy_(counts)
            self._held_counts = None
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        per_mb = self._routing.collect(step.micro_batches, pp_group)
        return per_mb, self._metrics(pp_group)

    def reset_expert_load(self) -> None:
        """Forget the routed-token counts of the expert-bias update (a new optimizer step begins)."""
        for router in self._bias_routers:
            router.local_tokens_per_expert.zero_()

    def end_optimizer_step(self, updated: bool) -> None:
        """After the optimizer step: when it ``updated`` the weights, Megatron's aux-loss-free update of
        every expert bias from the step's token counts (one all-reduce of ``[L, E]`` over TP x CP x DP;
        nothing at rate 0 or without biases); then the counts restart."""
        if updated and self._bias_rate > 0 and self._bias_routers:
            counts = torch.stack([r.local_tokens_per_expert for r in self._bias_routers])
            biases = torch.stack([r.expert_bias for r in self._bias_routers])
            updated_biases = get_updated_expert_bias(counts, biases, self._bias_rate)
            for router, bias in zip(self._bias_routers, updated_biases, strict=True):
                router.expert_bias.copy_(bias)
        self.reset_expert_load()

    def _metrics(self, pp_group: Any) -> dict[str, float]:
        moe = self.cfg.model.moe
        packed = torch.cat([self._stats["load_balancing_loss"], self._stats["z_loss"],
                            self._stats["tokens_per_expert"].reshape(-1)])
        groups = (pp_group, parallel_state.get_data_parallel_group(), self._routing.sp_group,
                  self._routing.cp_group)
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(packed, group=group)
        n_layers = self.num_moe_layers
        lb = (packed[:n_layers] / self._num_tokens).tolist()
        z = (packed[n_layers:2 * n_layers] / self._num_tokens).tolist()
        tpe = packed[2 * n_layers:].reshape(n_layers, self.num_experts)
        imbalance = (tpe.max(dim=1).values / tpe.mean(dim=1).clamp_min(1e-30)).tolist()
        metrics: dict[str, float] = {}
        if self._training and moe.aux_loss_type != "none" and moe.aux_loss_coeff > 0:
            metrics["moe/load_balancing_loss"] = sum(lb) / n_layers
            metrics.update({f"moe/load_balancing_loss/layer_{i}": v for i, v in enumerate(lb)})
        if self._training and moe.z_loss_coeff is not None:
            metrics["moe/z_loss"] = sum(z) / n_layers
            metrics.update({f"moe/z_loss/layer_{i}": v for i, v in enumerate(z)})
        if self._training:
            metrics["moe/aux_loss"] = moe.aux_loss_coeff * sum(lb) + (moe.z_loss_coeff or 0.0) * sum(z)
        metrics["moe/tokens_per_expert_imbalance"] = max(imbalance)
        metrics.update({f"moe/tokens_per_expert_imbalance/layer_{i}": v for i, v in enumerate(imbalance)})
        return metrics

    def reset(self) -> None:
        """Disarm: replay state cleared, queues emptied, the aux scale back to the schedule's own."""
        self._armed = False
        _StepScaledAuxLoss.factor = None
        self._routing.clear()

    # ------------------------------------------------------------------ hooks
    def _make_pre_hook(self, chunk: int):
        def hook(module, args, kwargs):
            return self._routing.enter(chunk, module, args, kwargs) if self._armed else None
        return hook

    def _make_post_hook(self, chunk: int):
        def hook(module, args, output):
            if self._armed:
                self._routing.exit(chunk)
            return None
        return hook

    def _router_pre_hook(self, router, args):
        if self._armed:
            self._snapshot[id(router)] = self._tracker_values(router.layer_number)

    def _router_post_hook(self, router, args, output):
        if not self._armed:
            return None
        index = self.moe_index[router.layer_number - 1]
        before = self._snapshot.pop(id(router), {})
        after = self._tracker_values(router.layer_number)
        # load balancing: the micro-batch's loss (under SP this rank's additive share of it); z: the
        # mean over this rank's routed tokens
        valid = self._routing.valid
        weights = {"load_balancing_loss": self._routing.mb_tokens, "z_loss": valid.sum().item()}
        for name, value in after.items():
            self._stats[name][index] += (value - before.get(name, 0.0)) * weights[name]
        _, routing_map = output
        valid = valid.to(routing_map.device)[:, None]
        self._stats["tokens_per_expert"][index] += (routing_map & valid).sum(dim=0).to(torch.float64)
        return None

    @staticmethod
    def _tracker_values(layer_number: int) -> dict[str, torch.Tensor]:
        tracker = moe_utils.get_moe_layer_wise_logging_tracker()
        out = {}
        for metric, names in _LOSS_NAMES.items():
            for name in names:
                if name in tracker:
                    out[metric] = out.get(metric, 0.0) + tracker[name]["values"][layer_number - 1].double()
        return out


def _empty_loss_tracker() -> None:
    """Empty Megatron-Core's global per-layer router-loss tracker: the dict itself up to 0.18, from
    0.19 ``get_moe_metrics_tracker().metrics`` (the legacy getter then returns a copy)."""
    metrics_tracker = getattr(moe_utils, "get_moe_metrics_tracker", None)
    tracker = metrics_tracker().metrics if metrics_tracker is not None else \
        moe_utils.get_moe_layer_wise_logging_tracker()
    tracker.clear()
