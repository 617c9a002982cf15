"""gpt-oss (``tests.parallel_setup``'s ``"gpt-oss"``: biases on every linear layer and the router,
attention sinks, a 4-token window on layers 0 and 2, YaRN, the clamped quick-GELU GLU MoE with 4
experts, top-2) on every layout against one rank.

Launch 1 (one gloo rank), from gpt-oss-like weights (``gpt_oss_like``: sinks and biases non-zero,
the experts' ``fc1`` large enough that the clamp at 7 cuts gates and ups, asserted): the fp32
reference (inference outputs, two ``train_batch`` steps, the first step's gradients, the weights
after each step, a third step; the sinks and every bias move); the window bites (sequences of up to
4 tokens equal a model without it, longer ones differ); a packed sequence equals itself alone (1
token, shorter and longer than the window, fp32 1e-6); router replay (R2 / R3) reproduces outputs,
loss and every gradient bit for bit. The bf16 reference and its fp32 twin: the same model with the
experts' fc1 unscaled (in bf16 weights of ~0.5 have an ulp of about lr: two bf16 runs differed by
3% after one step), both replaying one routing (R3; bf16 flips near-tied routing choices, and an
expert that gains or loses a token has another gradient).

Launch 2 (two gloo ranks) replays the references on identical weights: TP=2 + SP (thd, bshd, thd on
Megatron's ``DotProductAttention``; the experts at expert TP 1, the biased experts' default), EP=2,
TP=2 + SP with EP=2, PP=2, CP=2 (thd, bshd), DP=2 with the distributed optimizer, TP=2 + SP in bf16;
each: outputs, loss, grad norm, routing, every gradient of step 1, the weights after each step
(``tests.compare``: fp32 1e-5, two Adam steps 1e-4; bf16 per-tensor budgets from the one-rank bf16
run). Router replay at EP=2 bit for bit, at TP=2 + SP with EP=2 the routing bit for bit.
Checkpoints after two steps at TP=2 + SP and EP=2 load at TP=1 / EP=1 (DP=2) to the saver's
weights bit for bit, the sinks and biases included, and take step 3 as the reference does.

No launch: gpt-oss config fields the engine cannot honour raise ``ValueError`` naming them; the
biased experts' expert TP defaults to 1.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.compare import bf16_budget
from tests.engine_setup import (
    check_router_replay,
    flat_values,
    full_state,
    load_full_state,
    local_params,
    make_batch,
)
from tests.parallel_setup import TOL, check_layout_tensors, compare, config, run_steps, same_tensors
from tests.utils import REL_TOL, assert_identical, assert_rel_close, run_distributed

CLAMP = 7.0
FC1_SCALE = 9.0  # the experts' fc1 outputs ~N(0, 3.5): a few percent of gates / ups beyond the clamp
FLAGS = dict(calculate_entropy=True, temperature=0.8)
PACK = [1, 3, 4, 5, 17, 9]  # one token, shorter than / as long as / one past the window, longer

# name, config kwargs, tolerance
LAYOUTS = [
    ("tp2-sp", dict(tp=2, sp=True), TOL),  # expert TP 1: biased experts' default
    ("tp2-sp-bshd", dict(tp=2, sp=True, data_format="bshd"), TOL),
    # Megatron's DotProductAttention: its softmax_offset TP-split, the window per packed sequence
    ("tp2-sp-local", dict(tp=2, sp=True, core_attention="local"), TOL),
    ("ep2", dict(ep=2), TOL),
    ("tp2-sp-ep2", dict(tp=2, sp=True, ep=2, etp=1), TOL),
    ("pp2", dict(pp=2), TOL),
    ("cp2", dict(cp=2), TOL),  # a window that crosses the CP split, sinks in the log-sum-exp merge
    ("cp2-bshd", dict(cp=2, data_format="bshd"), TOL),
    ("dp2-distopt", dict(distopt=True), TOL),
    ("tp2-sp-bf16", dict(tp=2, sp=True, precision="bf16"), REL_TOL[torch.bfloat16]),
]
# router replay: bit for bit; under SP the routing bit for bit, the rest to fp32 1e-5 (padding slots,
# whose routing is not returned, are routed afresh: other expert GEMM sizes, other last bits)
REPLAY = {"ep2": None, "tp2-sp-ep2": TOL}
# a checkpoint after step 2 -> (the saver's layout, the layout that loads it)
SAVERS = {"tp2-sp": (dict(tp=2, sp=True), dict()), "ep2": (dict(ep=2), dict())}


def _config(*, distopt: bool = False, core_attention: str = "sdpa", **kwargs):
    """``config("gpt-oss", **kwargs)`` with the distributed optimizer and ``core_attention``."""
    cfg = config("gpt-oss", **kwargs)
    optimizer = dataclasses.replace(cfg.optimizer, use_distributed_optimizer=distopt)
    model = dataclasses.replace(cfg.model, core_attention=core_attention)
    return dataclasses.replace(cfg, model=model, optimizer=optimizer)


def gpt_oss_like(engine, seed: int = 0) -> None:
    """gpt-oss-like weights on a fresh one-rank engine: sinks ``N(0, 1)`` (Megatron initialises them
    ~0.05), every bias ``N(0, 0.1)`` (initialised to 0), the experts' ``fc1`` weights times
    ``FC1_SCALE`` so that the clamp is active (:func:`_clamped`)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        (chunk,) = engine.model
        for name, p in chunk.module.named_parameters():
            if name.endswith("softmax_offset"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            if "local_experts" in name and name.endswith("linear_fc1.weight"):
                p.mul_(FC1_SCALE)
    engine.optimizer.reload_model_params()


def _clamped(engine, batch) -> tuple[float, float]:
    """Fractions of the experts' gate inputs above ``CLAMP`` and up inputs beyond +-``CLAMP`` in one
    inference of ``batch``."""
    counts, hooks = torch.zeros(3), []

    def count(module, args, output):
        out, bias = output
        gate, up = (out if bias is None else out + bias).chunk(2, -1)
        counts.add_(torch.tensor([(gate > CLAMP).sum(), (up.abs() > CLAMP).sum(), gate.numel()]))

    for chunk in engine.model:
        for name, module in chunk.module.named_modules():
            if "local_experts" in name and name.endswith("linear_fc1"):
                hooks.append(module.register_forward_hook(count))
    engine.infer_batch(batch)
    for hook in hooks:
        hook.remove()
    return float(counts[0] / counts[2]), float(counts[1] / counts[2])


def _trained(full0: dict, full2: dict) -> None:
    """The sinks and every bias moved in two steps."""
    keys = [k for k in full0 if k.endswith(("softmax_offset", ".bias"))]
    assert sum(k.endswith("softmax_offset") for k in keys) == 4, sorted(keys)
    assert sum(k.endswith("router.bias") for k in keys) == 4, sorted(keys)
    still = [k for k in keys if torch.equal(full0[k], full2[k])]
    assert not still, f"not trained: {still}"


def _pack(seed: int = 5):
    return make_batch(seed, lengths=PACK, **FLAGS)


def _pack_vs_alone(engine) -> dict:
    """A packed sequence's outputs equal the sequence alone (fp32, 1e-6); the packed outputs."""
    packed = engine.infer_batch(_pack())
    for i, n in enumerate(PACK):
        alone = engine.infer_batch(_pack()[i:i + 1])
        for key in ("log_probs", "entropy"):
            got, want = packed[key][i], flat_values(alone[key])
            err = float((got - want).abs().max())
            assert err <= 1e-6 * max(1.0, float(want.abs().max())), f"sequence {i} ({n} tokens) {key}: {err}"
    return packed


def _window_bites(packed: dict, full0: dict) -> None:
    """The same weights without the window: equal where the window covers the whole sequence
    (length <= 4), different on every longer sequence."""
    cfg = _config()
    engine = _engine(dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, sliding_window=None, sliding_window_pattern=None)))
    load_full_state(engine, full0)
    wide = engine.infer_batch(_pack())
    for i, n in enumerate(PACK):
        err = float((packed["log_probs"][i] - wide["log_probs"][i]).abs().max())
        if n <= 4:
            assert err <= 1e-6, f"sequence {i} ({n} tokens) within the window: {err}"
        else:
            assert err > 1e-3, f"sequence {i} ({n} tokens): the window changes nothing ({err})"


