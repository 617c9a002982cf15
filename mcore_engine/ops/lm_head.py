"""Fused lm-head: per-token outputs from hidden states and the lm-head shard, chunk by chunk
(one MAX + one SUM all-reduce per chunk), recomputed in backward. Memory above the inputs: O(N (8 + 2k))
fp32, a chunk buffer, the gradients (fp32 ``[V_local, H]`` for a bf16/fp16 weight); never ``[N, V_local]``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mcore_engine.ops import _common, driver
from mcore_engine.ops.backend import ChunkBackend
from mcore_engine.ops.plan import TEACHER_ARG_NAMES, Plan, Rows, make_plan
from mcore_engine.ops.temperature import Temperature


def _chunk_elements(backend: ChunkBackend) -> int:
    """Default rows x V_local: 2**26 with Triton, a quarter of the torch default (two workspaces)."""
    return min(backend.chunk_elements, 2**26) if backend.name == "triton" else backend.chunk_elements // 4


class _LMHeadGrads:
    """Gradients of ``h [N, H]`` and ``w [V_valid, H]`` accumulated chunk by chunk."""

    def __init__(self, h: torch.Tensor, w: torch.Tensor, weight: torch.Tensor, need_h: bool,
                 need_w: bool) -> None:
        self.h, self.w = h, w
        self.grad_h = torch.empty_like(h) if need_h else None
        # bf16/fp16 weights accumulate their gradient over the chunks in fp32; padded rows stay 0.
        self.acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        self.grad_w = (torch.zeros(weight.shape, dtype=self.acc_dtype, device=weight.device) if need_w
                       else None)

    def add(self, r0: int, r1: int, gx: torch.Tensor) -> None:
        """``grad_h[r0:r1] = gx @ w`` (compute dtype); ``grad_w += gx.T @ h[r0:r1]`` (fp32)."""
        if self.grad_h is not None:
            torch.matmul(gx.to(self.w.dtype), self.w, out=self.grad_h[r0:r1])
        if self.grad_w is not None:
            self.grad_w[:self.w.shape[0]].addmm_(gx.T.to(self.acc_dtype), self.h[r0:r1].to(self.acc_dtype))


class _FusedLMHeadFunction(torch.autograd.Function):
    """Backward per chunk: logit gradient G -> ``G @ W``, ``G.T @ hidden``; one SUM of the hidden gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                teacher_ids: torch.Tensor | None, teacher_log_probs: torch.Tensor | None,
                t_rows: torch.Tensor | None, plan: Plan) -> tuple[torch.Tensor, ...]:
        rows = Rows(labels, teacher_ids, teacher_log_probs, t_rows)
        h = hidden.reshape(-1, hidden.shape[-1])
        source = driver.MatmulSource(h, weight[:plan.shard.v_valid], plan)
        stats, row_max = driver.forward_stats(plan, source, rows, h.shape[0], hidden.device)
        return driver.save_and_output(ctx, plan, (hidden, weight), rows, row_max, stats)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        plan: Plan = ctx.plan
        (hidden, weight), t_rows, row_max, coef = driver.saved_and_coefficients(ctx, grads)
        none = (None,) * 5
        if coef is None:
            return (None, None) + none
        h, w = hidden.reshape(-1, hidden.shape[-1]), weight[:plan.shard.v_valid]
        acc = _LMHeadGrads(h, w, weight, *ctx.needs_input_grad[:2])
        driver.backward_grads(plan, driver.MatmulSource(h, w, plan), coef, row_max, t_rows, take=acc.add)
        grad_h = acc.grad_h
        if grad_h is not None:
            grad_h = _common.all_reduce_(grad_h, dist.ReduceOp.SUM, plan.shard).view(hidden.shape)
        return (grad_h, acc.grad_w.to(weight.dtype) if acc.grad_w is not None else None) + none


def fused_lm_head_outputs(
    hidden: torch.Tensor, weight: torch.Tensor, *, labels: torch.Tensor | None = None,
    teacher_ids: torch.Tensor | None = None, teacher_log_probs: torch.Tensor | None = None,
    entropy: bool = False, sum_pi_squared: bool = False, kl_tail: bool = False,
    log_prob_min_clamp: float | None = None, temperature: Temperature = 1.0,
    group: dist.ProcessGroup | None = None, chunk_size: int | None = None, vocab_size: int | None = None,
    teacher_arg_names: tuple[str, str] = TEACHER_ARG_NAMES,
) -> dict[str, torch.Tensor]:
    """``vocab_parallel_logits_outputs(hidden @ weight.T, ...)`` without holding ``[N, V_local]``.

    ``hidden [..., H]`` replicated, ``weight [V_local, H]`` this rank's shard (logits in its dtype).
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"hidden must be a floating tensor [..., H], got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)}")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2 \
            or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be a floating tensor [V_local > 0, H = {hidden.shape[-1]}], got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    hidden = hidden.to(weight.dtype)  # differentiable cast
    group = _common.resolve_group(group)
    # the shard geometry of the logits this weight would produce ([0, V_local] on the meta device)
    shard = _common.make_shard(weight.new_empty(0, weight.shape[0], device="meta"), group, vocab_size)
    lead = tuple(hidden.shape[:-1])
    plan, rows = make_plan(shard, lead, hidden.device, labels=labels, teacher_ids=teacher_ids,
                           teacher_log_probs=teacher_log_probs, entropy=entropy,
                           sum_pi_squared=sum_pi_squared, kl_tail=kl_tail,
                           log_prob_min_clamp=log_prob_min_clamp, temperature=temperature,
                           chunk_size=chunk_size, teacher_arg_names=teacher_arg_names,
                           default_elements=_chunk_elements)
    if not plan.keys:
        return {}
    outs = _FusedLMHeadFunction.apply(hidden, weight, rows.labels, rows.teacher_ids, rows.teacher_log_probs,
                                      rows.t_rows, plan)
    return {key: o.view(lead) for key, o in zip(plan.keys, outs, strict=True)}
