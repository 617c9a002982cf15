"""MoE settings of verl on the mcore_engine backend: ``router_replay`` (R2 / R3), the expert-bias update
rate and MTP.

In-process (no ranks): the config mapping and its refusals by verl's field names; the batches each
replay mode hands the core (``verl_router_replay.prepare_routing``) for batches built as verl's trainer
builds them (the agent loop's left-padded ``routed_experts``, then ``left_right_2_no_padding``):
layer axis, the rollout's missing last row, trailing unrouted rows, refusals.

One rank: R2 through a real ``TrainingWorker`` on a tiny Qwen3-MoE (a dense first layer, two MoE
layers of 4 experts, top-2) with verl's dynamic batch size (micro-batches reordered): the
old-log-prob pass returns the routing, exactly ``transformers``' routers' choice per token, with
``transformers``' log-probs; a pass whose batch carries routes (here every token's second choice, so
that native routing would differ) replays them in inference and in the update (the update's
log-probs, read by verl's loss, equal ``transformers``' under that routing); an update without routes
is refused. R3 end to end (verl's trainer, a rollout that returns routed experts) is
``test_verl_trainer.py::test_verl_main_ppo_grpo_moe_r3``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("verl", reason="verl is installed by `make setup` (pip install --no-deps verl==0.9.1)")

from tests.integrations.test_verl_config import build_configs  # noqa: E402
from tests.integrations.verl_setup import make_hf_model  # noqa: E402
from tests.utils import rel_err, run_distributed  # noqa: E402

TOL = 1e-5
P_LEN, R_LEN = [5, 3, 4, 2], [4, 6, 2, 5]  # prompt / response lengths of the test batch
LAYERS, MOE_LAYERS, K = 3, [1, 2], 2  # the tiny Qwen3-MoE: layer 0 dense


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Folders: the tiny Qwen3-MoE (weights), a dense Qwen2 (weights), a DeepSeek-V3 config with an
    expert bias and one MTP layer (config only: the mapping reads config.json)."""
    import json

    from tests.hf.deepseek_models import hf_config as deepseek_config
    from tests.hf.models import save_tiny_model

    root = tmp_path_factory.mktemp("verl_moe")
    save_tiny_model("qwen3_moe", root / "moe", num_layers=LAYERS)
    make_hf_model(str(root / "dense"))
    deepseek_config("ds_top2").save_pretrained(root / "ds")
    config = json.loads((root / "ds" / "config.json").read_text())
    (root / "ds" / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    return {name: str(root / name) for name in ("moe", "dense", "ds")}


def configs(hf_dir: str, *, mode: str = "disabled", otc: dict | None = None, model: dict | None = None,
            value: bool = False, replay_files: dict | None = None, **engine):
    """verl's four configs (``test_verl_config.build_configs``) with ``router_replay.mode=mode`` (and
    ``replay_files``: its record / replay file), ``override_transformer_config=otc``, model fields."""
    from verl.workers.config.engine import EngineRouterReplayConfig

    cfg = build_configs(hf_dir, "value" if value else "engine",
                        dict(engine, override_transformer_config=otc or {}))
    replay = EngineRouterReplayConfig(mode=mode, **(replay_files or {}))
    cfg = (cfg[0], dataclasses.replace(cfg[1], router_replay=replay), *cfg[2:])
    if model:
        kind = {"model_type": "value_model"} if value else {}
        cfg = (build_configs(hf_dir, "model", dict(model, **kind))[0], *cfg[1:])
    return cfg


# ------------------------------------------------------------------------------------------ config
def test_verl_router_replay_config(dirs):
    """R2 / R3 are accepted on an MoE actor; refused by ``engine_config.router_replay.*``: on a dense
    model, on a forward-only engine (verl's reference policy routes natively), on a critic, with a
    record / replay file (verl 0.9.1 reads none)."""
    from mcore_engine.integrations.verl_config import engine_config_from_verl, router_replay_mode

    for mode in ("disabled", "R2", "R3"):
        cfg = configs(dirs["moe"], mode=mode)
        assert engine_config_from_verl(*cfg).model.moe.num_experts == 4 and router_replay_mode(cfg[1]) == mode
    refused = [
        (configs(dirs["dense"], mode="R3"), r"router_replay\.mode='R3' .*a dense model has no routing"),
        (configs(dirs["moe"], mode="R2", forward_only=True), r"router_replay\.mode='R2' .*reference policy"),
        (configs(dirs["moe"], mode="R3", value=True), r"router_replay\.mode='R3' .*critic route natively"),
    ]
    for name in ("record_file", "replay_file"):
        cfg = configs(dirs["moe"], mode="R3", replay_files={name: "routes.pt"})
        refused.append((cfg, rf"engine_config\.router_replay\.{name}='routes\.pt' .*from the batch"))
    for cfg, match in refused:
        with pytest.raises(ValueError, match=match):
            engine_config_from_verl(*cfg)


def test_verl_moe_bias_and_mtp_mapping(dirs):
    """``override_transformer_config.moe_router_bias_update_rate`` -> ``MoEConfig.router_bias_update_rate``
    (0 when absent; refused without an expert bias or on a dense model), ``moe_router_enable_expert_bias``
    must say what the checkpoint has; verl's MTP settings (``model_config.mtp``,
    ``override_transformer_config.mtp_num_layers`` / ``mtp_loss_scaling_factor``) ->
    ``ModelConfig.mtp_num_layers`` / ``mtp_loss_scaling_factor`` with verl's rules; refusals by name.
    ``ds``: DeepSeek-V3 with an expert bias (``e_score_correction_bias``) and one MTP layer."""
    from verl.workers.config.model import MtpConfig

    from mcore_engine.integrations.verl_config import engine_config_from_verl

    def build(hf, **kw):
        return engine_config_from_verl(*configs(dirs[hf], **kw)).model

    # expert-bias update: off unless set; the checkpoint decides whether there is a bias
    rate, bias = "moe_router_bias_update_rate", "moe_router_enable_expert_bias"
    assert build("ds").moe.router_expert_bias and build("ds").moe.router_bias_update_rate == 0.0
    assert build("ds", otc={rate: 1e-3, bias: True}).moe.router_bias_update_rate == 1e-3
    assert build("moe", otc={rate: 0.0, bias: False}).moe.router_bias_update_rate == 0.0
    field = r"engine_config\.override_transformer_config\."
    for hf, otc, match in (
            ("moe", {rate: 1e-3}, field + "moe_router_bias_update_rate=0.001 .*router_expert_bias=True"),
            ("ds", {rate: -1.0}, field + r"moe_router_bias_update_rate=-1\.0 .*finite number >= 0"),
            ("ds", {rate: "1e-3"}, field + "moe_router_bias_update_rate='1e-3' .*a number"),
            ("moe", {bias: True}, field + "moe_router_enable_expert_bias=True .*checkpoint .*has none"),
            ("ds", {bias: False}, field + "moe_router_enable_expert_bias=False .*checkpoint .*has"),
            ("dense", {rate: 1e-3}, field + "moe_router_bias_update_rate=0.001 .*a dense model"),
            ("moe", {"moe_router_load_balancing_type": "none"}, r"_config=\['moe_router_load_balancing")):
        with pytest.raises(ValueError, match=match):
            build(hf, otc=otc)

    # MTP: off by default (the checkpoint's MTP layer is not built); on: loaded, trained or kept
    def mtp(block=None, otc=None, **kw):
        model = build("ds", model={"mtp": block or MtpConfig()}, otc=otc, **kw)
        return model.mtp_num_layers, model.mtp_loss_scaling_factor

    assert mtp() == (0, 0.0) and build("moe").mtp_num_layers == 0  # verl's default: no MTP modules
    assert mtp(MtpConfig(enable=True)) == (1, 0.0)  # loaded / exported, not trained
    assert mtp(MtpConfig(enable=True, enable_train=True)) == (1, 0.1)  # verl's default factor
    assert mtp(MtpConfig(enable=True, enable_train=True, mtp_loss_scaling_factor=0.2)) == (1, 0.2)
    assert mtp(MtpConfig(enable=True, enable_train=True), {"mtp_loss_scaling_factor": 0.3,
                                                           "mtp_num_layers": 1}) == (1, 0.3)
    assert mtp(MtpConfig(enable=True, enable_train=True), forward_only=True) == (1, 0.0)
    assert mtp(MtpConfig(enable=True, enable_rollout=True, num_speculative_tokens=2)) == (1, 0.0)
    for block, otc, kw, match in (
            (MtpConfig(enable=True), {"mtp_num_layers": 2}, {}, field + "mtp_num_layers=2 .*has 1 MTP"),
            (MtpConfig(), {"mtp_num_layers": 1}, {}, field + r"mtp_num_layers=1 .*mtp\.enable=false"),
            (MtpConfig(), {"mtp_loss_scaling_factor": 0.1}, {},
             field + r"mtp_loss_scaling_factor=0\.1 .*enable=false"),
            (MtpConfig(enable=True, detach_encoder=True), {}, {}, r"model_config\.mtp\.detach_encoder=True"),
            (MtpConfig(enable=True), {}, {"value": True}, r"model_config\.mtp\.enable=True .*value model"),
            (MtpConfig(enable=True, enable_train=True, mtp_loss_scaling_factor=-1.0), {}, {},
             r"model_config\.mtp\.mtp_loss_scaling_factor=-1\.0 .*ModelConfig\.mtp_loss_scaling_factor")):
        with pytest.raises(ValueError, match=match):
            mtp(block, otc, **kw)
    with pytest.raises(ValueError, match=r"^model_config\.mtp\.enable=True .*no MTP layers"):
        build("moe", model={"mtp": MtpConfig(enable=True)})


# --------------------------------------------------------------------------------------- batches
def verl_batch(seed: int, routes: torch.Tensor | None = None, **flags):
    """A verl batch as the trainer builds it (left-padded prompts, right-padded responses, then
    ``left_right_2_no_padding``); ``routes`` ``[B, P + R, L, k]`` placed like the agent loop's
    ``routed_experts`` (int16, padding rows zero)."""
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from tests.integrations.verl_setup import VOCAB

    g = torch.Generator().manual_seed(seed)
    b, p, r = len(P_LEN), max(P_LEN), max(R_LEN)
    ids = torch.zeros(b, p + r, dtype=torch.int64)
    mask = torch.zeros(b, p + r, dtype=torch.int64)
    response_mask = torch.zeros(b, r, dtype=torch.int64)
    for i, (pl, rl) in enumerate(zip(P_LEN, R_LEN, strict=True)):
        ids[i, p - pl: p + rl] = torch.randint(3, VOCAB, (pl + rl,), generator=g)
        mask[i, p - pl: p + rl] = 1
        response_mask[i, :rl] = 1
    fields = dict(prompts=ids[:, :p], responses=ids[:, p:], input_ids=ids, attention_mask=mask,
                  position_ids=(mask.cumsum(1) - 1).clamp_min(0), response_mask=response_mask,
                  old_log_probs=torch.zeros(b, r), advantages=torch.randn(b, r, generator=g))
    if routes is not None:
        fields["routed_experts"] = routes.to(torch.int16)
    td = TensorDict(fields, batch_size=[b])
    tu.assign_non_tensor(td, temperature=1.0, global_batch_size=b, **flags)
    return left_right_2_no_padding(td)


def placed(per_sequence: list[torch.Tensor], layers: int) -> torch.Tensor:
    """The agent loop's dense ``routed_experts [B, P + R, layers, k]``: each sequence's rows from its
    first (left-padded) token on, zeros elsewhere."""
    p, r = max(P_LEN), max(R_LEN)
    out = torch.zeros(len(per_sequence), p + r, layers, K, dtype=torch.int64)
    for i, rows in enumerate(per_sequence):
        out[i, p - P_LEN[i]: p - P_LEN[i] + len(rows), : rows.shape[1]] = rows
    return out


def test_verl_router_replay_batches(dirs):
    """What each mode hands the core and returns (``prepare_routing``), on verl's batches."""
    from mcore_engine.integrations.verl_config import engine_config_from_verl
    from mcore_engine.integrations.verl_router_replay import prepare_routing

    model = engine_config_from_verl(*configs(dirs["moe"])).model
    dense = engine_config_from_verl(*configs(dirs["dense"])).model
    g = torch.Generator().manual_seed(3)
    lengths = [p + r for p, r in zip(P_LEN, R_LEN, strict=True)]
    # rollout routes of the MoE layers for every token fed (all but the last): k distinct ids in [0, 4)
    rollout = [torch.stack([torch.stack([torch.randperm(4, generator=g)[:K] for _ in MOE_LAYERS])
                            for _ in range(n - 1)]) for n in lengths]
    fill = torch.arange(K).expand(len(MOE_LAYERS), K)

    def expected(routes):
        return torch.cat([torch.cat([r, fill[None]]) for r in routes])

    # R3, the layer axis listing every decoder layer (the dense one's rows zero) or the MoE layers only
    all_layers = [torch.zeros(n - 1, LAYERS, K, dtype=torch.int64).index_copy(1, torch.tensor(MOE_LAYERS), r)
                  for n, r in zip(lengths, rollout, strict=True)]
    for layers, routes in ((LAYERS, all_layers), (len(MOE_LAYERS), rollout)):
        data = verl_batch(0, placed(routes, layers))
        out = prepare_routing(data, "R3", model, forward_only=True, replay_enabled=None)
        got = out.data["routed_experts"]
        assert not out.return_routes and got.dtype == torch.int64
        assert torch.equal(got.offsets(), data["input_ids"].offsets()) and torch.equal(got.values(),
                                                                                       expected(rollout))
        assert data["routed_experts"].dtype == torch.int16, "the caller's batch must stay as it was"
    # a multi-turn sequence whose last rows the rollout never routed (zeros): routed like the last token
    cut = [r.clone() for r in rollout]
    cut[1][-3:] = 0
    got = prepare_routing(verl_batch(0, placed(cut, 2)), "R3", model, forward_only=False,
                          replay_enabled=None).data["routed_experts"]
    want = expected(rollout).unbind(0)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    assert torch.equal(got.unbind()[1][-4:], fill.expand(4, *fill.shape))
    kept = starts[1] + lengths[1] - 4
    assert torch.equal(got.values()[:kept], torch.stack(want[:kept]))
    # routes given jagged with one row fewer than the tokens (verl's align_r3_router_replay_data)
    data = verl_batch(0, placed(rollout, 2))
    data["routed_experts"] = torch.nested.as_nested_tensor(rollout, layout=torch.jagged)
    got = prepare_routing(data, "R3", model, forward_only=True, replay_enabled=None).data["routed_experts"]
    assert torch.equal(got.values(), expected(rollout))

    # R2: the old-log-prob pass records and returns; a batch with routes replays them; no routes in
    # the update is refused
    data = verl_batch(0)
    out = prepare_routing(data, "R2", model, forward_only=True, replay_enabled=None)
    assert out.data is data and out.return_routes
    recorded = torch.nested.as_nested_tensor([torch.cat([r, fill[None]]) for r in rollout],
                                             layout=torch.jagged)
    model_output = out.outputs({"log_probs": None, "routed_experts": recorded})
    assert model_output["routed_experts"].dtype == torch.int16
    assert torch.equal(model_output["routed_experts"].values().long(), recorded.values())
    data["routed_experts"] = model_output["routed_experts"]  # as verl's trainer unions it into the batch
    out = prepare_routing(data, "R2", model, forward_only=False, replay_enabled=None)
    assert not out.return_routes and torch.equal(out.data["routed_experts"].values(), recorded.values())
    assert "routed_experts" not in out.outputs({"routed_experts": recorded})
    with pytest.raises(ValueError, match=r"mode='R2' .*no 'routed_experts': .*bypass_mode=false"):
        prepare_routing(verl_batch(0), "R2", model, forward_only=False, replay_enabled=None)

    # no replay: mode disabled, verl's enable_routing_replay=False, a dense model: routes dropped
    with_routes = verl_batch(0, placed(rollout, 2))
    for mode, m, flag in (("disabled", model, None), ("R3", model, False), ("R2", model, False),
                          ("R3", dense, None)):
        out = prepare_routing(with_routes, mode, m, forward_only=True, replay_enabled=flag)
        assert "routed_experts" not in out.data.keys() and not out.return_routes
        assert "routed_experts" not in out.outputs({"routed_experts": recorded})
    assert "routed_experts" in with_routes.keys()

    # refusals
    bad = [(verl_batch(0), "mode='R3' .*no 'routed_experts': .*enable_rollout_routing_replay=true"),
           (verl_batch(0, torch.zeros(len(lengths), max(P_LEN) + max(R_LEN), 4, K)),
            "a layer axis of 4; expected the model's 2 MoE layers or all its 3 decoder layers")]
    short = verl_batch(0, placed(rollout, 2))
    short["routed_experts"] = torch.nested.as_nested_tensor([r[:-1] for r in rollout], layout=torch.jagged)
    bad.append((short, "sequence 0 has 7 routed tokens for 9 input tokens"))
    dense_routes = verl_batch(0, placed(rollout, 2))
    dense_routes["routed_experts"] = torch.zeros(len(lengths), 11, 2, K, dtype=torch.int64)
    bad.append((dense_routes, "must be jagged"))
    for data, match in bad:
        with pytest.raises(ValueError, match=match):
            prepare_routing(data, "R3", model, forward_only=True, replay_enabled=None)


# --------------------------------------------------------------------------------- R2, one rank
def hf_pass(model, ids: torch.Tensor, policy: str = "native", forced: torch.Tensor | None = None):
    """``transformers``' log p(ids[t + 1]) for t < len - 1 and the routes its routers used."""
    from tests.integrations.hf_routing import RouteHooks

    with torch.no_grad(), RouteHooks(model, policy, forced) as hooks:
        logp = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), -1)
    return logp[:-1].gather(-1, ids[1:, None])[:, 0], hooks.routes()