def _routed(routes: list) -> list:
    """``batches()`` carrying ``routes`` (one ``routed_experts`` per batch): every pass replays them
    (R3), so the bf16 runs route as the fp32 one, both steps (bf16 sums flip near ties: an expert
    that gains or loses a token has another gradient, which no per-tensor budget bounds)."""
    from tests.parallel_setup import batches

    data = batches()
    for batch, route in zip(data, routes, strict=True):
        batch.set("routed_experts", route)
    return data


def _engine(cfg):
    """An initialised ``MegatronEngine``."""
    from mcore_engine.engine import MegatronEngine

    engine = MegatronEngine(cfg)
    engine.initialize()
    return engine


def _step3(engine) -> dict:
    """A third ``train_batch`` (the first batch again): loss and grad norm."""
    from tests.engine_setup import policy_loss
    from tests.parallel_setup import batches

    out = engine.train_batch(batches()[0], policy_loss)
    metrics = out.get_non_tensor("metrics")
    assert metrics["update_skipped"] == 0.0
    return {"loss": out.get_non_tensor("loss").clone(),
            "grad_norm": torch.tensor(metrics["grad_norm"], dtype=torch.float64)}


# ---------------------------------------------------------------------------------------- launch 1
def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.parallel.platform import destroy_distributed
    from tests.parallel_setup import batches

    engine = _engine(_config())
    gpt_oss_like(engine)
    full0 = full_state(engine)
    gates, ups = _clamped(engine, batches()[0])
    assert 0.005 < gates < 0.3 and 0.005 < ups < 0.3, f"clamp inactive: gates {gates:.4f}, ups {ups:.4f}"
    check_router_replay("one rank", engine, batches()[0])
    packed = _pack_vs_alone(engine)
    ref = {"full0": full0, **run_steps(engine, "moe")}
    ref["full2"] = full_state(engine)
    _trained(full0, ref["full2"])
    ref["step3"] = _step3(engine)
    ref["full3"] = full_state(engine)
    del engine
    destroy_distributed()

    _window_bites(packed, full0)
    destroy_distributed()

    # bf16: the same model without the scaled experts (bf16 rounding of fc1 weights ~0.5 is ~lr)
    gentle = {k: v / FC1_SCALE if "local_experts" in k and k.endswith("linear_fc1.weight") else v
              for k, v in full0.items()}
    runs, routes = {}, None
    for precision in ("fp32", "bf16"):
        engine = _engine(_config(precision=precision))
        load_full_state(engine, gentle)
        if routes is None:  # fp32's routing of both batches at the initial weights, replayed by all
            routes = [engine.infer_batch(b)["routed_experts"] for b in batches()]
        runs[precision] = {"full0": gentle, **run_steps(engine, "moe", data=_routed(routes)),
                           "full2": full_state(engine)}
        del engine
        destroy_distributed()
    low, high = runs["bf16"], runs["fp32"]
    grads = bf16_budget(low["grads"], high["grads"])
    # the sinks' and router biases' gradients are sums over every query / token of terms that cancel
    # (a top-k softmax's sum to 0), in tensors of 2 - 4 entries a rank, and bf16 rounds each SP
    # rank's partial sum first: the one-rank run's deviation does not bound another layout's
    # (measured at TP=2 + SP under ATEN_CPU_CAPABILITY=avx2: a sink 3.6e-2 against 4 x 8e-3, a router
    # bias 7.4e-3 against 2e-3); 0.1 still fails a reduction that is missing or doubled
    grads.update({k: max(v, 0.1) for k, v in grads.items() if k.endswith(("router.bias", "softmax_offset"))})
    # biases (~0.1) and sinks after two Adam steps of ~lr = 3e-3 an entry: where bf16 flips the sign of
    # a near-zero gradient the entry lands 2 lr away, ~1% of a 64-entry bias (measured 7.5e-3 against
    # 4 x the one-rank deviation, 9e-3, under ATEN_CPU_CAPABILITY=default); fp32 bounds such entries
    # by Adam's step (``AdamSteps``), bf16 budgets cannot
    full2 = bf16_budget(low["full2"], high["full2"])
    full2.update({k: max(v, 2e-2) for k, v in full2.items() if k.endswith((".bias", "softmax_offset"))})
    ref["bf16"] = {**high, "bf16": low, "routes": routes, "bf16_budget": {"grads": grads, "full2": full2}}
    torch.save(ref, path)


