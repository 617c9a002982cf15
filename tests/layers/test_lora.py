"""mcore_engine.layers.lora: LoRA on Megatron's parallel linears against a float64 reference built from
the FULL per-projection weights and adapters (``y_p = x W_p^T + b_p + (alpha / r) (x A_p^T) B_p^T``).

One launch per world size. TP=1: every case (qkv with q+v and q+k+v, fc1 gate+up and up, a plain
column linear with a returned bias, proj, fc2, a row linear with an added bias): output and the
gradients of the input, every A / B (and of a trainable base) at fp32 1e-6; bf16 within a budget of
the plain bf16 PEFT computation; disabled == base and fresh adapters (B = 0) == base bit for bit;
``merged_weight``; PEFT itself on an ``nn.Linear`` (same A / B -> same outputs and gradients; init
conventions); the model-level ``apply_lora`` contract and its refusals. TP=2 without and with
sequence parallelism: the same cases equal TP=1 (values; sharded adapter grads as slices, replicated
ones after the engine's TP sum of the marked grads), adapters are slices of TP=1's, dropout (column:
TP=1's masks draw for draw; row: this rank's stream), checkpoint sharding metadata; a tiny GPTModel
with adapters at TP=2 (+SP) equals TP=1; a tiny Qwen2 with PEFT adapters on all seven projections
loaded by ``load_adapters`` gives PEFT's logits at TP=1 and 2, ``adapter_shards`` gathered give PEFT's
tensors back and ``merged_weight`` PEFT's ``merge_and_unload``.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.utils import REL_TOL, assert_rel_close, rel_err, run_distributed

H, NH, NG, D, FFN, R, ALPHA = 32, 4, 2, 8, 48, 3, 7.0
S, BATCH, SEED = 10, 3, 1234
SCALING = ALPHA / R
FP32_TOL = 1e-6
# kind -> (column?, projection -> full rows, in features, bias, skip_bias_add)
KINDS = {"qkv": (True, {"q": NH * D, "k": NG * D, "v": NG * D}, H, True, False),
         "fc1": (True, {"gate": FFN, "up": FFN}, H, False, True),
         "plain": (True, {"up": 40}, H, True, True),
         "proj": (False, {"o": H}, NH * D, False, True),
         "fc2": (False, {"down": H}, FFN, False, True),
         "row_bias": (False, {"down": H}, FFN, True, False)}
CASES = [("qkv", ("q", "v")), ("qkv", ("q", "k", "v")), ("fc1", ("gate", "up")), ("fc1", ("up",)),
         ("plain", ("up",)), ("proj", ("o",)), ("fc2", ("down",)), ("row_bias", ("down",))]
TRAINABLE_BASE = ("qkv", ("q", "k", "v"))  # the base weight / bias keep requires_grad in this case


# ----------------------------------------------------------------------------------------------------
# Layouts, modules, the float64 reference
# ----------------------------------------------------------------------------------------------------
def _tp() -> tuple[int, int]:
    from megatron.core import parallel_state

    ps = parallel_state
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _local_rows(kind: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The rank's rows of the fused tensor (dim 0): qkv per group ``[q | k | v]`` split by groups; else
    ``[p_0[t]; p_1[t]; ...]``."""
    rank, tp = _tp()
    if kind == "qkv":
        q, k, v = (parts[p] for p in "qkv")
        fused = torch.cat([t.reshape(NG, -1, *t.shape[1:]) for t in (q, k, v)], 1).reshape(-1, *q.shape[1:])
        return fused.chunk(tp)[rank]
    return torch.cat([t.chunk(tp)[rank] for t in parts.values()])


def _local_out(kind: str, ys: dict[str, torch.Tensor], sp: bool) -> torch.Tensor:
    """The rank's output: column fused on the last dim (all tokens); row the full output (SP: its
    sequence chunk)."""
    rank, tp = _tp()
    if KINDS[kind][0]:
        return _local_rows(kind, {p: y.movedim(-1, 0) for p, y in ys.items()}).movedim(0, -1)
    (y,) = ys.values()
    return y.chunk(tp)[rank] if sp else y


def _local_in(kind: str, x: torch.Tensor, sp: bool) -> torch.Tensor:
    rank, tp = _tp()
    if KINDS[kind][0]:
        return x.chunk(tp)[rank] if sp else x
    return x.chunk(tp, -1)[rank]


