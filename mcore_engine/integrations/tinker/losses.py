"""Tinker's six losses (SkyRL 0.3.0's names): per-token formulas, the engine's flat loss function.

Per token i of a datum: ``lp`` = learner log-prob of ``targets[i]`` (a critic: its value ``v``),
``q`` = sampling log-prob, ``A`` = advantage, ``w`` = weight, ``r = exp(lp - q)``, ``sg`` =
stop-gradient. The loss is the plain sum ``L = sum_datums sum_i w_i * l_i`` (Tinker's definition, no
normalisation; ``forward_backward_custom`` relies on it)::

    cross_entropy        l = -lp
    importance_sampling  l = -r * A                                        (plain exp)
    ppo                  l = -min(r * A, clip(r, lo, hi) * A)              lo 0.8, hi 1.2 (ratio bounds)
    cispo                l = -sg(clip(r, lo, hi)) * lp * A                 lo 0.8, hi 1.2
    dppo                 l = -r * A * m,  m = sg(0 if A > 0 and p - mu > d_hi or A < 0 and mu - p > d_lo
                                                 else 1),  p = e^lp, mu = e^q   d_lo = d_hi = 0.2
    ppo_critic           l = 1/2 max((v_c - R)^2, (v - R)^2),  v_c = v_old + clamp(v - v_old, -c, c)
                         without old values: 1/2 (v - R)^2                 c = value_clip 0.2

ppo / cispo / dppo take ``r = exp(clamp(lp - q, -20, 20))`` (SkyRL-Train's ``safe_exp_delta``: no
``inf * 0``). A critic takes ``ppo`` or ``ppo_critic`` (both the value loss above); a policy refuses
``ppo_critic``. Everything is computed in fp32 whatever the inputs' dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["CONFIG_DEFAULTS", "CRITIC_LOSSES", "FIELDS", "LOSSES", "POLICY_LOSSES", "RL_LOSSES",
           "elementwise", "engine_elementwise", "engine_loss_fn", "resolve_config"]

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "ppo_critic", "dppo")
POLICY_LOSSES = frozenset(LOSSES) - {"ppo_critic"}
CRITIC_LOSSES = frozenset({"ppo", "ppo_critic"})
RL_LOSSES = frozenset({"importance_sampling", "ppo", "cispo", "dppo"})
"""Policy losses that need the datum's sampling ``logprobs`` and ``advantages``."""

CONFIG_DEFAULTS: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2, "value_clip": 0.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "ppo_critic": {"value_clip": 0.2},
    "dppo": {"delta_low": 0.2, "delta_high": 0.2},
}
"""The ``loss_fn_config`` keys each loss takes (SkyRL's API refuses others with 422) and defaults."""

_RATIO_CLAMP = 20.0


def resolve_config(loss_fn: str, config: Mapping[str, float] | None) -> dict[str, float]:
    """``config`` over the loss's defaults; ``ValueError`` naming ``loss_fn`` / ``loss_fn_config`` for an
    unknown loss, an unknown key or a non-finite value."""
    if loss_fn not in CONFIG_DEFAULTS:
        raise ValueError(f"loss_fn: {loss_fn!r} is not supported; expected one of {list(LOSSES)}")
    out = dict(CONFIG_DEFAULTS[loss_fn])
    for key, value in (config or {}).items():
        if key not in out:
            raise ValueError(f"loss_fn_config: unknown key {key!r} for loss_fn={loss_fn!r}; "
                             f"expected some of {sorted(out)}")
        value = float(value)
        if not torch.isfinite(torch.tensor(value)):
            raise ValueError(f"loss_fn_config.{key} must be finite, got {value}")
        out[key] = value
    return out


def _ratio(lp: torch.Tensor, q: torch.Tensor, clamp: bool) -> torch.Tensor:
    delta = lp - q
    return torch.exp(delta.clamp(-_RATIO_CLAMP, _RATIO_CLAMP) if clamp else delta)