# ---------------------------------------------------------------------------------------- launch 2
def _compare_bf16(name: str, got: dict, ref: dict) -> None:
    """A bf16 layout's outputs, losses and grad norms against the fp32 reference ``ref``: within
    ``BF16_FACTOR`` times the one-rank bf16 run's deviation from fp32, at least bf16's 2e-2; the
    replayed routing exactly."""
    from tests.compare import BF16_FACTOR
    from tests.utils import rel_err

    low, bf16 = REL_TOL[torch.bfloat16], ref["bf16"]

    def close(a: torch.Tensor, b: torch.Tensor, b16: torch.Tensor, what: str) -> None:
        assert_rel_close(a, b, max(low, BF16_FACTOR * rel_err(b16, b)), f"{name}: {what}")

    assert torch.equal(got["routed_experts"], ref["routed_experts"]), f"{name}: replayed routed_experts"
    for key, value in ref["infer"].items():
        close(got["infer"][key], value, bf16["infer"][key], f"infer {key}")
    for i, (g, r, b) in enumerate(zip(got["steps"], ref["steps"], bf16["steps"], strict=True)):
        for key in ("loss", "grad_norm"):
            close(g[key], r[key], b[key], f"step {i} {key}")
        for key, value in r["outputs"].items():
            close(g["outputs"][key], value, b["outputs"][key], f"step {i} {key}")