def _layout(kind: str):
    from mcore_engine.layers.lora import ColumnLayout

    return {"qkv": ColumnLayout(("q", "k", "v"), (NH // NG * D, D, D), NG, True),
            "fc1": ColumnLayout(("gate", "up"), (FFN, FFN)), "plain": ColumnLayout(("up",), (40,))}[kind]


def _config(sp: bool = False, dtype: torch.dtype = torch.float32):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=NH, num_query_groups=NG,
                             kv_channels=D, ffn_hidden_size=FFN, gated_linear_unit=True, add_qkv_bias=True,
                             use_cpu_initialization=True, tensor_model_parallel_size=_tp()[1],
                             sequence_parallel=sp, params_dtype=dtype, bf16=dtype == torch.bfloat16)


def _full(kind: str, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Fresh full weights / biases (``W.p``, ``b.p``), input ``x`` and upstream grads ``g.p``, rounded to
    ``dtype`` and held in float64."""
    column, outs, in_f, bias, _ = KINDS[kind]
    g = torch.Generator().manual_seed(seed)
    t = {"x": torch.randn(S, BATCH, in_f, generator=g, dtype=torch.float64)}
    for p, out_f in outs.items():
        t[f"W.{p}"] = torch.randn(out_f, in_f, generator=g, dtype=torch.float64) / math.sqrt(in_f)
        if bias:
            t[f"b.{p}"] = torch.randn(out_f, generator=g, dtype=torch.float64)
        t[f"g.{p}"] = torch.randn(S, BATCH, out_f, generator=g, dtype=torch.float64)
    return {k: v.to(dtype).double() for k, v in t.items()}


def _base(kind: str, full: dict, config, trainable: bool):
    """Megatron's linear holding this rank's slice of ``full``."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    column, outs, in_f, bias, skip = KINDS[kind]
    init = torch.nn.init.zeros_
    if column:
        m = ColumnParallelLinear(in_f, sum(outs.values()), config=config, init_method=init, bias=bias,
                                 skip_bias_add=skip, gather_output=False, stride=2 if kind == "fc1" else 1)
        w = _local_rows(kind, {p: full[f"W.{p}"] for p in outs})
        b = _local_rows(kind, {p: full[f"b.{p}"] for p in outs}) if bias else None
    else:
        m = RowParallelLinear(in_f, H, config=config, init_method=init, bias=bias, input_is_parallel=True,
                              skip_bias_add=skip)
        (p,) = outs
        w = full[f"W.{p}"].chunk(_tp()[1], 1)[_tp()[0]]
        b = full[f"b.{p}"] if bias else None
    with torch.no_grad():
        m.weight.copy_(w)
        if b is not None:
            m.bias.copy_(b)
    for param in m.parameters():
        param.requires_grad_(trainable)
    return m


def _wrap(kind: str, module, targets, init=False, dropout: float = 0.0, name: str | None = None):
    from mcore_engine.layers.lora import LoRAColumnParallelLinear, LoRARowParallelLinear

    common = dict(rank=R, alpha=ALPHA, seed=SEED, name=name or f"layer.{kind}", dropout=dropout,
                  init_lora_weights=init)
    if KINDS[kind][0]:
        return LoRAColumnParallelLinear.from_base(module, layout=_layout(kind), targets=targets, **common)
    return LoRARowParallelLinear.from_base(module, projection=targets[0], **common)


def _gather_tp(t: torch.Tensor, dim: int | None) -> torch.Tensor:
    """A TP shard gathered along ``dim`` (None: replicated, returned as is)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    tp = _tp()[1]
    if dim is None or tp == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp)]
    dist.all_gather(parts, t.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return torch.cat(parts, dim)


def _full_adapters(module) -> dict[str, torch.Tensor]:
    """``A.p`` / ``B.p`` gathered over TP by the documented split dims (what an exporter does)."""
    out = {}
    for p, shard in module.adapter_shards().items():
        out[f"A.{p}"] = _gather_tp(shard.a, shard.a_tp_dim).clone()
        out[f"B.{p}"] = _gather_tp(shard.b, shard.b_tp_dim).clone()
    return out


def _reference(kind: str, full: dict, adapters: dict, targets, masks: dict | None = None,
               dtype: torch.dtype = torch.float64) -> tuple[dict, dict]:
    """Per-projection outputs and the gradients of ``sum_p <y_p, g_p>`` w.r.t. x, W, b, A, B in
    ``dtype`` (float64: the reference; bf16: the plain PEFT computation). ``masks[p]``: the adapter
    input's dropout factor."""
    _, outs, _, bias, skip = KINDS[kind]
    leaves = {k: v.to(dtype).clone().requires_grad_() for k, v in (full | adapters).items()
              if not k.startswith("g.")}
    ys, loss = {}, 0
    for p in outs:
        y = leaves["x"] @ leaves[f"W.{p}"].T
        if bias and not skip:
            y = y + leaves[f"b.{p}"]
        if p in targets:
            xa = leaves["x"] * masks[p].to(dtype) if masks else leaves["x"]
            y = y + ((xa @ leaves[f"A.{p}"].T) @ leaves[f"B.{p}"].T) * SCALING
        ys[p] = y
        loss = loss + (y * full[f"g.{p}"].to(dtype)).sum()
    loss.backward()
    grads = {k: v.grad for k, v in leaves.items() if v.grad is not None}
    return {p: y.detach() for p, y in ys.items()}, grads


def _run(module, kind: str, full: dict, sp: bool, dtype: torch.dtype):
    """Output, returned bias, input grad and parameter grads (engine's TP sum of marked ones done)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_engine.layers.lora import LORA_TP_PARTIAL_GRAD

    module.zero_grad(set_to_none=True)
    x = _local_in(kind, full["x"], sp).to(dtype).requires_grad_()
    snapshot = x.detach().clone()
    out, bias = module(x)
    g = _local_out(kind, {p: full[f"g.{p}"] for p in KINDS[kind][1]}, sp)
    (out.double() * g).sum().backward()
    assert torch.equal(x.detach(), snapshot), "input modified"
    grads = {}
    for name, param in module.named_parameters():
        if param.grad is not None:
            grad = param.grad.clone()
            if getattr(param, LORA_TP_PARTIAL_GRAD, False):
                dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
            grads[name] = grad
    return out.detach(), bias, x.grad, grads


def _expected_grad(kind: str, name: str, param, ref_grads: dict) -> torch.Tensor:
    """The rank's slice of a reference gradient, by the parameter's TP attributes."""
    rank, tp = _tp()
    which, p = name.replace("lora_", "").split(".") if "lora_" in name else (name[0].upper(), None)
    if p is not None:
        full = ref_grads[f"{which}.{p}"]
        return full.chunk(tp, param.partition_dim)[rank] if param.tensor_model_parallel else full
    key = "W" if name == "weight" else "b"
    if KINDS[kind][0]:
        return _local_rows(kind, {q: ref_grads[f"{key}.{q}"] for q in KINDS[kind][1]})
    (q,) = KINDS[kind][1]
    return ref_grads[f"{key}.{q}"].chunk(tp, 1)[rank] if key == "W" else ref_grads[f"{key}.{q}"]


def _check_against_reference(kind, targets, module, full, sp, dtype, tol, what, masks=None, trainable=False):
    """Output / input grad / every parameter grad of ``module`` vs the float64 reference."""
    adapters = {k: v.double() for k, v in _full_adapters(module).items()}
    ys, ref = _reference(kind, full, adapters, targets, masks)
    out, bias, dx, grads = _run(module, kind, full, sp, dtype)
    assert_rel_close(out, _local_out(kind, ys, sp).to(out.dtype), tol, f"{what}: output")
    assert bias is (module.bias if KINDS[kind][4] else None), f"{what}: returned bias"
    assert_rel_close(dx, _local_in(kind, ref["x"], sp).to(dx.dtype), tol, f"{what}: input grad")
    expected_names = {f"lora_{w}.{p}" for p in targets for w in "AB"}
    if trainable:
        expected_names |= {"weight", "bias"}
    assert set(grads) == expected_names, f"{what}: grads of {sorted(grads)}"
    for name, grad in grads.items():
        param = dict(module.named_parameters())[name]
        expected = _expected_grad(kind, name, param, ref).to(grad.dtype)
        assert_rel_close(grad, expected, tol, f"{what}: grad {name}")
    return out, dx, grads


# ----------------------------------------------------------------------------------------------------
# Per-case checks, run at any TP
# ----------------------------------------------------------------------------------------------------
def _split_out(kind: str, out: torch.Tensor) -> dict[str, torch.Tensor]:
    """A TP=1 fused tensor (projections on the last dim) -> per-projection tensors."""
    outs = KINDS[kind][1]
    if kind == "qkv":
        parts = out.reshape(*out.shape[:-1], NG, -1).split([NH // NG * D, D, D], -1)
        parts = [t.reshape(*out.shape[:-1], -1) for t in parts]
    else:
        parts = out.split(list(outs.values()), -1)
    return dict(zip(outs, parts, strict=True))


def _as_full_grads(kind: str, grads: dict) -> dict[str, torch.Tensor]:
    """TP=1 parameter grads keyed like the reference's (``A.p``, ``B.p``, ``W.p``, ``b.p``)."""
    out = {k.replace("lora_", ""): g for k, g in grads.items() if k.startswith("lora_")}
    for key, name in (("W", "weight"), ("b", "bias")):
        if name in grads and KINDS[kind][0]:
            parts = _split_out(kind, grads[name].movedim(0, -1))
            out |= {f"{key}.{p}": t.movedim(-1, 0) for p, t in parts.items()}
    return out


def _case(kind: str, targets: tuple, sp: bool, seed: int, tp1: dict | None = None) -> dict:
    """fp32 checks of one case at the current TP; against TP=1's record ``tp1`` when given."""
    from mcore_engine.layers.lora import LORA_TP_PARTIAL_GRAD, adapters_disabled

    rank, tp = _tp()
    what = f"{kind}{targets} tp={tp} sp={sp}"
    trainable = (kind, targets) == TRAINABLE_BASE
    full = _full(kind, seed, torch.float32)
    config = _config(sp)

    # --- the base, then fresh adapters (B = 0): the same forward and backward bit for bit ---
    out0, bias0, dx0, grads0 = _run(_base(kind, full, config, trainable), kind, full, sp, torch.float32)
    fresh = _wrap(kind, _base(kind, full, config, trainable), targets, init=True)
    for p, shard in fresh.adapter_shards().items():
        assert not shard.b.any(), f"{what}: B.{p} not zero at init"
        bound = 1 / math.sqrt(fresh.full_shapes(p)[0][1])  # kaiming-uniform(a=sqrt 5) over the FULL fan-in
        assert 0.5 * bound < shard.a.abs().max() <= bound, f"{what}: A.{p} outside PEFT's init bound"
    out1, _, dx1, _ = _run(fresh, kind, full, sp, torch.float32)
    assert torch.equal(out1, out0) and torch.equal(dx1, dx0), f"{what}: fresh adapters changed the output"

    # --- random A and B: marks; disabled == base exactly; enabled vs float64 ---
    module = _wrap(kind, _base(kind, full, config, trainable), targets, init=False)
    for p in targets:  # the TP-partial-grad mark: column A, row B
        marked = [getattr(t, LORA_TP_PARTIAL_GRAD, False) for t in (module.lora_A[p], module.lora_B[p])]
        assert marked == ([True, False] if KINDS[kind][0] else [False, True]), f"{what}: marks {marked}"
        assert all(t.allreduce and t.requires_grad for t in (module.lora_A[p], module.lora_B[p]))
    with adapters_disabled(torch.nn.ModuleList([module])):
        assert not module.lora_enabled
        out_d, bias_d, dx_d, grads_d = _run(module, kind, full, sp, torch.float32)
    assert module.lora_enabled
    assert torch.equal(out_d, out0) and torch.equal(dx_d, dx0), f"{what}: disabled != base"
    assert bias_d is (module.bias if bias0 is not None else None)
    assert grads_d.keys() == grads0.keys() and all(torch.equal(grads_d[k], grads0[k]) for k in grads0)
    out, dx, grads = _check_against_reference(kind, targets, module, full, sp, torch.float32, FP32_TOL, what,
                                              trainable=trainable)

    # --- merged weight: W + scaling B A in the local layout ---
    adapters = _full_adapters(module)
    merged = {p: full[f"W.{p}"] + (SCALING * adapters[f"B.{p}"].double() @ adapters[f"A.{p}"].double()
                                   if p in targets else 0) for p in KINDS[kind][1]}
    expected = _local_rows(kind, merged) if KINDS[kind][0] else next(iter(merged.values())).chunk(tp, 1)[rank]
    assert_rel_close(module.merged_weight(), expected.float(), FP32_TOL, f"{what}: merged_weight")

    if tp1 is None:  # the TP=1 record, per projection
        return {"adapters": adapters, "out": _split_out(kind, out) if KINDS[kind][0] else {targets[0]: out},
                "dx": dx, "grads": _as_full_grads(kind, grads)}
    # --- TP=2 vs TP=1: adapters are slices of TP=1's; values and gradients equal ---
    for k, v in adapters.items():
        assert torch.equal(v, tp1["adapters"][k]), f"{what}: adapter {k} is not TP=1's"
    assert_rel_close(out, _local_out(kind, tp1["out"], sp), FP32_TOL, f"{what}: output vs TP=1")
    assert_rel_close(dx, _local_in(kind, tp1["dx"], sp), FP32_TOL, f"{what}: input grad vs TP=1")
    params = dict(module.named_parameters())
    for name, grad in grads.items():
        assert_rel_close(grad, _expected_grad(kind, name, params[name], tp1["grads"]), FP32_TOL,
                         f"{what}: grad {name} vs TP=1")
    return {}


def _bf16_case(kind: str, targets: tuple, seed: int) -> None:
    """bf16 (TP=1): error vs float64 within 1.25 x the plain bf16 PEFT computation's + 5e-4 (measured:
    equal to it, 2e-3 to 4e-3)."""
    what = f"bf16 {kind}{targets}"
    full = _full(kind, seed, torch.bfloat16)
    module = _wrap(kind, _base(kind, full, _config(dtype=torch.bfloat16), False), targets)
    with torch.no_grad():  # nonzero B (PEFT's B = 0 would hide the adapter's rounding)
        for p in targets:
            module.lora_B[p].uniform_(-0.5, 0.5, generator=torch.Generator().manual_seed(seed))
    adapters = {k: v.double() for k, v in _full_adapters(module).items()}
    ys, ref = _reference(kind, full, adapters, targets)
    ys_b, ref_b = _reference(kind, full, adapters, targets, dtype=torch.bfloat16)
    out, _, dx, grads = _run(module, kind, full, False, torch.bfloat16)
    pairs = [("out", out, _local_out(kind, ys, False), _local_out(kind, ys_b, False)),
             ("dx", dx, ref["x"], ref_b["x"])]
    pairs += [(n, g, ref[n.replace("lora_", "")], ref_b[n.replace("lora_", "")]) for n, g in grads.items()]
    for name, ours, exact, plain in pairs:
        err, budget = rel_err(ours, exact), 1.25 * rel_err(plain, exact) + 5e-4
        assert err <= min(budget, REL_TOL[torch.bfloat16]), f"{what}: {name} error {err:.2e} > {budget:.2e}"


def _dropout_case(kind: str, targets: tuple, sp: bool, tp1: dict | None = None) -> dict:
    """p = 0.25 in training: the module's masks reproduced from the same RNG state (column: the default
    generator, one mask per projection; row: this rank's TP tracker) give the float64 reference; column
    masks are TP=1's draw for draw; eval mode draws nothing."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    rank, tp = _tp()
    what = f"dropout {kind}{targets} tp={tp} sp={sp}"
    full = _full(kind, 91, torch.float32)
    module = _wrap(kind, _base(kind, full, _config(sp), False), targets, dropout=0.25)
    module.train()
    torch.manual_seed(99)  # the same default-generator state on every rank and at every TP
    tracker = get_cuda_rng_tracker()
    if KINDS[kind][0]:
        state = torch.get_rng_state()
        masks = {p: F.dropout(torch.ones(S, BATCH, H), 0.25, True) for p in targets}
        torch.set_rng_state(state)
    else:
        states = tracker.get_states()
        with tracker.fork():
            local = F.dropout(torch.ones(S, BATCH, KINDS[kind][2] // tp), 0.25, True)
        tracker.set_states(states)
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local, group=parallel_state.get_tensor_model_parallel_group())
        assert tp == 1 or not torch.equal(parts[0], parts[1]), f"{what}: TP ranks drew the same row mask"
        masks = {targets[0]: torch.cat(parts, -1)}
        state = torch.get_rng_state()
    _check_against_reference(kind, targets, module, full, sp, torch.float32, FP32_TOL, what, masks)
    if not KINDS[kind][0]:
        assert torch.equal(torch.get_rng_state(), state), f"{what}: the row side used the default generator"
    module.eval()  # no dropout, no draw
    state = torch.get_rng_state()
    out_eval = module(_local_in(kind, full["x"], sp).float())[0]
    assert torch.equal(torch.get_rng_state(), state), f"{what}: eval mode drew random numbers"
    no_drop, _ = _reference(kind, full, {k: v.double() for k, v in _full_adapters(module).items()}, targets)
    assert_rel_close(out_eval.detach(), _local_out(kind, no_drop, sp).float(), FP32_TOL, f"{what}: eval")
    if tp1 is not None and KINDS[kind][0]:
        for p, m in masks.items():
            assert torch.equal(m, tp1["masks"][p]), f"{what}: mask {p} is not TP=1's"
    return {"masks": masks}


def _check_sharded_state_dict() -> None:
    """Checkpoint metadata (TP=2): sharded adapters split on their TP dim, replicated ones whole."""
    from megatron.core import parallel_state

    rank, tp = _tp()
    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    for kind, targets, sharded, replicated in (("qkv", ("q", "k"), "lora_B.q", "lora_A.q"),
                                                ("proj", ("o",), "lora_A.o", "lora_B.o")):
        module = _wrap(kind, _base(kind, _full(kind, 5, torch.float32), _config(), False), targets)
        sd = module.sharded_state_dict(prefix="m.", metadata=meta)
        assert {"m.weight", f"m.{sharded}", f"m.{replicated}"} <= set(sd)
        t = sd[f"m.{sharded}"]
        dim = module.lora_B["q"].partition_dim if kind == "qkv" else 1
        full_shape = list(t.local_shape)
        full_shape[dim] *= tp
        assert t.global_shape == tuple(full_shape), f"{kind}: {t.global_shape} != {full_shape}"
        assert t.global_offset[dim] == rank * t.local_shape[dim]
        r = sd[f"m.{replicated}"]
        assert r.global_shape == r.local_shape and not any(r.global_offset)


# ----------------------------------------------------------------------------------------------------
# Model level: apply_lora on a tiny GPTModel
# ----------------------------------------------------------------------------------------------------
ALL_TARGETS = {"linear_qkv": {"q", "k", "v"}, "linear_proj": {"o"}, "linear_fc1": {"gate", "up"},
               "linear_fc2": {"down"}}
VOCAB, SEQ = 250, 12  # vocab padded to 256 at TP 1 and 2


def _gpt(tp: int, sp: bool = False, **model_kwargs):
    """The engine's GPTModel (local spec, torch norms, SDPA core attention), base frozen."""
    from mcore_engine.config import EngineConfig, ModelConfig, ParallelConfig
    from mcore_engine.model.build import build_model_chunks
    from mcore_engine.parallel.platform import init_distributed

    model = ModelConfig(**(dict(num_layers=2, hidden_size=H, num_attention_heads=NH, num_query_groups=NG,
                                ffn_hidden_size=FFN, vocab_size=VOCAB, max_sequence_length=32,
                                add_qkv_bias=True, init_method_std=0.1) | model_kwargs))
    parallel = ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp)
    cfg = EngineConfig(model=model, parallel=parallel)
    init_distributed(cfg.parallel, cfg.seed)
    (chunk,) = build_model_chunks(cfg)
    for param in chunk.parameters():
        param.requires_grad_(False)
    return chunk


def _gpt_inputs():
    g = torch.Generator().manual_seed(17)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return ids, torch.arange(SEQ).expand(2, SEQ), torch.randn(2, SEQ, 256, generator=g)


def _gpt_run(model, w=None):
    """Logits and the adapters' grads (TP sum of the marked ones done); no backward when ``w`` is None."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_engine.layers.lora import LORA_TP_PARTIAL_GRAD

    ids, pos, _ = _gpt_inputs()
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(w is not None):
        logits = model(ids, pos, None)
    if w is None:
        return logits, {}
    (logits * w).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grads[name] = param.grad.clone()
            if getattr(param, LORA_TP_PARTIAL_GRAD, False):
                dist.all_reduce(grads[name], group=parallel_state.get_tensor_model_parallel_group())
    return logits.detach(), grads


def _slice(full: torch.Tensor, param) -> torch.Tensor:
    rank, tp = _tp()
    return full.chunk(tp, param.partition_dim)[rank] if param.tensor_model_parallel else full


def _model_tp1() -> dict:
    """TP=1: fresh adapters == base bit for bit; 28 adapter params; random B changes the logits;
    disabled == base bit for bit. Returns the record for TP=2."""
    from mcore_engine.layers.lora import adapters_disabled, apply_lora, lora_modules
    from mcore_engine.parallel.platform import destroy_distributed

    _, _, w = _gpt_inputs()
    model = _gpt(1)
    base, _ = _gpt_run(model)
    params = apply_lora(model, rank=R, alpha=ALPHA, targets=ALL_TARGETS, seed=SEED)
    assert len(params) == 2 * 7 * 2 and all(p.requires_grad for p in params)
    names = {n for n, _ in lora_modules(model)}
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    assert names == {f"decoder.layers.{i}.{linear}" for i in range(2) for linear in linears}
    assert torch.equal(_gpt_run(model)[0], base), "fresh adapters changed the logits"
    destroy_distributed()

    model = _gpt(1)
    apply_lora(model, rank=R, alpha=ALPHA, targets=ALL_TARGETS, seed=SEED, init_lora_weights=False)
    logits, grads = _gpt_run(model, w)
    assert rel_err(logits, base) > 1e-2, "random adapters did not change the logits"
    assert len(grads) == 28 and all(g.abs().sum() > 0 for g in grads.values())
    with adapters_disabled(model):
        assert torch.equal(_gpt_run(model)[0], base), "disabled adapters != base model"
    record = {"base": base, "logits": logits, "grads": grads,
              "adapters": {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}}
    destroy_distributed()
    return record


def _model_tp2(sp: bool, tp1: dict) -> None:
    """TP=2 (+SP): adapters are slices of TP=1's; logits and adapter grads equal TP=1's."""
    from mcore_engine.layers.lora import adapters_disabled, apply_lora
    from mcore_engine.parallel.platform import destroy_distributed

    model = _gpt(2, sp)
    apply_lora(model, rank=R, alpha=ALPHA, targets=ALL_TARGETS, seed=SEED, init_lora_weights=False)
    rank, tp = _tp()
    vocab = slice(rank * 256 // tp, (rank + 1) * 256 // tp)
    params = {n: p for n, p in model.named_parameters() if ".lora_" in n}
    assert params.keys() == tp1["adapters"].keys()
    for name, param in params.items():
        assert torch.equal(param.detach(), _slice(tp1["adapters"][name], param)), f"sp={sp}: {name}"
    logits, grads = _gpt_run(model, _gpt_inputs()[2][..., vocab])
    assert_rel_close(logits, tp1["logits"][..., vocab], 1e-5, f"model tp=2 sp={sp}: logits")
    for name, grad in grads.items():
        expected = _slice(tp1["grads"][name], params[name])
        assert_rel_close(grad, expected, 1e-5, f"model tp=2 sp={sp}: grad {name}")
    with adapters_disabled(model):
        assert_rel_close(_gpt_run(model)[0], tp1["base"][..., vocab], 1e-5, f"model tp=2 sp={sp}: disabled")
    destroy_distributed()


# ----------------------------------------------------------------------------------------------------
# PEFT itself
# ----------------------------------------------------------------------------------------------------
def _peft_linear_checks() -> None:
    """PEFT's ``lora.Linear`` on an ``nn.Linear`` vs the plain column wrapper given the same A / B: the
    same output and gradients (scaling alpha / r, B (A x) order); init conventions match PEFT's."""
    import peft

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up_proj = torch.nn.Linear(H, 40)

    torch.manual_seed(3)
    tiny = peft.get_peft_model(Tiny(), peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["up_proj"],
                                                       init_lora_weights=False))
    layer = tiny.base_model.model.up_proj
    full = _full("plain", 8, torch.float32)
    full["W.up"], full["b.up"] = (t.detach().double() for t in layer.base_layer.parameters())
    ours = _wrap("plain", _base("plain", full, _config(), False), ("up",))
    ours.load_full("up", layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach())
    x = full["x"].float().requires_grad_()
    y = layer(x)
    (y.double() * full["g.up"]).sum().backward()
    out, bias, dx, grads = _run(ours, "plain", full, False, torch.float32)
    assert_rel_close(out + bias, y.detach(), FP32_TOL, "PEFT Linear: output")
    assert_rel_close(dx, x.grad, FP32_TOL, "PEFT Linear: input grad")
    assert_rel_close(grads["lora_A.up"], layer.lora_A["default"].weight.grad, FP32_TOL, "PEFT Linear: grad A")
    assert_rel_close(grads["lora_B.up"], layer.lora_B["default"].weight.grad, FP32_TOL, "PEFT Linear: grad B")

    # --- init: True (A kaiming-uniform(a=sqrt 5) = U(+-1/sqrt(in)), B 0) and "gaussian" (A ~ N(0, 1/r)) ---
    from mcore_engine.layers.lora import LoRAColumnParallelLinear

    big_r = 64
    for init in (True, "gaussian"):
        config = peft.LoraConfig(r=big_r, lora_alpha=8, target_modules=["up_proj"], init_lora_weights=init)
        theirs = peft.get_peft_model(Tiny(), config).base_model.model.up_proj
        a_theirs, b_theirs = theirs.lora_A["default"].weight, theirs.lora_B["default"].weight
        mine = LoRAColumnParallelLinear.from_base(
            _base("plain", full, _config(), False), layout=_layout("plain"), targets={"up"}, rank=big_r,
            alpha=8, seed=1, name="tiny.up_proj", init_lora_weights=init)
        a_mine, b_mine = mine.lora_A["up"], mine.lora_B["up"]
        assert a_mine.shape == a_theirs.shape and b_mine.shape == b_theirs.shape
        assert not b_mine.any() and not b_theirs.any()
        assert mine.lora_scaling == theirs.scaling["default"] == 8 / big_r
        if init is True:
            bound = 1 / math.sqrt(H)
            for a in (a_mine, a_theirs):
                assert 0.95 * bound < a.abs().max() <= bound, f"init True: max |A| {a.abs().max():.4f}"
        for a in (a_mine, a_theirs):  # uniform(+-b): std b / sqrt 3; gaussian: 1 / r
            std = 1 / big_r if init == "gaussian" else 1 / math.sqrt(3 * H)
            assert abs(a.std().item() / std - 1) < 0.1, f"init {init}: std {a.std():.4f} vs {std:.4f}"


