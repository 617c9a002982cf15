"""SkyRL's ``PreparedModelPassBatch`` -> validated per-model groups of datums -> engine TensorDicts.

Every request is checked on the controller before any engine call (plan section 8); a bad one gets an
error message that names the field and the datum index (within its request) and is left out, the
others run. Requests are then grouped by ``(model_id, loss_fn, loss_fn_config)``: one engine pass per
group. A datum of ``N`` tokens becomes ``input_ids = model_input + [target_tokens[-1]]`` (``N + 1``;
the targets are next-token targets, checked), and per-token fields of ``N + 1`` slots whose last slot
(the one the engine masks) is 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tensordict import TensorDict

from mcore_engine.integrations.tinker.losses import (
    CRITIC_LOSSES,
    LOSSES,
    POLICY_LOSSES,
    RL_LOSSES,
    resolve_config,
)

__all__ = ["Datum", "Group", "ModelLimits", "group_requests", "to_tensordict"]


@dataclass(frozen=True)
class ModelLimits:
    """What a model accepts: its role and the base's vocabulary and length."""

    role: str
    vocab_size: int
    max_positions: int
    max_tokens_per_micro_batch: int


@dataclass
class Datum:
    """One validated datum, plain python (it pickles for the broadcast): ``tokens`` has ``N + 1`` ids,
    the float lists ``N`` values (``[]`` where the loss reads none)."""

    tokens: list[int]
    weights: list[float]
    sampling_logprobs: list[float]
    advantages: list[float]
    values: list[float]
    returns: list[float]

    @property
    def num_targets(self) -> int:
        return len(self.tokens) - 1


@dataclass
class Group:
    """Requests of one model with one loss and config: one engine pass."""

    model_id: str
    loss_fn: str
    config: dict[str, float]
    datums: list[Datum] = field(default_factory=list)
    requests: list[tuple[str, int, int]] = field(default_factory=list)
    """``(request_id, start, end)``: the request's datums are ``datums[start:end]``."""


def _tokens(model_input: Any, k: int) -> list[int]:
    out: list[int] = []
    for j, chunk in enumerate(model_input.chunks):
        kind = getattr(chunk, "type", None)
        if kind != "encoded_text":
            raise ValueError(f"datum {k}: model_input.chunks[{j}] is a {kind!r} chunk; this server takes "
                             "encoded_text chunks only (no images)")
        out.extend(chunk.tokens)
    return out


def _floats(values: Sequence[float], name: str, k: int, n: int, required: bool) -> list[float]:
    values = list(values)
    if not values and not required:
        return []
    if len(values) != n:
        what = "missing" if not values else f"{len(values)} values"
        raise ValueError(f"datum {k}: {name} must have {n} values (one per target token), got {what}")
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"datum {k}: {name}[{bad[0]}] is not finite ({values[bad[0]]})")
    return [float(v) for v in values]


def _ids(ids: Sequence[int], name: str, k: int, vocab: int) -> None:
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ValueError(f"datum {k}: {name}[{i}] = {t!r} is outside the vocabulary [0, {vocab})")


def validate_datum(batch: Any, i: int, k: int, loss_fn: str, limits: ModelLimits) -> Datum:
    """Datum ``i`` of ``batch`` (``k``-th of its request) as a :class:`Datum`; ``ValueError`` naming the
    field and ``k`` for anything the engine cannot take exactly."""
    inputs, targets = _tokens(batch.all_model_inputs[i], k), list(batch.all_targets[i])
    n = len(inputs)
    if n == 0:
        raise ValueError(f"datum {k}: model_input is empty")
    _ids(inputs, "model_input", k, limits.vocab_size)
    _ids(targets, "target_tokens", k, limits.vocab_size)
    if len(targets) != n:
        raise ValueError(f"datum {k}: target_tokens has {len(targets)} tokens, model_input {n}; they must "
                         "match")
    for t in range(n - 1):
        if targets[t] != inputs[t + 1]:
            raise ValueError(f"datum {k}: target_tokens[{t}] != model_input[{t + 1}] (this server supports "
                             "next-token targets only: target_tokens[:-1] == model_input[1:])")
    if n + 1 > limits.max_positions:
        raise ValueError(f"datum {k}: model_input has {n} tokens; with the last target {n + 1} exceed the "
                         f"model's max_position_embeddings {limits.max_positions}")
    if n + 1 > limits.max_tokens_per_micro_batch:
        raise ValueError(f"datum {k}: model_input has {n} tokens; {n + 1} exceed max_token_len_per_gpu "
                         f"{limits.max_tokens_per_micro_batch} (backend config)")
    critic = limits.role == "critic"
    rl = loss_fn in RL_LOSSES and not critic
    return Datum(tokens=inputs + [targets[-1]],
                 weights=_floats(batch.all_token_weights[i], "weights", k, n, True),
                 sampling_logprobs=_floats(batch.all_sampling_logprobs[i], "logprobs", k, n, rl),
                 advantages=_floats(batch.all_advantages[i], "advantages", k, n, rl),
                 values=_floats(batch.all_values[i], "values", k, n, False),
                 returns=_floats(batch.all_returns[i], "returns", k, n, critic))


