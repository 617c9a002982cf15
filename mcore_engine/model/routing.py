"""Router replay for one engine's chunks: each token's top-k expert ids per MoE layer, recorded on
every pass as the per-token output ``routed_experts`` (int64, ``input_ids``' layout + ``[L_moe, k]``),
or replayed from a batch that carries them (``RouterReplay.REPLAY_FORWARD``: the probabilities are
the router's scores gathered at the given ids, the gradient reaches it through them only). This
engine's ``RouterReplay`` instances leave the class-wide list, so two engines in one process never
meet. Under SP / CP each rank routes its share of a micro-batch (SP: a contiguous block of the s-major
router order); the records are summed over TP / CP. Memory: ``tokens x L_moe x k`` int64 per step.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from tensordict import TensorDictBase

from mcore_engine.config import EngineConfig

__all__ = ["ROUTING_KEY", "RoutingReplay", "has_routing", "validate_routing"]

ROUTING_KEY = "routed_experts"


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


def has_routing(batch: TensorDictBase) -> bool:
    """True when ``batch`` carries ``routed_experts``."""
    return ROUTING_KEY in batch.keys()


def _to_router_order(t: torch.Tensor) -> torch.Tensor:
    """``[b, S, ...]`` model layout -> ``[S * b, ...]``, the router's token order (s-major)."""
    return t.transpose(0, 1).reshape(-1, *t.shape[2:])


def _from_router_order(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return t.reshape(cols, rows, *t.shape[1:]).transpose(0, 1)


class RoutingReplay:
    """Records (or replays) the routing of one engine's chunks, one micro-batch at a time.

    ``chunk_routers[c]``: chunk ``c``'s decoder routers as ``(MoE layer index, router)``. A step::

        targets = replay.stage(micro_batches)   # validates routed_experts (may raise)
        replay.start(micro_batches, targets)
        ... each chunk forward: enter(c, ...) / exit(c) ...
        per_mb = replay.collect(micro_batches, pp_group)   # collective over PP, SP, CP
        replay.clear()
    """

    def __init__(self, chunks: list[torch.nn.Module], cfg: EngineConfig) -> None:
        moe = cfg.model.moe
        self.topk, self.num_experts = moe.router_topk, moe.num_experts
        pattern = moe.layer_pattern(cfg.model.num_layers)
        self.moe_index = {layer: sum(pattern[:layer]) for layer in range(len(pattern)) if pattern[layer]}
        self.num_moe_layers = sum(pattern)
        self.chunk_routers: list[list[tuple[int, TopKRouter]]] = []
        for chunk in chunks:
            routers = sorted(((m.layer_number - 1, m) for m in chunk.decoder.modules()
                              if isinstance(m, TopKRouter)), key=lambda item: item[0])
            self.chunk_routers.append([(self.moe_index[layer], r) for layer, r in routers])
        ours = {id(m.router_replay) for chunk in chunks for m in chunk.modules() if isinstance(m, TopKRouter)}
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in ours]
        sp = cfg.parallel.sequence_parallel
        self.sp_group = parallel_state.get_tensor_model_parallel_group() if sp else None
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size() if sp else 1
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank() if sp else 0
        cp = cfg.parallel.context_parallel_size
        self.cp_group = parallel_state.get_context_parallel_group() if cp > 1 else None
        self._queues: list[deque] = [deque() for _ in chunks]
        self._active: list[Any] = [None for _ in chunks]
        self._records: dict[int, torch.Tensor] = {}
        self.valid = torch.ones(0, dtype=torch.bool)  # the running micro-batch's routed rows: real tokens
        self.mb_tokens = 0  # the running micro-batch's real tokens

    def stage(self, micro_batches: list[Any]) -> list[torch.Tensor | None]:
        """Each micro-batch's ``routed_experts`` in router order ``[S * b, L, k]``, or ``None`` each
        when no micro-batch carries them."""
        replay = any(ROUTING_KEY in mb.data.keys() for mb in micro_batches)
        return [self._stage_targets(mb) if replay else None for mb in micro_batches]

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

    def start(self, micro_batches: list[Any], targets: list[torch.Tensor | None]) -> None:
        """Queue the step's micro-batches (each chunk runs them in order) and forget old records."""
        for queue in self._queues:
            queue.clear()
            queue.extend(zip(micro_batches, targets, strict=True))
        self._records = {}

    def enter(self, chunk: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """Chunk ``chunk``'s forward pre-hook: arm its routers to record or replay the next queued
        micro-batch and pass the model its ``padding_mask`` (the model's layout, this rank's share)."""
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
        self.mb_tokens = int(inputs.token_index.numel())
        self.valid = ~_to_router_order(padding)[local]
        if mb.cp is not None:  # the model sees this CP rank's share
            padding = padding.reshape(-1)[mb.cp.slots[mb.cp.rank]].reshape(mb.cp.local_shape)
        if self.tp_size > 1 and not module.pre_process:  # GPTModel scatters it on the first stage only
            padding = padding.chunk(self.tp_size, dim=1)[self.tp_rank]
        return args, {**kwargs, "padding_mask": padding}

    def exit(self, chunk: int) -> None:
        """Chunk ``chunk``'s forward hook: keep its routers' ids for the running micro-batch."""
        mb = self._active[chunk]
        if mb is None:
            return
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

    def _local_rows(self, mb: Any) -> slice | torch.Tensor:
        """This rank's rows of micro-batch ``mb`` in the whole pack's router order (s-major): all of
        them, or its context-parallel share (``mb.cp``, in the local router order), then under
        sequence parallelism its ``s / tp`` slice of those."""
        rows, cols = mb.inputs.input_ids.shape
        if mb.cp is None:
            per_rank = rows * cols // self.tp_size
            return slice(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank)
        column = mb.cp.slots[mb.cp.rank].reshape(rows, -1) % cols      # [rows, cols / cp] global columns
        order = (column * rows + torch.arange(rows, device=column.device)[:, None]).T.reshape(-1)
        per_rank = order.numel() // self.tp_size
        return order[self.tp_rank * per_rank:(self.tp_rank + 1) * per_rank]

    def collect(self, micro_batches: list[Any], pp_group: Any) -> list[dict[str, torch.Tensor]]:
        """Per micro-batch ``{"routed_experts": [rows, cols, L, k]}`` (model layout), every layer filled
        on every rank: one SUM over the pipeline, sequence- and context-parallel groups."""
        flat = []
        for mb in micro_batches:
            rows, cols = mb.inputs.input_ids.shape
            rec = self._records.get(mb.index)
            if rec is None:
                rec = torch.zeros(rows * cols, self.num_moe_layers, self.topk, dtype=torch.int64,
                                  device=mb.inputs.input_ids.device)
            flat.append(rec)
        joined = torch.cat(flat)
        for group in (pp_group, self.sp_group, self.cp_group):  # each stage / share filled its own rows
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(joined, group=group)
        per_mb = []
        start = 0
        for mb in micro_batches:
            rows, cols = mb.inputs.input_ids.shape
            part = joined[start:start + rows * cols]
            start += rows * cols
            per_mb.append({ROUTING_KEY: _from_router_order(part, rows, cols)})
        return per_mb

    def clear(self) -> None:
        """Empty the queues and clear every router's replay state."""
        for queue in self._queues:
            queue.clear()
        for routers in self.chunk_routers:
            for _, router in routers:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