def _peft_model_checks(folder: str, tp: int) -> None:
    """A tiny Qwen2 (GQA, qkv bias, SwiGLU) with PEFT adapters on all seven projections: the engine's
    model with ``apply_lora`` + ``load_adapters`` of PEFT's tensors gives PEFT's logits; the shards
    gathered by their TP dims give PEFT's tensors back; ``merged_weight`` is the rank's slice of PEFT's
    ``merge_and_unload`` weights."""
    import re

    from mcore_engine.config import EngineConfig, ParallelConfig
    from mcore_engine.hf import from_hf_config, load_hf_weights, read_hf_config
    from mcore_engine.layers.lora import (
        LINEAR_PROJECTIONS,
        adapter_shards,
        apply_lora,
        load_adapters,
        lora_modules,
    )
    from mcore_engine.model.build import build_model_chunks
    from mcore_engine.parallel.platform import destroy_distributed, init_distributed

    saved = torch.load(f"{folder}/peft.pt")
    adapters: dict[tuple[int, str], list] = {}
    for key, t in saved["adapters"].items():  # base_model.model.model.layers.{i}.*.{p}_proj.lora_{A|B}...
        i, p, which = re.search(r"layers\.(\d+)\.\w+\.(\w+)_proj\.lora_([AB])", key).groups()
        adapters.setdefault((int(i), p), [None, None])["AB".index(which)] = t
    cfg = EngineConfig(model=from_hf_config(read_hf_config(f"{folder}/base"), hf_path=f"{folder}/base"),
                       parallel=ParallelConfig(tensor_model_parallel_size=tp))
    init_distributed(cfg.parallel, cfg.seed)
    (model,) = build_model_chunks(cfg)
    load_hf_weights([model], f"{folder}/base", cfg)
    apply_lora(model, rank=R, alpha=ALPHA, targets=ALL_TARGETS, seed=0)
    with pytest.raises(ValueError, match="no entry for layer 1 projection 'down'"):
        load_adapters(model, {k: v for k, v in adapters.items() if k != (1, "down")})
    load_adapters(model, adapters)

    rank = _tp()[0]
    shards = adapter_shards(model)
    assert shards.keys() == adapters.keys()
    for key, shard in shards.items():
        gathered = (_gather_tp(shard.a, shard.a_tp_dim), _gather_tp(shard.b, shard.b_tp_dim))
        assert all(map(torch.equal, gathered, adapters[key])), f"PEFT tp={tp}: gathered {key} differs"
    for name, module in lora_modules(model):
        linear = name.rsplit(".", 1)[1]
        where = f"model.layers.{module.lora_layer}.{'mlp' if linear.startswith('linear_fc') else 'self_attn'}"
        merged = {p: saved["merged"][f"{where}.{p}_proj.weight"].double() for p in LINEAR_PROJECTIONS[linear]}
        if linear in ("linear_qkv", "linear_fc1"):
            expected = _local_rows("qkv" if linear == "linear_qkv" else "fc1", merged)
        else:
            expected = next(iter(merged.values())).chunk(tp, 1)[rank]
        assert_rel_close(module.merged_weight(), expected.float(), FP32_TOL, f"PEFT tp={tp}: merged {name}")
    with torch.no_grad():
        logits = model(saved["ids"], torch.arange(saved["ids"].shape[1]).expand_as(saved["ids"]), None)
    lo = rank * logits.shape[-1]
    real = min(logits.shape[-1], VOCAB - lo)
    assert_rel_close(logits[..., :real], saved["logits"][..., lo:lo + real], 1e-4, f"PEFT tp={tp}: logits")
    destroy_distributed()


