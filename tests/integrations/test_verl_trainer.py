"""verl 0.9.1's own trainer end to end on CPU on the mcore_engine backend: ``python -m
verl.trainer.main_ppo`` with the packaged config (``--config-path pkg://mcore_engine.integrations.
verl_hydra --config-name ppo_mcore_engine_trainer``: verl's ``ppo_megatron_trainer`` with actor,
reference and critic on this backend, the reference and critic in the actor's dtype), its legacy
``RayPPOTrainer`` loop on the engine workers ``verl.workers.engine_workers.ActorRolloutRefWorker`` /
``TrainingWorker``, Ray, for two steps, six times:

- GRPO (n=4) with a KL loss, so actor + reference policy, and verl's critic enabled
  (``critic.enable=True``), every role at TP=2 on two ranks with sequence parallelism (verl's
  default): rollout on the harness's ``hf_cpu`` server (TP=2 replica), verl's reward loop with a
  rule-based custom reward, GRPO advantages, actor and critic updates, weight sync back to the
  rollout through verl's naive checkpoint engine, a checkpoint with an HF export at the end;
- the same with every role at context parallelism 2 (``megatron.context_parallel_size=2``, TP=1);
- verl's on-policy distillation (``distillation.enabled=True``, top-k forward KL) with a teacher
  served by an ``hf_cpu`` teacher replica (prompt top-k log-probs, verl's teacher loop), at TP=1;
- GRPO with LoRA (``actor_rollout_ref.model.lora.rank=4``) at TP=2: the reference from the actor with
  its adapters disabled, the rollout synced with the base once and then adapters + PEFT config;
- GRPO on a tiny Qwen3-MoE with rollout routing replay (R3) at TP=1: the rollout returns its routed
  experts (and routes unlike the trainer), the actor replays them in its old-log-prob pass and update.
- GRPO on a tiny hybrid Qwen3.5 (three Gated DeltaNet layers, one gated attention layer) at TP=2 + SP:
  the rollout decodes with transformers' recurrent rule, the actor computes with the chunked one.
- GRPO on a tiny gpt-oss (attention sinks, a 4-token window, YaRN, the biased clamped-SwiGLU MoE) at
  TP=2 + SP, packed: the rollout decodes with transformers' eager attention and its window cache.

What verl lacks on CPU is added in ``tests/integrations/verl_trainer_harness.py`` (loaded by every
Ray process through verl's ``VERL_USE_EXTERNAL_MODULES`` plugin hook). The checks read what verl
logs (its file logger's metrics) and what the harness records (the engines verl built, every
weight version the rollout server received and the requests it served under each).
"""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest

pytest.importorskip("verl", reason="verl is installed by `make setup` (pip install --no-deps verl==0.9.1)")
pytest.importorskip("ray")

from tests.integrations.verl_trainer_harness import ROUTING_ENV  # noqa: E402
from tests.integrations.verl_trainer_setup import (  # noqa: E402
    make_dataset,
    make_gpt_oss_model,
    make_model,
    make_moe_model,
    make_qwen3_5_model,
    make_tokenizer,
    tokenizer_dir,
    trainer_command,
    trainer_env,
)
from tests.integrations.verl_vlm_setup import make_vlm_dataset, make_vlm_folder  # noqa: E402

STEPS = 2
VLM_PROMPT_LENGTH = 32  # <|vision_start|> + 4..9 image tokens + <|vision_end|> + "colour?:"
PER_STEP = 4 * 4  # prompts x rollout.n
TIMEOUT = 900


