"""mcore_engine.layers.attention: SDPACoreAttention at CP = 1 against Megatron's DotProductAttention
(bshd) and the project's PackedDotProductAttention (thd); CP = 2 on two gloo ranks against CP = 1 on
the same global inputs (values and q/k/v gradients, fp32 and bf16); the CP layout; bad inputs."""

from __future__ import annotations

import math

import pytest
import torch

from tests.utils import REL_TOL, assert_rel_close, rel_err, run_distributed

H, G, D = 4, 2, 8  # query heads, KV groups (GQA), head dim
FP32_TOL = 1e-6


# ----------------------------------------------------------------------------------------------------
# Helpers (run inside the gloo ranks)
# ----------------------------------------------------------------------------------------------------
def _setup(cp: int) -> None:
    from megatron.core import parallel_state

    from mcore_engine.parallel.cpu_device import apply_cpu_device_layer
    from mcore_engine.parallel.distributed import seed_everything

    apply_cpu_device_layer()
    parallel_state.initialize_model_parallel(context_parallel_size=cp)
    seed_everything(0)  # Megatron's DotProductAttention forks the TP RNG stream


def _config(cp: int = 1, **kwargs):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=1, hidden_size=H * D, num_attention_heads=H, num_query_groups=G, kv_channels=D,
                context_parallel_size=cp, use_cpu_initialization=True, attention_dropout=0.0,
                masked_softmax_fusion=False)
    return TransformerConfig(**(base | kwargs))


def _ours(cp: int = 1, pg_collection=None, **kwargs):
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_engine.layers.attention import SDPACoreAttention

    module_args = ("k_channels", "v_channels", "softmax_scale")
    config_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k not in module_args}
    return SDPACoreAttention(_config(cp, **config_kwargs), 1, AttnMaskType.causal, "self",
                             pg_collection=pg_collection, **kwargs)


def _packed(lengths: list[int], padded: bool = True):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    cu_padded = cu if padded else None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
                           cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max(lengths),
                           max_seqlen_kv=max(lengths))


def _qkvg(shape_q: tuple, shape_kv: tuple, seed: int, dtype=torch.float64, dv: int | None = None):
    """Fresh float64 q, k, v and an upstream gradient for the output."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(*shape_q, generator=g, dtype=torch.float64)
    k = torch.randn(*shape_kv, generator=g, dtype=torch.float64)
    v = torch.randn(*shape_kv[:-1], dv or shape_kv[-1], generator=g, dtype=torch.float64)
    grad = torch.randn(*shape_q[:-2], shape_q[-2] * (dv or shape_kv[-1]), generator=g, dtype=torch.float64)
    return q, k, v, grad


def _run(module, q, k, v, grad, dtype, mask=None, packed=None):
    """Output and q/k/v gradients of ``module`` in ``dtype``; thd output is ``[t, np * hv]``."""
    q, k, v = (x.detach().to(dtype, copy=True).requires_grad_() for x in (q, k, v))
    snapshot = [x.detach().clone() for x in (q, k, v)]
    out = module(q, k, v, mask, packed_seq_params=packed)
    out.backward(grad.to(dtype).reshape(out.shape))
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), snapshot, strict=True)), "inputs were modified"
    return [x.detach() for x in (out.reshape(grad.shape), q.grad, k.grad, v.grad)]


def _reference(q, k, v, lengths: list[int], scale: float) -> torch.Tensor:
    """float64 causal attention per sequence; q ``[s, b, np, dk]``, k/v ``[s, b, ng, d*]``."""
    k, v = (x.repeat_interleave(q.size(2) // k.size(2), dim=2) for x in (k, v))
    outs = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        scores = torch.einsum("ibhd,jbhd->bhij", qs, ks) * scale
        n = qs.size(0)
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        outs.append(torch.einsum("bhij,jbhd->ibhd", scores.softmax(-1), vs))
    out = torch.cat(outs)
    return out.reshape(out.size(0), out.size(1), -1)


def _check_all(actual: list, expected: list, tol: float, what: str) -> None:
    for name, a, e in zip(("out", "dq", "dk", "dv"), actual, expected, strict=True):
        assert_rel_close(a.double(), e.double(), tol, f"{what}: {name}")


def _errors(actual: list, expected: list) -> list[float]:
    return [rel_err(a, e) for a, e in zip(actual, expected, strict=True)]


def _reference_run(q, k, v, grad, lengths, scale):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = _reference(q, k, v, lengths, scale)
    out.backward(grad.reshape(out.shape))
    return [x.detach() for x in (out.reshape(grad.shape), q.grad, k.grad, v.grad)]


def _self_attention(core, cp: int = 1, pg_collection=None, state: dict | None = None):
    """Megatron's ``SelfAttention`` of the local GPT layer spec with ``core`` as its core attention."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = copy.deepcopy(get_gpt_layer_local_spec().submodules.self_attention)
    spec.submodules.core_attention = core
    module = build_module(spec, config=_config(cp), layer_number=1, pg_collection=pg_collection)
    if state is not None:
        module.load_state_dict(state)
    return module