def r2_rank(rank: int, world: int, hf_dir: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29997",
                      LOCAL_RANK="0", VERL_ENGINE_DEVICE="cpu")
    import json

    from transformers import AutoModelForCausalLM
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss
    from verl.workers.utils.padding import no_padding_2_padding

    from tests.integrations.test_verl import actor_config, metric_value

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    # verl's dynamic batch size: at most 20 tokens a micro-batch (sequences of 9, 9, 6, 7 tokens)
    model, engine, optim, ckpt = configs(hf_dir, mode="R2", tensor_model_parallel_size=1,
                                         use_dynamic_bsz=True, max_token_len_per_gpu=20,
                                         infer_max_token_len_per_gpu=20, use_distributed_optimizer=False)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model,
                                                 engine_config=engine, optimizer_config=optim,
                                                 checkpoint_config=ckpt))
    worker.device_name, worker.flops_counter = "cpu", None
    worker.reset()
    seen = []

    def loss(model_output, data, dp_group=None):  # verl's PPO loss; records what the update computed
        seen.append((data["input_ids"], model_output["log_probs"].detach()))
        return ppo_loss(config=dataclasses.replace(actor_config(), use_dynamic_bsz=True),
                        model_output=model_output, data=data, dp_group=dp_group)

    worker.set_loss_fn(loss)
    report: dict[str, float] = {}
    data = verl_batch(1, calculate_entropy=False, compute_loss=False)
    ids = data["input_ids"].unbind()
    native = [hf_pass(hf, s) for s in ids]
    second = [hf_pass(hf, s, "second_choice")[1] for s in ids]
    forced = [hf_pass(hf, s, "forced", r)[0] for s, r in zip(ids, second, strict=True)]

    # the old-log-prob pass: transformers' log-probs, and its routing returned (int16, verl's layout)
    out = worker.infer_batch(data)
    routes, logp = tu.get(out, "routed_experts"), tu.get(out, "log_probs")
    assert routes.dtype == torch.int16 and torch.equal(routes.offsets(), data["input_ids"].offsets())
    for i, (want_logp, want_routes) in enumerate(native):
        got = routes.unbind()[i].long()
        assert torch.equal(got.sort(-1).values, want_routes.sort(-1).values), f"sequence {i}: routing"
        key = "R2 record: log-probs vs transformers"
        report[key] = max(report.get(key, 0.0), rel_err(logp.unbind()[i][:-1], want_logp))
    # a batch carrying routes (every token's second choice) replays them: inference ...
    replay = verl_batch(1, calculate_entropy=False, compute_loss=False)
    replay["routed_experts"] = torch.nested.as_nested_tensor([r.to(torch.int16) for r in second],
                                                             layout=torch.jagged)
    out = worker.infer_batch(replay)
    assert "routed_experts" not in out.keys(), "a replaying pass returns no routing (verl's)"
    logp = tu.get(out, "log_probs").unbind()
    report["R2 replay: inference vs transformers (forced)"] = max(rel_err(a[:-1], b) for a, b in zip(
        logp, forced, strict=True))
    report["R2 replay: native routing's distance"] = min(rel_err(a[:-1], b[0]) for a, b in zip(
        logp, native, strict=True))
    # ... and the update (verl's loss sees the replayed log-probs), on dynamic micro-batches
    train = verl_batch(1)
    train["routed_experts"] = replay["routed_experts"]
    train["old_log_probs"] = no_padding_2_padding(tu.get(out, "log_probs"), train)
    metrics = tu.get(worker.train_batch(train), "metrics")
    assert len(seen) == 2, "two micro-batches under the token budget"
    by_ids = {tuple(s.tolist()): f for s, f in zip(ids, forced, strict=True)}
    for mb_ids, mb_logp in seen:
        for s, lp in zip(mb_ids.unbind(), mb_logp.unbind(), strict=True):
            err = rel_err(lp[:-1], by_ids[tuple(s.tolist())])
            report["R2 replay: update vs transformers (forced)"] = max(
                report.get("R2 replay: update vs transformers (forced)", 0.0), err)
    report["R2 replay: update ppo_kl"] = abs(metric_value(metrics["actor/ppo_kl"]))
    with pytest.raises(ValueError, match="mode='R2' .*bypass_mode=false"):
        worker.train_batch(verl_batch(2))
    with open(os.path.join(out_dir, "r2.json"), "w") as f:
        json.dump(report, f, indent=1)
    assert report["R2 record: log-probs vs transformers"] < TOL, report
    assert report["R2 replay: inference vs transformers (forced)"] < TOL, report
    assert report["R2 replay: update vs transformers (forced)"] < TOL, report
    assert report["R2 replay: native routing's distance"] > 1e-2, report
    assert report["R2 replay: update ppo_kl"] < 1e-6, report


@pytest.mark.slow
def test_verl_router_replay_r2_worker(dirs, tmp_path):
    run_distributed(r2_rank, 1, dirs["moe"], str(tmp_path))
    print(open(tmp_path / "r2.json").read())
