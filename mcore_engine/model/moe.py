"""Mixture-of-experts side of one engine step: aux-loss normalisation, router metrics, router replay.

Megatron-Core's ``TopKRouter`` does the routing, the aux / z losses and the replay
(``router_replay.RouterReplay``); :class:`MoERuntime` only scopes and drives them for one engine.

Aux-loss normalisation. Each router attaches its losses to the activations with
``MoEAuxLossAutoScaler`` (``calculate_per_token_loss=True``: micro-batch ``m``'s loss times its
routed-token count ``n_m``), and the backward multiplies that by the class-wide scale the schedule
sets. The schedule's scale is multiplied here by ``1 / N`` (``N = sum_{dp, m} n_m``), so the
objective's router term is the token-weighted mean over the step, like the main loss::

    objective = main_loss + sum_layers sum_{dp, m} (n_m / N) * (c_aux * lb_m + c_z * z_m)

independent of how the tokens are split into micro-batches and data-parallel ranks (as far as each
``lb_m`` is: the load-balancing loss is a per-micro-batch statistic). Padding slots are not routed
tokens (``padding_mask``).

Metrics (token-weighted means over the step, every rank): ``moe/load_balancing_loss`` and
``moe/z_loss`` (mean over MoE layers of the coefficient-free losses; per layer under
``.../layer_{i}``, ``i`` counting MoE layers), ``moe/tokens_per_expert_imbalance`` (max over layers
of ``max_e tokens_e / mean_e tokens_e`` over the step; 1 is perfectly balanced) and ``moe/aux_loss``
(the coefficient-weighted router term that entered the objective).

Router replay. ``RouterReplay`` keeps every instance in a class-level list; this engine's instances
are taken out of it at build, so two engines in one process never see each other's. Every pass
records each token's top-k expert ids per MoE layer and returns them as the per-token output
``routed_experts`` (int64, ``input_ids``' layout + ``[L_moe, k]``). A batch carrying
``routed_experts`` is routed exactly by it (``REPLAY_FORWARD``: the router's probabilities are its
scores gathered at the given ids, so the gradient reaches the router through them only).
Memory: ``tokens x L_moe x k`` int64 per step.

Expert bias (aux-loss-free balancing, ``MoEConfig.router_expert_bias``). Each router's
``expert_bias`` ``[E]`` (a buffer) shifts the top-k choice only (:mod:`mcore_engine.layers.router`).
With ``router_bias_update_rate`` > 0, an optimizer step that updated the weights ends with
Megatron's update (:meth:`MoERuntime.end_optimizer_step`)::

    n = sum over TP x CP x DP of each rank's routed real tokens per expert    # [L, E], this step
    b += rate * sign(mean_e(n) - n)

``n`` is counted by the routers while gradients are enabled (once per token: a recomputed forward
counts, its no-grad first run does not; padding is masked) over the training passes since the last
``zero_grad`` (gradient accumulation over several passes counts them all); a forward-only pass
leaves the counts as it found them. The update is scale-free, so a layout that counts every token
``tp`` times (TP without SP) would update alike; with SP / CP each rank counts its share. Megatron's
``finalize_model_grads`` would update before the loss guard's verdict and whether or not the
optimizer skips the step, so the engine takes the update over: a failed pass (zeroed grads) or a
skipped update (non-finite gradients) leaves the bias unchanged; rate 0 never touches it.

Sequence parallelism: each TP rank routes its ``s / tp`` slice of every micro-batch (router order is
s-major, so a contiguous block of rows); replay targets are cut to it, each rank records its block
and the blocks and router statistics are summed over TP.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from tensordict import TensorDictBase

from mcore_engine.config import EngineConfig

__all__ = ["ROUTING_KEY", "MoERuntime", "validate_routing"]

ROUTING_KEY = "routed_experts"
_LOSS_NAMES = {"load_balancing_loss": ("load_balancing_loss", "seq_load_balancing_loss",
                                       "global_load_balancing_loss"),
               "z_loss": ("z_loss",)}


# ----------------------------------------------------------------------------------------------------
# the aux-loss scale: the schedule's value times this step's 1 / N
# ----------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------
# routing tensors
# ----------------------------------------------------------------------------------------------------
def validate_routing(values: torch.Tensor, *, num_layers: int, topk: int, num_experts: int) -> None:
    """``ValueError`` naming ``routed_experts`` unless ``values`` (real tokens ``[N, L, k]``) is an
    integer tensor with ``L = num_layers`` MoE layers, ``k = topk`` distinct ids in ``[0, num_experts)``."""
    key = ROUTING_KEY
    if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
        raise ValueError(f"{key} must be an integer tensor, got {values.dtype}")
    if values.dim() != 3 or tuple(values.shape[1:]) != (num_layers, topk):
        raise ValueError(f"{key} must have per-token shape [{num_layers} MoE layers, {topk} experts], "
                         f"got {tuple(values.shape[1:])}")
    if values.numel() == 0:
        return
    lo, hi = int(values.min()), int(values.max())
    if lo < 0 or hi >= num_experts:
        raise ValueError(f"{key}: expert ids must be in [0, {num_experts}), got range [{lo}, {hi}]")
    if topk > 1:
        ordered = values.sort(dim=-1).values
        if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
            raise ValueError(f"{key}: the {topk} expert ids of a token must be distinct")


def _to_router_order(t: torch.Tensor) -> torch.Tensor:
    """``[b, S, ...]`` model layout -> ``[S * b, ...]``, the router's token order (s-major)."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _from_router_order(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return t.reshape(cols, rows, *t.shape[1:]).transpose(0, 1)


