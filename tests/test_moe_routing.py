"""DeepSeek-V3 routing (sigmoid scores, expert bias, grouped top-k) and aux-loss-free balancing.

Unit (no launch): :func:`mcore_engine.layers.router.topk_routing`, the function Megatron-Core's
``TopKRouter`` calls once the engine's MoE compat is applied, against ``transformers``'
``DeepseekV3TopkRouter`` (weight = identity, so its logits are the given ones) on random logits and
bias: the chosen experts exactly, the weights and their gradients w.r.t. the logits (fp32, 1e-6),
for grouped configs with ``norm_topk_prob`` on / off and ``routed_scaling_factor`` 2.5; float64
gradients by ``gradcheck``; Megatron-Core's own group rule (top ``k / topk_group``) routes
differently exactly where ``k != 2 topk_group``; router replay gives the recorded experts with weights
from the current scores.

Engine (launch 1, one rank; launch 2, two ranks): a tiny Megatron-only MoE (standard attention,
8 experts in 4 groups, top-2 of 2 groups: the config where Megatron's group rule differs, random
expert biases). One rank: the routers route as ``transformers`` on their own inputs; the bias update
equals ``rate * sign(mean - n)`` with ``n`` counted from the step's ``routed_experts``, forward-only
passes do not count, rate 0 and a failed step (loss function raising) leave it bit for bit; a
checkpoint round trip restores it; replay of recorded routing after a bias change reproduces the
recorded outputs bit for bit. Two ranks: DP=2 (with full activation recompute), EP=2, TP=2 + SP,
CP=2 and PP=2 against the one-rank run of the same batch: routed experts, losses, weights and
expert biases after two steps (fp32 1e-5; biases and routing exactly); router replay on EP=2 and
TP=2 + SP; the EP=2 checkpoint loads at EP=1 (biases bit for bit). Weights go through
``tests.compare`` (production ``adam_eps``): the entries step 1's gradients cannot pin down (mostly
key-bias channels RoPE barely turns) are bounded by 2 x lr per step, the rest held to 1e-5 (measured
worst 1.1e-6). Step 2's routing is still compared bit for bit: those entries move each score of a
query by nearly the same amount, which softmax cancels, so the hidden states the routers see differ
by rounding only, as at step 1 (a layout that flips a route there would be a real difference).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from tests.engine_setup import check_router_replay, flat_values, make_batch, policy_loss, tiny_config
from tests.utils import REL_TOL, assert_rel_close, run_distributed

# ----------------------------------------------------------------------------------------- unit
CONFIGS = {"8e-4g-top2g-k4": (8, 4, 2, 4), "8e-4g-top2g-k2": (8, 4, 2, 2),
           "16e-8g-top3g-k6": (16, 8, 3, 6), "8e-4g-top1g-k1": (8, 4, 1, 1)}
SCALE = 2.5
TOKENS = 2048


def _hf_router(num_experts: int, groups: int, group_topk: int, topk: int, norm: bool, bias: torch.Tensor,
               weight: torch.Tensor | None = None):
    """``transformers``' DeepSeek-V3 router with ``weight`` ``[E, H]``; by default the identity, so
    its logits are its input."""
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    weight = torch.eye(num_experts) if weight is None else weight
    cfg = transformers.DeepseekV3Config(hidden_size=weight.shape[1], n_routed_experts=num_experts,
                                        num_experts_per_tok=topk, n_group=groups, topk_group=group_topk,
                                        norm_topk_prob=norm, routed_scaling_factor=SCALE)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    return router


def _inputs(num_experts: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(TOKENS, num_experts, generator=g)).to(dtype)
    bias = 0.3 * torch.randn(num_experts, generator=g)          # fp32, as the checkpoints keep it
    upstream = torch.randn(TOKENS, num_experts, generator=g).to(dtype)
    return logits, bias, upstream


def _route(logits, bias, topk, groups, group_topk, norm, replay=None):
    from mcore_engine.layers.router import topk_routing

    return topk_routing(logits, topk, use_pre_softmax=not norm, num_groups=groups, group_topk=group_topk,
                        scaling_factor=SCALE, score_function="sigmoid", expert_bias=bias,
                        router_replay=replay)


@pytest.mark.parametrize("norm", [True, False], ids=["norm", "no-norm"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_routing_matches_transformers(name, norm):
    num_experts, groups, group_topk, topk = CONFIGS[name]
    logits, bias, upstream = _inputs(num_experts, seed=len(name) + norm)
    hf = _hf_router(num_experts, groups, group_topk, topk, norm, bias)
    x = logits.clone().requires_grad_(True)
    _, weights, ids = hf(x)
    (weights * upstream.gather(1, ids)).sum().backward()

    z = logits.clone().requires_grad_(True)
    probs, routing_map = _route(z, bias, topk, groups, group_topk, norm)
    (probs * upstream).sum().backward()
    want_map = torch.zeros_like(routing_map).scatter(1, ids, True)
    assert torch.equal(routing_map, want_map), f"{name}: chosen experts differ from transformers'"
    want = torch.zeros_like(logits).scatter(1, ids, weights.detach())
    assert (probs.detach() - want).abs().max() <= 1e-6 * SCALE, f"{name}: weights"
    assert (z.grad - x.grad).abs().max() <= 1e-6 * SCALE, f"{name}: gradient w.r.t. the logits"
    assert x.grad.abs().sum() > 0 or (topk == 1 and norm), f"{name}: no gradient reached the logits"

    # float64: the same experts, weights within fp32 rounding of transformers' fp32 ones; exact gradient
    z64 = logits.double().requires_grad_(True)
    probs64, map64 = _route(z64, bias, topk, groups, group_topk, norm)
    assert torch.equal(map64, want_map), f"{name}: float64 experts"
    assert (probs64.detach() - want.double()).abs().max() <= 1e-6 * SCALE, f"{name}: float64 weights"
    rows = z64[:64].detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda t: _route(t, bias, topk, groups, group_topk, norm)[0], (rows,), eps=1e-7, atol=1e-8), name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_megatron_group_rule_differs_only_where_k_is_not_two_groups(name):
    """Megatron-Core's group score (top ``k / topk_group``) agrees with the checkpoints' (top 2) only
    when ``k = 2 topk_group``; the engine's routing follows the checkpoints' everywhere."""
    from mcore_engine.layers import router
    from mcore_engine.parallel.compat import apply_moe_compat

    apply_moe_compat()
    num_experts, groups, group_topk, topk = CONFIGS[name]
    logits, bias, _ = _inputs(num_experts, seed=7)
    choice = torch.sigmoid(logits) + bias
    if topk // group_topk > num_experts // groups:  # Megatron's rule cannot even run this config
        return
    _, megatron_ids = router._MEGATRON_GROUP_TOPK(choice, topk, TOKENS, num_experts, groups, group_topk)
    _, ours = router.group_limited_topk(choice, topk, TOKENS, num_experts, groups, group_topk)
    differ = (megatron_ids.sort(-1).values != ours.sort(-1).values).any(-1).float().mean().item()
    if topk == 2 * group_topk:
        assert differ == 0.0, f"{name}: {differ:.3f} of tokens differ"
    else:
        assert differ > 0.05, f"{name}: only {differ:.3f} of tokens differ under Megatron's rule"


def test_replay_uses_recorded_experts_and_current_scores():
    """RECORD then REPLAY_FORWARD on other logits: the recorded experts, weighted by the new scores
    gathered at them (renormalised and scaled, the bias not in the weights)."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    num_experts, groups, group_topk, topk = CONFIGS["8e-4g-top2g-k2"]
    logits, bias, _ = _inputs(num_experts, seed=3)
    replay = RouterReplay()
    RouterReplay.global_router_replay_instances.remove(replay)
    replay.set_router_replay_action(RouterReplayAction.RECORD)
    _, recorded_map = _route(logits, bias, topk, groups, group_topk, True, replay)
    recorded = replay.get_recorded_indices()
    assert torch.equal(torch.zeros_like(recorded_map).scatter(1, recorded, True), recorded_map)
    new_logits = logits + torch.randn_like(logits)
    replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    replay.set_target_indices(recorded)
    probs, routing_map = _route(new_logits, -bias, topk, groups, group_topk, True, replay)
    assert torch.equal(routing_map, recorded_map)
    s = torch.sigmoid(new_logits).gather(1, recorded)
    want = torch.zeros_like(probs).scatter(1, recorded, SCALE * s / (s.sum(-1, keepdim=True) + 1e-20))
    assert (probs - want).abs().max() <= 1e-6