def run_trainer(work: str, **kw) -> dict:
    """Run verl's trainer in ``work``; return its metrics per step, the harness's records and the
    paths."""
    student, teacher, data = (os.path.join(work, n) for n in ("student", "teacher", "train.parquet"))
    env = trainer_env(work)
    if kw.pop("moe", False):  # a Qwen3-MoE student; the rollout server routes by ROUTING_ENV's policy
        make_moe_model(student, seed=0)
        env[ROUTING_ENV] = kw.pop("rollout_routing", "native")
    elif kw.pop("qwen3_5", False):  # a hybrid Qwen3.5 student (Gated DeltaNet + gated attention)
        make_qwen3_5_model(student, seed=0)
    elif kw.pop("gpt_oss", False):  # a gpt-oss student (sinks, a sliding window, biased MoE)
        make_gpt_oss_model(student, seed=0)
    elif kw.pop("vlm", False):  # a Qwen2.5-VL student with its processor files; an image dataset
        make_vlm_folder(student, seed=0)
        kw.update(tokenizer_path=student, prompt_length=VLM_PROMPT_LENGTH)
    else:
        make_model(student, seed=0)
    make_tokenizer(tokenizer_dir(work))
    if kw.get("tokenizer_path") == student:
        make_vlm_dataset(data)
    else:
        make_dataset(data)
    if kw.pop("distill", False):
        make_model(teacher, seed=1)
        kw["teacher_dir"] = teacher
    cmd = trainer_command(work, student, data, steps=STEPS, **kw)
    with open(os.path.join(work, "trainer.log"), "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                              timeout=TIMEOUT, cwd=work)
    tail = open(os.path.join(work, "trainer.log"), errors="replace").read()[-6000:]
    assert proc.returncode == 0, f"verl's trainer failed (log {work}/trainer.log):\n{tail}"
    steps = {}
    for line in open(os.path.join(work, "metrics.jsonl")):
        record = json.loads(line)
        steps[record["step"]] = record["data"]
    report = os.path.join(work, "report")

    def records(name):
        path = os.path.join(report, f"{name}.jsonl")
        return [json.loads(line) for line in open(path)] if os.path.exists(path) else []

    return {"steps": steps, "records": records, "student": student, "work": work}


def finite_metrics(steps: dict) -> None:
    assert sorted(steps) == list(range(1, STEPS + 1)), sorted(steps)
    for step, metrics in steps.items():
        bad = {k: v for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"


def check_weight_sync(run: dict, server: str = "hf_cpu_server_0_0") -> list[dict]:
    """The rollout received the actor's weights through verl's sync before the first rollout and after
    every update (global steps 0..STEPS), generated every step's responses on the latest version,
    and that version is what the actor holds: the first equals the HF folder (fp32, bitwise), each
    later one moved, the last equals the actor's final checkpoint (HF export)."""
    import torch
    from safetensors.torch import load_file

    events = run["records"](server)
    updates = [e for e in events if e["event"] == "update_weights"]
    assert [u["global_steps"] for u in updates] == list(range(STEPS + 1)), updates
    versions = [load_file(u["file"]) for u in updates]
    initial = load_file(os.path.join(run["student"], "model.safetensors"))
    assert versions[0].keys() == initial.keys()
    assert all(torch.equal(versions[0][k], initial[k]) for k in initial), "first sync != the HF weights"
    for before, after in zip(versions, versions[1:], strict=False):
        moved = max(float((after[k] - before[k]).norm() / before[k].norm()) for k in before)
        assert moved > 1e-4, "an actor update did not reach the rollout"
    exported = load_file(os.path.join(run["work"], "checkpoints", f"global_step_{STEPS}", "actor",
                                      "huggingface", "model.safetensors"))
    assert all(torch.equal(versions[-1][k], exported[k]) for k in exported), "rollout != actor after the run"
    generated = [e for e in events if e["event"] == "generate"]
    by_version = {v: sum(e["version"] == v for e in generated) for v in range(1, STEPS + 1)}
    assert by_version == {v: PER_STEP for v in range(1, STEPS + 1)}, by_version
    return generated


def check_engines(run: dict, expected: set[tuple[str, bool]], tp: int = 1, cp: int = 1,
                  lora_rank: int | None = None) -> None:
    """Every engine verl's workers built is this backend's: (model type, forward_only) as expected,
    at TP ``tp`` x CP ``cp`` on ``tp * cp`` ranks a role, with sequence parallelism (verl's default)
    when ``tp > 1``, LoRA of rank ``lora_rank`` (None: off),
    in fp32: the command line sets only the actor's dtype, the packaged config makes the reference
    (verl's megatron_ref.yaml: bfloat16) and the critic follow it."""
    engines = run["records"]("engines")
    assert all(e["tp"] == tp and e["cp"] == cp and e["sequence_parallel"] is (tp > 1)
               and e["lora_rank"] == lora_rank for e in engines), engines
    assert {(e["model_type"], e["forward_only"], e["precision"]) for e in engines} == {
        (model_type, forward_only, "fp32") for model_type, forward_only in expected}, engines
    for key in expected:
        ranks = {e["pid"] for e in engines if (e["model_type"], e["forward_only"]) == key}
        assert len(ranks) == tp * cp, (key, engines)
    assert {e["backend"] for e in engines} == {"mcore_engine"}, engines
    classes = {"language_model": "mcore_engine.integrations.verl.McoreEngineVerl",
               "value_model": "mcore_engine.integrations.verl.McoreEngineVerlValue"}
    assert all(e["class"] == classes[e["model_type"]] for e in engines), engines
    assert {(e["model_type"], e["forward_only"]) for e in engines} == expected, engines


@pytest.mark.slow
@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)], ids=["tp2-sp", "cp2"])
def test_verl_main_ppo_grpo_with_critic(tmp_path, tp, cp):
    run = run_trainer(str(tmp_path), critic=True, tp=tp, cp=cp)
    steps = run["steps"]
    finite_metrics(steps)
    # actor, reference policy (forward_only) and critic, all on mcore_engine
    check_engines(run, {("language_model", False), ("language_model", True), ("value_model", False)},
                  tp=tp, cp=cp)
    check_weight_sync(run)
    for step, m in steps.items():
        # the rollout's sampling log-probs are the actor's (same weights, fp32): verl's own check
        assert m["training/rollout_probs_diff_valid"] == 1, step
        assert m["training/rollout_probs_diff_max"] < 1e-4, step
        assert m["critic/score/max"] > m["critic/score/min"], "rule-based rewards must vary"
        assert m["critic/advantages/max"] > 0 > m["critic/advantages/min"], "GRPO advantages"
        assert m["actor/grad_norm"] > 0 and m["critic/grad_norm"] > 0, step
        for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "critic/vpred_mean"):
            assert key in m, (step, key)
        assert m["response_length/mean"] > 0
    assert steps[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # ref == actor before the first update
    assert steps[2]["actor/kl_loss"] > 0  # the actor moved away from the reference


@pytest.mark.slow
def test_verl_main_ppo_distillation_with_teacher(tmp_path):
    run = run_trainer(str(tmp_path), distill=True)
    steps = run["steps"]
    finite_metrics(steps)
    check_engines(run, {("language_model", False), ("language_model", True)})
    generated = check_weight_sync(run)
    # the student's server samples at most rollout.response_length (12) tokens when the request
    # has no max_tokens, as vLLM's does: verl truncates nothing, and the teacher scored exactly
    # each sample's prompt + response, token for token (one request per sample)
    lengths = [e["response_len"] for e in generated]
    assert min(lengths) >= 1 and max(lengths) == 12, lengths  # ~1/250 EOS a token: most reach the bound
    teacher = [e for e in run["records"]("hf_cpu_server_teacher_0_0_default") if e["event"] == "generate"]
    assert len(teacher) == STEPS * PER_STEP, len(teacher)
    student_seqs = sorted(e["prompt_ids"] + e["token_ids"] for e in generated)
    assert sorted(e["prompt_ids"] for e in teacher) == student_seqs, "teacher != student prompt + response"
    for step, m in steps.items():
        assert m["training/rollout_probs_diff_max"] < 1e-4, step
        assert m["actor/distillation/loss"] > 0 and m["actor/grad_norm"] > 0, step
        assert 0 < m["actor/distillation/teacher_mass"] <= 1 and 0 < m["actor/distillation/student_mass"] <= 1


# the seven projections the packaged config's LoRA adapts (Megatron-Bridge's canonical_lora names)
LORA_TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def check_lora_weight_sync(run: dict, server: str = "hf_cpu_server_0_0") -> None:
    """verl's LoRA sync with ``model.lora.merge=False`` (its default): before the first rollout the
    frozen base (Hugging Face names, bit-identical to the HF folder) and the adapters, after every
    update the adapters only (PEFT key names, verl's ``peft_config``), which the server puts on its
    base with PEFT. The weights the rollout then computes with (base + scaling B A): at step 0 the HF
    folder exactly (B = 0), every untargeted tensor (embeddings, norms, biases, lm-head) bit-identical
    to it throughout (the base is frozen), the adapted ones moving with every update, and at the end
    the actor's merged HF export (fp32, PEFT's merge vs the core's) and its PEFT adapter folder
    (``huggingface/adapter``, bit-identical to the last adapters received). Every rollout ran on the
    latest full sync."""
    import torch
    from safetensors.torch import load_file

    events = run["records"](server)
    updates = [e for e in events if e["event"] == "update_weights"]
    assert [(u["global_steps"], u["kind"]) for u in updates] == [(0, "base"), (0, "adapter")] + [
        (g, "adapter") for g in range(1, STEPS + 1)], updates
    peft = updates[-1]["peft_config"]
    assert (peft["peft_type"], peft["task_type"], peft["r"], peft["lora_alpha"]) == (
        "LORA", "CAUSAL_LM", 4, 8)
    assert sorted(peft["target_modules"]) == LORA_TARGETS
    initial = load_file(os.path.join(run["student"], "model.safetensors"))
    base = load_file(updates[0]["file"])
    assert base.keys() == initial.keys() and all(torch.equal(base[k], initial[k]) for k in initial)
    last = {u["global_steps"]: u for u in updates}  # the weights each step's rollouts saw
    versions = [load_file(last[g]["file"]) for g in range(STEPS + 1)]
    adapted = {k for k in initial if k.endswith("proj.weight")}
    assert len(adapted) == 2 * len(LORA_TARGETS)  # two layers
    assert all(torch.equal(versions[0][k], initial[k]) for k in initial), "step 0 != the HF weights (B = 0)"
    for version in versions:
        assert version.keys() == initial.keys()
        assert all(torch.equal(version[k], initial[k]) for k in initial.keys() - adapted), "the base moved"
    for before, after in zip(versions, versions[1:], strict=False):
        moved = min(float((after[k] - before[k]).norm() / before[k].norm()) for k in adapted)
        assert moved > 1e-4, "an adapter update did not reach every adapted projection of the rollout"
    export = os.path.join(run["work"], "checkpoints", f"global_step_{STEPS}", "actor", "huggingface")
    merged = load_file(os.path.join(export, "model.safetensors"))
    assert merged.keys() == initial.keys()
    for k in merged:
        torch.testing.assert_close(versions[-1][k], merged[k], rtol=1e-6, atol=1e-7, msg=k)
    received = load_file(last[STEPS]["received"])
    exported = load_file(os.path.join(export, "adapter", "adapter_model.safetensors"))
    assert received.keys() == exported.keys() and len(received) == 2 * 2 * len(LORA_TARGETS)
    assert all(torch.equal(received[k], exported[k]) for k in exported), "rollout adapters != the actor's"
    generated = [e for e in events if e["event"] == "generate"]
    by_step = {g: sum(e["version"] == last[g]["version"] for e in generated) for g in range(STEPS)}
    assert by_step == {g: PER_STEP for g in range(STEPS)} and len(generated) == STEPS * PER_STEP, by_step


@pytest.mark.slow
def test_verl_main_ppo_grpo_lora(tmp_path):
    """GRPO with LoRA through verl's own switch: ``actor_rollout_ref.model.lora.rank=4`` (alpha 8) on
    the packaged config, TP=2 + SP on two ranks. verl then builds no reference engine: the reference
    log-probs come from the actor with its adapters disabled (``ref_in_actor``: ``no_lora_adapter`` ->
    ``disable_adapter()``), so the KL loss is 0 at step 1 (B = 0: actor == base) and > 0 at step 2,
    where an actor whose adapters stayed on would give exactly the old log-probs, i.e. KL 0. The sync
    is verl's default for LoRA (``merge=False``): the base once, then adapters (check_lora_weight_sync);
    the rollout's sampling log-probs equal the actor's at every step."""
    arr = "actor_rollout_ref"
    run = run_trainer(str(tmp_path), tp=2, extra=(f"{arr}.model.lora.rank=4", f"{arr}.model.lora.alpha=8",
                                                  f"{arr}.model.enable_gradient_checkpointing=False"))
    steps = run["steps"]
    finite_metrics(steps)
    check_engines(run, {("language_model", False)}, tp=2, lora_rank=4)  # the actor only, with LoRA
    check_lora_weight_sync(run)
    for step, m in steps.items():
        assert m["training/rollout_probs_diff_valid"] == 1, step
        assert m["training/rollout_probs_diff_max"] < 1e-4, step
        assert m["critic/advantages/max"] > 0 > m["critic/advantages/min"], "GRPO advantages"
        assert m["actor/grad_norm"] > 0 and "actor/pg_loss" in m, step
    assert steps[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the base (B = 0) == the actor
    assert steps[2]["actor/kl_loss"] > 1e-4  # the reference stayed the base while the adapters moved


def check_r3_routing(run: dict, server: str = "hf_cpu_server_0_0") -> dict[str, int]:
    """R3 replayed the rollout's routing: the rollout returned every sequence's routes (prompt +
    response but the last token, ``[P + R - 1, L, k]``), and each pass of the actor's engine (the
    old-log-prob pass and the update, every step) routed each of its sequences exactly so, the last
    token to experts ``0 .. k-1`` (its placeholder); the reference policy's engine routed natively
    (at step 1, on the rollout's weights: its top-2, never the rollout's second choice)."""
    served = {}
    for e in run["records"](server):
        if e["event"] == "generate":
            assert "routed_experts" in e, "the rollout returned no routed experts"
            routes = e["routed_experts"]
            assert len(routes) == e["prompt_len"] + e["response_len"] - 1, (len(routes), e["prompt_len"])
            served[tuple(e["prompt_ids"] + e["token_ids"])] = routes
    passes = run["records"]("routing")
    actor = [p for p in passes if not p["engine_forward_only"]]
    reference = [p for p in passes if p["engine_forward_only"]]
    assert sorted((p["forward_only"], p["replayed"]) for p in actor) == [(False, True)] * STEPS + [
        (True, True)] * STEPS, [(p["forward_only"], p["replayed"]) for p in actor]
    assert len(reference) == STEPS and not any(p["replayed"] for p in reference)
    tokens = 0
    for p in actor:
        for seq in p["sequences"]:
            want = served[tuple(seq["ids"])]
            assert seq["routes"][:-1] == want, "the actor did not route by the rollout's routing"
            assert all(row == [0, 1] for row in seq["routes"][-1]), seq["routes"][-1]
            tokens += len(want)
    same = total = 0
    for seq in reference[0]["sequences"]:  # step 1: the reference's weights are the rollout's
        for got, rollout in zip(seq["routes"], served[tuple(seq["ids"])], strict=False):
            same += sum(set(g) == set(r) for g, r in zip(got, rollout, strict=True))
            total += len(got)
    assert total > 0 and same == 0, f"the reference replayed the rollout's routing on {same} of {total}"
    return {"actor tokens replayed": tokens, "reference routes compared": total}


@pytest.mark.slow
def test_verl_main_ppo_grpo_moe_r3(tmp_path):
    """GRPO on a tiny Qwen3-MoE with verl's rollout routing replay (R3:
    ``actor.megatron.router_replay.mode=R3``, ``rollout.enable_rollout_routing_replay=True``), TP=1,
    with a KL loss (so a reference policy). The harness's rollout routes every token to its experts
    ranked 3-4 (``second_choice``: a rollout whose routing differs from the trainer's everywhere) and
    returns them with the responses, as vLLM does; so the actor's old log-probs equal the rollout's
    only if the old-log-prob pass replays that routing, the update's first log-probs equal the old
    ones (``ppo_kl`` 0) only if the update replays it too, and the reference, which routes natively
    (verl's rule), differs from the actor from the first step (KL > 0)."""
    arr = "actor_rollout_ref"
    run = run_trainer(str(tmp_path), moe=True, rollout_routing="second_choice",
                      extra=(f"{arr}.actor.megatron.router_replay.mode=R3",
                             f"{arr}.rollout.enable_rollout_routing_replay=True",
                             f"{arr}.model.enable_gradient_checkpointing=False"))  # core: no MoE recompute
    steps = run["steps"]
    finite_metrics(steps)
    check_engines(run, {("language_model", False), ("language_model", True)})
    check_weight_sync(run)
    counts = check_r3_routing(run)
    for step, m in steps.items():
        assert m["training/rollout_probs_diff_valid"] == 1, step
        assert m["training/rollout_probs_diff_max"] < 1e-4, (step, m["training/rollout_probs_diff_max"])
        assert abs(m["actor/ppo_kl"]) < 1e-6 and m["actor/pg_clipfrac"] == 0, step
        assert m["actor/grad_norm"] > 0 and m["critic/advantages/max"] > 0 > m["critic/advantages/min"]
        # ~1e-7 for a dense model at step 1 (same weights); here the routing differs
        assert m["actor/kl_loss"] > 1e-5, "the reference must route natively, unlike the actor"
    print({key: [steps[s][key] for s in sorted(steps)] for key in (
        "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean", "actor/ppo_kl",
        "actor/kl_loss")}, counts)


def check_decode_gap_run(steps: dict) -> None:
    """A two-step GRPO run whose rollout decodes token by token while the actor computes packed
    sequences, fp32: verl's train / decode gap (``|p_rollout - p_actor|`` per token, per-sequence mean
    log-prob, mean log-ratio) at rounding level, the first actor pass equal to the old log-probs,
    rewards with spread, finite non-zero gradients, KL loss 0 then > 0."""
    for step, m in steps.items():
        assert m["training/rollout_probs_diff_valid"] == 1, step
        assert m["training/rollout_probs_diff_max"] < 1e-6, (step, m["training/rollout_probs_diff_max"])
        assert abs(m["rollout_corr/log_ppl_diff_max"]) < 1e-5 and abs(m["rollout_corr/kl"]) < 1e-6, step
        assert abs(m["actor/ppo_kl"]) < 1e-6 and m["actor/pg_clipfrac"] == 0, step  # first pass == old
        assert m["critic/score/max"] > m["critic/score/min"], "rule-based rewards must vary"
        assert 0 < m["actor/grad_norm"] < 10, (step, m["actor/grad_norm"])
        assert m["critic/advantages/max"] > 0 > m["critic/advantages/min"], "GRPO advantages"
    assert steps[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # ref == actor before the first update
    assert steps[2]["actor/kl_loss"] > 0  # the actor moved away from the reference
    print({key: [steps[s][key] for s in sorted(steps)] for key in (
        "training/rollout_probs_diff_max", "training/rollout_probs_diff_mean",
        "rollout_corr/log_ppl_diff_max", "rollout_corr/kl", "actor/ppo_kl", "actor/kl_loss",
        "actor/grad_norm", "timing_s/step")})


@pytest.mark.slow
def test_verl_main_ppo_grpo_qwen3_5(tmp_path):
    """GRPO (n=4, KL loss, so a reference policy) on a tiny hybrid Qwen3.5 (``Qwen3_5ForCausalLM``:
    three Gated DeltaNet layers, then a gated attention layer) with the packaged config and nothing
    else, actor and reference at TP=2 + SP on two ranks; the rollout is ``transformers`` decoding
    token by token with its cache (the GDN layers on the recurrent rule), the engine computes the
    old log-probs with the chunked rule on whole packed sequences: verl's own
    ``rollout_probs_diff_max`` is the train / decode gap (fp32). The weight sync speaks the folder's
    own names (``linear_attn.in_proj_qkv`` ...), first equal to the folder, the last to the export."""
    run = run_trainer(str(tmp_path), qwen3_5=True, tp=2)
    steps = run["steps"]
    finite_metrics(steps)
    check_engines(run, {("language_model", False), ("language_model", True)}, tp=2)
    check_weight_sync(run)  # every tensor of the folder, GDN's included, in its own names
    from safetensors import safe_open

    with safe_open(os.path.join(run["student"], "model.safetensors"), "pt") as f:
        names = set(f.keys())
    gdn = ("A_log", "dt_bias", "conv1d.weight", "in_proj_qkv.weight", "in_proj_z.weight", "norm.weight")
    assert {f"model.layers.{i}.linear_attn.{n}" for i in range(3) for n in gdn} <= names, sorted(names)
    assert "model.layers.3.self_attn.q_proj.weight" in names
    # the rollout decodes token by token with transformers' recurrent rule, the actor runs the chunked
    # rule on packed sequences; transformers' gradient of this loss is ~0.9 (a zero embedding row
    # sampled gives ~550)
    check_decode_gap_run(steps)


@pytest.mark.slow
def test_verl_main_ppo_grpo_gpt_oss(tmp_path):
    """GRPO (n=4, KL loss, so a reference policy) on a tiny gpt-oss (``GptOssForCausalLM``: attention
    sinks, a 4-token sliding window on layer 0, YaRN, biases everywhere, 4 experts top-2 with the
    clamped SwiGLU) with the packaged config (packed: ``use_remove_padding``; activation recompute off,
    as for every MoE: the core does not recompute MoE layers), actor
    and reference at TP=2 + SP on two ranks (the experts at expert TP 1, the biased experts'
    default); the rollout is ``transformers`` decoding token by token (eager attention with its
    sliding-window cache), the engine computes whole packed sequences: verl's own
    ``rollout_probs_diff_max`` is the train / decode gap (fp32). The weight sync speaks the folder's
    own names (fused ``gate_up_proj`` and its bias, ``sinks``, the router's bias), first equal to the
    folder, the last to the export."""
    run = run_trainer(str(tmp_path), gpt_oss=True, tp=2,  # MoE layers are not recomputed (as for R3)
                      extra=("actor_rollout_ref.model.enable_gradient_checkpointing=False",))
    steps = run["steps"]
    finite_metrics(steps)
    check_engines(run, {("language_model", False), ("language_model", True)}, tp=2)
    check_weight_sync(run)  # every tensor of the folder, sinks and biases included, in its own names
    from safetensors import safe_open

    with safe_open(os.path.join(run["student"], "model.safetensors"), "pt") as f:
        names = set(f.keys())
    own = ("self_attn.sinks", "self_attn.q_proj.bias", "self_attn.o_proj.bias", "mlp.router.bias",
           "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj_bias")
    assert {f"model.layers.{i}.{n}" for i in range(2) for n in own} <= names, sorted(names)
    # the rollout decodes token by token (eager attention, its sliding-window cache), the actor runs
    # whole packed sequences (measured rollout_probs_diff_max 3.7e-9)
    check_decode_gap_run(steps)


def check_media(run: dict) -> dict[str, int]:
    """What verl's workers handed the core engine, as the harness recorded it before every pass: each
    pass of the actor (old log-probs, update) and the reference carried every sample's image
    (``multi_modal_inputs`` entries with ``pixel_values`` and ``image_grid_thw`` only: verl's
    ``images_seqlens`` dropped; ``pixel_values`` one row per patch of the grid, 1176 = 3 * 2 * 14^2
    features) and the ``(t, h, w)`` positions ``[j, 3]`` of verl's ``[4, L]`` rows, equal to
    ``transformers``' ``get_rope_index`` of the sample (the image tokens on the merged-patch grid)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(run["student"], dtype=torch.float32)
    image_token = model.config.image_token_id
    passes = run["records"]("media")
    actor = sorted((p["forward_only"], len(p["samples"])) for p in passes if not p["engine_forward_only"])
    reference = [p for p in passes if p["engine_forward_only"]]
    assert {fo for fo, _ in actor} == {False, True} and len(reference) >= STEPS, (actor, len(reference))
    samples = grids = 0
    for p in passes:
        for s in p["samples"]:
            assert s["keys"] == ["image_grid_thw", "pixel_values"], s["keys"]
            grid = torch.tensor(s["image_grid_thw"])
            assert s["pixel_values"] == [int(grid.prod(-1).sum()), 1176], (s["pixel_values"], grid)
            ids = torch.tensor(s["ids"])
            assert int((ids == image_token).sum()) == int(grid.prod(-1).sum()) // 4
            types = (ids == image_token).long()[None]
            want, _ = model.model.get_rope_index(ids[None], mm_token_type_ids=types, image_grid_thw=grid)
            assert torch.equal(torch.tensor(s["positions"]), want[:, 0].T), "positions != get_rope_index"
            samples += 1
            grids += len(grid)
    return {"samples": samples, "images": grids}


@pytest.mark.slow
def test_verl_main_ppo_grpo_vlm(tmp_path):
    """GRPO (n=4, KL loss, so a reference policy) on a tiny Qwen2.5-VL with the packaged config and a
    synthetic image dataset (16 solid-colour PNGs of 56x56 .. 84x84 px through verl's
    ``RLHFDataset``; the rule reward: the share of lowercase letters in the response, the colour name's
    counted three times),
    actor and reference at TP=2 + SP. verl's agent loop renders the prompt through the processor
    (``<|image_pad|>`` per merged patch), the ``hf_cpu`` rollout samples with ``transformers`` on the
    images, verl recomputes each sample's ``multi_modal_inputs`` and its ``[4, L]`` mRoPE positions,
    and the adapter hands them to the engine (check_media), which runs the vision tower: verl's
    ``rollout_probs_diff_max`` is the engine's log-probs against ``transformers``' on the same images
    and weights. The weight sync carries the folder's names (``visual.*`` included), the tower trains
    (its weights move every step). The harness works around verl 0.9.1 + ``transformers`` 5.24 (its
    post-processing decode drops the image placeholders) and the missing torchvision / qwen_vl_utils."""
    run = run_trainer(str(tmp_path), vlm=True, tp=2)
    steps = run["steps"]
    finite_metrics(steps)
    check_engines(run, {("language_model", False), ("language_model", True)}, tp=2)
    check_weight_sync(run)  # the first sync is the folder, visual.* included; the last is the export
    from safetensors.torch import load_file

    events = run["records"]("hf_cpu_server_0_0")
    grids = [e.get("image_grid_thw") for e in events if e["event"] == "generate"]
    assert all(grids) and len({str(g) for g in grids}) == 4, "the rollout saw each image size"
    files = [load_file(e["file"]) for e in events if e["event"] == "update_weights"]
    visual = [k for k in files[0] if k.startswith("visual.")]
    assert len(visual) > 10, sorted(files[0])
    for before, after in zip(files, files[1:], strict=False):  # the tower trains (not frozen by default)
        assert max(float((after[k] - before[k]).norm() / before[k].norm()) for k in visual) > 1e-4
    check_media(run)
    for step, m in steps.items():
        assert m["training/rollout_probs_diff_valid"] == 1, step
        assert m["training/rollout_probs_diff_max"] < 1e-4, step  # engine + tower == transformers
        assert m["critic/score/max"] > m["critic/score/min"], "rule-based rewards must vary"
        assert m["critic/advantages/max"] > 0 > m["critic/advantages/min"], "GRPO advantages"
        assert m["actor/grad_norm"] > 0 and math.isfinite(m["actor/pg_loss"]), step
    assert steps[1]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)
    assert steps[2]["actor/kl_loss"] > 0
