"""One comparison of model tensors across layouts or runs (gradients, weights after steps).

Every tensor is compared on its own (relative norm error). Entries whose gradient is zero in exact
arithmetic (:func:`zero_grad_mask`) carry rounding noise only, which Adam (``g / (sqrt(v) + eps)``,
about ``lr * sign(g)`` on the first step) turns into ``lr``-sized steps: their gradients are asserted
near zero and they are left out. bf16 runs are held per tensor to a budget from the fp32 run
(:func:`bf16_budget`), not to one error over the whole model, where a wrong small tensor (a norm
weight) disappears.

``TENSOR_REPORT=<file>``: every comparison appends its worst tensors there (margins, not checks).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tests.utils import REL_TOL, rel_err

FP32 = REL_TOL[torch.float32]
# Weights after two Adam steps: the first step leaves the entries it cannot pin down (below) up to
# ~lr apart, which moves the second step's gradients by up to ~3e-5 (measured: the top-k distillation
# model at CP = 2, layer 1's linear_fc2) and its small-gradient entries by lr * dg / |g|.
FP32_TWO_STEPS = 1e-4
BF16_FACTOR = 4.0  # a bf16 layout may deviate from fp32 by this many times the reference's deviation
BF16_FLOOR = 2e-3  # ... or by this much (a bf16 ulp near 1 is 7.8e-3; half-ulp rounding of sums)


@dataclass(frozen=True)
class Attention:
    """What decides which key-bias entries have a zero gradient: the per-group head layout, the
    channels RoPE rotates, and whether the keys are normalised after the bias."""

    heads: int
    groups: int
    head_dim: int
    rotated: int  # leading channels of each head RoPE rotates (0: no RoPE)
    key_norm: bool

    @classmethod
    def of(cls, model) -> Attention | None:
        """From an engine ``ModelConfig`` (``None`` for MLA: no key bias)."""
        if model.mla is not None:
            return None
        d = model.kv_channels or model.hidden_size // model.num_attention_heads
        rotated = int(d * model.rotary_percent) // 2 * 2
        return cls(model.num_attention_heads, model.query_groups, d, rotated, model.qk_layernorm)

    @classmethod
    def of_hf(cls, hf: dict) -> Attention:
        """From a Hugging Face ``config.json`` dict (Qwen2 / Qwen3 / Llama / Mixtral style)."""
        heads = hf["num_attention_heads"]
        d = hf.get("head_dim") or hf["hidden_size"] // heads
        rope = hf.get("rope_parameters") or {}
        pct = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        key_norm = hf.get("model_type") in ("qwen3", "qwen3_moe") or bool(hf.get("use_qk_norm"))
        return cls(heads, hf.get("num_key_value_heads") or heads, d, int(d * pct) // 2 * 2, key_norm)


def zero_grad_mask(name: str, shape: torch.Size, attn: Attention | None) -> torch.Tensor | None:
    """The entries of parameter ``name`` (a local TP shard of ``shape``) whose gradient is zero in
    exact arithmetic, or ``None`` when there are none.

    A key bias ``b`` enters every score of a query ``q`` as ``q . R_j b`` (``R_j``: RoPE at key
    position ``j``). On channels RoPE leaves alone that term is the same for every key, and softmax
    is shift invariant: those channels of ``b`` get no gradient -- unless a key norm follows the
    bias. Megatron's fused ``linear_qkv.bias`` holds per query group ``[q (heads/groups * d), k (d),
    v (d)]`` (a TP shard holds whole groups); Hugging Face's ``k_proj.bias`` is ``[groups * d]``.
    """
    if attn is None or attn.key_norm or attn.rotated >= attn.head_dim:
        return None
    d, per_group = attn.head_dim, attn.heads // attn.groups
    if name.endswith("linear_qkv.bias"):
        mask = torch.zeros(shape[0] // ((per_group + 2) * d), per_group + 2, d, dtype=torch.bool)
        mask[:, per_group, attn.rotated:] = True
    elif name.endswith("k_proj.bias"):
        mask = torch.zeros(shape[0] // d, d, dtype=torch.bool)
        mask[:, attn.rotated:] = True
    else:
        return None
    return mask.reshape(shape)


@dataclass(frozen=True)
class AdamSteps:
    """The Adam steps between two weight snapshots, from a fresh optimizer (or, for one step, from
    the same loaded moments): the first step's gradients (keyed like the weights), ``lr``, ``eps``
    and the number of steps."""

    grads: dict | list[dict]
    lr: float
    eps: float
    steps: int

    def unresolved(self, grad: torch.Tensor, weight_norm: float, tol: float) -> torch.Tensor:
        """Entries whose Adam step the gradient check does not pin down to the weight budget.

        The first step moves ``w_i`` by ``lr * g_i / (|g_i| + eps)``, whose error under a gradient
        error ``dg`` is ``lr * dg * eps / (|g_i| + eps)^2``: largest (``lr * dg / 4 eps``) where
        ``|g_i|`` is near ``eps``. The gradient check allows ``dg`` up to ``FP32 * ||g||``; entries
        where that could move the weight by a tenth of the tensor's budget ``tol * ||w||`` are
        unresolved (in our tiny models: mostly the key-bias channels of the slowest RoPE frequency,
        which turns by 0.02 rad over 64 positions, nearly shift invariant, with gradients ~1e-7 of
        their tensor's). Later steps divide by ``sqrt(v)``, which keeps the first gradient's size.
        """
        g = grad.double().abs()
        worst = self.lr * FP32 * float(g.norm()) * self.eps / (g + self.eps) ** 2
        return (worst > 0.1 * tol * weight_norm) & (g > 0)  # exact zeros (absent tokens) stay zero


def hf_grads(engine) -> dict[str, torch.Tensor]:
    """The engine's current main gradients (fp32) in Hugging Face names and layouts, as
    ``per_tensor_generator`` streams the weights (collective likewise): ``AdamSteps.grads`` for
    weights compared in HF names."""
    from mcore_engine.hf.export import iter_hf_tensors

    grads = {id(p): (lambda p=p: p.main_grad) for chunk in engine.model for p in chunk.module.parameters()}
    return dict(iter_hf_tensors(engine.model, engine.config, dtype=torch.float32, overrides=grads,
                                keep_fp32=True))


def _flat(tensors: dict | list[dict]) -> dict[str, torch.Tensor]:
    """``{name: tensor}``, or one dict per model chunk (names prefixed with the chunk when several)."""
    if isinstance(tensors, dict):
        return tensors
    if len(tensors) == 1:
        return tensors[0]
    return {f"{i}.{k}": v for i, chunk in enumerate(tensors) for k, v in chunk.items()}


def _report(what: str, errors: dict, budgets: dict, unresolved: dict) -> None:
    path = os.environ.get("TENSOR_REPORT")
    if not path or not errors or (dist.is_initialized() and dist.get_rank() != 0):
        return
    worst = sorted(errors, key=lambda k: errors[k] / budgets[k], reverse=True)[:3]
    line = "; ".join(f"{k} {errors[k]:.2e}/{budgets[k]:.1e}" for k in worst)
    if any(unresolved.values()):
        line += f" | {sum(unresolved.values())} entries unresolved by Adam"
    with open(path, "a") as f:
        f.write(f"{os.environ.get('ATEN_CPU_CAPABILITY', 'native')} | {what} | {line}\n")


def bf16_budget(bf16_ref: dict | list[dict], fp32_ref: dict | list[dict]) -> dict[str, float]:
    """Per-tensor budgets for a bf16 layout against the fp32 reference: ``BF16_FACTOR`` times the
    bf16 reference's own deviation from fp32 (same layout as the references), at least ``BF16_FLOOR``.
    Keys as :func:`assert_tensors_close` sees them (pass both on the reference's layout)."""
    low, high = _flat(bf16_ref), _flat(fp32_ref)
    assert all(torch.isfinite(t).all() for t in (*low.values(), *high.values())), "non-finite reference"
    return {k: max(BF16_FACTOR * rel_err(low[k].float(), high[k]), BF16_FLOOR) for k in high}


def assert_tensors_close(what: str, got: dict | list[dict], want: dict | list[dict], *,
                         attn: Attention | None, grads: bool,
                         tol: float | dict[str, float] | list[dict[str, float]] = FP32,
                         adam: AdamSteps | None = None) -> None:
    """Every tensor of ``got`` against ``want`` (same names and shapes), on its own.

    ``tol``: one relative-norm budget (fp32: 1e-5) or one per tensor (:func:`bf16_budget`; per model
    chunk like ``got``). Entries of :func:`zero_grad_mask`: with ``grads`` asserted near zero (norm at
    most the budget times the norm of the whole tensor's gradient, on both sides) and left out; for
    weights after steps (``adam``) left out and, like the entries :meth:`AdamSteps.unresolved` names,
    each asserted to differ by at most the ``2 * lr`` per step that Adam can move it; otherwise
    compared. Both sides must be finite; an empty comparison fails.
    """
    got, want = _flat(got), _flat(want)
    tol = _flat(tol) if isinstance(tol, list) else tol
    if adam is not None:  # parameters only (a state dict also holds buffers)
        params = _flat(adam.grads).keys()
        dropped = [k for k in got.keys() | want.keys()
                   if k not in params and k.endswith((".weight", ".bias"))]
        assert not dropped, f"{what}: parameters {sorted(dropped)} have no gradient in adam.grads"
        got, want = ({k: t[k] for k in params} for t in (got, want))
    assert got.keys() == want.keys(), f"{what}: tensors {sorted(got.keys() ^ want.keys())} on one side only"
    assert want, f"{what}: nothing to compare"
    errors, budgets, unresolved = {}, {}, {}
    for key, w in want.items():
        g = got[key]
        budget = tol[key] if isinstance(tol, dict) else tol
        assert g.shape == w.shape, f"{what}: {key}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert torch.isfinite(g).all() and torch.isfinite(w).all(), f"{what}: {key}: non-finite values"
        g, w = g.detach().double(), w.detach().double()
        mask = zero_grad_mask(key, w.shape, attn) if grads or adam is not None else None
        for side, t in (("got", g), ("want", w)) if mask is not None and grads else ():
            noise, scale = float(t[mask].norm()), float(t.norm())
            assert noise <= budget * scale, (f"{what}: {key}: gradient {noise:.3e} on exact-zero entries "
                                             f"({side}) > {budget:.1e} * {scale:.3e}")
        if adam is not None:
            steps_mask = adam.unresolved(_flat(adam.grads)[key], float(w.norm()), budget)
            if mask is not None:
                steps_mask = steps_mask | mask
            worst = float((g - w)[steps_mask].abs().max()) if steps_mask.any() else 0.0
            assert worst <= 2 * adam.lr * adam.steps, \
                f"{what}: {key}: an entry Adam cannot pin down moved {worst:.3e} > {adam.steps} x 2 x lr"
            unresolved[key] = int(steps_mask.sum())  # reported
            mask = steps_mask if mask is None else mask | steps_mask
        if mask is not None:
            g, w = g[~mask], w[~mask]
        errors[key], budgets[key] = rel_err(g, w), budget
    _report(what, errors, budgets, unresolved)
    bad = {k: e for k, e in errors.items() if not e <= budgets[k]}  # a NaN fails
    if bad:
        raise AssertionError(f"{what}: " + "; ".join(
            f"{k}: relative norm error {e:.3e} > {budgets[k]:.1e}" for k, e in bad.items()))
