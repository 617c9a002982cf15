"""Attention sinks and sliding windows of mcore_engine.layers.attention (SDPACoreAttention and its
block_attention): a float64 reference (explicit scores, band mask, sink column, softmax) for values and
q / k / v / sink gradients, fp32 and bf16, thd and bshd, GQA; transformers' gpt-oss eager attention;
the fp32 math path (the GPU one) on CPU; CP = 2 and TP = 2 vs one rank on two gloo ranks (with the
local PackedDotProductAttention as a cross-check and a TP = 2 -> 1 checkpoint); no [s, s] tensor saved."""

from __future__ import annotations

import math

import pytest
import torch

from tests.utils import REL_TOL, assert_rel_close, run_distributed

H, G, D = 4, 2, 8  # query heads, KV groups (GQA), head dim
FP32_TOL = 1e-5


# ----------------------------------------------------------------------------------------------------
# Reference and helpers
# ----------------------------------------------------------------------------------------------------
def _reference(q, k, v, sinks, lengths: list[int], window: int | None, scale: float) -> torch.Tensor:
    """float64 per sequence: ``q [s, b, np, dk]``, ``k / v [s, b, ng, d*]``, ``sinks [np]`` or None ->
    ``[s, b, np * dv]``; query i sees keys i - W < j <= i of its sequence, plus the sink logit."""
    k, v = (x.repeat_interleave(q.size(2) // k.size(2), dim=2) for x in (k, v))
    outs = []
    for qs, ks, vs in zip(q.split(lengths), k.split(lengths), v.split(lengths), strict=True):
        z = torch.einsum("ibhd,jbhd->bhij", qs, ks) * scale
        i, j = torch.arange(qs.size(0))[:, None], torch.arange(qs.size(0))[None, :]
        hidden = (j > i) | ((j <= i - window) if window is not None else False)
        z = z.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            z = torch.cat([z, sinks[None, :, None, None].expand(*z.shape[:3], 1)], -1)
        p = z.softmax(-1)[..., : qs.size(0)]
        outs.append(torch.einsum("bhij,jbhd->ibhd", p, vs))
    out = torch.cat(outs)
    return out.reshape(out.size(0), out.size(1), -1)


def _inputs(shape_q: tuple, shape_kv: tuple, seed: int):
    """Fresh float64 q, k, v, sinks [np] and an output gradient (never zero)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in (shape_q, shape_kv, shape_kv))
    sinks = torch.randn(shape_q[-2], generator=g, dtype=torch.float64) + 1.0
    grad = torch.randn(*shape_q[:-2], shape_q[-2] * shape_kv[-1], generator=g, dtype=torch.float64)
    return q, k, v, sinks, grad


def _grads(fn, q, k, v, sinks, grad, dtype) -> list[torch.Tensor]:
    """Output and q / k / v (/ sink) gradients of ``fn(q, k, v, sinks)`` in ``dtype``."""
    xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    s = None if sinks is None else sinks.detach().to(dtype).requires_grad_()
    snapshot = [x.detach().clone() for x in xs]
    out = fn(*xs, s)
    out.backward(grad.to(dtype).reshape(out.shape))
    assert all(torch.equal(a, b) for a, b in zip(xs, snapshot, strict=True)), "inputs were modified"
    return [out.detach().reshape(grad.shape), *(x.grad for x in xs)] + ([] if s is None else [s.grad])


def _check(actual, expected, tol: float, what: str) -> None:
    assert len(actual) == len(expected), what
    for name, a, e in zip(("out", "dq", "dk", "dv", "dsinks")[: len(actual)], actual, expected, strict=True):
        if not e.any():  # W = 1 without sinks: softmax of one logit, dq = dk = 0 exactly
            assert a.shape == e.shape and float(a.abs().max()) <= tol, f"{what}: {name} should be 0"
        else:
            assert_rel_close(a.double(), e.double(), tol, f"{what}: {name}")


def _config(tp: int = 1, cp: int = 1, window: int | None = None, sinks: bool = True, **kwargs):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=2, hidden_size=H * D, num_attention_heads=H, num_query_groups=G, kv_channels=D,
                tensor_model_parallel_size=tp, context_parallel_size=cp, use_cpu_initialization=True,
                attention_dropout=0.0, masked_softmax_fusion=False,
                softmax_type="learnable" if sinks else "vanilla",
                window_size=None if window is None else (window - 1, 0))
    return TransformerConfig(**(base | kwargs))


def _module(window=None, sinks_value=None, layer_number=1, pg_collection=None, cls=None, tp=1, cp=1, **kw):
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_engine.layers.attention import SDPACoreAttention

    cls = cls or SDPACoreAttention
    module = cls(_config(tp, cp, window, sinks_value is not None, **kw), layer_number, AttnMaskType.causal,
                 "self", pg_collection=pg_collection)
    if sinks_value is not None:
        with torch.no_grad():
            module.softmax_offset.copy_(sinks_value)
    return module


def _packed(lengths: list[int]):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                           cu_seqlens_kv_padded=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def _module_grads(module, q, k, v, sinks, grad, dtype, packed=None) -> list[torch.Tensor]:
    """Output, q / k / v gradients and the ``softmax_offset`` gradient (if any) of ``module``."""
    module.zero_grad(set_to_none=True)
    if sinks is not None:
        with torch.no_grad():
            module.softmax_offset.data = sinks.detach().to(dtype).clone()
    xs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    out = module(*xs, None, packed_seq_params=packed)
    out.backward(grad.to(dtype).reshape(out.shape))
    extra = [] if sinks is None else [module.softmax_offset.grad.clone()]
    return [out.detach().reshape(grad.shape), *(x.grad for x in xs), *extra]


def _reference_grads(q, k, v, sinks, grad, lengths, window, thd: bool) -> list[torch.Tensor]:
    xs = [x.clone().requires_grad_() for x in (q, k, v)]
    s = None if sinks is None else sinks.clone().requires_grad_()
    if thd:
        out = _reference(*(x[:, None] for x in xs), s, lengths, window, 1 / math.sqrt(D))[:, 0]
    else:
        out = _reference(*xs, s, lengths, window, 1 / math.sqrt(D))
    out.backward(grad.reshape(out.shape))
    return [out.detach().reshape(grad.shape), *(x.grad for x in xs)] + ([] if s is None else [s.grad])


# ----------------------------------------------------------------------------------------------------
# One process
# ----------------------------------------------------------------------------------------------------
THD_LENGTHS = [1, 5, 40, 3, 130, 17]  # 1, below and above every window


@pytest.mark.parametrize("window, sinks", [(None, True), (1, True), (1, False), (6, True), (6, False),
                                           (64, True), (64, False), (1000, True)])
def test_thd_matches_float64_reference(window, sinks):
    t = sum(THD_LENGTHS)
    q, k, v, s, grad = _inputs((t, H, D), (t, G, D), seed=(window or 0) + sinks)
    s = s if sinks else None
    module = _module(window, s)
    expected = _reference_grads(q, k, v, s, grad, THD_LENGTHS, window, thd=True)
    _check(_module_grads(module, q, k, v, s, grad, torch.float32, _packed(THD_LENGTHS)), expected, FP32_TOL,
           f"thd fp32 W={window} sinks={sinks}")
    bf16 = _module_grads(module, q, k, v, s, grad, torch.bfloat16, _packed(THD_LENGTHS))
    _check(bf16, expected, REL_TOL[torch.bfloat16], f"thd bf16 W={window} sinks={sinks}")


def test_thd_generic_kernels_through_the_module(monkeypatch):
    """The module's route with the fp32 math kernels (what GPUs without Transformer Engine run)."""
    import mcore_engine.layers.attention as attention
    from mcore_engine.layers.attention_blocks import block_attention

    calls = []

    def generic(*args, **kwargs):
        calls.append(1)
        return block_attention(*args, **(kwargs | {"cpu_flash": False}))

    monkeypatch.setattr(attention, "block_attention", generic)
    t = sum(THD_LENGTHS)
    q, k, v, s, grad = _inputs((t, H, D), (t, G, D), seed=40)
    expected = _reference_grads(q, k, v, s, grad, THD_LENGTHS, 6, thd=True)
    _check(_module_grads(_module(6, s), q, k, v, s, grad, torch.float32, _packed(THD_LENGTHS)), expected,
           FP32_TOL, "thd fp32, math kernels")
    assert calls


@pytest.mark.parametrize("window", [None, 1, 5, 100])
def test_bshd_matches_float64_reference(window):
    s_len, b = 70, 3
    q, k, v, s, grad = _inputs((s_len, b, H, D), (s_len, b, G, D), seed=30 + (window or 0))
    module = _module(window, s)
    expected = _reference_grads(q, k, v, s, grad, [s_len], window, thd=False)
    _check(_module_grads(module, q, k, v, s, grad, torch.float32), expected, FP32_TOL, f"bshd W={window}")
    _check(_module_grads(module, q, k, v, s, grad, torch.bfloat16), expected, REL_TOL[torch.bfloat16],
           f"bshd bf16 W={window}")


@pytest.mark.parametrize("cpu_flash", [True, False])
@pytest.mark.parametrize("q_start, c, window", [(0, 37, None), (20, 37, None), (0, 300, 1), (0, 300, 7),
                                                 (100, 300, 70), (100, 150, 200), (0, 130, 64)])
def test_block_attention_kernels(cpu_flash, q_start, c, window):
    """Both kernels (CPU flash; fp32 math = the GPU path) for a query chunk at ``q_start`` (as under CP),
    its key range starting at the window's first key, sinks on: values and gradients vs float64."""
    from mcore_engine.layers.attention_blocks import block_attention

    k0 = 0 if window is None else max(0, q_start - window + 1)
    g = torch.Generator().manual_seed(q_start + c)
    n = q_start + c - k0
    q, k, v = (torch.randn(2, h, m, D, generator=g, dtype=torch.float64) for h, m in ((H, c), (G, n), (G, n)))
    sinks = torch.randn(H, generator=g, dtype=torch.float64)
    grad = torch.randn(2, H, c, D, generator=g, dtype=torch.float64)

    def reference(q, k, v, s):  # the keys' positions k0 .. in one [s, b, ...] sequence from 0
        pad = lambda x, m: torch.cat([x.new_zeros(*x.shape[:2], m, D), x], 2)  # noqa: E731
        kk, vv = pad(k, k0), pad(v, k0)
        qq = pad(q, q_start)
        out = _reference(*(x.permute(2, 0, 1, 3) for x in (qq, kk, vv)), s, [q_start + c], window, 0.3)
        return out[q_start:].unflatten(-1, (H, D)).permute(1, 2, 0, 3)

    def ours(q, k, v, s):
        return block_attention(q, k, v, s, q_start, k0, window, 0.3, cpu_flash)

    expected = _grads(reference, q, k, v, sinks, grad, torch.float64)
    _check(_grads(ours, q, k, v, sinks, grad, torch.float32), expected, FP32_TOL, "fp32")
    _check(_grads(ours, q, k, v, sinks, grad, torch.bfloat16), expected, REL_TOL[torch.bfloat16], "bf16")


@pytest.mark.parametrize("window", [3, 16, 100])
def test_matches_transformers_gpt_oss_eager(window):
    """One sequence: transformers' gpt-oss ``eager_attention_forward`` with its sliding-window mask."""
    from types import SimpleNamespace

    from transformers.masking_utils import sliding_window_causal_mask_function
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    s_len = 40
    q, k, v, s, grad = _inputs((s_len, 1, H, D), (s_len, 1, G, D), seed=50 + window)
    allowed = sliding_window_causal_mask_function(window)
    idx = torch.arange(s_len)
    mask = allowed(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])  # [s, s], True = visible
    assert (int(mask.sum()) < s_len * (s_len + 1) // 2) == (window < s_len)  # the window bites if < s
    additive = torch.zeros(s_len, s_len, dtype=torch.float64).masked_fill(~mask,
                                                                          torch.finfo(torch.float64).min)
    hf_module = SimpleNamespace(num_key_value_groups=H // G, sinks=s, training=False)
    hf, _ = eager_attention_forward(hf_module, *(x.permute(1, 2, 0, 3) for x in (q, k, v)),
                                    additive[None, None], scaling=1 / math.sqrt(D))
    ours = _module_grads(_module(window, s), q, k, v, s, grad, torch.float64)[0]
    assert_rel_close(ours, hf.permute(1, 0, 2, 3).reshape(ours.shape), 1e-12, f"vs gpt-oss eager, W={window}")


def test_no_square_tensor_saved_for_backward():
    """s = 1024, W = 64: every tensor saved for backward is linear in s (none holds s * s elements)."""
    s_len = 1024
    q, k, v, s, grad = _inputs((s_len, 1, 2 * G, D), (s_len, 1, G, D), seed=60)
    module = _module(64, s, num_attention_heads=2 * G, hidden_size=2 * G * D)
    xs = [x.float().requires_grad_() for x in (q, k, v)]
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(*xs, None)
    out.backward(grad.float().reshape(out.shape))
    assert sizes and max(sizes) < s_len * s_len // 16, f"saved tensor sizes {sorted(sizes)[-4:]}"
    assert sum(sizes) < 16 * s_len * 2 * G * D, f"saved {sum(sizes)} elements in all"
    assert module.softmax_offset.grad is not None and module.softmax_offset.grad.abs().sum() > 0


def test_window_layers_and_bad_input():
    from megatron.core.transformer.enums import AttnMaskType

    from mcore_engine.layers.attention import SDPACoreAttention
    from mcore_engine.layers.attention_blocks import block_attention

    # window_attn_skip_freq: a 0/1 list per layer, or every n-th layer full
    pattern = _config(window=8, window_attn_skip_freq=[1, 0])
    windows = [SDPACoreAttention(pattern, n, AttnMaskType.causal, "self").window for n in (1, 2)]
    assert windows == [8, None]
    every_second = _config(window=8, window_attn_skip_freq=2)
    windows = [SDPACoreAttention(every_second, n, AttnMaskType.causal, "self").window for n in (1, 2)]
    assert windows == [8, None]
    module = _module(4, torch.zeros(H))
    assert module.softmax_offset.shape == (H,) and isinstance(module.softmax_offset, torch.nn.Parameter)
    assert module.softmax_offset.tensor_model_parallel and module.softmax_offset.partition_dim == 0
    assert "softmax_offset" in module.state_dict()

    # off-by-one: a fixed zero logit (not a parameter, not in the state dict) = learnable sinks at 0
    q, k, v, _, grad = _inputs((30, 1, H, D), (30, 1, G, D), seed=70)
    off = SDPACoreAttention(_config(window=5, sinks=False, softmax_type="off-by-one"), 1, AttnMaskType.causal,
                            "self")
    assert not list(off.parameters()) and "softmax_offset" not in off.state_dict()
    expected = _reference_grads(q, k, v, torch.zeros(H, dtype=torch.float64), grad, [30], 5, thd=False)
    _check(_module_grads(off, q, k, v, None, grad, torch.float32), expected[:4], FP32_TOL, "off-by-one")

    with pytest.raises(ValueError, match="window_size"):
        _module(window=None, sinks_value=None, window_size=(3, 2))
    x = torch.randn(1, H, 6, D)
    with pytest.raises(ValueError, match="sinks must be"):
        block_attention(x, x[:, :G], x[:, :G], torch.zeros(H + 1), 0, 0, 3, 1.0, True)
    with pytest.raises(ValueError, match="key positions"):
        block_attention(x, x[:, :G, :5], x[:, :G, :5], None, 0, 0, 3, 1.0, True)


# ----------------------------------------------------------------------------------------------------
# Two gloo ranks: CP = 2 vs CP = 1, TP = 2 vs TP = 1, local PackedDotProductAttention, checkpoint
# ----------------------------------------------------------------------------------------------------
def _parallel_checks(rank: int, world: int, ckpt_dir: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mcore_engine.layers.attention import cp_local_index
    from mcore_engine.layers.packed_attention import PackedDotProductAttention
    from mcore_engine.parallel.cpu_device import apply_cpu_device_layer
    from mcore_engine.parallel.distributed import seed_everything

    apply_cpu_device_layer()
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group

    # --- CP = 2 vs CP = 1: thd (windows below / above a chunk, across the CP split) and bshd ---
    parallel_state.initialize_model_parallel(context_parallel_size=world)
    seed_everything(0)
    cp_group = parallel_state.get_context_parallel_group()
    tp = parallel_state.get_tensor_model_parallel_group()
    real = [1, 3, 6, 9, 2, 37, 20]
    lengths = [-(-n // (2 * world)) * 2 * world for n in real]
    idx = cp_local_index(lengths, world, rank)
    t = sum(lengths)
    for window, sinks in ((1, True), (3, True), (7, False), (15, True), (100, True)):
        q, k, v, s, grad = _inputs((t, H, D), (t, G, D), seed=80 + window)
        s = s if sinks else None
        one = _module(window, s, pg_collection=ProcessGroupCollection(tp=tp, cp=solo))
        two = _module(window, s, cp=world)
        expected = _module_grads(one, q, k, v, s, grad, torch.float32, _packed(lengths))
        actual = _module_grads(two, *(x[idx] for x in (q, k, v)), s, grad[idx], torch.float32,
                               _packed(lengths))
        if sinks:
            dist.all_reduce(actual[4], group=cp_group)  # the engine reduces parameter grads over DP x CP
        want = [e[idx] for e in expected[:4]] + expected[4:]
        _check(actual, want, FP32_TOL, f"rank {rank}: thd CP=2 vs CP=1 W={window} sinks={sinks}")
    s_len = 24
    row_idx = cp_local_index([s_len], world, rank)
    for window in (5, 9):
        q, k, v, s, grad = _inputs((s_len, 3, H, D), (s_len, 3, G, D), seed=90 + window)
        one = _module(window, s, pg_collection=ProcessGroupCollection(tp=tp, cp=solo))
        two = _module(window, s, cp=world)
        expected = _module_grads(one, q, k, v, s, grad, torch.float32)
        actual = _module_grads(two, *(x[row_idx] for x in (q, k, v)), s, grad[row_idx], torch.float32)
        dist.all_reduce(actual[4], group=cp_group)
        _check(actual, [e[row_idx] for e in expected[:4]] + expected[4:], FP32_TOL,
               f"rank {rank}: bshd CP=2 vs CP=1 W={window}")
    parallel_state.destroy_model_parallel()

    # --- TP = 2 vs TP = 1 (heads split; softmax_offset [H / 2] per rank) and the local attention ---
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    seed_everything(0)
    cp = parallel_state.get_context_parallel_group()
    lengths = [5, 1, 23, 12]
    t = sum(lengths)
    q, k, v, s, grad = _inputs((t, H, D), (t, G, D), seed=100)
    one = _module(6, s, pg_collection=ProcessGroupCollection(tp=solo, cp=cp))
    two = _module(6, s[rank * 2: rank * 2 + 2], tp=world)
    expected = _module_grads(one, q, k, v, s, grad, torch.float32, _packed(lengths))
    heads, groups = slice(rank * H // 2, (rank + 1) * H // 2), slice(rank * G // 2, (rank + 1) * G // 2)
    local_grad = grad.unflatten(-1, (H, D))[:, heads].flatten(1)
    actual = _module_grads(two, q[:, heads], k[:, groups], v[:, groups], s[heads], local_grad, torch.float32,
                           _packed(lengths))
    want = [expected[0].unflatten(-1, (H, D))[:, heads].flatten(1), expected[1][:, heads],
            expected[2][:, groups], expected[3][:, groups], expected[4][heads]]
    # dk / dv: this rank's group gets the gradient of its two heads only, which is all of it (G = H / 2)
    _check(actual, want, FP32_TOL, f"rank {rank}: thd TP=2 vs TP=1")

    # the local attention (Megatron's DotProductAttention, learnable softmax) with the band per sequence
    local = _module(6, s, pg_collection=ProcessGroupCollection(tp=solo, cp=cp), cls=PackedDotProductAttention)
    _check(_module_grads(local, q, k, v, s, grad, torch.float32, _packed(lengths)), expected, FP32_TOL,
           f"rank {rank}: thd SDPACoreAttention vs PackedDotProductAttention")
    q2, k2, v2, s2, grad2 = _inputs((30, 2, H, D), (30, 2, G, D), seed=101)
    local_bshd = _module_grads(local, q2, k2, v2, s2, grad2, torch.float32)
    _check(local_bshd, _reference_grads(q2, k2, v2, s2, grad2, [30], 6, thd=False), FP32_TOL,
           f"rank {rank}: bshd PackedDotProductAttention vs reference")

    # --- checkpoint: TP = 2 shards of softmax_offset saved, loaded into a TP = 1 module ---
    two = _module(6, s[rank * 2: rank * 2 + 2], tp=world)
    dist_checkpointing.save(two.sharded_state_dict(prefix="attn."), ckpt_dir)
    one = _module(6, torch.zeros(H), pg_collection=ProcessGroupCollection(tp=solo, cp=cp))
    # the two TP = 1 copies are DP replicas: the world as their DP x CP group
    replicas = {"dp_cp_group": dist.group.WORLD}
    loaded = dist_checkpointing.load(one.sharded_state_dict("attn.", metadata=replicas), ckpt_dir)
    one.load_state_dict({"softmax_offset": loaded["attn.softmax_offset"]})
    assert torch.equal(one.softmax_offset.detach(), s.float()), f"rank {rank}: TP=2 -> TP=1 softmax_offset"
    parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_cp2_tp2_match_one_rank(tmp_path):
    (tmp_path / "ckpt").mkdir()
    run_distributed(_parallel_checks, 2, str(tmp_path / "ckpt"))