def _check_loss(loss_fn: str, role: str) -> None:
    if loss_fn not in LOSSES:
        raise ValueError(f"loss_fn: {loss_fn!r} is not supported; expected one of {list(LOSSES)}")
    if role == "critic" and loss_fn not in CRITIC_LOSSES:
        raise ValueError(f"loss_fn: a critic model takes {sorted(CRITIC_LOSSES)}, got {loss_fn!r}")
    if role != "critic" and loss_fn not in POLICY_LOSSES:
        raise ValueError(f"loss_fn: {loss_fn!r} is only valid for critic models (model_role='critic')")


def group_requests(batch: Any, limits: dict[str, ModelLimits]) -> tuple[list[Group], dict[str, str]]:
    """Validate every request of ``batch`` (a ``PreparedModelPassBatch``) and group the good ones by
    ``(model_id, loss_fn, loss_fn_config)``; returns the groups and ``{request_id: error}``."""
    groups: dict[tuple, Group] = {}
    errors: dict[str, str] = {}
    for request_id, model_id, start, end in batch.request_batch_slices:
        try:
            if model_id not in limits:
                raise ValueError(f"model_id: model {model_id!r} not found")
            lim = limits[model_id]
            if end <= start:
                raise ValueError("data: the request has no datums")
            loss_fn, raw = batch.all_loss_fns[start], batch.all_loss_fn_configs[start]
            for i in range(start, end):
                if batch.all_model_ids[i] != model_id or batch.all_loss_fns[i] != loss_fn \
                        or batch.all_loss_fn_configs[i] != raw:
                    raise ValueError(f"datum {i - start}: model_id / loss_fn / loss_fn_config differ within "
                                     "one request")
            _check_loss(loss_fn, lim.role)
            cfg = resolve_config(loss_fn, raw)
            datums = [validate_datum(batch, i, i - start, loss_fn, lim) for i in range(start, end)]
        except ValueError as exc:
            errors[request_id] = str(exc)
            continue
        key = (model_id, loss_fn, tuple(sorted(cfg.items())))
        group = groups.setdefault(key, Group(model_id=model_id, loss_fn=loss_fn, config=cfg))
        group.requests.append((request_id, len(group.datums), len(group.datums) + len(datums)))
        group.datums.extend(datums)
    return list(groups.values()), errors


def _jagged(rows: list[list[float]], n_plus_1: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Rows padded with zeros to ``N + 1`` slots (an empty row: all zeros), as a jagged ``[B, N + 1]``."""
    out = []
    for row, n in zip(rows, n_plus_1, strict=True):
        t = torch.zeros(n, dtype=dtype)
        if row:
            t[: len(row)] = torch.tensor(row, dtype=dtype)
        out.append(t)
    return torch.nested.nested_tensor(out, layout=torch.jagged)


def to_tensordict(datums: list[Datum], max_token_len_per_gpu: int) -> TensorDict:
    """The engine batch of ``datums``: jagged ``input_ids`` and ``tinker_*`` fields ``[B, N + 1]``, a
    dynamic micro-batch size of ``max_token_len_per_gpu`` tokens (the loss is a sum: no effect on it).
    ``tinker_has_values`` is 1 on every target slot of a datum that carries old ``values``."""
    lengths = [len(d.tokens) for d in datums]
    ids = torch.nested.nested_tensor([torch.tensor(d.tokens, dtype=torch.int64) for d in datums],
                                     layout=torch.jagged)
    def rows(name: str) -> torch.Tensor:
        return _jagged([getattr(d, name) for d in datums], lengths, torch.float32)

    fields = {"input_ids": ids, "tinker_weights": rows("weights"),
              "tinker_sampling_logprobs": rows("sampling_logprobs"), "tinker_advantages": rows("advantages"),
              "tinker_values": rows("values"), "tinker_returns": rows("returns"),
              "tinker_has_values": _jagged([[1.0] * d.num_targets if d.values else [] for d in datums],
                                           lengths, torch.float32)}
    td = TensorDict(fields, batch_size=[len(datums)])
    td.set_non_tensor("use_dynamic_bsz", True)
    td.set_non_tensor("max_token_len_per_gpu", int(max_token_len_per_gpu))
    return td
