"""Mixture-of-experts engine: expert parallelism, aux-loss normalisation and metrics, router replay.

Launch 1 (one gloo rank, EP=1) records the reference on seeded weights and runs the single-rank
checks: aux-loss normalisation (a micro-batch repeated gives the same gradient as once; the
gradient matches a finite difference of the reported ``moe/aux_loss``), router replay (recorded
routing reproduces the outputs bit for bit; after a weight change the recorded experts are used),
malformed ``routed_experts`` refused by name with nothing changed, the replay instances scoped per
engine. Launches 2 and 3 load the same weights at EP=1 x DP=2 and EP=2 x DP=2 (two ranks), EP=2 x
DP=4 (expert data-parallel size 2) and EP=2 x PP=2 (four ranks), each rank its slice of the batch
in one-sequence micro-batches as the reference, and compare infer_batch outputs and routed_experts,
the processor's flags (entropy, sum_pi_squared, top-k distillation losses), loss, router metrics,
every gradient and the weights after each of two train_batch steps (production ``adam_eps``),
tensor by tensor through ``tests.compare`` (fp32 1e-5; after two steps 1e-4); EP=2 x DP=2
also with bshd micro-batches and the fused lm-head. On every layout, router replay of recorded
routing reproduces infer_batch and the forward-backward's loss and gradients bit for bit; at
EP=2 x DP=2 and EP=2 x PP=2 a checkpoint saved after the two steps resumes a third step bit for bit.
Launch 2 also reshards checkpoints EP 2 -> 1 and 1 -> 2 (plain and distributed optimizer): the
step after the load matches the never-saved engine's at the target layout to 1e-6.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.compare import AdamSteps, Attention, assert_tensors_close
from tests.engine_setup import (
    check_router_replay,
    flat_values,
    load_full_state,
    make_batch,
    policy_loss,
    tiny_config,
)
from tests.parallel_setup import after_steps, same_tensors
from tests.utils import REL_TOL, assert_rel_close, run_distributed

TOL = REL_TOL[torch.float32]
SEED = 5
NUM_SEQS = 6
E, K = 4, 2
MOE = dict(num_experts=E, router_topk=K, ffn_hidden_size=32, aux_loss_coeff=0.01, z_loss_coeff=1e-3,
           layer_freq=[0, 1, 1, 1])


def moe_config(*, ep: int = 1, tp: int = 1, pp: int = 1, micro_batch_size: int = 1, data_format: str = "thd",
               fused_lm_head: bool = False, use_distributed_optimizer: bool = False, seed: int = 1234, **moe):
    from mcore_engine.config import OptimizerConfig
    from mcore_engine.config.moe import MoEConfig

    cfg = tiny_config(tp=tp, pp=pp, micro_batch_size=micro_batch_size, data_format=data_format,
                      fused_lm_head=fused_lm_head, use_distributed_optimizer=use_distributed_optimizer,
                      seed=seed, adam_eps=OptimizerConfig.adam_eps)
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, moe=MoEConfig(**{**MOE, **moe})),
        parallel=dataclasses.replace(cfg.parallel, expert_model_parallel_size=ep))


def params(engine) -> dict[str, torch.Tensor]:
    (chunk,) = engine.model
    return {k: v.detach().clone() for k, v in chunk.module.named_parameters()}


def grads(engine) -> dict[str, torch.Tensor]:
    (chunk,) = engine.model
    return {k: v.main_grad.detach().clone() for k, v in chunk.module.named_parameters()}


def _zero_main_loss(outputs, data, ctx):
    return (outputs["log_probs"] * 0.0).sum(), {}


FLAG_OUTPUTS = ("log_probs", "entropy", "sum_pi_squared", "distillation_losses")


def flags_batch(rows: slice | None = None, *, topk: bool = True):
    """The main batch's sequences with every processor flag on (teacher top-k unless ``topk=False``)."""
    extra = dict(teacher_k=3, distillation_use_topk=True) if topk else {}
    batch = make_batch(SEED, NUM_SEQS, calculate_entropy=True, calculate_sum_pi_squared=True, **extra)
    return batch if rows is None else batch[torch.arange(rows.start, rows.stop)]


