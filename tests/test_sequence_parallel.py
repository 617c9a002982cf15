"""Sequence parallelism (``parallel.sequence_parallel``) against TP=1 on identical weights.

Launch 1 (one gloo rank) records the TP=1 references of three models: the dense tiny GPT, the same
GPT with QK-norm and MoE layers, and a critic (``head: value``). Launch 2 (two ranks) and launch 3
(four ranks) replay them under TP=2 with sequence parallelism: for each layout, inference outputs,
then two ``train_batch`` steps (per-token outputs, global loss, grad norm, router metrics, every
gradient of the first step) and every weight after them, fp32 relative-norm error 1e-5 (bf16:
2e-2). Sequence lengths are random (3..17), so every micro-batch is padded to a multiple of TP.
Layouts: thd and bshd, the fused lm-head, selected rows (``outputs_on_loss_mask_only``), the
critic, MoE with expert-TP 2, with expert-TP 1 x EP=2 and with the allgather dispatcher; on four
ranks TP=2 x PP=2 (dense, also interleaved VPP=2, and MoE) and MoE TP=2 x EP=2. Under SP every
token is routed to the TP=1 experts, and replaying the recorded ``routed_experts`` reproduces the
routing bit for bit, outputs, loss and gradients to 1e-6. MoE training at TP=2 without SP is
refused naming ``sequence_parallel``. A checkpoint written with SP resumes without it (and back).
"""

from __future__ import annotations

import dataclasses
import math
import os

import torch

from tests.engine_setup import (
    check_router_replay,
    flat_values,
    full_state,
    load_full_state,
    local_reference,
    make_batch,
    policy_loss,
    tiny_config,
)
from tests.utils import REL_TOL, assert_rel_close, run_distributed

TOL = REL_TOL[torch.float32]
SEED = 23
NUM_SEQS = 6
FLAGS = dict(calculate_entropy=True, temperature=0.8)
MOE = dict(num_experts=4, router_topk=2, ffn_hidden_size=32, aux_loss_coeff=0.01, z_loss_coeff=1e-3,
           layer_freq=[0, 1, 1, 1])


def config(model: str, *, tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1,
           etp: int | None = None, sp: bool = False, data_format: str = "thd", fused_lm_head: bool = False,
           precision: str = "fp32", dispatcher: str = "alltoall", micro_batch_size: int = 2):
    """The tiny GPT of ``tests.engine_setup`` as ``model`` ``"dense"``, ``"moe"`` (with QK-norm) or
    ``"value"``."""
    from mcore_engine.moe_config import MoEConfig

    cfg = tiny_config(tp=tp, pp=pp, vpp=vpp, data_format=data_format, micro_batch_size=micro_batch_size,
                      fused_lm_head=fused_lm_head, precision=precision, lr=3e-3)
    m = cfg.model
    if model == "moe":
        m = dataclasses.replace(m, qk_layernorm=True, moe=MoEConfig(**MOE, token_dispatcher=dispatcher))
    elif model == "value":
        m = dataclasses.replace(m, head="value")
    parallel = dataclasses.replace(cfg.parallel, sequence_parallel=sp, expert_model_parallel_size=ep,
                                   expert_tensor_parallel_size=etp)
    return dataclasses.replace(cfg, model=m, parallel=parallel)


def batches() -> list:
    return [make_batch(SEED + i, NUM_SEQS, **FLAGS) for i in range(2)]


OUTPUT_KEYS = {"dense": ("log_probs", "entropy"), "moe": ("log_probs", "entropy"), "value": ("values",)}


def run_steps(engine, model: str, select: bool = False) -> dict:
    """Inference, then two train steps: outputs (flat, real tokens), loss, grad norm, metrics, and
    the first step's gradients per model chunk."""
    keys = OUTPUT_KEYS[model]
    flags = {} if model != "value" else {"calculate_entropy": False}
    got: dict = {"steps": []}
    data = batches()
    for batch in data:
        for key, value in {**flags, "outputs_on_loss_mask_only": select}.items():
            batch.set_non_tensor(key, value)
    infer = engine.infer_batch(data[0])
    got["infer"] = {k: flat_values(infer[k]) for k in keys}
    if model == "moe":
        got["routed_experts"] = flat_values(infer["routed_experts"])
    for batch in data:
        out = engine.train_batch(batch, policy_loss if model != "value" else value_loss)
        if "grads" not in got:  # the first step's gradients (clipped in place, as on every layout)
            got["grads"] = [{k: p.main_grad.detach().float().clone()
                             for k, p in chunk.module.named_parameters()} for chunk in engine.model]
        engine.lr_scheduler_step()
        metrics = out.get_non_tensor("metrics")
        got["steps"].append({"loss": out.get_non_tensor("loss").clone(),
                             "grad_norm": torch.tensor(metrics["grad_norm"], dtype=torch.float64),
                             "outputs": {k: flat_values(out[k]) for k in keys},
                             "moe": {k: v for k, v in metrics.items() if k.startswith("moe/")}})
        assert metrics["update_skipped"] == 0.0
    return got


def value_loss(outputs: dict, data, ctx):
    """Token-mean squared error of the values against the advantages, as a contribution."""
    mask = data["loss_mask"]
    loss = (((outputs["values"] - data["advantages"]) ** 2) * mask).sum() / ctx.global_num_tokens
    return loss, {}


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.platform import destroy_distributed

    ref = {}
    for model in OUTPUT_KEYS:
        engine = MegatronEngine(config(model))
        engine.initialize()
        full0 = full_state(engine)
        got = run_steps(engine, model)
        ref[model] = {"full0": full0, "full2": full_state(engine), **got}
        del engine
        destroy_distributed()
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