# ----------------------------------------------------------------------------------------- engine
TOL = REL_TOL[torch.float32]
SEED = 11
RATE = 1e-2
ENGINE_MOE = dict(num_experts=8, router_topk=2, ffn_hidden_size=16, router_score_function="sigmoid",
                  router_num_groups=4, router_group_topk=2, router_expert_bias=True,
                  router_bias_update_rate=RATE, router_topk_scaling_factor=SCALE, aux_loss_type="none",
                  layer_freq=[0, 1, 1, 1])
MOE_LAYERS = (1, 2, 3)


def routing_config(*, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, rate: float = RATE):
    from mcore_engine.config.moe import MoEConfig

    cfg = tiny_config(tp=tp, pp=pp, micro_batch_size=2)
    moe = MoEConfig(**{**ENGINE_MOE, "router_bias_update_rate": rate})
    return dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, moe=moe),
        parallel=dataclasses.replace(cfg.parallel, expert_model_parallel_size=ep, context_parallel_size=cp,
                                     sequence_parallel=tp > 1))


def routers(engine) -> dict[int, torch.nn.Module]:
    """This rank's routers by global layer index."""
    from megatron.core.transformer.moe.router import TopKRouter

    return {m.layer_number - 1: m for chunk in engine.model for m in chunk.module.modules()
            if isinstance(m, TopKRouter)}