@pytest.fixture(scope="module")
def peft_qwen2(tmp_path_factory) -> str:
    """A tiny Qwen2 folder, PEFT adapters (random A and B) on all seven projections, PEFT's logits and
    merged weights."""
    peft = pytest.importorskip("peft")
    from tests.hf.models import save_tiny_model

    root = tmp_path_factory.mktemp("lora")
    model = save_tiny_model("qwen2", root / "base", seed=3)
    torch.manual_seed(5)
    modules = [f"{p}_proj" for p in ("q", "k", "v", "o", "gate", "up", "down")]
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, init_lora_weights=False, target_modules=modules)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        base = model(ids).logits
        wrapped = peft.get_peft_model(model, lora)
        logits = wrapped(ids).logits
    assert rel_err(logits, base) > 1e-2
    adapters = {k: v.detach().clone() for k, v in wrapped.state_dict().items() if ".lora_" in k}
    merged = {k: v.detach().clone() for k, v in wrapped.merge_and_unload().state_dict().items()}
    torch.save({"ids": ids, "logits": logits, "adapters": adapters, "merged": merged}, root / "peft.pt")
    return str(root)

# ----------------------------------------------------------------------------------------------------
# Refusals
# ----------------------------------------------------------------------------------------------------
def _refusals_tp1() -> None:
    from megatron.core.tensor_parallel import ColumnParallelLinear

    from mcore_engine.config.moe import MoEConfig
    from mcore_engine.layers.lora import (
        ColumnLayout,
        LoRAColumnParallelLinear,
        adapters_disabled,
        apply_lora,
        lora_modules,
    )
    from mcore_engine.parallel.platform import destroy_distributed

    model = _gpt(1)
    good = dict(rank=R, alpha=ALPHA, targets=ALL_TARGETS, seed=SEED)
    bad = [(dict(rank=0), "rank"), (dict(rank=True), "rank"), (dict(rank=2.5), "rank"),
           (dict(alpha=math.inf), "alpha"), (dict(alpha=0), "alpha"), (dict(alpha=-2.0), "alpha"),
           (dict(dropout=1.0), "dropout"), (dict(dropout=-0.1), "dropout"),
           (dict(init_lora_weights="orthogonal"), "init_lora_weights"), (dict(seed=None), "seed"),
           (dict(targets={"linear_qq": {"q"}}), "unknown linear"),
           (dict(targets={"linear_qkv": {"o"}}), "linear_qkv"),
           (dict(targets={"linear_fc1": set()}), "linear_fc1"), (dict(targets={}), "targets"),
           (dict(swiglu=False), "swiglu")]
    for kwargs, match in bad:
        with pytest.raises(ValueError, match=match):
            apply_lora(model, **(good | kwargs))
    wrapper = torch.nn.Module()
    wrapper.module = model
    with pytest.raises(ValueError, match="unwrapped GPTModel"):
        apply_lora(wrapper, **good)
    assert not list(lora_modules(model)), "a refused apply_lora changed the model"
    apply_lora(model, **(good | dict(targets={"linear_proj": {"o"}})))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model, **(good | dict(targets={"linear_qkv": {"q"}, "linear_proj": {"o"}})))
    assert [n.rsplit(".", 1)[1] for n, _ in lora_modules(model)] == ["linear_proj"] * 2
    destroy_distributed()

    # --- MoE MLPs refused under linear_fc1 / linear_fc2; attention adapters fine ---
    model = _gpt(1, moe=MoEConfig(num_experts=2, router_topk=2, ffn_hidden_size=16))
    for linear, projection in (("linear_fc1", "up"), ("linear_fc2", "down")):
        with pytest.raises(ValueError, match="MoE expert linears"):
            apply_lora(model, **(good | dict(targets={"linear_qkv": {"q"}, linear: {projection}})))
    assert not list(lora_modules(model))
    attention_only = {"linear_qkv": {"q", "v"}, "linear_proj": {"o"}}
    assert len(apply_lora(model, **(good | dict(targets=attention_only)))) == 12
    destroy_distributed()

    # --- no SwiGLU: fc1 is one projection, "up" ---
    model = _gpt(1, swiglu=False)
    with pytest.raises(ValueError, match="linear_fc1"):
        apply_lora(model, **(good | dict(targets={"linear_fc1": {"gate"}})))
    apply_lora(model, **(good | dict(targets={"linear_fc1": {"up"}}, init_lora_weights=False)))
    assert model.decoder.layers[0].mlp.linear_fc1.lora_targets == ("up",)
    with adapters_disabled(model):
        base = _gpt_run(model)[0]
    assert rel_err(_gpt_run(model)[0], base) > 1e-3
    destroy_distributed()

    # --- from_base / load_full ---
    from mcore_engine.config import ParallelConfig
    from mcore_engine.parallel.platform import init_distributed

    init_distributed(ParallelConfig(), SEED)
    full = _full("qkv", 1, torch.float32)

    class OtherLinear(ColumnParallelLinear):
        pass

    base = _base("qkv", full, _config(), False)
    base.__class__ = OtherLinear
    with pytest.raises(ValueError, match="exactly"):
        _wrap("qkv", base, ("q",))
    common = dict(rank=R, alpha=ALPHA, seed=0, name="x")
    with pytest.raises(ValueError, match="subset"):
        LoRAColumnParallelLinear.from_base(_base("qkv", full, _config(), False), layout=_layout("qkv"),
                                           targets={"gate"}, **common)
    with pytest.raises(ValueError, match="local rows"):
        LoRAColumnParallelLinear.from_base(_base("qkv", full, _config(), False),
                                           layout=ColumnLayout(("q",), (8,)), targets={"q"}, **common)
    module = _wrap("qkv", _base("qkv", full, _config(), False), ("q", "v"))
    assert module.full_shapes("q") == ((R, H), (NH * D, R))
    with pytest.raises(ValueError, match="shape"):
        module.load_full("q", torch.zeros(R, H + 1), torch.zeros(NH * D, R))
    with pytest.raises(ValueError, match="no adapter"):
        module.load_full("k", torch.zeros(R, H), torch.zeros(NG * D, R))
    assert "LoRA(r=3" in repr(module)
    destroy_distributed()