def _compare(name: str, got: dict, ref: dict, select: bool, tol: float, data) -> None:
    masks = []
    for b in data:  # selected rows: the packed loss mask (each sequence's last token dropped)
        mask = flat_values(b["loss_mask"]).bool()
        mask[b["input_ids"].offsets()[1:] - 1] = False
        masks.append(mask)

    def same(a: torch.Tensor, b: torch.Tensor, what: str, mask: torch.Tensor) -> None:
        if select:
            a, b = a[mask], b[mask]
        assert_rel_close(a, b, tol, f"{name}: {what}")

    for key, value in ref["infer"].items():
        same(got["infer"][key], value, f"infer {key}", masks[0])
    if "routed_experts" in ref:  # every token's top-k experts in every MoE layer, as at TP=1
        assert torch.equal(got["routed_experts"], ref["routed_experts"]), f"{name}: routed_experts"
    for i, (g, r) in enumerate(zip(got["steps"], ref["steps"], strict=True)):
        assert_rel_close(g["loss"], r["loss"], tol, f"{name}: step {i} loss")
        assert_rel_close(g["grad_norm"], r["grad_norm"], tol, f"{name}: step {i} grad norm")
        for key, value in r["outputs"].items():
            same(g["outputs"][key], value, f"step {i} {key}", masks[i])
        assert g["moe"].keys() == r["moe"].keys(), f"{name}: router metrics {sorted(g['moe'])}"
        for key, value in r["moe"].items():
            assert abs(g["moe"][key] - value) <= tol * max(abs(value), 1e-6), \
                f"{name}: step {i} {key} {g['moe'][key]} vs {value}"


def _layouts(rank: int, world_size: int, path: str) -> None:
    from megatron.core import parallel_state

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.platform import destroy_distributed
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
        _compare(name, got, ref[model], select, tol, batches())
        weights = [{k: p.detach().float() for k, p in chunk.module.named_parameters()}
                   for chunk in engine.model]
        _same_tensors(f"{name}: weights after 2 steps", weights,
                      local_reference(engine, ref[model]["full2"]), tol)
        _same_tensors(f"{name}: gradients of step 1", got["grads"],
                      local_reference(engine, ref[model]["grads"][0]), tol)
        if name == "dense-tp2-sp-thd":
            _check_resume_without_sp(engine, os.path.join(os.path.dirname(path), "ckpt-sp"))
        if model == "moe":
            # replayed routing exact; the rest to 1e-6: padding slots (whose routing is not returned)
            # are routed afresh, which changes the experts' GEMM sizes and so the last bits
            check_router_replay(name, engine, batches()[0], tol=1e-6)
        del engine
        destroy_distributed()


def _check_resume_without_sp(engine, folder: str) -> None:
    """A checkpoint of the SP engine loads into the same model at TP=2 without SP (and back): the
    weights bit for bit, the next step's loss, grad norm and weights as the SP engine's to 1e-5."""
    from mcore_engine.engine import MegatronEngine

    engine.save_checkpoint(folder)
    batch = make_batch(SEED + 7, NUM_SEQS, **FLAGS)

    def step(e) -> tuple[torch.Tensor, float, list[torch.Tensor]]:
        out = e.train_batch(batch, policy_loss)
        return (out.get_non_tensor("loss").clone(), out.get_non_tensor("metrics")["grad_norm"],
                [p.detach().clone() for chunk in e.model for p in chunk.module.parameters()])

    saved = [p.detach().clone() for chunk in engine.model for p in chunk.module.parameters()]
    want = step(engine)
    plain = MegatronEngine(config("dense", tp=2))
    plain.initialize()
    plain.load_checkpoint(folder)
    loaded = [p.detach() for chunk in plain.model for p in chunk.module.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(loaded, saved, strict=True)), "SP checkpoint -> no SP"
    loss, norm, weights = step(plain)
    assert_rel_close(loss, want[0], TOL, "resumed without SP: loss")
    assert abs(norm - want[1]) <= TOL * want[1], f"resumed without SP: grad norm {norm} vs {want[1]}"
    for got, ref in zip(weights, want[2], strict=True):
        assert_rel_close(got, ref, TOL, "resumed without SP: weights after the step")
    engine.load_checkpoint(folder)  # and back into the SP engine
    assert all(torch.equal(p.detach(), b) for p, b in
               zip((p for chunk in engine.model for p in chunk.module.parameters()), saved, strict=True))
    del plain


def _same_tensors(what: str, got: list[dict], want: list[dict], tol: float) -> None:
    """Every tensor of ``got`` (per model chunk) against ``want`` at ``tol``; bf16 (against the fp32
    run) on all of them at once, where the zero-initialised biases' updates are rounding noise."""
    pairs = [(key, g[key], w[key]) for g, w in zip(got, want, strict=True) for key in g]
    if tol == TOL:
        for key, g, w in pairs:
            assert_rel_close(g, w, tol, f"{what}: {key}")
    else:
        assert_rel_close(torch.cat([g.reshape(-1) for _, g, _ in pairs]),
                         torch.cat([w.reshape(-1) for _, _, w in pairs]), tol, what)


def _moe_without_sequence_parallel(full0) -> None:
    """MoE at TP=2 without sequence parallelism: inference matches TP=1, training raises a
    ``ValueError`` naming ``sequence_parallel`` with the weights untouched."""
    from mcore_engine.engine import MegatronEngine
    from mcore_engine.platform import destroy_distributed

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
    run_distributed(_layouts, 4, path)
