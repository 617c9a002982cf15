"""Context parallelism (``parallel.context_parallel_size``) against CP = 1 on identical weights.

Launch 1 (one rank) records the CP = 1 references (dense GPT in thd and bshd, the critic, top-k
distillation) with the engine's SDPA core attention, and checks that attention against Megatron's
local ``DotProductAttention`` (``model.core_attention: local``) at CP = 1: outputs, loss, every
gradient, fp32 1e-6. Launch 2 (two ranks, CP = 2) and launch 3 (four ranks: CP = 2 x TP = 2 + SP,
CP = 2 x PP = 2, CP = 2 x DP = 2 with the distributed optimizer) replay them: inference outputs,
two ``train_batch`` steps (outputs, global loss, grad norm), every gradient of step 1 and every
weight after two steps (fp32 1e-5, bf16 2e-2). The sequences are 1, 2 and 3 tokens (shorter than
2 x CP), odd, and one at ``max_sequence_length`` (64). Layouts: thd, bshd, the fused lm-head,
selected rows, bf16, the critic, top-k distillation, full activation recompute, dynamic batch size,
the interleaved pipeline schedule (CP = 2 x PP = 2 x VPP = 2), MoE (EP=1, EP=2 and
CP = 2 x TP = 2 + SP: every token routed to the CP = 1 experts, router metrics equal, replaying the
recorded routing reproduces it). A checkpoint
written at CP = 2 loads at CP = 1 (DP = 2 on the same ranks) bit for bit, the next step equal, and
back: CP holds no state.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.compare import FP32_TWO_STEPS, AdamSteps, Attention, assert_tensors_close, bf16_budget
from tests.engine_setup import (
    check_router_replay,
    flat_values,
    full_state,
    load_full_state,
    make_batch,
    policy_loss,
)
from tests.parallel_setup import (
    OUTPUT_KEYS,
    TOL,
    after_steps,
    batches,
    check_layout_tensors,
    compare,
    config,
    run_steps,
)
from tests.utils import REL_TOL, assert_rel_close, run_distributed

# shorter than 2 x CP (1, 2, 3), odd, and one at max_sequence_length (64)
LENGTHS = [[1, 2, 3, 64, 17, 30], [5, 63, 1, 8, 11, 2]]
TEACHER_K = 3


def cp_batches(model: str, **flags) -> list:
    return batches(LENGTHS, **({"teacher_k": TEACHER_K} if model == "distill" else {}), **flags)


def cp_config(model: str, *, cp: int = 2, recompute: bool = False, attention: str = "sdpa", **kwargs):
    cfg = config("dense" if model == "distill" else model, cp=cp, **kwargs)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, core_attention=attention))
    if recompute:
        cfg = dataclasses.replace(cfg, recompute_granularity="full", recompute_method="uniform",
                                  recompute_num_layers=1)
    return cfg


REFERENCES = (("dense", "thd"), ("dense", "bshd"), ("value", "thd"), ("distill", "thd"),
              ("moe", "thd"))


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    ref, starts = {}, {}
    for model, fmt in REFERENCES:
        runs = {}
        variants = {"dense": ("sdpa", "local", "bf16") if fmt == "thd" else ("sdpa", "local")}
        for variant in variants.get(model, ("sdpa",)):
            attention, precision = ("sdpa", "bf16") if variant == "bf16" else (variant, "fp32")
            engine = MegatronEngine(cp_config(model, cp=1, data_format=fmt, attention=attention,
                                              precision=precision))
            engine.initialize()
            start = starts.setdefault(model if model in ("value", "moe") else "lm", full_state(engine))
            load_full_state(engine, start)
            runs[variant] = {"full0": start, **run_steps(engine, model, data=cp_batches(model)),
                               "full2": full_state(engine)}
            del engine
            destroy_distributed()
        if "local" in runs:  # the SDPA core attention equals Megatron's local attention at CP = 1
            sdpa, local = runs["sdpa"], runs["local"]
            compare(f"sdpa vs local ({fmt})", sdpa, local, False, 1e-6, cp_batches(model))
            attn = Attention.of(cp_config(model).model)
            assert_tensors_close(f"sdpa vs local ({fmt}): gradients of step 1", sdpa["grads"], local["grads"],
                                 attn=attn, grads=True, tol=1e-6)
            opt = cp_config(model).optimizer
            assert_tensors_close(f"sdpa vs local ({fmt}): weights after step 1", sdpa["weights1"],
                                 local["weights1"], attn=attn, grads=False,
                                 adam=AdamSteps(local["grads"], opt.lr, opt.adam_eps, 1))
            assert_tensors_close(f"sdpa vs local ({fmt}): weights after 2 steps", sdpa["full2"],
                                 local["full2"], attn=attn, grads=False, tol=FP32_TWO_STEPS,
                                 adam=AdamSteps(local["grads"], opt.lr, opt.adam_eps, 2))
        ref[(model, fmt)] = runs["sdpa"]
        if "bf16" in runs:  # per-tensor budgets of the bf16 layouts: the bf16 run's deviation from fp32
            bf16, fp32 = runs["bf16"], runs["sdpa"]
            ref[(model, fmt)]["bf16_budget"] = {"grads": bf16_budget(bf16["grads"], fp32["grads"]),
                                                "full2": bf16_budget(bf16["full2"], fp32["full2"])}
    torch.save(ref, path)


# name, model, reference data format, config kwargs, selected rows, tolerance
LAYOUTS_2 = [
    ("dense-cp2-thd", "dense", "thd", dict(), False, TOL),
    ("dense-cp2-bshd", "dense", "bshd", dict(data_format="bshd"), False, TOL),
    ("dense-cp2-fused", "dense", "thd", dict(fused_lm_head=True), False, TOL),
    ("dense-cp2-selected-bshd", "dense", "bshd", dict(data_format="bshd"), True, TOL),
    ("dense-cp2-bf16", "dense", "thd", dict(precision="bf16"), False, REL_TOL[torch.bfloat16]),
    ("dense-cp2-recompute", "dense", "thd", dict(recompute=True), False, TOL),
    ("value-cp2", "value", "thd", dict(), False, TOL),
    ("value-cp2-selected", "value", "thd", dict(), True, TOL),
    ("distill-cp2", "distill", "thd", dict(), False, TOL),
    ("moe-cp2", "moe", "thd", dict(), False, TOL),
    ("moe-cp2-ep2", "moe", "thd", dict(ep=2, etp=1), False, TOL),
    # the token budget counts whole sequences (each CP rank holds 1 / CP of them)
    ("dense-cp2-dynamic-bsz", "dense", "thd",
     dict(flags=dict(use_dynamic_bsz=True, max_token_len_per_gpu=70)), False, TOL),
]
LAYOUTS_4 = [
    ("dense-cp2-tp2-sp", "dense", "thd", dict(tp=2, sp=True), False, TOL),
    ("dense-cp2-tp2-sp-bshd", "dense", "bshd", dict(tp=2, sp=True, data_format="bshd"), False, TOL),
    ("dense-cp2-pp2", "dense", "thd", dict(pp=2), False, TOL),
    ("dense-cp2-pp2-vpp2", "dense", "thd", dict(pp=2, vpp=2, micro_batch_size=3), False, TOL),
    ("dense-cp2-dp2", "dense", "thd", dict(), False, TOL),
    ("moe-cp2-tp2-sp", "moe", "thd", dict(tp=2, sp=True), False, TOL),
]


def _dp_share(data: list) -> tuple[list, list[slice]]:
    """This DP rank's half of every batch, and its tokens' slice of the flat outputs."""
    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    shares, slices = [], []
    for b in data:
        per = b.batch_size[0] // dp
        tokens = [0, *b["input_ids"].offsets().diff().cumsum(0).tolist()]
        shares.append(b[torch.arange(rank * per, (rank + 1) * per)])
        slices.append(slice(tokens[rank * per], tokens[(rank + 1) * per]))
    return shares, slices


def _layouts(rank: int, world_size: int, path: str) -> None:
    from megatron.core import parallel_state

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    refs = torch.load(path, weights_only=False)
    for name, model, fmt, kwargs, select, tol in (LAYOUTS_2 if world_size == 2 else LAYOUTS_4):
        ref = refs[(model, fmt)]
        kwargs = dict(kwargs)
        flags = kwargs.pop("flags", {})
        engine = MegatronEngine(cp_config(model, **kwargs))
        engine.initialize()
        assert parallel_state.get_context_parallel_world_size() == 2, name
        load_full_state(engine, ref["full0"])
        data = cp_batches(model, **flags)
        if parallel_state.get_data_parallel_world_size() > 1:
            data, slices = _dp_share(data)
            got = run_steps(engine, model, select, data=data)
            for key, value in ref["infer"].items():
                assert_rel_close(got["infer"][key], value[slices[0]], tol, f"{name}: infer {key}")
            for i, (g, r) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
                assert_rel_close(g["loss"], r["loss"], after_steps(tol, i), f"{name}: step {i} loss")
                assert_rel_close(g["grad_norm"], r["grad_norm"], after_steps(tol, i),
                                 f"{name}: step {i} grad norm")
        else:
            got = run_steps(engine, model, select, data=data)
            compare(name, got, ref, select, tol, data)
        check_layout_tensors(name, engine, got, ref, bf16=kwargs.get("precision") == "bf16")
        if name == "dense-cp2-thd":  # too long a sequence: refused naming the field, nothing changed
            before = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
            with pytest.raises(ValueError, match="max_sequence_length"):
                engine.train_batch(make_batch(5, lengths=[3, 65]), policy_loss)
            after = [p.detach() for chunk in engine.model for p in chunk.module.parameters()]
            assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), name
        if model == "moe":  # replaying the recorded routing reproduces it (outputs etc. to 1e-6)
            check_router_replay(name, engine, data[0], tol=1e-6)
        del engine
        destroy_distributed()
    if world_size == 2:
        folder = os.path.join(os.path.dirname(path), "ckpt")
        _checkpoint_holds_no_cp_state(refs[("dense", "thd")]["full0"], folder)


def _checkpoint_holds_no_cp_state(full0: dict, folder: str) -> None:
    """Saved at CP = 2, loaded at CP = 1 (DP = 2 on the same two ranks, each given the whole batch:
    the same global loss and gradient): the weights bit for bit and the next step equal to 1e-5;
    that engine's checkpoint loaded back at CP = 2 bit for bit. CP holds no state."""
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    batch = make_batch(77, lengths=[9, 2, 40], calculate_entropy=True)

    def step(engine) -> tuple:
        out = engine.train_batch(batch, policy_loss)
        grads = {k: p.main_grad.detach().clone() for chunk in engine.model
                 for k, p in chunk.module.named_parameters()}
        return out.get_non_tensor("loss").clone(), flat_values(out["log_probs"]), full_state_of(engine), grads

    engine = MegatronEngine(cp_config("dense", cp=2))
    engine.initialize()
    load_full_state(engine, full0)
    step(engine)
    engine.save_checkpoint(folder + "-cp2")
    saved = full_state_of(engine)
    want = step(engine)
    del engine
    destroy_distributed()

    plain = MegatronEngine(cp_config("dense", cp=1))
    plain.initialize()
    plain.load_checkpoint(folder + "-cp2")
    assert all(torch.equal(v, saved[k]) for k, v in full_state_of(plain).items()), "CP = 2 ckpt -> CP = 1"
    got = step(plain)
    assert_rel_close(got[0], want[0], TOL, "CP = 1 from the CP = 2 checkpoint: loss")
    assert_rel_close(got[1], want[1], TOL, "CP = 1 from the CP = 2 checkpoint: log_probs")
    opt = cp_config("dense").optimizer
    assert_tensors_close("CP = 1 from the CP = 2 checkpoint: weights after the step", got[2], want[2],
                         attn=Attention.of(cp_config("dense").model), grads=False,
                         adam=AdamSteps(want[3], opt.lr, opt.adam_eps, 1))
    plain.save_checkpoint(folder + "-cp1")
    del plain
    destroy_distributed()

    back = MegatronEngine(cp_config("dense", cp=2))
    back.initialize()
    back.load_checkpoint(folder + "-cp1")
    assert all(torch.equal(v, got[2][k]) for k, v in full_state_of(back).items()), "CP = 1 ckpt -> CP = 2"
    del back
    destroy_distributed()


def full_state_of(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for chunk in engine.model for k, v in chunk.module.state_dict().items()
            if isinstance(v, torch.Tensor)}


@pytest.mark.slow
def test_context_parallel_four_ranks(tmp_path):
    path = os.path.join(tmp_path, "cp_ref.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 4, path)


def test_context_parallel_matches_cp1(tmp_path):
    path = os.path.join(tmp_path, "cp_ref.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)


def test_output_keys_cover_the_models():
    assert {m for m, _ in REFERENCES} <= set(OUTPUT_KEYS)