def biases(engine) -> dict[int, torch.Tensor]:
    return {layer: r.expert_bias.detach().clone() for layer, r in routers(engine).items()}


def set_biases(engine, values: dict[int, torch.Tensor]) -> None:
    for layer, router in routers(engine).items():
        router.expert_bias.copy_(values[layer])


def same_bits(got: dict[int, torch.Tensor], want: dict[int, torch.Tensor], what: str) -> None:
    assert got.keys() <= want.keys() and got, what
    for layer, value in got.items():
        assert torch.equal(value.view(torch.int32), want[layer].view(torch.int32)), f"{what}: layer {layer}"


def two_steps(engine, batch) -> dict:
    rec = {}
    for i in (1, 2):
        out = engine.train_batch(batch, policy_loss)
        rec[f"loss{i}"] = out.get_non_tensor("loss").clone()
        rec[f"routed{i}"] = flat_values(out["routed_experts"])
        if i == 1:  # the first step's (clipped) gradients: which entries Adam's steps cannot pin down
            rec["grads"] = [{k: p.main_grad.detach().float().clone()
                             for k, p in chunk.module.named_parameters()} for chunk in engine.model]
    rec["params"] = [{k: p.detach().clone() for k, p in chunk.module.named_parameters()}
                     for chunk in engine.model]
    rec["biases"] = biases(engine)
    return rec


def expected_update(before: dict[int, torch.Tensor], routed: torch.Tensor) -> dict[int, torch.Tensor]:
    """Megatron's update from the step's routed experts ``[N, L, k]``: ``b + rate * sign(mean - n)``."""
    out = {}
    for i, layer in enumerate(MOE_LAYERS):
        n = torch.bincount(routed[:, i].reshape(-1), minlength=ENGINE_MOE["num_experts"]).float()
        out[layer] = before[layer] + torch.sign(n.mean() - n) * RATE
    return out


def _check_routes_as_transformers(engine, batch) -> None:
    """Each router's choice and weights on its own input equal transformers' DeepSeek-V3 router."""
    seen = []

    def hook(router, args, output):
        seen.append((router, args[0].detach().clone(), output[0].detach().clone(), output[1].clone()))

    handles = [r.register_forward_hook(hook) for r in routers(engine).values()]
    engine.infer_batch(batch)
    for h in handles:
        h.remove()
    assert {id(r) for r, *_ in seen} == {id(r) for r in routers(engine).values()}
    for router, hidden, probs, routing_map in seen:
        hf = _hf_router(8, 4, 2, 2, True, router.expert_bias.detach(), router.weight.detach())
        with torch.no_grad():
            _, weights, ids = hf(hidden.reshape(-1, hidden.shape[-1]))
        assert torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, ids, True)), "engine routing"
        assert_rel_close(probs, torch.zeros_like(probs).scatter(1, ids, weights), 1e-6, "engine weights")