def _step_record(engine, batch, flagged) -> dict:
    """infer outputs (also with every processor flag), one forward-backward's loss / metrics /
    grads, two train steps' results."""
    rec = {}
    infer = engine.infer_batch(batch)
    rec["infer_log_probs"] = flat_values(infer["log_probs"])
    rec["routed"] = flat_values(infer["routed_experts"])
    out = engine.infer_batch(flagged)
    rec["flags"] = {k: flat_values(out[k]) for k in FLAG_OUTPUTS if k in out.keys()}
    out = engine.forward_backward_batch(batch, policy_loss)
    rec["fb_loss"] = out.get_non_tensor("loss").clone()
    rec["fb_metrics"] = dict(out.get_non_tensor("metrics"))
    rec["grads"] = grads(engine)
    engine.zero_grad()
    for i in (1, 2):
        out = engine.train_batch(batch, policy_loss)
        rec[f"loss{i}"] = out.get_non_tensor("loss").clone()
        rec[f"grad_norm{i}"] = torch.tensor(out.get_non_tensor("metrics")["grad_norm"], dtype=torch.float64)
        rec[f"params{i}"] = params(engine)
        if i == 1:
            rec["grads1"] = grads(engine)  # the first step's (clipped) gradients
    return rec


# ----------------------------------------------------------------------------- launch 1: one rank
def _check_aux_normalisation(engine, full) -> None:
    """Router term = token-weighted mean: a micro-batch repeated == once; gradient == finite
    difference of the reported moe/aux_loss along the router weight."""
    import copy

    from tensordict import TensorDict

    one = make_batch(SEED + 1, 3, micro_batch_size_per_gpu=3)
    twice = TensorDict({k: torch.nested.nested_tensor(list(one[k].unbind()) * 2, layout=torch.jagged)
                        for k in one.keys() if isinstance(one.get(k), torch.Tensor)}, batch_size=[6])
    twice.set_non_tensor("micro_batch_size_per_gpu", 3)
    results = []
    for batch in (one, twice):
        load_full_state(engine, full)
        engine.zero_grad()
        out = engine.forward_backward_batch(batch, _zero_main_loss)
        results.append((grads(engine), out.get_non_tensor("metrics")["moe/aux_loss"]))
    (g1, a1), (g2, a2) = results
    assert abs(a1 - a2) <= 1e-6 * abs(a1), f"moe/aux_loss of a repeated micro-batch: {a2} vs {a1}"
    router = "decoder.layers.2.mlp.router.weight"
    assert g1[router].abs().sum() > 0, "no router gradient from the aux losses"
    for key in g1:
        assert_rel_close(g2[key], g1[key], TOL, f"aux-only grad of {key}, micro-batch repeated")

    # The z-loss alone (no expert counts, so differentiable): its gradient against a finite
    # difference of the reported objective. A second MoE engine in the process.
    from mcore_engine.engine import MegatronEngine

    z_engine = MegatronEngine(moe_config(aux_loss_coeff=0.0, z_loss_coeff=0.05))
    z_engine.initialize()
    load_full_state(z_engine, full)
    z_engine.zero_grad()
    out = z_engine.forward_backward_batch(one, _zero_main_loss)
    g = grads(z_engine)[router]
    assert "moe/load_balancing_loss" not in out.get_non_tensor("metrics")
    direction = g / g.norm()
    eps = 1e-2
    values = []
    for sign in (1.0, -1.0):
        state = copy.copy(full)
        state[router] = full[router] + sign * eps * direction
        load_full_state(z_engine, state)
        out = z_engine.forward_backward_batch(one, _zero_main_loss)
        values.append(out.get_non_tensor("metrics")["moe/aux_loss"])
    fd = (values[0] - values[1]) / (2 * eps)
    analytic = float(g.norm())
    assert abs(fd - analytic) <= 1e-2 * analytic, f"z-loss gradient {analytic} vs finite difference {fd}"
    del z_engine


