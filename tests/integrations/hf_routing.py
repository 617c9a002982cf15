"""Routing of a ``transformers`` MoE causal LM with softmax top-k routers (Qwen2-MoE, Qwen3-MoE,
Mixtral): read each token's top-k experts per MoE layer from the routers, or route by other ids.

transformers 5's routers (the class its ``output_router_logits`` records from) return ``(logits,
weights, indices)``; :class:`RouteHooks` hooks them. ``policy``:

- ``"native"``: the router's own choice (recorded only);
- ``"second_choice"``: each token's experts ranked ``k+1 .. 2k`` by router probability, weighted
  like the router weights its own choice (softmax probabilities at the ids, renormalised with
  ``norm_topk_prob`` / Mixtral): a rollout that routes unlike the trainer on every token, which
  verl's R3 must then reproduce in the trainer;
- ``"forced"``: the ids in ``forced`` (``[T, L, k]`` for one forward over T tokens), weighted so.

``routes()`` is what the routers used, ``[tokens of every call, L_moe, k]`` (int64), in call order:
verl's layout of a rollout's ``routed_experts`` (prompt + response tokens the model was fed).
"""

from __future__ import annotations

import torch


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's routers in layer order: the modules ``transformers`` records router logits from."""
    recorder = type(model)._can_record_outputs.get("router_logits") if hasattr(
        type(model), "_can_record_outputs") else None
    found = [] if recorder is None else [m for m in model.modules() if isinstance(m, recorder.target_class)]
    if not found:
        raise ValueError(f"{type(model).__name__}: no MoE routers (output_router_logits) to hook")
    return found


def _weights(router: torch.nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The router's weights for ``ids``: softmax probabilities there, renormalised as the router does."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids)
    if getattr(router, "norm_topk_prob", True):  # Mixtral's router always renormalises
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs.to(logits.dtype)


class RouteHooks:
    """Context manager on a model's routers (module docstring)."""

    def __init__(self, model: torch.nn.Module, policy: str = "native", forced: torch.Tensor | None = None):
        forced_ok = (policy == "forced") == (forced is not None)
        if policy not in ("native", "second_choice", "forced") or not forced_ok:
            raise ValueError(f"policy={policy!r}: 'native', 'second_choice' or 'forced' (with forced ids)")
        self.routers, self.policy, self.forced = routers(model), policy, forced
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]
        self._handles: list = []

    def __enter__(self) -> RouteHooks:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module, args, output):
            logits, weights, ids = output
            if self.policy == "second_choice":
                k = ids.shape[-1]
                ids = torch.softmax(logits, -1, dtype=torch.float32).topk(2 * k, dim=-1).indices[:, k:]
                weights = _weights(module, logits, ids)
            elif self.policy == "forced":
                ids = self.forced[:, layer].to(ids.device, ids.dtype)
                weights = _weights(module, logits, ids)
            self.calls[layer].append(ids.detach().to("cpu", torch.int64))
            return logits, weights, ids
        return hook

    def routes(self) -> torch.Tensor:
        """``[tokens, L_moe, k]``: the ids every router used, over all calls."""
        return torch.stack([torch.cat(calls) for calls in self.calls], dim=1)