def _reference(rank: int, world_size: int, path: str) -> None:
    from mcore_engine.engine import MegatronEngine

    batch = make_batch(SEED, 6)
    engine = MegatronEngine(routing_config())
    engine.initialize()
    g = torch.Generator().manual_seed(SEED)
    start = {layer: 0.05 * torch.randn(8, generator=g) for layer in MOE_LAYERS}
    set_biases(engine, start)
    full0 = {k: v.detach().clone() for k, v in engine.model[0].module.named_parameters()}
    _check_routes_as_transformers(engine, batch)
    ref = {"full0": full0, "biases0": start, **two_steps(engine, batch)}
    torch.save(ref, path)

    # the update: from this step's routed real tokens only (a forward-only pass before does not count)
    other = make_batch(SEED + 1, 4)
    before = biases(engine)
    engine.forward_backward_batch(other, None, forward_only=True)
    out = engine.train_batch(batch, policy_loss)
    same_bits(biases(engine), expected_update(before, flat_values(out["routed_experts"])), "bias update")
    assert any(not torch.equal(biases(engine)[i], before[i]) for i in MOE_LAYERS)

    # a failed step (the loss function raises) leaves the bias and the weights unchanged
    def failing(outputs, data, ctx):
        raise ValueError("no loss here")

    before = biases(engine)
    weights = {k: p.detach().clone() for k, p in engine.model[0].module.named_parameters()}
    with pytest.raises(ValueError, match="no loss here"):
        engine.train_batch(batch, failing)
    same_bits(biases(engine), before, "bias after a failed step")
    assert all(torch.equal(p, weights[k]) for k, p in engine.model[0].module.named_parameters())

    # an update skipped for non-finite gradients leaves the bias too (Megatron's own would move it)
    def nan_loss(outputs, data, ctx):
        loss, metrics = policy_loss(outputs, data, ctx)
        return loss * float("nan"), metrics

    out = engine.train_batch(batch, nan_loss)
    assert out.get_non_tensor("metrics")["update_skipped"] == 1.0
    same_bits(biases(engine), before, "bias after a skipped update")

    # gradient accumulation over two passes: the update counts the tokens of both
    engine.zero_grad()
    first = engine.forward_backward_batch(batch, policy_loss)
    second = engine.forward_backward_batch(other, policy_loss)
    engine.optimizer_step()
    routed = torch.cat([flat_values(first["routed_experts"]), flat_values(second["routed_experts"])])
    same_bits(biases(engine), expected_update(before, routed), "bias update after two accumulated passes")
    before = biases(engine)

    # checkpoint round trip
    folder = os.path.join(os.path.dirname(path), "ckpt-1")
    engine.save_checkpoint(folder)
    engine.train_batch(batch, policy_loss)
    assert any(not torch.equal(biases(engine)[i], before[i]) for i in MOE_LAYERS)
    engine.load_checkpoint(folder)
    same_bits(biases(engine), before, "bias after load_checkpoint")

    # replay after a bias change: the recorded experts, the recorded outputs (the bias is not a weight)
    recorded = engine.infer_batch(batch)
    set_biases(engine, {layer: b.flip(0) * 4 for layer, b in before.items()})
    free = engine.infer_batch(batch)
    assert not torch.equal(flat_values(free["routed_experts"]), flat_values(recorded["routed_experts"]))
    replay = batch.clone()
    replay.set("routed_experts", recorded["routed_experts"])
    again = engine.infer_batch(replay)
    for key in ("routed_experts", "log_probs"):
        assert torch.equal(flat_values(again[key]), flat_values(recorded[key])), f"replay: {key}"
    del engine

    # rate 0 (the default): the bias stays bit for bit through training steps
    engine = MegatronEngine(routing_config(rate=0.0))
    engine.initialize()
    set_biases(engine, start)
    for _ in range(2):
        engine.train_batch(batch, policy_loss)
    same_bits(biases(engine), start, "bias at rate 0")