def _check_replay(engine, full) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    ours = [m.router_replay for m in engine.model[0].module.modules() if hasattr(m, "router_replay")
            and m.router_replay is not None]
    assert len(ours) == 3 and not any(r in RouterReplay.global_router_replay_instances for r in ours), \
        "router replay instances not scoped to the engine"

    batch = make_batch(SEED + 2, 4, calculate_entropy=True)
    load_full_state(engine, full)
    rec = engine.infer_batch(batch)
    routed = rec["routed_experts"]
    assert routed.dtype == torch.int64 and flat_values(routed).shape[1:] == (3, K)
    assert tuple(routed.offsets().tolist()) == tuple(batch["input_ids"].offsets().tolist())
    replay = batch.clone()
    replay.set("routed_experts", routed)
    again = engine.infer_batch(replay)
    for key in ("log_probs", "entropy", "routed_experts"):
        assert torch.equal(flat_values(again[key]), flat_values(rec[key])), f"replay not bit-identical: {key}"

    # after a weight change: recorded experts used, not the new router's choice
    changed = dict(full)
    for layer in (1, 2, 3):
        key = f"decoder.layers.{layer}.mlp.router.weight"
        changed[key] = torch.randn_like(full[key])
    load_full_state(engine, changed)
    fresh = engine.infer_batch(batch)
    assert not torch.equal(flat_values(fresh["routed_experts"]), flat_values(routed)), "routing unchanged"
    replayed = engine.infer_batch(replay)
    assert torch.equal(flat_values(replayed["routed_experts"]), flat_values(routed))
    assert not torch.equal(flat_values(replayed["log_probs"]), flat_values(fresh["log_probs"]))
    # gradients reach the router through the gathered scores of the replayed experts
    engine.zero_grad()
    engine.forward_backward_batch(replay, policy_loss)
    g = grads(engine)
    assert all(g[f"decoder.layers.{i}.mlp.router.weight"].abs().sum() > 0 for i in (1, 2, 3))
    engine.zero_grad()

    # malformed routing: ValueError naming the key, nothing changed
    before, step0 = params(engine), engine.global_step
    values = flat_values(routed)
    offsets = routed.offsets()

    def bad(v):
        b = batch.clone()
        b.set("routed_experts", torch.nested.nested_tensor_from_jagged(v, offsets=offsets))
        return b

    cases = {"expert id out of range": bad(values.clone().fill_(E)),
             "wrong layer count": bad(values[:, :2].contiguous()),
             "wrong k": bad(values[:, :, :1].contiguous()),
             "repeated expert": bad(values[:, :, :1].expand(-1, -1, K).contiguous()),
             "floating": bad(values.float())}
    for what, b in cases.items():
        with pytest.raises(ValueError, match="routed_experts"):
            engine.train_batch(b, policy_loss)
        with pytest.raises(ValueError, match="routed_experts"):
            engine.infer_batch(b)
        now = params(engine)
        assert all(torch.equal(now[k], before[k]) for k in before), f"{what}: parameters changed"
    assert engine.global_step == step0


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine

    engine = MegatronEngine(moe_config())
    engine.initialize()
    full = params(engine)
    ref = {"full0": full, **_step_record(engine, make_batch(SEED, NUM_SEQS, calculate_entropy=True),
                                         flags_batch())}
    _check_aux_normalisation(engine, full)
    _check_replay(engine, full)
    torch.save(ref, path)