def _layouts(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.parallel.platform import destroy_distributed
    from tests.parallel_setup import after_steps, batches

    ref = torch.load(path, weights_only=False)
    folder = os.path.dirname(path)
    saved = {}
    for name, kwargs, tol in LAYOUTS:
        bf16 = kwargs.get("precision") == "bf16"
        r = ref["bf16"] if bf16 else ref
        engine = _engine(_config(**kwargs))
        load_full_state(engine, r["full0"])
        data = _routed(r["routes"]) if bf16 else batches()
        got = run_steps(engine, "moe", data=data)
        if bf16:
            _compare_bf16(name, got, r)
        else:
            compare(name, got, r, False, tol, data)
        if kwargs.get("distopt"):  # reduce-scattered gradients: each rank holds its shard's sums
            same_tensors(f"{name}: weights after 2 steps", engine, local_params(engine), r["full2"],
                         steps_from=r["grads"][0])
        else:
            check_layout_tensors(name, engine, got, r, bf16=bf16)
        if name in REPLAY:
            check_router_replay(name, engine, batches()[0], tol=REPLAY[name])
        if name in SAVERS:
            engine.save_checkpoint(os.path.join(folder, name))
            saved[name] = local_params(engine)
        del engine
        destroy_distributed()

    for name, (saver, loader) in SAVERS.items():
        engine = _engine(_config(**loader))
        engine.load_checkpoint(os.path.join(folder, name))
        assert engine.global_step == 2, f"{name} -> {loader}: global_step {engine.global_step}"
        full = full_state(engine)
        step3 = _step3(engine)
        tol = after_steps(TOL, 2)
        for key in ("loss", "grad_norm"):
            assert_rel_close(step3[key], ref["step3"][key], tol, f"{name} -> {loader}: step 3 {key}")
        same_tensors(f"{name} -> {loader}: weights after 3 steps", engine, local_params(engine), ref["full3"],
                     steps_from=ref["grads"][0], steps=3)
        del engine
        destroy_distributed()
        engine = _engine(_config(**saver))  # the loaded weights cut back to the saver's layout
        load_full_state(engine, full)
        assert_identical(list(local_params(engine)[0].values()), list(saved[name][0].values()),
                         f"{name} -> {loader}: weights after the load")
        del engine
        destroy_distributed()


def test_gpt_oss_layouts_match_one_rank(tmp_path):
    path = str(tmp_path / "reference.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)


# ---------------------------------------------------------------------------------------- bad input
def _model(**fields):
    cfg = _config()
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **fields))


