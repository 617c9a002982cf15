"""mcore_engine.layers.gated_delta_net: GatedDeltaNet on one rank against ``transformers`` 5.24's
``Qwen3_5GatedDeltaNet`` (fp32) and a float64 token-by-token reference (values, input and weight
gradients); a ``thd`` pack equal to its sequences alone; on two gloo ranks TP = 2, TP = 2 + SP and
CP = 2 (``thd`` and ``bshd``), on four TP = 2 + SP with CP = 2, against one rank with the same full
weights (fp32, and bf16 within the one-rank bf16 error); a TP = 2 checkpoint loaded at TP = 1; bad
inputs."""

from __future__ import annotations

import pytest
import torch

from tests.utils import assert_rel_close, rel_err, run_distributed

NK, NV, DK, DV, K, H = 4, 8, 8, 6, 4, 24  # key / value heads, head dims, conv kernel, hidden size
CHUNK = 8  # chunk of the rule: sequences longer than a chunk stay cheap
EPS = 1e-6
FP32_TOL = 1e-5
PACK_TOL = 1e-6  # a sequence in a pack vs alone (fp32)
F64_TOL = 1e-10
# bf16 relative-norm error budget vs fp32 / float64 (measured, ours and transformers' alike: <= 3.4e-2 on
# one rank, <= 4.7e-2 for the input gradient of the CP = 2 pack's positions)
BF16_CAP = 8e-2
NAMES = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
         "A_log", "dt_bias", "norm.weight", "out_proj.weight")


# ----------------------------------------------------------------------------------------------------
# Helpers (run inside the gloo ranks)
# ----------------------------------------------------------------------------------------------------
def _setup(tp: int = 1, cp: int = 1) -> None:
    from megatron.core import parallel_state

    from mcore_engine.parallel.cpu_device import apply_cpu_device_layer
    from mcore_engine.parallel.distributed import seed_everything

    apply_cpu_device_layer()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    seed_everything(0)


def _gdn(nk: int = NK, nv: int = NV):
    from mcore_engine.config.gdn import GDNConfig

    return GDNConfig(num_key_heads=nk, num_value_heads=nv, key_head_dim=DK, value_head_dim=DV,
                     conv_kernel_dim=K, chunk_size=CHUNK)


def _config(tp: int = 1, cp: int = 1, sp: bool = False, dtype: torch.dtype = torch.float32):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                             tensor_model_parallel_size=tp,
                             context_parallel_size=cp, sequence_parallel=sp, use_cpu_initialization=True,
                             layernorm_epsilon=EPS, params_dtype=dtype, bf16=dtype == torch.bfloat16)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    """Fresh float64 weights in the Hugging Face layout (``in_proj_qkv`` rows ``[q; k; v]``, all heads)."""
    g = torch.Generator().manual_seed(seed)
    c = 2 * NK * DK + NV * DV

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    s = H ** -0.5
    return {"in_proj_qkv.weight": randn(c, H, scale=s), "in_proj_z.weight": randn(NV * DV, H, scale=s),
            "in_proj_b.weight": randn(NV, H, scale=s), "in_proj_a.weight": randn(NV, H, scale=s),
            "conv1d.weight": randn(c, 1, K, scale=0.5),
            "A_log": torch.empty(NV, dtype=torch.float64).uniform_(0.1, 4, generator=g).log(),
            "dt_bias": randn(NV, scale=0.5), "norm.weight": 1 + randn(DV, scale=0.2),
            "out_proj.weight": randn(H, NV * DV, scale=(NV * DV) ** -0.5)}


