"""Sequence parallelism (``parallel.sequence_parallel``) against TP=1 on identical weights.

Launch 1 (one gloo rank) records the TP=1 references of three models: the dense tiny GPT, the same
GPT with QK-norm and MoE layers, and a critic (``head: value``). Launch 2 (two ranks) and launch 3
(four ranks) replay them under TP=2 with sequence parallelism: for each layout, inference outputs,
then two ``train_batch`` steps (per-token outputs, global loss, grad norm, router metrics, every
gradient of the first step) and the weights after each, tensor by tensor (``tests.compare``: fp32
1e-5, weights after two Adam steps 1e-4; bf16 against per-tensor budgets from a one-rank bf16 run).
Sequence lengths are random (3..17), so every micro-batch is padded to a multiple of TP.
Layouts: thd and bshd, the fused lm-head, selected rows (``outputs_on_loss_mask_only``), the
critic, MoE with expert-TP 2, with expert-TP 1 x EP=2 and with the allgather dispatcher; on four
ranks TP=2 x PP=2 (dense, also interleaved VPP=2, and MoE) and MoE TP=2 x EP=2. Under SP every
token is routed to the TP=1 experts, and replaying the recorded ``routed_experts`` reproduces the
routing bit for bit, outputs, loss and gradients to 1e-5. MoE training at TP=2 without SP is
refused naming ``sequence_parallel``. A checkpoint written with SP resumes without it (and back).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.compare import AdamSteps, Attention, assert_tensors_close, bf16_budget
from tests.engine_setup import (
    check_router_replay,
    full_state,
    load_full_state,
    make_batch,
    policy_loss,
)
from tests.parallel_setup import (
    FLAGS,
    NUM_SEQS,
    SEED,
    TOL,
    batches,
    check_layout_tensors,
    compare,
    config,
    run_steps,
)
from tests.utils import REL_TOL, assert_rel_close, run_distributed


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    ref = {}
    for model in ("dense", "moe", "value", "dense-bf16"):
        name, precision = (model[:-5], "bf16") if model.endswith("-bf16") else (model, "fp32")
        engine = MegatronEngine(config(name, precision=precision))
        engine.initialize()
        if precision == "bf16":  # per-tensor budgets of the bf16 layout: this run's deviation from fp32
            load_full_state(engine, ref[name]["full0"])
        full0 = full_state(engine)
        got = run_steps(engine, name)
        ref[model] = {"full0": full0, "full2": full_state(engine), **got}
        del engine
        destroy_distributed()
    bf16, fp32 = ref.pop("dense-bf16"), ref["dense"]
    fp32["bf16_budget"] = {"grads": bf16_budget(bf16["grads"], fp32["grads"]),
                           "full2": bf16_budget(bf16["full2"], fp32["full2"])}
    torch.save(ref, path)


# name, model, config kwargs, selected rows, tolerance
LAYOUTS_2 = [
    ("dense-tp2-sp-thd", "dense", dict(), False, TOL),
    ("dense-tp2-sp-bshd", "dense", dict(data_format="bshd"), False, TOL),
    ("dense-tp2-sp-fused", "dense", dict(fused_lm_head=True), False, TOL),
    ("dense-tp2-sp-selected", "dense", dict(), True, TOL),
    ("dense-tp2-sp-fused-selected-bshd", "dense", dict(fused_lm_head=True, data_format="bshd"), True, TOL),
    ("dense-tp2-sp-bf16", "dense", dict(precision="bf16"), False, REL_TOL[torch.bfloat16]),
    ("value-tp2-sp", "value", dict(), False, TOL),
    ("value-tp2-sp-selected", "value", dict(), True, TOL),
    ("moe-tp2-sp-etp2", "moe", dict(), False, TOL),
    ("moe-tp2-sp-etp1-ep2", "moe", dict(ep=2, etp=1), False, TOL),
    ("moe-tp2-sp-etp1-ep2-bshd-fused", "moe", dict(ep=2, etp=1, data_format="bshd", fused_lm_head=True),
     False, TOL),
    ("moe-tp2-sp-allgather", "moe", dict(dispatcher="allgather"), False, TOL),
]
LAYOUTS_4 = [
    ("dense-tp2-pp2-sp", "dense", dict(pp=2), False, TOL),
    ("dense-tp2-pp2-vpp2-sp-bshd", "dense", dict(pp=2, vpp=2, data_format="bshd", micro_batch_size=3), False,
     TOL),
    ("moe-tp2-pp2-sp", "moe", dict(pp=2), False, TOL),
    ("moe-tp2-ep2-sp", "moe", dict(ep=2), False, TOL),
]


def _layouts(rank: int, world_size: int, path: str) -> None:
    from megatron.core import parallel_state

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed
    ref = torch.load(path, weights_only=False)
    lengths = torch.cat([b["input_ids"].offsets().diff() for b in batches()])
    assert (lengths % 2 == 1).any(), "the batches must need padding to a multiple of TP"
    if world_size == 2:
        _moe_without_sequence_parallel(ref["moe"]["full0"])
    for name, model, kwargs, select, tol in (LAYOUTS_2 if world_size == 2 else LAYOUTS_4):
        engine = MegatronEngine(config(model, tp=2, sp=True, **kwargs))
        engine.initialize()
        assert parallel_state.get_tensor_model_parallel_world_size() == 2
        load_full_state(engine, ref[model]["full0"])
        got = run_steps(engine, model, select)
        compare(name, got, ref[model], select, tol, batches())
        r = ref[model]
        check_layout_tensors(name, engine, got, r, bf16=kwargs.get("precision") == "bf16")
        if name == "dense-tp2-sp-thd":
            _check_resume_without_sp(engine, os.path.join(os.path.dirname(path), "ckpt-sp"))
        if model == "moe":
            # replayed routing exact; the rest to fp32 1e-5: padding slots (whose routing is not
            # returned) are routed afresh, which changes the experts' GEMM sizes and so the last bits,
            # and the loss (0.02 from terms of order 1) carries them at up to 3e-6 (AVX2 kernels)
            check_router_replay(name, engine, batches()[0], tol=TOL)
        del engine
        destroy_distributed()


def _check_resume_without_sp(engine, folder: str) -> None:
    """A checkpoint of the SP engine loads into the same model at TP=2 without SP (and back): the
    weights bit for bit, the next step's loss, grad norm and weights as the SP engine's to 1e-5."""
    from mcore_engine.engine import MegatronEngine

    engine.save_checkpoint(folder)
    batch = make_batch(SEED + 7, NUM_SEQS, **FLAGS)

    def step(e) -> tuple[torch.Tensor, float, dict, dict]:
        out = e.train_batch(batch, policy_loss)
        (chunk,) = e.model
        return (out.get_non_tensor("loss").clone(), out.get_non_tensor("metrics")["grad_norm"],
                {k: p.detach().clone() for k, p in chunk.module.named_parameters()},
                {k: p.main_grad.detach().clone() for k, p in chunk.module.named_parameters()})

    saved = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
    want = step(engine)
    plain = MegatronEngine(config("dense", tp=2))
    plain.initialize()
    plain.load_checkpoint(folder)
    loaded = [p.detach() for chunk in plain.model for p in chunk.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved, strict=True)), "SP checkpoint -> no SP"
    loss, norm, weights, _ = step(plain)
    assert_rel_close(loss, want[0], TOL, "resumed without SP: loss")
    assert abs(norm - want[1]) <= TOL * want[1], f"resumed without SP: grad norm {norm} vs {want[1]}"
    opt = engine.config.optimizer  # one step from the same loaded weights and optimizer state
    assert_tensors_close("resumed without SP: weights after the step", weights, want[2],
                         attn=Attention.of(engine.config.model), grads=False,
                         adam=AdamSteps(want[3], opt.lr, opt.adam_eps, 1))
    engine.load_checkpoint(folder)  # and back into the SP engine
    assert all(torch.equal(p.detach(), b) for p, b in
               zip((p for chunk in engine.model for p in chunk.module.parameters()), saved, strict=True))
    del plain


def _moe_without_sequence_parallel(full0) -> None:
    """MoE at TP=2 without sequence parallelism: inference matches TP=1, training raises a
    ``ValueError`` naming ``sequence_parallel`` with the weights untouched."""
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed

    engine = MegatronEngine(config("moe", tp=2))
    engine.initialize()
    load_full_state(engine, full0)
    before = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
    inferred = engine.infer_batch(batches()[0])
    # forward-only passes run in eval mode like infer_batch (Megatron's MoELayer refuses TP > 1
    # without SP only in training mode): the same outputs, and the modules' modes come back
    for chunk in engine.model:
        chunk.train()
    with torch.no_grad():
        passed = engine.forward_backward_batch(batches()[0], policy_loss, forward_only=True)
    assert all(m.training for chunk in engine.model for m in chunk.modules()), "training mode not restored"
    assert torch.equal(passed["log_probs"].values(), inferred["log_probs"].values())
    assert math.isfinite(passed.get_non_tensor("loss"))
    try:
        engine.train_batch(batches()[0], policy_loss)
    except ValueError as exc:
        assert "sequence_parallel" in str(exc) and "tensor_model_parallel_size" in str(exc), exc
    else:
        raise AssertionError("MoE training at TP=2 without sequence_parallel did not raise")
    after = [p.detach() for chunk in engine.model for p in chunk.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "weights changed"
    del engine
    destroy_distributed()


def test_sequence_parallel_matches_tp1(tmp_path):
    path = os.path.join(tmp_path, "sp_ref.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)


@pytest.mark.slow
def test_sequence_parallel_four_ranks(tmp_path):
    path = os.path.join(tmp_path, "sp_ref.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 4, path)