BAD = {  # what -> (build the config, field names the error must carry)
    "sliding_window_pattern too short": (lambda: _model(sliding_window_pattern=[1, 0, 1]),
                                         ["sliding_window_pattern"]),
    "sliding_window_pattern too long": (lambda: _model(sliding_window_pattern=[1, 0] * 3),
                                        ["sliding_window_pattern"]),
    "sliding_window_pattern not 0 / 1": (lambda: _model(sliding_window_pattern=[1, 2, 1, 0]),
                                         ["sliding_window_pattern"]),
    "sliding_window_pattern without a window": (lambda: _model(sliding_window=None),
                                                ["sliding_window_pattern", "sliding_window"]),
    "sliding_window 0": (lambda: _model(sliding_window=0), ["sliding_window"]),
    "glu_clamp 0": (lambda: _model(glu_clamp=0.0), ["glu_clamp"]),
    "glu_clamp negative": (lambda: _model(glu_clamp=-7.0), ["glu_clamp"]),
    "glu_activation unknown": (lambda: _model(glu_activation="gelu"), ["glu_activation"]),
    "yarn and rope_scaling_factor": (lambda: _model(rope_scaling_factor=8.0),
                                     ["yarn", "rope_scaling_factor"]),
    "glu fields without the gated MLP": (lambda: _model(swiglu=False), ["swiglu", "glu_activation"]),
    "EP that does not divide the experts": (lambda: _config(ep=3), ["expert_model_parallel_size",
                                                                   "num_experts"]),
    "biased experts split over expert TP": (lambda: _config(tp=2, etp=2), ["expert_tensor_parallel_size",
                                                                           "add_bias_linear"]),
}


def test_gpt_oss_expert_tp_defaults_to_one():
    """Biased experts cannot be split over TP (Megatron-Core): their expert TP defaults to 1."""
    assert _config(tp=2, sp=True).parallel.expert_tensor_size == 1
    assert config("moe", tp=2, sp=True).parallel.expert_tensor_size == 2  # unbiased: TP, as before


@pytest.mark.parametrize("what", list(BAD))
def test_gpt_oss_config_refused_by_field(what):
    build, fields = BAD[what]
    with pytest.raises(ValueError) as err:
        build()
    for field in fields:
        assert field in str(err.value), f"{what}: {field!r} not named in {err.value}"


def test_sinks_and_windows_keep_the_engine_attention_where_te_imports(monkeypatch):
    """Transformer Engine's layer spec is used when it imports, but never for sinks or windows."""
    from mcore_engine.model import spec

    monkeypatch.setattr(spec, "has_te", lambda: True)
    assert not spec.uses_te_spec(_config())
    assert not spec.uses_te_spec(_model(attention_sinks=False))  # the window alone
    assert not spec.uses_te_spec(_model(sliding_window=None, sliding_window_pattern=None))  # sinks alone
    assert spec.uses_te_spec(_model(attention_sinks=False, sliding_window=None, sliding_window_pattern=None))