def _run_layer(layer, hidden, grad, mask=None, packed=None):
    """``SelfAttention`` output, hidden-state gradient and parameter gradients."""
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().clone().requires_grad_()
    out, _ = layer(hidden, mask, packed_seq_params=packed)  # the output bias (skipped add) stays unused
    out.backward(grad.float())
    return out.detach(), hidden.grad, {n: p.grad.clone() for n, p in layer.named_parameters()
                                       if p.grad is not None}


def _causal_mask(s: int, b: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's bshd mask (True = masked): ``causal | key is padding``, ``[b, 1, s, s]``."""
    pos = torch.arange(s)
    lengths = torch.full((b,), s) if lengths is None else lengths
    return (pos[None, :] > pos[:, None])[None, None] | (pos[None, :] >= lengths[:, None])[:, None, None, :]


def _thd_reference_run(q, k, v, grad, lengths, scale):
    """:func:`_reference_run` of a ``thd`` pack (``[t, heads, dim]``, output ``[t, np * hv]``)."""
    return [x.squeeze(1) for x in _reference_run(q[:, None], k[:, None], v[:, None], grad[:, None], lengths,
                                                 scale)]


# ----------------------------------------------------------------------------------------------------
# CP = 1 (one rank)
# ----------------------------------------------------------------------------------------------------
def _cp1_checks(rank: int, world: int) -> None:
    from megatron.core import parallel_state
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_engine.layers.packed_attention import PackedDotProductAttention

    _setup(1)
    ours = _ours()
    scale = 1 / math.sqrt(D)
    assert ours.softmax_scale == scale

    # --- bshd, right-padded rows: Megatron with the engine's causal | key-padding mask ---
    lengths, s = torch.tensor([13, 7, 1]), 13
    q, k, v, grad = _qkvg((s, 3, H, D), (s, 3, G, D), seed=1)
    real = torch.arange(s)[:, None] < lengths[None, :]  # [s, b]
    grad = grad * real[..., None]  # padding queries send no gradient
    mask = _causal_mask(s, 3, lengths)
    megatron = DotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    expected = _run(megatron, q, k, v, grad, torch.float32, mask=mask)
    actual = _run(ours, q, k, v, grad, torch.float32, mask=mask)
    actual[0], expected[0] = actual[0] * real[..., None], expected[0] * real[..., None]
    _check_all(actual, expected, FP32_TOL, "bshd vs DotProductAttention")

    # --- thd: odd lengths, one of length 1; vs PackedDotProductAttention; cu_seqlens_q fallback ---
    lengths = [5, 1, 8, 3]
    q, k, v, grad = _qkvg((17, H, D), (17, G, D), seed=2)
    packed_megatron = PackedDotProductAttention(_config(), 1, AttnMaskType.causal, "self")
    expected = _run(packed_megatron, q, k, v, grad, torch.float32, packed=_packed(lengths))
    for padded in (True, False):
        actual = _run(ours, q, k, v, grad, torch.float32, packed=_packed(lengths, padded))
        _check_all(actual, expected, FP32_TOL, f"thd vs PackedDotProductAttention (padded cu: {padded})")

    # --- MLA head dims (k_channels != v_channels), both ways, and softmax_scale: float64 reference ---
    lengths = [6, 3, 9]
    for dk, dv in ((12, 8), (8, 12)):
        mla = _ours(k_channels=dk, v_channels=dv, softmax_scale=0.21)
        q, k, v, grad = _qkvg((18, H, dk), (18, G, dk), seed=3 + dk, dv=dv)
        expected = _thd_reference_run(q, k, v, grad, lengths, 0.21)
        actual = _run(mla, q, k, v, grad, torch.float32, packed=_packed(lengths))
        _check_all(actual, expected, FP32_TOL, f"MLA dk={dk} dv={dv}")

    # --- bf16: the error vs float64 within Megatron's bf16 error (+ 20 %) ---
    q, k, v, grad = _qkvg((64, 2, H, D), (64, 2, G, D), seed=4)
    expected = _reference_run(q, k, v, grad, [64], scale)
    ours_err = _errors(_run(ours, q, k, v, grad, torch.bfloat16), expected)
    bf16_config = _config(bf16=True, params_dtype=torch.bfloat16)
    megatron_bf16 = DotProductAttention(bf16_config, 1, AttnMaskType.causal, "self")
    megatron_err = _errors(_run(megatron_bf16, q, k, v, grad, torch.bfloat16), expected)
    for name, ours_e, meg_e in zip(("out", "dq", "dk", "dv"), ours_err, megatron_err, strict=True):
        assert ours_e <= 1.2 * meg_e + 1e-3, f"bf16 {name}: error {ours_e:.2e} vs Megatron's {meg_e:.2e}"

    # --- inside Megatron's SelfAttention (the call contract): thd and bshd vs PackedDotProductAttention ---
    from mcore_engine.layers.attention import SDPACoreAttention

    reference = _self_attention(PackedDotProductAttention)
    layer = _self_attention(SDPACoreAttention, state=reference.state_dict())
    g = torch.Generator().manual_seed(5)
    lengths = [5, 1, 8, 3]
    cases = ((None, _packed(lengths), (17, 1, H * D)), (_causal_mask(9, 2), None, (9, 2, H * D)))
    for mask, packed, shape in cases:
        hidden, grad = (torch.randn(*shape, generator=g) for _ in range(2))
        (out, d_hidden, grads), (ref_out, ref_d_hidden, ref_grads) = (
            _run_layer(m, hidden, grad, mask, packed) for m in (layer, reference))
        what = "SelfAttention " + ("thd" if packed else "bshd")
        assert_rel_close(out, ref_out, FP32_TOL, f"{what}: output")
        assert_rel_close(d_hidden, ref_d_hidden, FP32_TOL, f"{what}: hidden grad")
        assert grads.keys() == ref_grads.keys() and len(grads) >= 2
        for name, grad in grads.items():
            assert_rel_close(grad, ref_grads[name], FP32_TOL, f"{what}: grad {name}")

    # --- bad input ---
    from megatron.core.packed_seq_params import PackedSeqParams

    q, k, v = (torch.randn(8, 1, n, D) for n in (H, G, G))
    with pytest.raises(ValueError, match="attention_bias"):
        ours(q, k, v, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="qkv_format"):
        ours(q, k, v, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="global pack size"):
        ours(q[:, 0], k[:, 0], v[:, 0], None, packed_seq_params=_packed([3, 4]))
    refused = ((dict(attention_dropout=0.1), "dropout"), (dict(window_size=(4, 2)), "window_size"),
               (dict(context_parallel_size=2), "context_parallel_size=2"))
    for bad, match in refused:
        with pytest.raises(ValueError, match=match):
            _ours(**bad)
    parallel_state.destroy_model_parallel()


# ----------------------------------------------------------------------------------------------------
# CP = 2 (two ranks) vs CP = 1 on the same global inputs
# ----------------------------------------------------------------------------------------------------
def _cp2_checks(rank: int, world: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mcore_engine.layers.attention import cp_local_index

    _setup(world)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    tp = parallel_state.get_tensor_model_parallel_group()
    cp1 = _ours(1, pg_collection=ProcessGroupCollection(tp=tp, cp=solo))
    cp2 = _ours(world)
    assert (cp2.cp_size, cp2.cp_rank) == (world, rank)

    # --- thd: lengths shorter than 2 * cp, odd, one long; each padded to a multiple of 2 * cp ---
    real = [1, 3, 6, 9, 2, 37]
    lengths = [-(-n // (2 * world)) * 2 * world for n in real]
    idx = cp_local_index(lengths, world, rank)
    t = sum(lengths)
    q, k, v, grad = _qkvg((t, H, D), (t, G, D), seed=10)
    local = [x[idx] for x in (q, k, v, grad)]
    expected = _run(cp1, q, k, v, grad, torch.float32, packed=_packed(lengths))
    actual = _run(cp2, *local, torch.float32, packed=_packed(lengths))
    _check_all(actual, [e[idx] for e in expected], FP32_TOL, f"rank {rank}: thd CP=2 vs CP=1")

    # --- bf16 thd: CP=2's error vs float64 within CP=1's at the same positions (+ 20 %) and REL_TOL ---
    reference = _thd_reference_run(q, k, v, grad, lengths, 1 / math.sqrt(D))
    cp1_err = _errors([x[idx] for x in _run(cp1, q, k, v, grad, torch.bfloat16, packed=_packed(lengths))],
                      [e[idx] for e in reference])
    cp2_err = _errors(_run(cp2, *local, torch.bfloat16, packed=_packed(lengths)), [e[idx] for e in reference])
    for name, e2, e1 in zip(("out", "dq", "dk", "dv"), cp2_err, cp1_err, strict=True):
        assert e2 <= min(1.2 * e1 + 1e-3, REL_TOL[torch.bfloat16]), \
            f"rank {rank}: bf16 {name} error {e2:.2e} (CP=1: {e1:.2e})"

    # --- bshd: 3 rows of global length 24 ---
    s = 24
    row_idx = cp_local_index([s], world, rank)
    q, k, v, grad = _qkvg((s, 3, H, D), (s, 3, G, D), seed=11)
    expected = _run(cp1, q, k, v, grad, torch.float32)
    actual = _run(cp2, *(x[row_idx] for x in (q, k, v, grad)), torch.float32)
    _check_all(actual, [e[row_idx] for e in expected], FP32_TOL, f"rank {rank}: bshd CP=2 vs CP=1")

    # --- inside Megatron's SelfAttention (pg_collection from parallel_state): CP=2 vs CP=1 ---
    from mcore_engine.layers.attention import SDPACoreAttention

    reference = _self_attention(SDPACoreAttention, 1, ProcessGroupCollection(tp=tp, cp=solo))
    layer = _self_attention(SDPACoreAttention, world, state=reference.state_dict())
    g = torch.Generator().manual_seed(12)
    hidden, grad = (torch.randn(t, 1, H * D, generator=g) for _ in range(2))
    ref_out, ref_d_hidden, ref_grads = _run_layer(reference, hidden, grad, packed=_packed(lengths))
    out, d_hidden, grads = _run_layer(layer, hidden[idx], grad[idx], packed=_packed(lengths))
    assert_rel_close(out, ref_out[idx], FP32_TOL, f"rank {rank}: SelfAttention CP=2 output")
    assert_rel_close(d_hidden, ref_d_hidden[idx], FP32_TOL, f"rank {rank}: SelfAttention CP=2 hidden grad")
    for name, grad in grads.items():  # weight gradients: partial sums over the CP ranks
        dist.all_reduce(grad, group=parallel_state.get_context_parallel_group())
        assert_rel_close(grad, ref_grads[name], FP32_TOL, f"rank {rank}: SelfAttention CP=2 grad {name}")

    # --- bad input ---
    q, k, v = (torch.randn(6, n, D) for n in (H, G, G))
    with pytest.raises(ValueError, match="cu_seqlens_q_padded"):
        cp2(q, k, v, None, packed_seq_params=_packed([6, 6]))  # not multiples of 2 * cp = 4
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        cp2(q, k, v, None, packed_seq_params=_packed([6, 6], padded=False))
    with pytest.raises(ValueError, match="even"):
        cp2(torch.randn(5, 1, H, D), torch.randn(5, 1, G, D), torch.randn(5, 1, G, D), None)
    parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_cp1_matches_megatron_attention():
    run_distributed(_cp1_checks, 1)


@pytest.mark.slow
def test_cp2_matches_cp1():
    run_distributed(_cp2_checks, 2)


# ----------------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_local_index_is_a_partition(cp):
    from mcore_engine.layers.attention import cp_local_index

    g = torch.Generator().manual_seed(cp)
    lengths = (torch.randint(0, 5, (7,), generator=g) * 2 * cp).tolist()
    pieces = [cp_local_index(torch.tensor(lengths), cp, r) for r in range(cp)]
    assert all(p.numel() == sum(lengths) // cp for p in pieces)
    assert torch.equal(torch.cat(pieces).sort().values, torch.arange(sum(lengths)))


def test_cp_local_index_layout():
    from mcore_engine.layers.attention import cp_local_index

    # two sequences of 8 and 4 tokens, cp = 2: chunks of 2 and 1; rank r holds chunks r and 3 - r
    assert cp_local_index([8, 4], 2, 0).tolist() == [0, 1, 6, 7, 8, 11]
    assert cp_local_index([8, 4], 2, 1).tolist() == [2, 3, 4, 5, 9, 10]
    assert cp_local_index([5, 3], 1, 0).tolist() == list(range(8))
    with pytest.raises(ValueError, match="multiple of 2"):
        cp_local_index([8, 6], 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        cp_local_index([8], 2, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefix_kernels_agree(dtype):
    """The CPU prefix-merge path and the ``causal_lower_right`` path (the GPU one) give the same
    bottom-right causal attention, values and gradients."""
    from mcore_engine.layers.attention import _attend

    prefix, c = 11, 5
    q, k, v, grad = _qkvg((c, 2, H, D), (prefix + c, 2, H, D), seed=20)
    results = []
    for cpu_kernels in (True, False):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = _attend(*x, prefix, 0.3, cpu_kernels=cpu_kernels)
        out.backward(grad.to(dtype).reshape(c, 2, H, D).permute(1, 2, 0, 3))
        results.append([out.detach(), *(t.grad for t in x)])
    tol = FP32_TOL if dtype == torch.float32 else REL_TOL[dtype]
    _check_all(results[0], results[1], tol, f"prefix kernels {dtype}")