def check_uneven_micro_batch_counts(engine, batch, dp_rank: int) -> None:
    """EP = 2: data-parallel ranks whose batches split into different micro-batch counts (2 vs 4
    sequences, micro-batches of 2) all run the largest count (the expert all-to-all would hang
    otherwise), with the outputs of one micro-batch a rank; a rank that cannot give that many
    (dynamic batch size: 1 sequence vs 3 micro-batches) fails the step on every rank by name."""
    mine = batch[torch.arange(0, 2) if dp_rank == 0 else torch.arange(2, 6)]
    got = engine.infer_batch(mine)
    one = mine.clone()
    one.set_non_tensor("micro_batch_size_per_gpu", len(mine))
    want = engine.infer_batch(one)
    for key in ("log_probs", "routed_experts"):
        assert_rel_close(flat_values(got[key]).double(), flat_values(want[key]).double(), 1e-6,
                         f"uneven micro-batch counts: {key}")
    lengths = [8] if dp_rank == 0 else [8, 8, 8]
    uneven = make_batch(SEED, lengths=lengths, use_dynamic_bsz=True, max_token_len_per_gpu=8)
    with pytest.raises(ValueError, match="num_micro_batches" if dp_rank == 0 else "rejected"):
        engine.infer_batch(uneven)


LAYOUTS = (("dp2", dict()), ("ep2", dict(ep=2)), ("tp2-sp", dict(tp=2)), ("cp2", dict(cp=2)),
           ("pp2", dict(pp=2)))


def _layouts(rank: int, world_size: int, path: str) -> None:
    from megatron.core import parallel_state

    from mcore_engine.engine import MegatronEngine
    from mcore_engine.parallel.distributed import destroy_distributed
    from tests.engine_setup import load_full_state
    from tests.parallel_setup import same_tensors

    ref = torch.load(path, weights_only=False)
    batch = make_batch(SEED, 6)
    tokens = [0, *batch["input_ids"].offsets().diff().cumsum(0).tolist()]
    for name, kwargs in LAYOUTS:
        engine = MegatronEngine(routing_config(**kwargs))
        engine.initialize()
        load_full_state(engine, ref["full0"])
        set_biases(engine, ref["biases0"])
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        rows = slice(dp_rank * 6 // dp, (dp_rank + 1) * 6 // dp)
        mine = batch[torch.arange(rows.start, rows.stop)]
        got = two_steps(engine, mine)
        for i in (1, 2):
            assert_rel_close(got[f"loss{i}"], ref[f"loss{i}"], TOL, f"{name}: loss of step {i}")
            assert torch.equal(got[f"routed{i}"], ref[f"routed{i}"][tokens[rows.start]:tokens[rows.stop]]), \
                f"{name}: routed experts of step {i}"
        same_tensors(f"{name}: weights after two steps", engine, got["params"], ref["params"][0],
                     steps_from=ref["grads"][0], tol=TOL)
        same_bits(got["biases"], ref["biases"], f"{name}: expert bias after two steps")
        if name in ("ep2", "tp2-sp"):
            check_router_replay(name, engine, mine, tol=None if name == "ep2" else 1e-6)
        if name == "ep2":
            check_uneven_micro_batch_counts(engine, batch, dp_rank)
            folder = os.path.join(os.path.dirname(path), "ckpt-ep2")
            engine.save_checkpoint(folder)
            saved = biases(engine)
        del engine
        destroy_distributed()
    engine = MegatronEngine(routing_config())  # EP=1 x DP=2 loads the EP=2 checkpoint
    engine.initialize()
    engine.load_checkpoint(folder)
    same_bits(biases(engine), saved, "expert bias resharded EP 2 -> 1")


def test_expert_bias_routing_in_the_engine(tmp_path):
    path = os.path.join(tmp_path, "routing_ref.pt")
    run_distributed(_reference, 1, path)
    run_distributed(_layouts, 2, path)