def _shard(full: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    """TP rank ``rank``'s slices of ``full`` (names of the module)."""
    from mcore_engine.layers.gated_delta_net import qkv_partition_rows

    rows = qkv_partition_rows(_gdn(), tp, rank)
    v = slice(rank * NV * DV // tp, (rank + 1) * NV * DV // tp)
    h = slice(rank * NV // tp, (rank + 1) * NV // tp)
    return {"in_proj_qkv.weight": full["in_proj_qkv.weight"][rows],
            "in_proj_z.weight": full["in_proj_z.weight"][v], "in_proj_b.weight": full["in_proj_b.weight"][h],
            "in_proj_a.weight": full["in_proj_a.weight"][h], "conv1d.weight": full["conv1d.weight"][rows],
            "A_log": full["A_log"][h], "dt_bias": full["dt_bias"][h], "norm.weight": full["norm.weight"],
            "out_proj.weight": full["out_proj.weight"][:, v]}


def _module(full: dict, tp: int = 1, cp: int = 1, sp: bool = False, dtype=torch.float32, pg=None,
            rank: int = 0):
    from mcore_engine.layers.gated_delta_net import GatedDeltaNet

    module = GatedDeltaNet(_config(tp, cp, sp, dtype), gdn=_gdn(), pg_collection=pg)
    module.load_state_dict({k: v.to(dtype) for k, v in _shard(full, tp, rank).items()})
    return module


def _packed(lengths: list[int], padded: list[int] | None = None):
    from megatron.core.packed_seq_params import PackedSeqParams

    def cu(ns):
        return torch.tensor([0, *torch.tensor(ns).cumsum(0).tolist()], dtype=torch.int32)

    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu(lengths), cu_seqlens_kv=cu(lengths),
                           cu_seqlens_q_padded=None if padded is None else cu(padded),
                           cu_seqlens_kv_padded=None if padded is None else cu(padded),
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def _run(module, hidden: torch.Tensor, grad: torch.Tensor, packed=None) -> list:
    """Output, input gradient and the weight gradients (``NAMES`` order), float64 copies."""
    dtype = module.A_log.dtype
    module.zero_grad(set_to_none=True)
    x = hidden.detach().to(dtype, copy=True).requires_grad_()
    snapshot = x.detach().clone()
    out, bias = module(x, None, packed_seq_params=packed)
    assert bias is None
    out.backward(grad.to(dtype))
    assert torch.equal(x, snapshot), "the input was modified"
    params = dict(module.named_parameters())
    assert sorted(params) == sorted(NAMES)
    return [out.detach().double(), x.grad.double(), *(params[n].grad.double() for n in NAMES)]


def _check(actual: list, expected: list, tol: float, what: str) -> None:
    for name, a, e in zip(("out", "d_hidden", *NAMES), actual, expected, strict=True):
        assert_rel_close(a, e, tol, f"{what}: {name}")


def _reference(w: dict, x: torch.Tensor) -> torch.Tensor:
    """float64, one sequence ``x [T, H]``, token by token (the recurrence, not the chunked form)."""
    t = x.size(0)
    qkv = x @ w["in_proj_qkv.weight"].T
    padded = torch.cat([qkv.new_zeros(K - 1, qkv.size(1)), qkv])
    conv = sum(padded[j: j + t] * w["conv1d.weight"][:, 0, j] for j in range(K))
    q, k, v = torch.nn.functional.silu(conv).split([NK * DK, NK * DK, NV * DV], -1)
    q, k = ((y.unflatten(-1, (NK, DK)).repeat_interleave(NV // NK, 1)) for y in (q, k))
    q, k = ((y * torch.rsqrt((y * y).sum(-1, keepdim=True) + 1e-6)) for y in (q, k))
    q = q * DK ** -0.5
    v = v.unflatten(-1, (NV, DV))
    beta = (x @ w["in_proj_b.weight"].T).sigmoid()
    g = -w["A_log"].exp() * torch.nn.functional.softplus(x @ w["in_proj_a.weight"].T + w["dt_bias"])
    state, outs = x.new_zeros(NV, DK, DV), []
    for i in range(t):
        state = state * g[i].exp()[:, None, None]
        delta = (v[i] - torch.einsum("hkv,hk->hv", state, k[i])) * beta[i][:, None]
        state = state + k[i][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", state, q[i]))
    o = torch.stack(outs)
    z = (x @ w["in_proj_z.weight"].T).unflatten(-1, (NV, DV))
    o = w["norm.weight"] * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + EPS)
    o = o * torch.nn.functional.silu(z)
    return o.flatten(-2) @ w["out_proj.weight"].T


def _reference_run(full: dict, hidden: torch.Tensor, grad: torch.Tensor,
                   lengths: list[int] | None = None) -> list:
    """:func:`_reference` of ``hidden [s, b, H]`` (bshd rows, or one thd pack of ``lengths``)."""
    w = {k: v.clone().requires_grad_() for k, v in full.items()}
    x = hidden.detach().double().requires_grad_()
    if lengths is None:
        out = torch.stack([_reference(w, x[:, i]) for i in range(x.size(1))], 1)
    else:
        out = torch.cat([_reference(w, piece) for piece in x[:, 0].split(lengths) if piece.numel()])[:, None]
    out.backward(grad.double())
    return [out.detach(), x.grad, *(w[n].grad for n in NAMES)]


def _inputs(shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(2))


def _errors(actual: list, expected: list) -> list[float]:
    return [rel_err(a, e) for a, e in zip(actual, expected, strict=True)]


# ----------------------------------------------------------------------------------------------------
# One rank
# ----------------------------------------------------------------------------------------------------
def _one_rank_checks(rank: int, world: int) -> None:
    from megatron.core import parallel_state
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from mcore_engine.layers.gated_delta_net import GatedDeltaNet

    _setup()
    full = _weights(1)
    hf_config = Qwen3_5TextConfig(hidden_size=H, linear_num_key_heads=NK, linear_num_value_heads=NV,
                                  linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=K,
                                  rms_norm_eps=EPS, num_hidden_layers=1, layer_types=["linear_attention"])

    def hf_run(dtype, hidden, grad) -> list:
        hf = Qwen3_5GatedDeltaNet(hf_config, 0).to(dtype)
        hf.load_state_dict({k: v.to(dtype) for k, v in full.items()})
        x = hidden.detach().to(dtype).transpose(0, 1).contiguous().requires_grad_()
        out = hf(x)
        out.backward(grad.to(dtype).transpose(0, 1))
        params = dict(hf.named_parameters())
        return [out.detach().transpose(0, 1).double(), x.grad.transpose(0, 1).double(),
                *(params[n].grad.double() for n in NAMES)]

    # --- (a) vs transformers, fp32: bshd (2 rows, 37 tokens: several chunks) and one thd sequence ---
    hidden, grad = _inputs((37, 2, H), seed=2)
    expected = hf_run(torch.float32, hidden, grad)
    module = _module(full)
    _check(_run(module, hidden, grad), expected, FP32_TOL, "bshd vs transformers")
    thd = _run(module, hidden[:, :1], grad[:, :1], packed=_packed([37]))
    _check(thd, hf_run(torch.float32, hidden[:, :1], grad[:, :1]), FP32_TOL, "thd vs transformers")

    # --- float64: the module vs the token-by-token reference, bshd and a thd pack ---
    module64 = _module(full, dtype=torch.float64)
    _check(_run(module64, hidden, grad), _reference_run(full, hidden, grad), F64_TOL, "float64 bshd")
    lengths = [1, 19, 6]
    hidden_p, grad_p = _inputs((26, 1, H), seed=3)
    _check(_run(module64, hidden_p, grad_p, _packed(lengths)),
           _reference_run(full, hidden_p, grad_p, lengths), F64_TOL, "float64 thd")

    # --- (b) thd pack of 3 sequences (1, 19 > chunk, 6 tokens) equal to each alone, fp32; padded cu ---
    padded = [4, 20, 8]  # padding tokens at each sequence's end (cu_seqlens_q_padded)
    hidden_p, grad_p = _inputs((32, 1, H), seed=4)
    starts = torch.tensor([0, *padded]).cumsum(0)[:-1].tolist()
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    grad_p = torch.zeros_like(grad_p).index_copy(0, real, grad_p[real])  # padding sends no gradient
    pack = _run(module, hidden_p, grad_p, _packed(lengths, padded))
    weight_sum = [torch.zeros_like(g) for g in pack[2:]]
    for s, n in zip(starts, lengths, strict=True):
        alone = _run(module, hidden_p[s: s + n], grad_p[s: s + n])
        assert_rel_close(pack[0][s: s + n], alone[0], PACK_TOL, f"pack vs alone (length {n}): out")
        assert_rel_close(pack[1][s: s + n], alone[1], PACK_TOL, f"pack vs alone (length {n}): d_hidden")
        weight_sum = [a + b for a, b in zip(weight_sum, alone[2:], strict=True)]
    for name, a, e in zip(NAMES, pack[2:], weight_sum, strict=True):
        assert_rel_close(a, e, PACK_TOL, f"pack vs alone: sum of {name} grads")

    # --- gdn.recompute (default) vs keeping the rule's intermediates: the same numbers, less saved ---
    import dataclasses

    kept = _module(full)
    kept.gdn = dataclasses.replace(kept.gdn, recompute=False)
    assert module.gdn.recompute
    saved = {}
    for name, m in (("recompute", module), ("kept", kept)):
        sizes = []

        def pack_hook(t, sizes=sizes):
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            got = _run(m, hidden_p, grad_p, _packed(lengths, padded))
        saved[name] = sum(sizes)
        if name == "kept":
            _check(got, pack, 1e-12, "recompute vs kept intermediates")
    assert saved["recompute"] < 0.5 * saved["kept"], saved

    # --- bf16: the error vs fp32 within transformers' bf16 error (+ 25 %) and BF16_CAP ---
    ours = _errors(_run(_module(full, dtype=torch.bfloat16), hidden, grad), expected)
    theirs = _errors(hf_run(torch.bfloat16, hidden, grad), expected)
    print("bf16 errors:", [f"{a:.2e}/{b:.2e}" for a, b in zip(ours, theirs, strict=True)])
    for name, e_ours, e_hf in zip(("out", "d_hidden", *NAMES), ours, theirs, strict=True):
        assert e_ours <= min(1.25 * e_hf + 1e-3, BF16_CAP), \
            f"bf16 {name}: error {e_ours:.2e} vs transformers' {e_hf:.2e}"

    # --- built by Megatron's TransformerLayer from a ModuleSpec (the layer spec's contract), thd ---
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module

    spec = copy.deepcopy(get_gpt_layer_local_spec())
    spec.submodules.self_attention = ModuleSpec(module=GatedDeltaNet, params={"gdn": _gdn()})
    layer = build_module(spec, config=_config(), layer_number=1)
    assert isinstance(layer.self_attention, GatedDeltaNet)
    layer.self_attention.load_state_dict({k: v.float() for k, v in full.items()})
    seen = {}
    layer.self_attention.register_forward_hook(lambda m, args, out: seen.update(x=args[0], out=out[0]))
    hidden_p = hidden_p.float().requires_grad_()
    out, _ = layer(hidden_p, attention_mask=None, packed_seq_params=_packed(lengths, padded))
    out.backward(grad_p.float())
    alone, _ = module(seen["x"].detach(), None, packed_seq_params=_packed(lengths, padded))
    assert_rel_close(seen["out"].detach(), alone, 0.0, "TransformerLayer's self_attention output")
    assert all(p.grad is not None for p in layer.self_attention.parameters())

    # --- a fresh module: TP-independent init, A_log / dt_bias / conv marked tensor parallel ---
    fresh = GatedDeltaNet(_config(), gdn=_gdn())
    assert torch.all((fresh.A_log.exp() >= 1) & (fresh.A_log.exp() <= 16)) and torch.all(fresh.dt_bias == 1)
    for p in (fresh.A_log, fresh.dt_bias, fresh.conv1d.weight):
        assert p.tensor_model_parallel and p.partition_dim == 0
    assert not getattr(fresh.norm.weight, "tensor_model_parallel", False)

    # --- bad input ---
    from megatron.core.packed_seq_params import PackedSeqParams

    x = torch.randn(8, 2, H)
    with pytest.raises(ValueError, match="b=2"):
        module(x, None, packed_seq_params=_packed([8]))
    with pytest.raises(ValueError, match="global pack size"):
        module(x[:, :1], None, packed_seq_params=_packed([3, 4]))
    with pytest.raises(ValueError, match="qkv_format"):
        module(x, None, packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="attention_bias"):
        module(x, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="GDNConfig"):
        GatedDeltaNet(_config(), gdn=None)
    parallel_state.destroy_model_parallel()


# ----------------------------------------------------------------------------------------------------
# Two ranks: TP = 2, TP = 2 + SP, CP = 2 vs one rank
# ----------------------------------------------------------------------------------------------------
def _two_rank_checks(rank: int, world: int, checkpoint: str) -> None:
    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mcore_engine.layers.attention import cp_local_index
    from mcore_engine.layers.gated_delta_net import GatedDeltaNet

    full = _weights(5)
    solo = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group
    one_rank = ProcessGroupCollection(tp=solo, cp=solo)

    # --- TP = 2 (thd pack and bshd) and TP = 2 + SP (thd): vs one rank; shards of the weight grads ---
    _setup(tp=world)
    reference = _module(full, pg=one_rank)
    lengths = [1, 13, 5, 21]  # 40 tokens: SP splits them in two
    hidden, grad = _inputs((40, 1, H), seed=6)
    hidden_b, grad_b = _inputs((18, 2, H), seed=7)
    expected, expected_b = _run(reference, hidden, grad, _packed(lengths)), _run(reference, hidden_b, grad_b)

    def sharded(result: list) -> list:
        grads = _shard(dict(zip(NAMES, result[2:], strict=True)), world, rank)
        return result[:2] + [grads[n] for n in NAMES]

    tp = _module(full, tp=world, rank=rank)
    _check(_run(tp, hidden, grad, _packed(lengths)), sharded(expected), FP32_TOL, f"rank {rank}: TP=2 thd")
    _check(_run(tp, hidden_b, grad_b), sharded(expected_b), FP32_TOL, f"rank {rank}: TP=2 bshd")
    sp = _module(full, tp=world, sp=True, rank=rank)
    local = slice(rank * 20, (rank + 1) * 20)
    actual = _run(sp, hidden[local], grad[local], _packed(lengths))
    want = sharded(expected)
    want[:2] = [want[0][local], want[1][local]]
    _check(actual, want, FP32_TOL, f"rank {rank}: TP=2 + SP thd")

    # --- checkpoint layout: in_proj_qkv / conv1d pieces head-contiguous over TP (reshardable) ---
    state = tp.sharded_state_dict()
    for key, full_key in (("in_proj_qkv.weight", "in_proj_qkv.weight"), ("conv1d.weight", "conv1d.weight")):
        pieces = {p.key.rsplit(".", 1)[-1]: p for p in state[key].build()}
        offsets = {"q": 0, "k": NK * DK, "v": 2 * NK * DK}
        assert sorted(pieces) == sorted(offsets)
        for part, piece in pieces.items():
            start, size = piece.global_offset[0], piece.local_shape[0]
            assert piece.global_shape[0] == (NV * DV if part == "v" else NK * DK)
            rows = torch.arange(offsets[part] + start, offsets[part] + start + size)
            assert torch.equal(piece.data.double(), full[full_key][rows].float().double()), f"{key}.{part}"
    assert state["A_log"].global_shape == (NV,) and state["A_log"].global_offset == (rank * NV // world,)
    dist_checkpointing.save(tp.sharded_state_dict(prefix="gdn."), checkpoint, async_sharded_save=False)

    with pytest.raises(ValueError, match="num_key_heads"):
        GatedDeltaNet(_config(tp=world), gdn=_gdn(nk=1, nv=2))
    parallel_state.destroy_model_parallel()

    # --- CP = 2: thd pack (lengths padded to multiples of 2 cp) and bshd; weight grads summed over CP ---
    _setup(cp=world)
    tp1 = parallel_state.get_tensor_model_parallel_group()
    reference = _module(full, pg=ProcessGroupCollection(tp=tp1, cp=solo))
    cp = _module(full, cp=world)
    cp_group = parallel_state.get_context_parallel_group()

    def summed(result: list) -> list:
        for g in result[2:]:
            dist.all_reduce(g, group=cp_group)
        return result

    real = [1, 3, 9, 22, 2]
    padded = [-(-n // (2 * world)) * 2 * world for n in real]
    idx = cp_local_index(padded, world, rank)
    hidden, grad = _inputs((sum(padded), 1, H), seed=8)
    expected = _run(reference, hidden, grad, _packed(real, padded))
    actual = summed(_run(cp, hidden[idx], grad[idx], _packed(real, padded)))
    _check(actual, [expected[0][idx], expected[1][idx], *expected[2:]], FP32_TOL, f"rank {rank}: CP=2 thd")

    row_idx = cp_local_index([24], world, rank)
    hidden_b, grad_b = _inputs((24, 3, H), seed=9)
    expected_b = _run(reference, hidden_b, grad_b)
    actual = summed(_run(cp, hidden_b[row_idx], grad_b[row_idx]))
    _check(actual, [expected_b[0][row_idx], expected_b[1][row_idx], *expected_b[2:]], FP32_TOL,
           f"rank {rank}: CP=2 bshd")

    # --- bf16 thd: CP=2's error vs float64 within CP=1's (+ 20 %) and BF16_CAP ---
    exact = _run(_module(full, dtype=torch.float64, pg=ProcessGroupCollection(tp=tp1, cp=solo)), hidden, grad,
                 _packed(real, padded))
    exact = [exact[0][idx], exact[1][idx], *exact[2:]]
    one = _run(_module(full, dtype=torch.bfloat16, pg=ProcessGroupCollection(tp=tp1, cp=solo)), hidden, grad,
               _packed(real, padded))
    one_err = _errors([one[0][idx], one[1][idx], *one[2:]], exact)
    two = summed(_run(_module(full, cp=world, dtype=torch.bfloat16), hidden[idx], grad[idx],
                      _packed(real, padded)))
    for name, e2, e1 in zip(("out", "d_hidden", *NAMES), _errors(two, exact), one_err, strict=True):
        assert e2 <= min(1.2 * e1 + 1e-3, BF16_CAP), f"rank {rank}: bf16 {name} {e2:.2e} vs {e1:.2e}"

    # --- the TP = 2 checkpoint loads into a TP = 1 (CP = 2) layer: the full weights ---
    fresh = GatedDeltaNet(_config(cp=world), gdn=_gdn())
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(prefix="gdn."), checkpoint)
    weights = {k for k in loaded if not k.endswith("_extra_state")}
    assert weights == {f"gdn.{n}" for n in NAMES}, sorted(loaded)
    for name in NAMES:
        assert torch.equal(loaded[f"gdn.{name}"], full[name].float()), f"resharded checkpoint: {name}"

    # --- bad input ---
    with pytest.raises(ValueError, match="num_key_heads"):
        GatedDeltaNet(_config(cp=world), gdn=_gdn(nk=1, nv=2))
    with pytest.raises(ValueError, match="multiples of 4"):
        cp(torch.randn(6, 1, H), None, packed_seq_params=_packed([6, 6]))
    with pytest.raises(ValueError, match="even"):
        cp(torch.randn(5, 1, H), None)
    parallel_state.destroy_model_parallel()


# ----------------------------------------------------------------------------------------------------
# Four ranks: TP = 2 + SP with CP = 2 (each rank one key head of the full sequences) vs one rank
# ----------------------------------------------------------------------------------------------------
def _four_rank_checks(rank: int, world: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    from mcore_engine.layers.attention import cp_local_index

    full = _weights(10)
    solo = [dist.new_group([r]) for r in range(world)][rank]
    _setup(tp=2, cp=2)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    cp_rank = parallel_state.get_context_parallel_rank()
    reference = _module(full, pg=ProcessGroupCollection(tp=solo, cp=solo))
    module = _module(full, tp=2, cp=2, sp=True, rank=tp_rank)
    real = [3, 17, 1, 10]
    padded = [-(-n // 4) * 4 for n in real]  # 40 tokens: 20 per CP rank, 10 per TP rank after SP
    hidden, grad = _inputs((sum(padded), 1, H), seed=11)
    expected = _run(reference, hidden, grad, _packed(real, padded))
    idx = cp_local_index(padded, 2, cp_rank)[tp_rank * 10: (tp_rank + 1) * 10]  # CP chunks, then SP split
    actual = _run(module, hidden[idx], grad[idx], _packed(real, padded))
    for g in actual[2:]:
        dist.all_reduce(g, group=parallel_state.get_context_parallel_group())
    grads = _shard(dict(zip(NAMES, expected[2:], strict=True)), 2, tp_rank)
    _check(actual, [expected[0][idx], expected[1][idx], *(grads[n] for n in NAMES)], FP32_TOL,
           f"rank {rank} (tp {tp_rank}, cp {cp_rank}): TP=2 + SP + CP=2 thd")
    parallel_state.destroy_model_parallel()


@pytest.mark.slow
def test_one_rank_matches_transformers_and_reference():
    run_distributed(_one_rank_checks, 1)


@pytest.mark.slow
def test_tp2_sp_cp2_match_one_rank(tmp_path):
    run_distributed(_two_rank_checks, 2, str(tmp_path))


def test_qkv_partition_rows():
    from mcore_engine.layers.gated_delta_net import qkv_partition_rows

    gdn = _gdn()
    parts = [qkv_partition_rows(gdn, 2, r) for r in range(2)]
    assert torch.equal(torch.cat(parts).sort().values, torch.arange(2 * NK * DK + NV * DV))
    kd = NK * DK // 2  # per rank
    assert parts[1][:kd].tolist() == list(range(kd, 2 * kd))  # rank 1's q: the second half of the key heads
    assert parts[1][kd: 2 * kd].tolist() == list(range(NK * DK + kd, NK * DK + 2 * kd))  # its k
    assert parts[1][2 * kd:].tolist() == list(range(2 * NK * DK + NV * DV // 2, 2 * NK * DK + NV * DV))  # v
    with pytest.raises(ValueError, match="tp=3"):
        qkv_partition_rows(gdn, 3, 0)


@pytest.mark.slow
def test_tp2_sp_with_cp2_matches_one_rank():
    run_distributed(_four_rank_checks, 4)