def _refusals_tp2() -> None:
    """num_query_groups < TP (Megatron splits a group over ranks; the engine's config refuses it too)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from mcore_engine.layers.lora import ColumnLayout, apply_lora, lora_modules
    from mcore_engine.parallel.platform import destroy_distributed

    _init(2)
    with pytest.raises(ValueError, match="num_query_groups"):
        ColumnLayout(("q", "k", "v"), (2 * D, D, D), 1, True).local(2)
    config = TransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=NH, num_query_groups=1,
                               use_cpu_initialization=True, tensor_model_parallel_size=2)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=256,
                     max_sequence_length=32)
    with pytest.raises(ValueError, match="num_query_groups=1"):
        apply_lora(model, rank=R, alpha=ALPHA, targets={"linear_qkv": {"q"}}, seed=0)
    assert not list(lora_modules(model))
    destroy_distributed()


# ----------------------------------------------------------------------------------------------------
# Launches
# ----------------------------------------------------------------------------------------------------
def _init(tp: int) -> None:
    from mcore_engine.config import ParallelConfig
    from mcore_engine.parallel.platform import init_distributed

    init_distributed(ParallelConfig(tensor_model_parallel_size=tp), SEED)


def _one_rank(rank: int, world: int) -> None:
    from mcore_engine.parallel.platform import destroy_distributed

    _init(1)
    for i, (kind, targets) in enumerate(CASES):
        _case(kind, targets, False, seed=i)
        _bf16_case(kind, targets, seed=100 + i)
    _peft_linear_checks()
    destroy_distributed()
    _model_tp1()
    _refusals_tp1()


def _two_ranks(rank: int, world: int, peft_folder: str) -> None:
    from mcore_engine.parallel.platform import destroy_distributed

    # --- TP=1 records (DP=2) ---
    _init(1)
    cases = {(kind, targets): _case(kind, targets, False, seed=i) for i, (kind, targets) in enumerate(CASES)}
    drops = {kind: _dropout_case(kind, targets, False) for kind, targets in (("qkv", ("q", "k", "v")),
                                                                            ("fc2", ("down",)))}
    destroy_distributed()
    model = _model_tp1()
    _peft_model_checks(peft_folder, 1)

    # --- TP=2 without and with sequence parallelism ---
    _init(2)
    for sp in (False, True):
        for i, (kind, targets) in enumerate(CASES):
            _case(kind, targets, sp, seed=i, tp1=cases[(kind, targets)])
        for kind, targets in (("qkv", ("q", "k", "v")), ("fc2", ("down",))):
            _dropout_case(kind, targets, sp, tp1=drops[kind])
    _check_sharded_state_dict()
    destroy_distributed()
    for sp in (False, True):
        _model_tp2(sp, model)
    _peft_model_checks(peft_folder, 2)
    _refusals_tp2()


@pytest.mark.slow
def test_lora_tp1_reference_peft_and_refusals():
    run_distributed(_one_rank, 1)


@pytest.mark.slow
def test_lora_tp2_matches_tp1_and_peft(peft_qwen2):
    run_distributed(_two_ranks, 2, peft_qwen2)


def test_column_layout():
    from mcore_engine.layers.lora import ColumnLayout

    qkv = ColumnLayout(("q", "k", "v"), (2 * D, D, D), NG, True)
    assert qkv.local(1) == (NG, (2 * D, D, D)) and qkv.local(2) == (1, (2 * D, D, D))
    assert qkv.out_features("q") == NH * D and qkv.out_features("k") == NG * D
    assert ColumnLayout(("gate", "up"), (FFN, FFN)).local(2) == (1, (FFN // 2, FFN // 2))
    with pytest.raises(ValueError, match="not divisible"):
        ColumnLayout(("up",), (40,)).local(3)
    with pytest.raises(ValueError, match="differ in length"):
        ColumnLayout(("gate", "up"), (FFN,)).local(1)