# ----------------------------------------------------------------------------- launch 2: two ranks
def _compare(name: str, got: dict, ref: dict, engine, tokens: slice) -> None:
    assert_rel_close(got["infer_log_probs"], ref["infer_log_probs"][tokens], TOL, f"{name}: infer log_probs")
    assert torch.equal(got["routed"], ref["routed"][tokens]), f"{name}: routed_experts"
    assert got["flags"].keys() >= set(FLAG_OUTPUTS) - {"distillation_losses"}, got["flags"].keys()
    for key, value in got["flags"].items():
        assert_rel_close(value, ref["flags"][key][tokens], TOL, f"{name}: infer {key} with every flag")
    assert_rel_close(got["fb_loss"], ref["fb_loss"], TOL, f"{name}: loss")
    for key, value in ref["fb_metrics"].items():
        if key.startswith("moe/"):
            assert abs(got["fb_metrics"][key] - value) <= TOL * max(abs(value), 1e-3), \
                f"{name}: metric {key} {got['fb_metrics'][key]} vs {value}"
    same_tensors(f"{name}: gradients", engine, [got["grads"]], ref["grads"])
    for i in (1, 2):
        tol = after_steps(TOL, i - 1)
        assert_rel_close(got[f"loss{i}"], ref[f"loss{i}"], tol, f"{name}: loss of step {i}")
        assert_rel_close(got[f"grad_norm{i}"], ref[f"grad_norm{i}"], tol, f"{name}: grad norm of step {i}")
        same_tensors(f"{name}: weights after step {i}", engine, [got[f"params{i}"]], ref[f"params{i}"],
                     steps_from=ref["grads1"], steps=i)


LAYOUTS_2 = (("ep1-dp2", dict(ep=1)), ("ep2-dp2", dict(ep=2)),
             ("ep2-dp2-bshd-fused", dict(ep=2, data_format="bshd", fused_lm_head=True)))
# EP=2 inside DP=4 (expert data-parallel size 2); EP=2 x PP=2 (DP=2, 1F1B)
LAYOUTS_4 = (("ep2-dp4", dict(ep=2)), ("ep2-pp2", dict(ep=2, pp=2)))
CUTS = {2: [0, 3, 6], 4: [0, 2, 4, 5, 6]}


def _layouts(rank: int, world_size: int, path: str) -> None:
    from megatron.core import parallel_state

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.distributed import destroy_distributed

    ref = torch.load(path, weights_only=False)
    batch = make_batch(SEED, NUM_SEQS, calculate_entropy=True)
    tokens = torch.tensor([0] + [int(n) for n in batch["input_ids"].offsets().diff()]).cumsum(0)
    layouts = LAYOUTS_2 if world_size == 2 else LAYOUTS_4
    for name, kwargs in layouts:
        engine = MegatronEngine(moe_config(**kwargs))
        engine.initialize()
        assert parallel_state.get_expert_model_parallel_world_size() == kwargs["ep"]
        load_full_state(engine, ref["full0"])
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        cut = CUTS[dp]
        rows = slice(cut[dp_rank], cut[dp_rank + 1])
        mine = batch[torch.arange(rows.start, rows.stop)]
        got = _step_record(engine, mine, flags_batch(rows, topk="fused" not in name))
        _compare(name, got, ref, engine, slice(int(tokens[rows.start]), int(tokens[rows.stop])))
        check_router_replay(name, engine, mine)
        if name in ("ep2-dp2", "ep2-pp2"):
            _check_resume(engine, mine, os.path.join(os.path.dirname(path), f"ckpt-{name}"))
        del engine
        destroy_distributed()
    if world_size == 2:
        _check_ep_resharding(ref["full0"], os.path.dirname(path))


