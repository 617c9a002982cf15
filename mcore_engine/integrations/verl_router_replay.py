"""verl's MoE router replay (``engine_config.router_replay.mode``) on the core's replay.

The core routes a batch carrying ``routed_experts`` (jagged ``[B, j, L, k]`` like ``input_ids``; ``L``
the MoE layers or every decoder layer) by it and records the routing of every pass. Per pass, as
verl's Megatron engine:

- ``"disabled"``: native routing; a batch's routes are dropped and none returned (verl's trainer
  would replay a returned one).
- ``"R2"``: a forward-only pass without routes (the old log-probs) returns the recorded routing
  (int16); a batch with routes (the update) replays them, however the core splits it.
- ``"R3"``: every pass replays the rollout's routes; rows the rollout never routed (the last
  generated token, trailing all-zero rows) go to experts ``0 .. k-1`` (no log-prob depends on them).

A ``forward_only`` engine and a critic route natively; the batch flag ``enable_routing_replay=False``
turns replay off for a pass. Memory: one int64 copy of the routes per pass, one int16 copy of a
returned routing.
"""

from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from mcore_engine.config import ModelConfig

__all__ = ["MODES", "ROUTING_KEY", "RouterReplayPass", "prepare_routing"]

ROUTING_KEY = "routed_experts"
MODES = ("disabled", "R2", "R3")


class RouterReplayPass:
    """What one pass does with routing: ``data`` (the batch for the core: its ``routed_experts``
    dropped, kept, or aligned) and ``return_routes`` (hand the recorded routing back to verl)."""

    def __init__(self, data: TensorDict, return_routes: bool) -> None:
        self.data = data
        self.return_routes = return_routes

    def outputs(self, model_output: dict[str, Any]) -> dict[str, Any]:
        """verl's ``model_output``: the recorded routing as verl's int16 jagged tensor, or none."""
        routes = model_output.pop(ROUTING_KEY, None)
        if self.return_routes and routes is not None:
            model_output[ROUTING_KEY] = _as_int16(routes)
        return model_output


def prepare_routing(data: TensorDict, mode: str, model: ModelConfig, *, forward_only: bool,
                    replay_enabled: bool | None) -> RouterReplayPass:
    """The pass for ``mode`` (module docstring); ``data`` is not modified. ``replay_enabled``: verl's
    batch flag ``enable_routing_replay`` (None when absent). ``ValueError`` naming the field when the
    mode needs routes the batch lacks or the routes do not fit the model."""
    has_routes = ROUTING_KEY in data.keys()
    if mode == "disabled" or model.moe is None or replay_enabled is False:
        return RouterReplayPass(data.exclude(ROUTING_KEY) if has_routes else data, False)
    if mode == "R2":
        if has_routes:
            return RouterReplayPass(_with_routes(data, _select_layers(data, model)), False)
        if not forward_only:
            raise ValueError(f"engine_config.router_replay.mode='R2' replays in the update the routing "
                             f"recorded by the actor's old-log-prob pass, but the batch has no "
                             f"{ROUTING_KEY!r}: keep verl's old-log-prob recomputation on "
                             "(algorithm.rollout_correction.bypass_mode=false)")
        return RouterReplayPass(data, True)
    if not has_routes:
        raise ValueError(f"engine_config.router_replay.mode='R3' replays the rollout's routing, but the "
                         f"batch has no {ROUTING_KEY!r}: set actor_rollout_ref.rollout."
                         "enable_rollout_routing_replay=true (a rollout that returns routed experts)")
    return RouterReplayPass(_with_routes(data, _align_rollout_routes(data, model)), False)


# ----------------------------------------------------------------------------------------------------
def _as_int16(routes: torch.Tensor) -> torch.Tensor:
    """verl's dtype for routes (its Megatron engine's ``merge_nested_router_maps``); jagged stays
    jagged on the same offsets."""
    if routes.is_nested:
        values = routes.values().to(torch.int16)
        return torch.nested.nested_tensor_from_jagged(values, offsets=routes.offsets())
    return routes.to(torch.int16)


