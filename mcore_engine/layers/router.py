"""Top-k routing with the checkpoints' semantics, in place of Megatron-Core's routing function.

:func:`install_checkpoint_routing` binds ``TopKRouter``'s ``topk_routing_with_score_function`` (and
``moe_utils.group_limited_topk``) to the functions here, which route the logits ``z = x W_r^T``
``[T, E]`` as ``transformers``' ``DeepseekV3TopkRouter`` / ``Glm4MoeTopkRouter`` (numbered: where
Megatron-Core 0.16 - 0.19 differ)::

    s = sigmoid(z)                                   # [T, E], fp32 (fp64 for fp64 logits)
    c = s + b                                        # expert bias b [E]: the choice only
    group_score[g] = sum(top2(c[g]))                 # 1. top-2, whatever k is (Megatron: top k / topk_group)
    c[experts outside the topk_group best groups] = -inf
    ids = topk(c, k)                                 # [T, k]
    w = s[ids]                                       # the unbiased scores of the chosen experts
    w = w / (w.sum(-1) + 1e-20) unless pre_softmax   # 2. for every k (Megatron: never for k = 1)
                                                     # 3. pre_softmax = no renormalisation (Megatron
                                                     #    ignores it for sigmoid)
    w = w * scaling_factor                           # routed_scaling_factor, after the normalisation

The group rule (1.) also holds for softmax scores (otherwise Megatron-Core's path). The expert-bias
token count masks padding per token (:func:`count_routed_tokens`). Router replay chooses ``ids`` as
Megatron does; ``w`` always comes from the current scores. Memory: a few ``[T, E]`` temporaries.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["count_routed_tokens", "group_limited_topk", "install_checkpoint_routing", "topk_routing"]

_MEGATRON_ROUTING: Any = None  # Megatron-Core's own topk_routing_with_score_function
_MEGATRON_GROUP_TOPK: Any = None  # and its group_limited_topk (top k / group_topk per group)


def group_limited_topk(scores: torch.Tensor, topk: int, num_tokens: int, num_experts: int, num_groups: int,
                       group_topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``group_limited_topk`` signature with DeepSeek-V3's group score, the sum of a
    group's top-2 scores (``scores`` ``[T, E]``, E = ``num_groups`` groups of ``E / num_groups >= 2``
    experts); returns the top-``topk`` ``(scores, ids)`` ``[T, topk]`` within the ``group_topk`` best
    groups."""
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)                       # [T, G]
    group_idx = group_scores.topk(group_topk, dim=-1, sorted=False).indices          # [T, group_topk]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    keep = keep.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    return scores.masked_fill(~keep, float("-inf")).topk(topk, dim=-1)


def topk_routing(logits: torch.Tensor, topk: int, use_pre_softmax: bool = False,
                 num_groups: int | None = None, group_topk: int | None = None,
                 scaling_factor: float | None = None, score_function: str = "softmax",
                 expert_bias: torch.Tensor | None = None,
                 fused: bool = False, router_replay: Any = None, dense_output: bool = False,
                 precomputed_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's ``topk_routing_with_score_function`` (same arguments and results: ``(probs
    [T, E], routing_map [T, E] bool)``, or ``(probs [T, k], ids [T, k])`` with ``dense_output``) with
    the sigmoid path of the module docstring; softmax scores, the fused (TE) path and precomputed ids
    go to Megatron's own function (whose grouped routing uses :func:`group_limited_topk`)."""
    if fused or score_function != "sigmoid" or precomputed_indices is not None:
        extra = {} if not dense_output and precomputed_indices is None else \
            dict(dense_output=dense_output, precomputed_indices=precomputed_indices)
        return _MEGATRON_ROUTING(logits, topk, use_pre_softmax=use_pre_softmax, num_groups=num_groups,
                                 group_topk=group_topk, scaling_factor=scaling_factor,
                                 score_function=score_function, expert_bias=expert_bias, fused=fused,
                                 router_replay=router_replay, **extra)
    num_tokens, num_experts = logits.shape

    def choose(choice: torch.Tensor, k: int, num_groups: int | None = None, group_topk: int | None = None):
        if group_topk:  # RouterReplay passes these two by name
            return group_limited_topk(choice, k, num_tokens, num_experts, num_groups, group_topk)
        return choice.topk(k, dim=-1)

    # --- 1. scores (fp32 at least, as transformers) and the choice ---
    scores = torch.sigmoid(logits if logits.dtype == torch.float64 else logits.float())   # [T, E]
    choice = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    if router_replay is None:
        _, ids = choose(choice, topk, num_groups, group_topk)
    else:
        _, ids = router_replay.get_replay_topk(choice, topk, num_groups, group_topk, choose)
    # --- 2. weights from the unbiased scores: renormalised unless pre_softmax, then scaled ---
    probs = scores.gather(1, ids)                                                          # [T, k]
    if not use_pre_softmax:
        probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.type_as(logits)
    if dense_output:
        return probs, ids
    if torch.are_deterministic_algorithms_enabled():  # as Megatron: index_put_ instead of scatter
        rows = torch.arange(num_tokens, device=logits.device).unsqueeze(1)
        routing_probs = torch.zeros_like(logits).index_put_((rows, ids), probs)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).index_put_(
            (rows, ids), torch.ones_like(ids, dtype=torch.bool))
        return routing_probs, routing_map
    routing_probs = torch.zeros_like(logits).scatter(1, ids, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, ids, True)
    return routing_probs, routing_map


def count_routed_tokens(router: Any, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
                        ) -> None:
    """``TopKRouter._apply_expert_bias``: add the real tokens per expert of ``routing_map`` ``[T, E]``
    (``padding_mask`` ``[T]``, True = padding) to ``router.local_tokens_per_expert`` when the router has
    an expert bias and gradients are enabled (a recomputed forward counts, its no-grad first run and
    inference do not)."""
    if router.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            router.local_tokens_per_expert += routing_map.sum(dim=0)


def install_checkpoint_routing() -> None:
    """Bind Megatron-Core's routing names (``router.topk_routing_with_score_function``,
    ``moe_utils.group_limited_topk``, ``TopKRouter._apply_expert_bias``) to :func:`topk_routing`,
    :func:`group_limited_topk` and :func:`count_routed_tokens`, for every ``TopKRouter`` of the
    process; idempotent."""
    global _MEGATRON_ROUTING, _MEGATRON_GROUP_TOPK
    from megatron.core.transformer.moe import moe_utils, router

    if _MEGATRON_ROUTING is None:
        _MEGATRON_ROUTING = moe_utils.topk_routing_with_score_function
        _MEGATRON_GROUP_TOPK = moe_utils.group_limited_topk
    router.topk_routing_with_score_function = topk_routing
    moe_utils.group_limited_topk = group_limited_topk
    router.TopKRouter._apply_expert_bias = count_routed_tokens