def elementwise(loss_fn: str, x: torch.Tensor, cfg: Mapping[str, float], *, critic: bool = False,
                sampling_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                old_values: torch.Tensor | None = None, returns: torch.Tensor | None = None,
                has_old_values: torch.Tensor | None = None) -> torch.Tensor:
    """The unweighted per-token loss ``l`` (module docstring), fp32, same shape as ``x``.

    ``x``: log-probs ``lp`` (policy) or values ``v`` (``critic``); the other tensors have ``x``'s shape.
    ``cfg``: :func:`resolve_config`'s dict. A critic reads ``returns`` and, where ``has_old_values`` is
    nonzero (per token; None: nowhere), ``old_values`` for the clipped term. Differentiable in ``x``."""
    x = x.float()

    def f(t: torch.Tensor | None, name: str) -> torch.Tensor:
        if t is None:
            raise ValueError(f"{loss_fn} needs {name}")
        return t.to(device=x.device, dtype=torch.float32)

    if critic:
        if loss_fn not in CRITIC_LOSSES:
            raise ValueError(f"loss_fn: a critic takes {sorted(CRITIC_LOSSES)}, got {loss_fn!r}")
        ret = f(returns, "returns")
        plain = (x - ret) ** 2
        if has_old_values is None:
            return 0.5 * plain
        old, c = f(old_values, "values"), cfg["value_clip"]
        clipped = old + (x - old).clamp(-c, c)
        return 0.5 * torch.where(f(has_old_values, "has_old_values") != 0,
                                 torch.maximum((clipped - ret) ** 2, plain), plain)
    if loss_fn not in POLICY_LOSSES:
        raise ValueError(f"loss_fn: {loss_fn!r} needs a critic model (model_role='critic')")
    if loss_fn == "cross_entropy":
        return -x
    q, adv = f(sampling_logprobs, "logprobs"), f(advantages, "advantages")
    if loss_fn == "importance_sampling":
        return -_ratio(x, q, clamp=False) * adv
    r = _ratio(x, q, clamp=True)
    if loss_fn == "ppo":
        clipped = r.clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -torch.minimum(r * adv, clipped * adv)
    if loss_fn == "cispo":
        clipped = r.detach().clamp(cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -clipped * x * adv
    # dppo, binary total variation
    with torch.no_grad():
        diff = torch.exp(x) - torch.exp(q)
        drop = ((adv > 0) & (diff > cfg["delta_high"])) | ((adv < 0) & (-diff > cfg["delta_low"]))
        mask = (~drop).float()
    return -r * adv * mask


FIELDS = ("tinker_weights", "tinker_sampling_logprobs", "tinker_advantages", "tinker_values",
          "tinker_returns", "tinker_has_values")
"""The batch's per-token fields (``batch.py`` fills them; 0 on each sequence's last slot)."""


def engine_elementwise(loss_fn: str, x: torch.Tensor, data: Mapping[str, Any], cfg: Mapping[str, float],
                       critic: bool) -> torch.Tensor:
    """:func:`elementwise` on a batch's ``tinker_*`` fields (flat or per datum)."""
    return elementwise(loss_fn, x, cfg, critic=critic, sampling_logprobs=data["tinker_sampling_logprobs"],
                       advantages=data["tinker_advantages"], old_values=data["tinker_values"],
                       returns=data["tinker_returns"], has_old_values=data["tinker_has_values"])


NOT_FINITE = ("the loss is not finite: importance_sampling's exp(logprob - logprobs) overflows where "
              "the datum's logprobs lie far below the model's, and a weight of 0 does not cancel an "
              "infinite term")


def engine_loss_fn(loss_fn: str, cfg: Mapping[str, float], critic: bool = False) -> Callable:
    """The engine's ``loss_convention="flat"`` loss: ``sum_t w_t * l_t * loss_mask_t`` over this
    micro-batch's packed tokens ``[T]`` (its contribution to the global sum; the engine adds the
    micro-batches' gradients). Metric ``loss``: the same sum, detached."""
    key = "values" if critic else "log_probs"

    def loss(outputs: Mapping[str, torch.Tensor], data: Mapping[str, Any], ctx: Any):
        per_token = engine_elementwise(loss_fn, outputs[key], data, cfg, critic)
        total = (per_token * data["tinker_weights"].float() * data["loss_mask"].float()).sum()
        if not torch.isfinite(total):  # the engine then drops this pass's gradients on every rank
            raise ValueError(f"{NOT_FINITE} ({loss_fn}: {float(total)})")
        return total, {"loss": total.detach()}

    return loss