def _jagged(data: TensorDict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(route values ``[N', L, k]``, route lengths ``[B]``, input lengths ``[B]``) of a batch whose
    ``input_ids`` and ``routed_experts`` are jagged (verl's no-padding batches)."""
    from mcore_engine.data.layout import is_jagged, jagged_lengths

    routes, ids = data[ROUTING_KEY], data["input_ids"]
    if not is_jagged(routes) or not is_jagged(ids):
        kind = {True: "jagged", False: "dense"}
        raise ValueError(f"{ROUTING_KEY} must be jagged [B, j, L, k] like input_ids (verl's "
                         f"left_right_2_no_padding); got {kind[is_jagged(routes)]} {ROUTING_KEY} and "
                         f"{kind[is_jagged(ids)]} input_ids")
    if routes.dim() != 4:
        raise ValueError(f"{ROUTING_KEY} must be [B, j, L, k], got {routes.dim()} dims")
    values = torch.cat(routes.unbind()) if routes.lengths() is not None else \
        routes.values()[int(routes.offsets()[0]):int(routes.offsets()[-1])]
    return values, jagged_lengths(routes), jagged_lengths(ids)


def _layer_columns(num_layers_given: int, model: ModelConfig) -> torch.Tensor | None:
    """Indices of the MoE layers on a routes' layer axis of ``num_layers_given`` (None: all of them)."""
    pattern = model.moe.layer_pattern(model.num_layers)
    moe_layers = sum(pattern)
    if num_layers_given == moe_layers:
        return None
    if num_layers_given == model.num_layers:
        return torch.tensor([i for i, p in enumerate(pattern) if p], dtype=torch.int64)
    raise ValueError(f"{ROUTING_KEY}: a layer axis of {num_layers_given}; expected the model's {moe_layers} "
                     f"MoE layers or all its {model.num_layers} decoder layers")


def _select_layers(data: TensorDict, model: ModelConfig) -> torch.Tensor:
    """R2: the routes' values ``[N, L_moe, k]`` (int64), one row per token."""
    values, route_lengths, lengths = _jagged(data)
    if not torch.equal(route_lengths, lengths):
        raise ValueError(f"{ROUTING_KEY}: sequence lengths {route_lengths.tolist()} differ from "
                         f"input_ids' {lengths.tolist()}")
    columns = _layer_columns(values.shape[1], model)
    return (values if columns is None else values[:, columns.to(values.device)]).to(torch.int64)


def _align_rollout_routes(data: TensorDict, model: ModelConfig) -> torch.Tensor:
    """R3: the rollout's routes as ``[N, L_moe, k]`` (int64), one row per token: a sequence may have a
    row per token or one fewer (verl's ``align_r3_router_replay_data``); its last row and its trailing
    all-zero rows (tokens the rollout did not route) become experts ``0 .. k-1``."""
    values, route_lengths, lengths = _jagged(data)
    short = route_lengths == lengths - 1
    if not bool(((route_lengths == lengths) | short).all()):
        bad = int(((route_lengths != lengths) & ~short).nonzero()[0])
        raise ValueError(f"{ROUTING_KEY}: sequence {bad} has {int(route_lengths[bad])} routed tokens for "
                         f"{int(lengths[bad])} input tokens; expected as many or one fewer (the last "
                         "generated token, which the rollout never fed)")
    columns = _layer_columns(values.shape[1], model)
    values = (values if columns is None else values[:, columns.to(values.device)]).to(torch.int64)
    k = values.shape[-1]
    if bool(short.any()):  # append a placeholder row to the sequences that lack their last one
        starts = torch.cat([torch.zeros(1, dtype=torch.int64), route_lengths.cumsum(0)])
        parts = []
        for i in range(len(lengths)):
            parts.append(values[int(starts[i]):int(starts[i + 1])])
            if short[i]:
                parts.append(values.new_zeros(1, *values.shape[1:]))
        values = torch.cat(parts)
    # per token: its sequence, and whether it or a later token of its sequence was routed
    seq = torch.repeat_interleave(torch.arange(len(lengths)), lengths).to(values.device)
    index = torch.arange(values.shape[0], device=values.device)
    routed = (values != 0).flatten(1).any(dim=1)
    last_routed = torch.full((len(lengths),), -1, dtype=torch.int64, device=values.device)
    last_routed = last_routed.scatter_reduce(0, seq, torch.where(routed, index, -1), reduce="amax")
    ends = lengths.cumsum(0).to(values.device) - 1
    unrouted = (index > last_routed[seq]) | (index == ends[seq])
    fill = torch.arange(k, dtype=torch.int64, device=values.device)
    return torch.where(unrouted[:, None, None], fill, values)


def _with_routes(data: TensorDict, values: torch.Tensor) -> TensorDict:
    """A shallow copy of ``data`` whose ``routed_experts`` is ``values`` on ``input_ids``' offsets."""
    ids = data["input_ids"]
    offsets = ids.offsets() if ids.lengths() is None else \
        torch.cat([ids.offsets().new_zeros(1), ids.lengths().cumsum(0)])
    routes = torch.nested.nested_tensor_from_jagged(values, offsets=offsets.to(values.device))
    out = data.copy()
    out.set(ROUTING_KEY, routes)
    return out
