"""The Qwen3.5 hybrid decoder (3 Gated DeltaNet layers + 1 gated full-attention layer, zero-centred
norms, partial RoPE; chunks of 8 tokens for sequences of 3..17) on every layout against one rank.

Launch 1 (one gloo rank) records the references of the dense hybrid and its MoE twin (a gated
shared expert), fp32 and bf16, from trained-like GDN decays and norm weights (``trained_like``).
Launch 2 (two ranks) replays them on identical weights: TP=2, TP=2 + SP, PP=2 (the GDN / attention
layer types follow the global layer index across stages), CP=2 (thd and bshd: the GDN exchange of
``layers.gated_delta_net``) and the MoE at EP=2 and TP=2 + SP; each: inference outputs, two
``train_batch`` steps (outputs, loss, grad norm), every gradient of the first step and the weights
after each step, tensor by tensor (``tests.compare``: fp32 1e-5, two Adam steps 1e-4; bf16 per-
tensor budgets from the one-rank bf16 run).
"""

from __future__ import annotations

import torch

from tests.compare import bf16_budget
from tests.engine_setup import full_state, load_full_state
from tests.parallel_setup import TOL, check_layout_tensors, compare, config, run_steps, trained_like
from tests.utils import REL_TOL, run_distributed

# name, model, config kwargs, tolerance
LAYOUTS = [
    ("hybrid-tp2", "hybrid", dict(tp=2), TOL),
    ("hybrid-tp2-sp", "hybrid", dict(tp=2, sp=True), TOL),
    ("hybrid-tp2-sp-bshd", "hybrid", dict(tp=2, sp=True, data_format="bshd"), TOL),
    ("hybrid-pp2", "hybrid", dict(pp=2), TOL),
    ("hybrid-cp2", "hybrid", dict(cp=2), TOL),
    ("hybrid-cp2-bshd", "hybrid", dict(cp=2, data_format="bshd"), TOL),
    ("hybrid-tp2-bf16", "hybrid", dict(tp=2, precision="bf16"), REL_TOL[torch.bfloat16]),
    ("hybrid-moe-ep2", "hybrid-moe", dict(ep=2), TOL),
    ("hybrid-moe-tp2-sp", "hybrid-moe", dict(tp=2, sp=True), TOL),
]


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    ref = {}
    for model in ("hybrid", "hybrid-moe", "hybrid-bf16"):
        name, precision = (model[:-5], "bf16") if model.endswith("-bf16") else (model, "fp32")
        engine = MegatronEngine(config(name, precision=precision))
        engine.initialize()
        if precision == "bf16":
            load_full_state(engine, ref[name]["full0"])
        else:
            trained_like(engine)
        full0 = full_state(engine)
        got = run_steps(engine, name)
        ref[model] = {"full0": full0, "full2": full_state(engine), **got}
        del engine
        destroy_distributed()
    bf16, fp32 = ref.pop("hybrid-bf16"), ref["hybrid"]
    fp32["bf16_budget"] = {"grads": bf16_budget(bf16["grads"], fp32["grads"]),
                           "full2": bf16_budget(bf16["full2"], fp32["full2"])}
    torch.save(ref, path)


def _layouts(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed
    from tests.parallel_setup import batches

    ref = torch.load(path, weights_only=False)
    for name, model, kwargs, tol in LAYOUTS:
        engine = MegatronEngine(config(model, **kwargs))
        engine.initialize()
        r = ref[model]
        load_full_state(engine, r["full0"])
        got = run_steps(engine, model)
        compare(name, got, r, False, tol, batches())
        check_layout_tensors(name, engine, got, r, bf16=kwargs.get("precision") == "bf16")
        del engine
        destroy_distributed()


def test_hybrid_layouts_match_one_rank(tmp_path):
    path = str(tmp_path / "reference.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)


def _pack_vs_alone(rank: int, world_size: int) -> None:
    from mcore_engine.engine import MegatronEngine
    from tests.engine_setup import flat_values, make_batch

    engine = MegatronEngine(config("hybrid"))
    engine.initialize()
    trained_like(engine)
    lengths = [1, 17, 8, 9, 3]  # one token, over two chunks of 8, exactly a chunk, one past it
    flags = dict(calculate_entropy=True, temperature=0.8)
    packed = engine.infer_batch(make_batch(5, lengths=lengths, **flags))
    for i, n in enumerate(lengths):
        alone = engine.infer_batch(make_batch(5, lengths=lengths, **flags)[i:i + 1])
        for key in ("log_probs", "entropy"):
            got, want = packed[key][i], flat_values(alone[key])
            err = float((got - want).abs().max())
            assert err <= 1e-6 * max(1.0, float(want.abs().max())), f"sequence {i} ({n} tokens) {key}: {err}"


def test_hybrid_pack_equals_alone():
    """A sequence's outputs do not depend on its neighbours in the pack: the conv and recurrent state
    restart at every boundary (fp32, 1e-6)."""
    run_distributed(_pack_vs_alone, 1)


def _mtp_on_hybrid(rank: int, world_size: int) -> None:
    import dataclasses

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.layers.gated_attention import GatedSelfAttention
    from mcore_engine.layers.gated_delta_net import GatedDeltaNet
    from tests.engine_setup import policy_loss
    from tests.parallel_setup import batches

    cfg = config("hybrid")
    types = ["full_attention"] + ["linear_attention"] * 3
    gdn = dataclasses.replace(cfg.model.linear_attention, layer_types=types)
    model = dataclasses.replace(cfg.model, linear_attention=gdn, mtp_num_layers=1,
                                mtp_loss_scaling_factor=0.3)
    cfg = dataclasses.replace(cfg, model=model)
    engine = MegatronEngine(cfg)
    engine.initialize()
    (chunk,) = engine.model
    model = chunk.module
    types = [type(layer.self_attention) is GatedDeltaNet for layer in model.decoder.layers]
    assert types == [False, True, True, True], types
    # the output gate eager (Megatron's torch.compile'd one gave NaNs under ATEN_CPU_CAPABILITY=avx2)
    assert type(model.decoder.layers[0].self_attention) is GatedSelfAttention
    from megatron.core.transformer.attention import SelfAttention

    mtp_modules = list(model.mtp.modules())  # the layer attribute differs across Megatron-Core versions
    assert not any(isinstance(m, GatedDeltaNet) for m in mtp_modules)
    assert [m.config.attention_output_gate for m in mtp_modules if isinstance(m, SelfAttention)] == [True]
    out = engine.train_batch(batches()[0], policy_loss)
    metrics = out.get_non_tensor("metrics")
    assert metrics["mtp_loss"] > 0 and metrics["update_skipped"] == 0.0, metrics


def test_hybrid_mtp_layer_is_full_attention():
    """Qwen3.5's MTP module is a gated full-attention layer even where the decoder (or this stage)
    ends in a GDN layer, and its loss trains."""
    run_distributed(_mtp_on_hybrid, 1)
