"""Fused lm-head: every per-token RL output from hidden states and the lm-head shard, without the logits.

``fused_lm_head_outputs(hidden, weight, ...)`` equals
``vocab_parallel_logits_outputs(hidden @ weight.T, ...)`` but computes the logits one row chunk at a
time (``[chunk, V_local]``), reduces them to the ops' per-token statistics (``ops.stats``: the same
definitions; one MAX + one packed SUM all-reduce per chunk, as a chunk's logits are formed once,
unlike ``ops.fused`` which reads each chunk twice and reduces once per pass) and drops them. Backward
recomputes each chunk's logits from the saved ``hidden`` and ``weight`` (no copies) and turns the
chunk's logit gradient straight into gradients for both.

Memory above the inputs: outputs and O(N (8 + 2k)) fp32 statistics, three ``[chunk, V_local]``
chunk buffers allocated once per pass (the logits chunk and the torch backend's two workspaces), and
in backward the two gradients (``grad_weight`` accumulates in fp32 when the weight is bf16/fp16: one
fp32 ``[V_local, H]`` buffer). Never ``[N, V_local]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from mcore_engine.ops import _common
from mcore_engine.ops import stats as _stats
from mcore_engine.ops.backend import ChunkBackend, chunk_backend
from mcore_engine.ops.fused import OUTPUT_KEYS
from mcore_engine.ops.temperature import Temperature, temperature_rows
from mcore_engine.processor import _log_prob_labels, _teacher_tensors

_NO_GRAD_KEYS = ("student_mass", "teacher_mass")


def _output_keys(layout: _stats.StatLayout) -> tuple[str, ...]:
    """The requested outputs, in ``OUTPUT_KEYS`` order (the order of the Function's outputs)."""
    wanted = {"log_probs": layout.label, "entropy": layout.entropy, "sum_pi_squared": layout.sum_pi_squared,
              "distillation_losses": layout.k > 0, "student_mass": layout.k > 0, "teacher_mass": layout.k > 0}
    return tuple(key for key in OUTPUT_KEYS if wanted[key])


def _shard(weight: torch.Tensor, group: dist.ProcessGroup | None, vocab_size: int | None) -> _common.Shard:
    """This rank's place in the global vocab, from the weight shard ``[V_local, H]`` (V_local > 0)."""
    return _common.make_shard(weight.new_empty(0, weight.shape[0], device="meta"), group, vocab_size)


def _workspaces(backend: ChunkBackend, h: torch.Tensor, w: torch.Tensor,
                rows: int) -> tuple[tuple[torch.Tensor, ...] | None, torch.Tensor]:
    """A pass's chunk buffers, allocated once and reused by every chunk: the backend's workspace and
    the chunk logits ``[rows, V_valid]`` in the compute dtype (on CPU, per-chunk buffers of this size
    go back to the OS and are page-faulted in again on every chunk)."""
    x_buf = torch.empty(rows, w.shape[0], dtype=torch.result_type(h, w), device=h.device)
    return backend.workspace(rows, w.shape[0], h.device), x_buf


class _FusedLMHeadFunction(torch.autograd.Function):
    """Forward (per chunk of rows; ``x = hidden[r0:r1] @ weight[:V_valid].T``, freed after the chunk):

    1. m = row max of x / t (local) -> ONE all-reduce MAX.
    2. zm = x / t - m; packed statistics (``backend.chunk_stats``) -> ONE all-reduce SUM.
    3. After the loop: finalize per token (``stats.finalize``).
    Backward (per chunk, no collectives but one): recompute x, form the fp32 logit gradient
    ``G = backend.chunk_grad(...)`` (coefficients from ``stats.grad_coefficients``), then
    ``grad_hidden[r0:r1] = G @ W`` and ``grad_weight += G.T @ hidden[r0:r1]``; finally ONE all-reduce
    SUM of ``grad_hidden`` over the group (``hidden`` is replicated across it, as in Megatron's
    column-parallel output layer).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                teacher_ids: torch.Tensor | None, teacher_log_probs: torch.Tensor | None,
                t_rows: torch.Tensor | None, shard: _common.Shard, rows: int, layout: _stats.StatLayout,
                clamp: float | None, t_scalar: float | None,
                backend: ChunkBackend) -> tuple[torch.Tensor, ...]:
        h = hidden.reshape(-1, hidden.shape[-1])
        w = weight[:shard.v_valid]
        n = h.shape[0]
        stats = torch.empty(n, layout.width, dtype=torch.float32, device=hidden.device)
        row_max = torch.empty(n, dtype=torch.float32, device=hidden.device)
        ws, x_buf = _workspaces(backend, h, w, min(rows, n))
        for r0 in range(0, n, rows):
            r1 = min(r0 + rows, n)
            x = torch.matmul(h[r0:r1], w.T, out=x_buf[:r1 - r0])
            tc = t_rows[r0:r1] if t_rows is not None else t_scalar
            # --- 1. global row max ---
            m = _common.all_reduce_(backend.row_max(x, tc), dist.ReduceOp.MAX, shard)
            row_max[r0:r1] = m
            # --- 2. packed local statistics -> one SUM ---
            label = (_stats.local_columns(labels[r0:r1], shard.offset, shard.v_valid)
                     if labels is not None else None)
            teacher = (_stats.local_columns(teacher_ids[r0:r1], shard.offset, shard.v_valid)
                       if teacher_ids is not None else None)
            backend.chunk_stats(x, tc, m, layout, stats[r0:r1], label=label, teacher=teacher, ws=ws)
            _common.all_reduce_(stats[r0:r1], dist.ReduceOp.SUM, shard)
        # --- 3. finalize per token ---
        fin = _stats.finalize(stats, layout, teacher_log_probs=teacher_log_probs, clamp=clamp)
        ctx.shard, ctx.rows, ctx.layout, ctx.t_scalar, ctx.backend = shard, rows, layout, t_scalar, backend
        ctx.keys = _output_keys(layout)
        ctx.fin = fin  # per-token fp32 tensors only
        ctx.save_for_backward(hidden, weight, labels, teacher_ids, t_rows, row_max)
        ctx.set_materialize_grads(False)
        outs = tuple(fin.outputs[k].clone() for k in ctx.keys)
        ctx.mark_non_differentiable(*(o for k, o in zip(ctx.keys, outs, strict=True) if k in _NO_GRAD_KEYS))
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        hidden, weight, labels, ids, t_rows, row_max = ctx.saved_tensors
        shard: _common.Shard = ctx.shard
        none = (None,) * 10
        coef = _stats.grad_coefficients(ctx.fin, dict(zip(ctx.keys, grads, strict=True)), labels, ids)
        if coef is None:
            return (None, None) + none
        h = hidden.reshape(-1, hidden.shape[-1])
        w = weight[:shard.v_valid]
        n = h.shape[0]
        need_h, need_w = ctx.needs_input_grad[:2]
        grad_h = torch.empty_like(h) if need_h else None
        # bf16/fp16 weights accumulate their gradient over the chunks in fp32.
        acc_dtype = weight.dtype if weight.dtype in (torch.float32, torch.float64) else torch.float32
        grad_w = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device) if need_w else None
        gw = grad_w[:shard.v_valid] if need_w else None  # padded rows stay 0
        ws, x_buf = _workspaces(ctx.backend, h, w, min(ctx.rows, n))
        for r0 in range(0, n, ctx.rows):
            r1 = min(r0 + ctx.rows, n)
            x = torch.matmul(h[r0:r1], w.T, out=x_buf[:r1 - r0])
            tc = t_rows[r0:r1] if t_rows is not None else ctx.t_scalar
            # d/dx in fp32 (in the torch backend's workspace ``ws``; Triton allocates it)
            gz = ctx.backend.chunk_grad(x, tc, row_max[r0:r1], ctx.fin.inv_s[r0:r1],
                                        *coef.chunk(r0, r1, shard.offset, shard.v_valid), ws=ws)
            # grad_hidden from the logit gradient in the compute dtype (as the logits path has it);
            # grad_weight accumulates from the fp32 one (no extra rounding, no extra copy).
            if need_h:
                torch.matmul(gz.to(w.dtype), w, out=grad_h[r0:r1])
            if need_w:
                gw.addmm_(gz.T.to(acc_dtype), h[r0:r1].to(acc_dtype))
            del gz
        if need_h:
            _common.all_reduce_(grad_h, dist.ReduceOp.SUM, shard)
            grad_h = grad_h.view(hidden.shape)
        return (grad_h, grad_w.to(weight.dtype) if need_w else None) + none


def fused_lm_head_outputs(
    hidden: torch.Tensor, weight: torch.Tensor, *, labels: torch.Tensor | None = None,
    teacher_ids: torch.Tensor | None = None, teacher_log_probs: torch.Tensor | None = None,
    entropy: bool = False, sum_pi_squared: bool = False, kl_tail: bool = False,
    log_prob_min_clamp: float | None = None, temperature: Temperature = 1.0,
    group: dist.ProcessGroup | None = None, chunk_size: int | None = None, vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """``vocab_parallel_logits_outputs(hidden @ weight.T, ...)`` without ever holding ``[N, V_local]``.

    Equivalent torch math (``L`` the gathered logits ``hidden @ W_full.T``, padded ids dropped)::

        z = L / t; lse = z.logsumexp(-1); p = z.softmax(-1)
        "log_probs" = z.gather(-1, labels[..., None])[..., 0] - lse; "entropy" = lse - (p * z).sum(-1)
        "sum_pi_squared" = (p ** 2).sum(-1); top-k forward KL, student/teacher mass as in ops.fused

    Shapes: ``hidden [..., H]`` (identical on every rank of ``group``), ``weight [V_local, H]`` this
    rank's lm-head (or tied embedding) shard holding global ids ``[rank V_local, (rank + 1) V_local)``;
    labels ``[...]``, teacher_* ``[..., k]``; outputs fp32 ``[...]``. Differentiable w.r.t. ``hidden``
    (gradient all-reduced over ``group``) and ``weight``; the logits are computed in ``weight.dtype``.
    Other arguments as ``vocab_parallel_logits_outputs``.
    Memory: see the module docstring; ``chunk_size`` rows per chunk (default ~2**19 / V_local on the
    torch path, ~2**26 / V_local with the Triton backend).
    """
    if not isinstance(hidden, torch.Tensor) or not hidden.is_floating_point() or hidden.dim() < 1:
        raise ValueError(f"hidden must be a floating tensor [..., H], got "
                         f"{getattr(hidden, 'dtype', type(hidden).__name__)}")
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point() or weight.dim() != 2 \
            or weight.shape[1] != hidden.shape[-1] or weight.shape[0] == 0:
        raise ValueError(f"weight must be a floating tensor [V_local > 0, H = {hidden.shape[-1]}], got "
                         f"{getattr(weight, 'dtype', type(weight))} {tuple(getattr(weight, 'shape', ()))}")
    # The logits are computed in the weight's dtype, as the output layer would (e.g. fp32 hidden states
    # from Megatron's Float16Module with a bf16 weight); the cast is differentiable.
    hidden = hidden.to(weight.dtype)
    group = _common.resolve_group(group)
    shard = _shard(weight, group, vocab_size)
    lead = tuple(hidden.shape[:-1])
    n = hidden[..., 0].numel()
    if labels is not None:
        _common.check_ids(labels, "labels", lead, shard.vocab_size)
        labels = labels.reshape(n).long()
    if (teacher_ids is None) != (teacher_log_probs is None):
        raise ValueError("teacher_ids and teacher_log_probs must be given together (shape [..., k])")
    k = 0
    if teacher_ids is not None:
        if teacher_ids.dim() != len(lead) + 1 or teacher_ids.shape[-1] == 0:
            raise ValueError(f"teacher_ids must have shape hidden.shape[:-1] + (k,) = {lead} + (k,) with "
                             f"k >= 1, got {tuple(teacher_ids.shape)}")
        k = teacher_ids.shape[-1]
        _common.check_ids(teacher_ids, "teacher_ids", lead + (k,), shard.vocab_size)
        if not isinstance(teacher_log_probs, torch.Tensor) or not teacher_log_probs.is_floating_point() \
                or tuple(teacher_log_probs.shape) != lead + (k,):
            raise ValueError(f"teacher_log_probs must be a floating tensor of shape {lead + (k,)}")
        teacher_ids = teacher_ids.reshape(n, k).long()
        teacher_log_probs = teacher_log_probs.detach().reshape(n, k)
    if kl_tail and not k:
        raise ValueError("kl_tail=True requires teacher_ids and teacher_log_probs")
    clamp = _common.check_clamp(log_prob_min_clamp)
    backend = chunk_backend(hidden.device)
    # Each chunk materialises its logits [rows, V_local] whatever the backend: at most ~2**26 elements
    # with Triton (no workspace); the torch path adds two fp32 workspaces of that size, so its default
    # chunk is a quarter of the logits path's (~2**19 elements: 6 MB of buffers at V_local = 32768).
    default_elements = (min(backend.chunk_elements, 2**26) if backend.name == "triton"
                        else backend.chunk_elements // 4)
    rows = _common.check_chunk_size(chunk_size, shard.v_local, default_elements=default_elements)
    t = temperature_rows(temperature, lead, hidden.device)
    layout = _stats.StatLayout(entropy=bool(entropy), sum_pi_squared=bool(sum_pi_squared),
                               label=labels is not None, k=k, tail=bool(kl_tail))
    keys = _output_keys(layout)
    if not keys:
        return {}
    outs = _FusedLMHeadFunction.apply(hidden, weight, labels, teacher_ids, teacher_log_probs,
                                      t if isinstance(t, torch.Tensor) else None, shard, rows, layout, clamp,
                                      t if isinstance(t, float) else None, backend)
    return {key: o.view(lead) for key, o in zip(keys, outs, strict=True)}


def process_lm_head_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, label: torch.Tensor | None, temperature: Temperature, *,
    calculate_sum_pi_squared: bool, calculate_entropy: bool, distillation_use_topk: bool,
    distillation_only: bool, logits_processor_func: Callable[..., dict[str, torch.Tensor]] | None = None,
    batch: Mapping[str, Any] | None = None, data_format: str = "thd", vocab_size: int | None = None,
    chunk_size: int | None = None, group: dist.ProcessGroup | None = None,
    log_prob_min_clamp: float | None = None,
) -> dict[str, torch.Tensor]:
    """``process_lm_head_logits(hidden @ weight.T, ...)`` on the fused path: same flags, keys and contract.

    "log_probs" unless ``distillation_only`` (labels never reach the pass then); "entropy" iff
    ``calculate_entropy``; "sum_pi_squared" iff ``calculate_sum_pi_squared``; with
    ``distillation_use_topk`` the built-in top-k forward KL on ``batch["teacher_ids"]`` /
    ``batch["teacher_logprobs"]``. A custom ``logits_processor_func`` needs the logits, which this path
    never builds: ValueError (use the logits path for it). ``data_format`` is accepted for symmetry.
    """
    if distillation_only and not distillation_use_topk:
        raise ValueError("distillation_only=True requires distillation_use_topk=True")
    if logits_processor_func is not None:
        raise ValueError("logits_processor_func needs the logits; the fused lm-head never builds them "
                         "(set fused_lm_head: false to use a custom logits processor)")
    teacher_ids, teacher_log_probs = _teacher_tensors(batch) if distillation_use_topk else (None, None)
    return fused_lm_head_outputs(
        hidden, weight, labels=_log_prob_labels(label, distillation_only), teacher_ids=teacher_ids,
        teacher_log_probs=teacher_log_probs, entropy=calculate_entropy,
        sum_pi_squared=calculate_sum_pi_squared, log_prob_min_clamp=log_prob_min_clamp,
        temperature=temperature, group=group, chunk_size=chunk_size, vocab_size=vocab_size)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The ``GPTModel`` inside Megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def lm_head_weight(model: torch.nn.Module) -> torch.Tensor:
    """The lm-head weight shard ``[V_local, H]`` a Megatron ``GPTModel`` (last stage) multiplies by.

    The tied word embedding (``shared_embedding_or_output_weight()``) when embeddings are shared,
    else ``output_layer.weight``; wrappers (DDP, Float16Module) are looked through.
    """
    gpt = _unwrap(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def output_hidden_states(model: torch.nn.Module, enable: bool = True) -> None:
    """Make a Megatron ``GPTModel`` (last stage) return its final hidden states instead of logits.

    The output layer's forward becomes ``(hidden, None)``, so the model returns ``[b, s, H]`` (the
    final norm applied) where it returned ``[b, s, V_local]``; parameters, state dict and every other
    stage are untouched. Feed the result and :func:`lm_head_weight` to :func:`fused_lm_head_outputs`
    (it all-reduces the hidden gradient over the TP group, the output layer's backward job).
    ``enable=False`` restores the logits. Sequence parallelism (sharded hidden states) is refused.
    """
    gpt = _unwrap(model)
    layer = getattr(gpt, "output_layer", None)
    if layer is None:
        raise ValueError("model must be a GPTModel on the last pipeline stage (it has no output_layer)")
    if not enable:
        layer.__dict__.pop("forward", None)
        return
    if getattr(layer, "sequence_parallel", False):
        raise ValueError("output_hidden_states does not support sequence_parallel=True (sharded hidden)")

    def hidden_passthrough(input_: torch.Tensor, weight: torch.Tensor | None = None,
                           runtime_gather_output: bool | None = None) -> tuple[torch.Tensor, None]:
        return input_, None

    layer.forward = hidden_passthrough