# ----------------------------------------------------------------------------------------------------
# the runtime
# ----------------------------------------------------------------------------------------------------
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
        self.topk, self.num_experts = moe.router_topk, moe.num_experts
        pattern = moe.layer_pattern(cfg.model.num_layers)
        self.moe_index = {layer: sum(pattern[:layer]) for layer in range(len(pattern)) if pattern[layer]}
        self.num_moe_layers = sum(pattern)
        self.chunk_routers: list[list[tuple[int, TopKRouter]]] = []
        for chunk in chunks:
            routers = sorted(((m.layer_number - 1, m) for m in chunk.decoder.modules()
                              if isinstance(m, TopKRouter)), key=lambda item: item[0])
            self.chunk_routers.append([(self.moe_index[layer], r) for layer, r in routers])
            # every router, the MTP modules' too (those route freely: no replay, no routed_experts, no
            # router metrics); read at construction; the engine's loss is per token
            for router in (m for m in chunk.modules() if isinstance(m, TopKRouter)):
                router.calculate_per_token_loss = True
        ours = {id(m.router_replay) for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in ours]
        _install_step_scale()
        # aux-loss-free balancing: the engine runs the expert-bias update (module docstring), so
        # Megatron's finalize_model_grads must not (it reads this flag; the routers read it at build)
        self._bias_routers = [m for chunk in chunks for m in chunk.modules()
                              if isinstance(m, TopKRouter) and getattr(m, "expert_bias", None) is not None]
        for chunk in chunks:
            chunk.config.moe_router_enable_expert_bias = False
        self._bias_rate = moe.router_bias_update_rate
        self._queues: list[deque] = [deque() for _ in chunks]
        self._active: list[Any] = [None for _ in chunks]
        self._armed = False
        self._replay = False
        self._records: dict[int, torch.Tensor] = {}
        for i, chunk in enumerate(chunks):
            chunk.register_forward_pre_hook(self._make_pre_hook(i), with_kwargs=True)
            chunk.register_forward_hook(self._make_post_hook(i))
            for _, router in self.chunk_routers[i]:
                router.register_forward_pre_hook(self._router_pre_hook)
                router.register_forward_hook(self._router_post_hook)
        self._stats: dict[str, torch.Tensor] = {}
        # sequence parallelism: each TP rank routes its s / tp slice of every micro-batch
        sp = cfg.parallel.sequence_parallel
        self._sp_group = parallel_state.get_tensor_model_parallel_group() if sp else None
        self._tp_size = parallel_state.get_tensor_model_parallel_world_size() if sp else 1
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank() if sp else 0
        # context parallelism: each CP rank routes its share of every micro-batch (MicroBatch.cp)
        cp = cfg.parallel.context_parallel_size
        self._cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
        self._training = False
        self._held_counts: list[torch.Tensor] | None = None
        self._valid = torch.ones(0, dtype=torch.bool)
        self._snapshot: dict[int, dict[str, float]] = {}
        self._mb_tokens = 0

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
            self._replay = any(ROUTING_KEY in mb.data.keys() for mb in step.micro_batches)
            for mb in step.micro_batches:
                tokens += int(mb.inputs.token_index.numel())
                targets.append(self._stage_targets(mb) if self._replay else None)
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
        for queue in self._queues:
            queue.clear()
            queue.extend(zip(step.micro_batches, targets, strict=True))
        self._records = {}
        self._stats = {"tokens_per_expert": torch.zeros(self.num_moe_layers, self.num_experts,
                                                        dtype=torch.float64, device=device)}
        for name in _LOSS_NAMES:
            self._stats[name] = torch.zeros(self.num_moe_layers, dtype=torch.float64, device=device)
        self._num_tokens = counts[0].clamp_min(1.0)
        # Megatron's per-layer loss tracker only grows; zeroed per step, the per-router differences
        # read from it stay exact in fp32 however long the run
        moe_utils.clear_aux_losses_tracker()
        self._step = step
        self._training = training
        # a forward-only pass (with grad enabled, the routers count) leaves the step's counts as they were
        self._held_counts = None if training else [r.local_tokens_per_expert.clone()
                                                   for r in self._bias_routers]
        self._armed = True

    def _stage_targets(self, mb: Any) -> torch.Tensor:
        """The micro-batch's ``routed_experts`` in router order ``[S * b, L, k]`` (padding: ids 0..k-1)."""
        from mcore_engine.data.layout import token_values

        if ROUTING_KEY not in mb.data.keys():
            raise ValueError(f"batch key {ROUTING_KEY}: every micro-batch needs it once one has it")
        values = token_values(mb.data, ROUTING_KEY)
        validate_routing(values, num_layers=self.num_moe_layers, topk=self.topk, num_experts=self.num_experts)
        inputs = mb.inputs
        fill = torch.arange(self.topk, dtype=torch.int64).expand(self.num_moe_layers, self.topk)
        rows, cols = inputs.input_ids.shape
        full = fill.to(inputs.input_ids.device).repeat(rows * cols, 1, 1)
        full = full.index_copy(0, inputs.token_index.to(full.device), values.to(full.device, torch.int64))
        return _to_router_order(full.reshape(rows, cols, self.num_moe_layers, self.topk))

    def finish_into(self, out: TensorDictBase, step: Any) -> None:
        """Add ``routed_experts`` (``input_ids``' layout + ``[L, k]``) and the router metrics to a
        step's output TensorDict ``out``; disarms (collective over PP and DP)."""
        from mcore_engine.step.prepare import collect_outputs

        try:
            per_mb, metrics = self.finish()
        finally:
            self.reset()
        for key, value in collect_outputs(step, per_mb).items():
            out.set(key, value)
        out.set_non_tensor("metrics", {**out.get_non_tensor("metrics"), **metrics})

    def finish(self) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        """Per micro-batch ``{"routed_experts": [rows, cols, L, k]}`` (model layout; every layer
        filled on every rank: one SUM over the pipeline group) and the step's metrics (collective
        over PP and DP)."""
        step = self._step
        if self._held_counts is not None:
            for router, counts in zip(self._bias_routers, self._held_counts, strict=True):
                router.local_tokens_per_expert.copy_(counts)
            self._held_counts = None
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        per_mb = []
        flat = []
        for mb in step.micro_batches:
            rows, cols = mb.inputs.input_ids.shape
            rec = self._records.get(mb.index)
            if rec is None:
                rec = torch.zeros(rows * cols, self.num_moe_layers, self.topk, dtype=torch.int64,
                                  device=mb.inputs.input_ids.device)
            flat.append(rec)
        joined = torch.cat(flat)
        for group in (pp_group, self._sp_group, self._cp_group):  # each stage / share filled its own rows
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(joined, group=group)
        start = 0
        for mb in step.micro_batches:
            rows, cols = mb.inputs.input_ids.shape
            part = joined[start:start + rows * cols]
            start += rows * cols
            per_mb.append({ROUTING_KEY: _from_router_order(part, rows, cols)})
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
        for group in (pp_group, parallel_state.get_data_parallel_group(), self._sp_group, self._cp_group):
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
        for queue in self._queues:
            queue.clear()
        for routers in self.chunk_routers:
            for _, router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()

    # ------------------------------------------------------------------ hooks
    def _make_pre_hook(self, chunk: int):
        def hook(module, args, kwargs):
            if not self._armed:
                return None
            if not self._queues[chunk]:  # a forward outside the engine's schedule
                return None
            mb, target = self._queues[chunk].popleft()
            self._active[chunk] = mb
            inputs = mb.inputs
            rows, cols = inputs.input_ids.shape
            local = self._local_rows(mb)
            action = RouterReplayAction.REPLAY_FORWARD if target is not None else RouterReplayAction.RECORD
            for index, router in self.chunk_routers[chunk]:
                replay = router.router_replay
                replay.clear_indices()
                replay.set_router_replay_action(action)
                if target is not None:
                    replay.set_target_indices(target[local, index].contiguous())
            padding = torch.ones(rows * cols, dtype=torch.bool, device=inputs.input_ids.device)
            padding[inputs.token_index.to(padding.device)] = False
            padding = padding.reshape(rows, cols)
            self._mb_tokens = int(inputs.token_index.numel())
            self._valid = ~_to_router_order(padding)[local]
            if mb.cp is not None:  # the model sees this CP rank's share
                padding = padding.reshape(-1)[mb.cp.slots[mb.cp.rank]].reshape(mb.cp.local_shape)
            if self._tp_size > 1 and not module.pre_process:  # GPTModel scatters it on the first stage only
                padding = padding.chunk(self._tp_size, dim=1)[self._tp_rank]
            return args, {**kwargs, "padding_mask": padding}
        return hook

    def _local_rows(self, mb: Any) -> slice | torch.Tensor:
        """This rank's rows of micro-batch ``mb`` in the whole pack's router order (s-major): all of
        them, or its context-parallel share (``mb.cp``, in the local router order), then under
        sequence parallelism its ``s / tp`` slice of those."""
        rows, cols = mb.inputs.input_ids.shape
        if mb.cp is None:
            per_rank = rows * cols // self._tp_size
            return slice(self._tp_rank * per_rank, (self._tp_rank + 1) * per_rank)
        column = mb.cp.slots[mb.cp.rank].reshape(rows, -1) % cols      # [rows, cols / cp] global columns
        order = (column * rows + torch.arange(rows, device=column.device)[:, None]).T.reshape(-1)
        per_rank = order.numel() // self._tp_size
        return order[self._tp_rank * per_rank:(self._tp_rank + 1) * per_rank]

    def _make_post_hook(self, chunk: int):
        def hook(module, args, output):
            if not self._armed:
                return None
            mb = self._active[chunk]
            if mb is None:
                return None
            self._active[chunk] = None
            rows, cols = mb.inputs.input_ids.shape
            rec = self._records.get(mb.index)
            if rec is None:
                rec = torch.zeros(rows * cols, self.num_moe_layers, self.topk, dtype=torch.int64,
                                  device=mb.inputs.input_ids.device)
                self._records[mb.index] = rec
            local = self._local_rows(mb)
            for index, router in self.chunk_routers[chunk]:
                replay = router.router_replay
                ids = replay.recorded_topk_idx if replay.recorded_topk_idx is not None else \
                    replay.target_topk_idx
                rec[local, index] = ids.to(rec.device, torch.int64)
                replay.clear_indices()
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
        weights = {"load_balancing_loss": self._mb_tokens, "z_loss": self._valid.sum().item()}
        for name, value in after.items():
            self._stats[name][index] += (value - before.get(name, 0.0)) * weights[name]
        _, routing_map = output
        valid = self._valid.to(routing_map.device)[:, None]
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


def has_routing(batch: TensorDictBase) -> bool:
    """True when ``batch`` carries ``routed_experts``."""
    return ROUTING_KEY in batch.keys()