def _check_ep_resharding(full0, folder: str) -> None:
    """EP 1 <-> 2 on two ranks (DP=2 both), with and without the distributed optimizer: step 1 from
    ``full0``, save, step 2 (the never-saved reference); a load of the other EP size's checkpoint,
    step 2: loss, grad norm and all weights together to 1e-6, each weight to the fp32 budget 1e-5."""
    from megatron.core import parallel_state

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.distributed import destroy_distributed

    batches = [make_batch(SEED + s, NUM_SEQS, calculate_entropy=True) for s in (0, 3)]

    def step(engine, i: int) -> dict:
        cut = CUTS[parallel_state.get_data_parallel_world_size()]
        r = parallel_state.get_data_parallel_rank()
        out = engine.train_batch(batches[i][torch.arange(cut[r], cut[r + 1])], policy_loss)
        engine.lr_scheduler_step()
        return {"loss": out.get_non_tensor("loss").clone(), "params": params(engine), "grads": grads(engine),
                "norm": out.get_non_tensor("metrics")["grad_norm"], "config": engine.config}

    def same(got: dict, want: dict, what: str) -> None:
        assert_rel_close(got["loss"], want["loss"], 1e-6, f"{what}: loss")
        assert abs(got["norm"] - want["norm"]) <= 1e-6 * want["norm"], f"{what}: grad norm"
        opt = want["config"].optimizer  # one step from the same loaded weights and optimizer state
        assert_tensors_close(f"{what}: weights after the step", got["params"], want["params"],
                             attn=Attention.of(want["config"].model), grads=False,
                             adam=AdamSteps(want["grads"], opt.lr, opt.adam_eps, 1))

    for do in (False, True):
        ckpt, want = {ep: os.path.join(folder, f"ckpt-ep{ep}-do{int(do)}") for ep in (1, 2)}, {}
        for ep in (1, 2):
            engine = MegatronEngine(moe_config(ep=ep, use_distributed_optimizer=do))
            engine.initialize()
            load_full_state(engine, full0)
            step(engine, 0)
            engine.save_checkpoint(ckpt[ep])
            want[ep] = step(engine, 1)
            if ep == 2:  # this engine, two steps on, loads the EP=1 checkpoint
                engine.load_checkpoint(ckpt[1])
                assert engine.global_step == 1
                same(step(engine, 1), want[2], f"EP 1 -> 2, distributed optimizer {do}")
            del engine
            destroy_distributed()
        engine = MegatronEngine(moe_config(ep=1, use_distributed_optimizer=do, seed=99))  # other weights
        engine.initialize()
        engine.load_checkpoint(ckpt[2])
        assert engine.global_step == 1
        same(step(engine, 1), want[1], f"EP 2 -> 1, distributed optimizer {do}")
        del engine
        destroy_distributed()


def _check_resume(engine, batch, path: str) -> None:
    """save_checkpoint, a third step, load_checkpoint, the third step again: bit for bit."""
    engine.save_checkpoint(path)
    runs = []
    for _ in range(2):
        out = engine.train_batch(batch, policy_loss)
        runs.append((out.get_non_tensor("loss").clone(), dict(out.get_non_tensor("metrics")),
                     flat_values(out["routed_experts"]), params(engine)))
        engine.load_checkpoint(path)
    (loss_a, metrics_a, routed_a, params_a), (loss_b, metrics_b, routed_b, params_b) = runs
    assert torch.equal(loss_a, loss_b) and torch.equal(routed_a, routed_b), "resumed step differs"
    differ = {k: (v, metrics_b.get(k)) for k, v in metrics_a.items() if metrics_b.get(k) != v}
    assert not differ, f"resumed step's metrics differ: {differ}"
    assert all(torch.equal(params_a[k], params_b[k]) for k in params_a), "resumed weights differ"
    assert not all(torch.equal(params_a[k], v) for k, v in params(engine).items()), "load did not restore"


def test_moe_expert_parallel_matches_single_rank(tmp_path):
    path = os.path.join(tmp_path, "moe_ref.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)


@pytest.mark.slow
def test_moe_expert_parallel_four_ranks(tmp_path):
    path = os.path.join(tmp_path, "moe_ref.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 4, path)


def _engines_of_different_depths(rank: int, world_size: int) -> None:
    import dataclasses

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.platform import destroy_distributed
    from tests.engine_setup import policy_loss
    from tests.parallel_setup import batches, config

    for layers in (4, 6, 4):  # deeper, then shallower again, than the engine before
        cfg = config("moe")
        moe = dataclasses.replace(cfg.model.moe, layer_freq=[0] + [1] * (layers - 1))
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_layers=layers, moe=moe))
        engine = MegatronEngine(cfg)
        engine.initialize()
        metrics = engine.train_batch(batches()[0], policy_loss).get_non_tensor("metrics")
        assert metrics["update_skipped"] == 0.0 and metrics["moe/load_balancing_loss"] > 0, metrics
        del engine
        destroy_distributed()


def test_moe_engines_of_different_depths_in_one_process():
    """Megatron's router-loss tracker is global and sized by the first model that writes to it: an
    MoE engine built after a shallower one (a critic, a reference with MTP) still trains."""
    run_distributed(_engines_of_different_depths, 1)
